"""A real ComfyUI for slow tests: the source archive unpacked once per session, imported in a child process.

CI keeps ComfyUI 0.29.0's source as `../shared/comfyui-0.29.0.tar.xz` beside the checkout (GPL-3: a test
fixture, unpacked into a scratch folder, nothing of it copied into the project); `LOWBIT_COMFYUI_ARCHIVE`
names another copy. Without one, every test that needs it is skipped with one line saying how to get it
(`require_archive`); CI sets LOWBIT_COMFYUI_REQUIRED=1, which fails them instead, so a lost archive cannot turn
CI's real-ComfyUI tests into silent skips. ComfyUI keeps global state (its ops, QUANT_ALGOS, model management), so each check
runs in its own Python process: `run_child(script, job)` writes the job as JSON, runs the script with this
checkout first on PYTHONPATH and returns the JSON the script wrote.

`shared_comfyui()` (the `comfyui_src` session fixture of conftest.py) is the one unpacked tree the tests share: made
once per archive content in a cache folder (unpacked beside it and compiled to bytecode, then renamed into place: a
half-made tree is never used), so no child or server of any module unpacks or compiles ComfyUI again. Tests use it read-only: its manifest (every file's size and mtime, `__pycache__` aside) is checked when it is
reused and at the end of the session (`changes`), which names any file a test added, changed or removed. A test that
must write into a ComfyUI folder unpacks its own with `unpack(dest)`.

`shared_server_python(src, root)` (the `server_python` session fixture) is the one Python the server and browser
modules start ComfyUI with: a venv with ComfyUI's pinned requirements and this checkout installed the README's way,
made once per test session under a file lock (pytest-xdist's workers are processes of their own: the first to ask
builds it, the other waits and reuses it).
"""

from __future__ import annotations

import compileall
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from comfyui_server import find_archive  # noqa: E402 - the one lookup of the archive, shared with the benches

REQUIRED_ENV = "LOWBIT_COMFYUI_REQUIRED"
# The shared trees, one per archive content (`archive_key`): outside any checkout, so every worktree and session reuses it.
CACHE_ROOT = Path(tempfile.gettempdir()) / "lowbit_pipe-comfyui"
MANIFEST = ".lowbit-manifest.json"
LAYOUT = "b1"  # what a tree holds besides the archive's files (b1: bytecode); a new layout is a new tree


def require_archive() -> Path:
    """The ComfyUI source archive; else the calling test (or fixture) is skipped with one line saying where it was
    looked for and how to provide it (the same line for every such test: pytest -ra folds them into one), or
    failed where LOWBIT_COMFYUI_REQUIRED=1."""
    try:
        return find_archive()
    except FileNotFoundError as err:
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{err} ({REQUIRED_ENV}=1: the real-ComfyUI tests must run here)", pytrace=False)
        pytest.skip(str(err))


def unpack(dest: Path) -> Path:
    """Unpack the archive into `dest` (skipping the test without one: `require_archive`); the ComfyUI folder (the
    one holding `comfy/`)."""
    archive = require_archive()
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return _comfyui_folder(dest, archive)


def _comfyui_folder(dest: Path, archive: Path) -> Path:
    found = [p.parent for p in dest.glob("*/comfy") if p.is_dir()] + ([dest] if (dest / "comfy").is_dir() else [])
    if not found:
        raise FileNotFoundError(f"{archive} holds no ComfyUI folder (no comfy/ under {dest})")
    return found[0]


def run_child(script: Path, job: dict[str, Any], work: Path, timeout: int = 900) -> dict[str, Any]:
    """Run `python script job.json result.json` with this checkout first on the path; the result."""
    work.mkdir(parents=True, exist_ok=True)
    job_file, out_file = work / "job.json", work / "result.json"
    job_file.write_text(json.dumps(job, default=str))
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "bench")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.run([sys.executable, str(script), str(job_file), str(out_file)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=work)
    if proc.returncode != 0 or not out_file.is_file():
        raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())


def archive_key(archive: Path) -> str:
    """The cache folder's name for `archive`: its size, mtime and the start of its SHA-256 (another archive, or the
    same name re-downloaded, gets a tree of its own)."""
    st = archive.stat()
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    return f"{LAYOUT}-{st.st_size}-{st.st_mtime_ns}-{digest}"


