"""Temporary files of atomic writes: one naming scheme, publishing, stale ones found and removed, disk-full errors.

Every output (export, shard, shard index, LoRA file, report, summary) is written to a temporary file beside its
target and renamed onto it when complete, so the target holds the previous file or the new one, never a torn one.
The temporary file is named

    .<target name>.tmp-<pid>-<host>-<random>        e.g. .model.safetensors.tmp-4711-3fa2c1-9b0e77d2

(`host`: 6 hex digits of the host name's hash, so a pid is only judged on the host that owns it; `random`: two
writers in one process, or a reused pid, never share a name). A process killed mid-write (SIGKILL, OOM, power)
leaves its temporary file; the next write to the same target removes every one whose writer is gone (its pid dead
on this host, or another host's file untouched for `OTHER_HOST_AGE` seconds), and `python -m lowbit_pipe.purge`
finds them too. Live writers' files are never touched, so concurrent writes to one target do not disturb each other.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from lowbit_pipe.errors import WriteError

# A file of another host cannot be checked by pid; one untouched this long is taken for dead (a live writer appends
# to its file tensor by tensor, so its mtime keeps moving).
OTHER_HOST_AGE = 3600.0

_TEMP = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)(?:-(?P<host>[0-9a-f]{6})-(?P<nonce>[0-9a-f]{8}))?$")
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def temp_path(target: str | Path) -> Path:
    """A fresh temporary name beside `target` (see the module docstring)."""
    target = Path(target)
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{host_tag()}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class TempFile:
    path: Path
    target_name: str  # the name of the file it was to become
    pid: int
    host: str | None  # None: the earlier scheme `.<name>.tmp-<pid>`, written on this host


def parse(path: str | Path) -> TempFile | None:
    """The temporary file `path` names, or None when it is not one of ours."""
    path = Path(path)
    m = _TEMP.match(path.name)
    if m is None:
        return None
    return TempFile(path, m.group("target"), int(m.group("pid")), m.group("host"))


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def why_stale(temp: TempFile, *, now: float | None = None, other_host_age: float = OTHER_HOST_AGE) -> str | None:
    """Why `temp`'s writer is gone (a reason for the report), or None while it may still be writing."""
    if temp.host is None or temp.host == host_tag():
        return None if pid_alive(temp.pid) else f"writer pid {temp.pid} is gone"
    try:
        age = (now if now is not None else time.time()) - temp.path.stat().st_mtime
    except FileNotFoundError:
        return None  # removed meanwhile
    return f"written on host {temp.host}, untouched for {age:.0f} s" if age >= other_host_age else None