def _listing(home: Path) -> dict[str, list[int]]:
    """relative path -> [size, mtime_ns] of every file under `home` ([-1, 0] for a folder, whose mtime moves when
    Python adds a __pycache__ to it); __pycache__ folders and the manifest itself left out."""
    out: dict[str, list[int]] = {}
    for folder, dirs, files in os.walk(home):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        base = Path(folder)
        for name in dirs:
            out[(base / name).relative_to(home).as_posix() + "/"] = [-1, 0]
        for name in files:
            st = (base / name).lstat()
            out[(base / name).relative_to(home).as_posix()] = [st.st_size, st.st_mtime_ns]
    out.pop(MANIFEST, None)
    return out


def changes(home: Path) -> list[str]:
    """What differs in the shared tree `home` from its manifest: 'added X', 'changed X', 'removed X' (empty: the
    tree is as unpacked)."""
    want = json.loads((home / MANIFEST).read_text())
    have = _listing(home)
    return ([f"added {k}" for k in sorted(set(have) - set(want))] +
            [f"changed {k}" for k in sorted(set(have) & set(want)) if have[k] != want[k]] +
            [f"removed {k}" for k in sorted(set(want) - set(have))])


def tree_of(src: Path) -> Path:
    """The shared tree (the folder with the manifest) that holds the ComfyUI folder `src`."""
    return next(p for p in (src, *src.parents) if (p / MANIFEST).is_file())


def _build(archive: Path, home: Path) -> None:
    """Unpack `archive` beside `home`, write its manifest, then rename it into place (another session that made
    it first wins: this copy is dropped)."""
    home.parent.mkdir(parents=True, exist_ok=True)
    scratch = home.parent / f".{home.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        unpack(scratch)
        # Bytecode for every module, once (~2 s): each child and server then loads it instead of compiling what it
        # imports (~1 s of CPU per child for comfy.sd alone), PYTHONDONTWRITEBYTECODE or not. A file this Python
        # cannot compile is left to fail where it is imported, as it would without this.
        compileall.compile_dir(scratch, quiet=2, workers=0)
        (scratch / MANIFEST).write_text(json.dumps(_listing(scratch)))
        try:
            scratch.rename(home)
        except OSError:  # made meanwhile by another session (rename does not replace a non-empty folder)
            if not (home / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def shared_comfyui() -> Path:
    """The ComfyUI folder of the shared, read-only unpacked tree of the archive (made on first use; skipping the
    test without an archive: `require_archive`). A cached tree that was changed is set aside and made again."""
    archive = require_archive()
    home = CACHE_ROOT / archive_key(archive)
    if home.is_dir() and (not (home / MANIFEST).is_file() or changes(home)):
        stale = home.parent / f".stale-{home.name}-{uuid.uuid4().hex[:8]}"
        try:
            home.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        except FileNotFoundError:  # another session set it aside first: it is made again below
            assert not home.exists() or (home / MANIFEST).is_file(), home
    if not home.is_dir():
        _build(archive, home)
    return _comfyui_folder(home, archive)


@dataclass(frozen=True)
class ServerPython:
    """The server's Python and comfy-kitchen's version in it before / after the README's `pip install`."""

    python: str
    comfy_kitchen_before: str | None
    comfy_kitchen_after: str | None


def shared_server_python(src: Path, root: Path) -> ServerPython:
    """The session's server Python under `root` (a folder every worker of the session shares): made by the first
    caller (bench/comfyui_server: ComfyUI's requirements into a venv, then this checkout with the README's command),
    under an exclusive lock on `root/venv.lock`; later callers, in this process or another, read its record."""
    import comfyui_server as cs  # bench/, on the path above

    root.mkdir(parents=True, exist_ok=True)
    record = root / "venv.json"
    with open(root / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        if record.is_file():
            return ServerPython(**json.loads(record.read_text()))
        python = cs.prepare_python(src, root / "venv")
        before = cs.package_version(python, "comfy-kitchen")
        cs.install_lowbit(python)  # the README's `pip install "lowbit_pipe[comfy]"`, into ComfyUI's Python
        made = ServerPython(python, before, cs.package_version(python, "comfy-kitchen"))
        scratch = record.with_name(f".{record.name}.{os.getpid()}")
        scratch.write_text(json.dumps(asdict(made)))
        scratch.replace(record)
        return made