def stale_temps(folder: str | Path, target_name: str | None = None, *,
                other_host_age: float = OTHER_HOST_AGE) -> list[tuple[Path, str]]:
    """(path, why) of the stale temporary files in `folder` (of `target_name` only, when given)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    now = time.time()
    for path in sorted(folder.glob(".*.tmp-*")):
        temp = parse(path)
        if temp is None or not path.is_file() or (target_name is not None and temp.target_name != target_name):
            continue
        why = why_stale(temp, now=now, other_host_age=other_host_age)
        if why is not None:
            found.append((path, why))
    return found


def remove_stale(target: str | Path) -> list[Path]:
    """Remove what earlier, dead writers of `target` left beside it; returns the paths removed."""
    target = Path(target)
    removed = []
    for path, _why in stale_temps(target.parent, target.name):
        try:
            path.unlink()
        except FileNotFoundError:  # another writer cleaned it first
            continue
        removed.append(path)
    return removed


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (else set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError as err:  # not Linux: read it by setting it, below
        del err
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish(tmp: Path, path: Path, *, replace: bool = True) -> None:
    """Give a finished temp file the permissions a new file gets, fsync it, rename it onto `path`, fsync the folder
    (so the rename survives a power cut too). `replace=False`: FileExistsError when `path` exists, decided
    atomically (a hard link never replaces), so of two writers racing for one new path exactly one wins."""
    os.chmod(tmp, 0o666 & ~_umask())
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    if replace:
        os.replace(tmp, path)
    else:
        _link_new(tmp, path)
    _fsync_folder(path.parent)


def _link_new(tmp: Path, path: Path) -> None:
    """Move `tmp` to `path` only if nothing is there (FileExistsError otherwise)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as err:  # a filesystem without hard links: check, then rename (no longer atomic)
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _fsync_folder(folder: Path) -> bool:
    """Make a rename in `folder` durable; False where the filesystem refuses (the rename has happened all the same)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def move(src: Path, dst: Path, *, replace: bool) -> None:
    """Move a finished file to `dst` (another filesystem too: copied beside `dst`, then published);
    `replace=False`: FileExistsError when `dst` exists, `src` left in place."""
    try:
        if replace:
            os.replace(src, dst)
        else:
            _link_new(src, dst)
        return
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
    tmp = temp_path(dst)
    try:
        shutil.copyfile(src, tmp)
        publish(tmp, dst, replace=replace)
    finally:
        _discard(tmp)
    os.unlink(src)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder` (flock on the folder itself: no lock file to leave behind) while a set of
    files is published there, so two writers' sets never interleave."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def publish_together(files: list[tuple[Path, Path]], commit: tuple[Path, Path], *, replace: bool = True) -> None:
    """Publish (temp, target) pairs that only make sense together (shards and their index; a model file and its
    LoRA file): under `folder_lock`, the old `commit` target (the index, the model file) is removed first, then
    every file is renamed into place, `commit` last. Whatever stops it midway (SIGKILL, power) leaves the previous
    set whole or no `commit` file at all, never a `commit` that names files of another set. `replace=False`:
    FileExistsError, before anything is renamed, when any target exists."""
    commit_tmp, commit_path = commit
    with folder_lock(commit_path.parent):
        if not replace:
            taken = next((p for _, p in [*files, commit] if os.path.lexists(p)), None)
            if taken is not None:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(taken))
        commit_path.unlink(missing_ok=True)
        _fsync_folder(commit_path.parent)
        for tmp, path in files:
            publish(tmp, path, replace=replace)
        publish(commit_tmp, commit_path, replace=replace)


def write_temp_text(path: str | Path, text: str) -> Path:
    """`text` in a complete, synced temp file beside `path`, for `publish_together`; WriteError when it cannot."""
    path = Path(path)
    remove_stale(path)
    tmp = temp_path(path)
    data = text.encode("utf-8")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        _discard(tmp)
        raise write_error(err, path, needed=len(data)) from err
    except BaseException:
        _discard(tmp)
        raise
    return tmp


def discard(paths: list[Path]) -> None:
    """Remove temp files (a set abandoned before publishing)."""
    for tmp in paths:
        _discard(tmp)


def free_bytes(folder: str | Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def write_error(err: OSError, path: str | Path, *, needed: int | None = None, written: int | None = None) -> WriteError:
    """The WriteError for an OSError met while writing `path` (call it after the temporary file is removed, so the
    free space it reports is what the target's filesystem really has)."""
    path = Path(path)
    if err.errno in _DISK_FULL:
        free = free_bytes(path.parent)
        need = f"needs {needed} bytes" if needed is not None else \
            f"the disk filled after {written} bytes" if written is not None else "the disk filled"
        room = f"{free} bytes free" if free is not None else "free space unknown"
        return WriteError(str(path), f"disk full: writing it {need}, {room} on {path.parent} "
                                     "(nothing was written; the previous file, if any, is untouched)")
    if err.errno == errno.EEXIST:
        taken = getattr(err, "filename", None) or path
        return WriteError(str(taken), "exists (another run may have written it meanwhile); nothing was replaced "
                                      "(export.overwrite=true replaces it)")
    return WriteError(str(path), f"cannot write: {err.strerror or err} (the previous file, if any, is untouched)")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename; a failure leaves `path` as it was."""
    tmp = write_temp_text(path, text)
    try:
        publish(tmp, Path(path))
    except OSError as err:
        _discard(tmp)
        raise write_error(err, path, needed=len(text.encode("utf-8"))) from err
    finally:
        _discard(tmp)  # an exception of any kind (an interrupt too): no temporary file stays


def _discard(tmp: Path) -> None:
    try:
        tmp.unlink()
    except FileNotFoundError:
        return
