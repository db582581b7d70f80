"""Kills and full disks: a write stopped at any point leaves the previous file or nothing, never a torn one; what it
leaves behind is named so that the next write (and `python -m lowbit_pipe.purge`) removes it; a full disk is one
WriteError naming the path and the bytes; two exports to one path at once each publish whole."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors import safe_open

import lowbit_pipe
from lowbit_pipe.errors import StageError, WriteError
from lowbit_pipe.files import checkpoint, tempfiles
from lowbit_pipe.files.checkpoint import atomic_save
from lowbit_pipe.purge import purge_run_dir

CHILD = str(Path(__file__).with_name("fault_child.py"))
EXPORT = ["pipeline=[load,detect,quantize,export]"]


def _child(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, CHILD, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def _temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if ".tmp-" in p.name)


def _reloads(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def float_file(tmp_path_factory) -> Path:
    """A float checkpoint of the tiny Krea 2, the input of streamed runs."""
    out = tmp_path_factory.mktemp("float") / "float.safetensors"
    lowbit_pipe.run("default", ["pipeline=[load,detect,export]", f"export.path={out}"], run_dir=out.parent / "run")
    return out


def _killed_run(tmp_path: Path, point: str, extra: list[str], previous: bool) -> tuple[Path, bytes | None, Path]:
    """Export to `out/model.safetensors` in a child killed at `point`; returns (target, previous bytes, run dir)."""
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    before = None
    if previous:
        atomic_save({"previous": torch.arange(10, dtype=torch.float32)}, out)
        before = out.read_bytes()
    run_dir = tmp_path / "run"
    proc = _child("kill", point, str(run_dir), *EXPORT, *extra, f"export.path={out}", "export.overwrite=true")
    assert proc.returncode == -9, proc.stderr[-2000:]
    return out, before, run_dir


@pytest.mark.parametrize("point, streamed, previous", [
    ("bytes:200000", False, True),  # mid-write of the loading path's export
    # a streamed file-to-file run, complete and synced, killed just before its rename; and mid-write
    pytest.param("publish", True, False, marks=pytest.mark.slow),
    pytest.param("bytes:200000", True, True, marks=pytest.mark.slow),
    pytest.param("published", False, True, marks=pytest.mark.slow),  # just after: the new file, whole
])
def test_sigkill_leaves_the_previous_file_or_nothing_and_the_next_run_cleans(tmp_path, request, point, streamed,
                                                                             previous):
    extra = [f"model.path={request.getfixturevalue('float_file')}", "model.stream=true"] if streamed else []
    out, before, run_dir = _killed_run(tmp_path, point, extra, previous)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "running" and report["stage"] == "export"  # the trace a kill -9 leaves
    if point == "published":
        assert "weight" in " ".join(_reloads(out)) and _temps(out.parent) == []
        return
    assert (out.read_bytes() if out.exists() else None) == before  # never a torn file
    stale = _temps(out.parent)
    assert len(stale) == 1 and tempfiles.parse(stale[0]).target_name == "model.safetensors"
    assert tempfiles.why_stale(tempfiles.parse(stale[0])).startswith("writer pid")
    # purge finds it from the run dir, although the export went elsewhere (a dry run: the next write cleans it)
    found = purge_run_dir(run_dir, dry_run=True)["removed"]
    assert [Path(r["path"]) for r in found] == stale
    lowbit_pipe.run("default", [*EXPORT, *extra, f"export.path={out}", "export.overwrite=true"],
                    run_dir=tmp_path / "again")
    assert _temps(out.parent) == [] and len(_reloads(out)) > 1


def test_the_next_write_removes_only_dead_writers_temp_files(tmp_path):
    target = tmp_path / "model.safetensors"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = tempfiles.host_tag()
    stale = tmp_path / f".model.safetensors.tmp-{dead.pid}-{host}-0badc0de"
    legacy = tmp_path / f".model.safetensors.tmp-{dead.pid}"  # the earlier naming
    live = tmp_path / f".model.safetensors.tmp-{os.getpid()}-{host}-12345678"  # a writer still at work
    elsewhere = tmp_path / f".model.safetensors.tmp-{dead.pid}-ffffff-12345678"  # another host's: by age only
    other = tmp_path / f".other.safetensors.tmp-{dead.pid}-{host}-12345678"  # another target: not this write's
    for p in (stale, legacy, live, elsewhere, other):
        p.write_bytes(b"x")
    atomic_save({"w": torch.ones(3)}, target)
    assert not stale.exists() and not legacy.exists()
    assert live.exists() and elsewhere.exists() and other.exists()
    old = os.path.getmtime(elsewhere) - 2 * tempfiles.OTHER_HOST_AGE
    os.utime(elsewhere, (old, old))
    atomic_save({"w": torch.ones(3)}, target)
    assert not elsewhere.exists() and live.exists() and other.exists()


class _FullDisk:
    """A file object on a disk that takes `room` bytes, then fails every write with ENOSPC."""

    def __init__(self, real, room: int):
        self.real, self.room = real, room

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= n
        return self.real.write(data)

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.real.close()


def _full_disk(monkeypatch, module, room: int) -> None:
    monkeypatch.setattr(module, "open", lambda path, mode="r", *a, **k: _FullDisk(open(path, mode, *a, **k), room),  # noqa: SIM115
                        raising=False)


@pytest.mark.parametrize("room", [0, 5000])  # full at once; full mid-tensor
def test_a_full_disk_is_a_write_error_naming_path_and_bytes(tmp_path, monkeypatch, room):
    target = tmp_path / "model.safetensors"
    atomic_save({"previous": torch.ones(4)}, target)
    before = target.read_bytes()
    _full_disk(monkeypatch, checkpoint, room)
    with pytest.raises(WriteError) as info:
        atomic_save({"w": torch.zeros(10_000)}, target)
    message = str(info.value)
    assert "disk full" in message and str(target) in message and "needs 40" in message and "bytes free" in message
    assert target.read_bytes() == before and _temps(tmp_path) == []


def test_a_full_disk_in_a_text_write_and_in_a_run(tmp_path, monkeypatch):
    report = tmp_path / "report.json"
    report.write_text("{}")
    _full_disk(monkeypatch, tempfiles, 10)
    with pytest.raises(WriteError, match="disk full"):
        tempfiles.atomic_write_text(report, json.dumps({"x": "y" * 100}))
    assert report.read_text() == "{}" and _temps(tmp_path) == []
    monkeypatch.undo()
    # the export stage of a run: a failed stage naming the export path and "disk full"; the run is torn down
    out = tmp_path / "out" / "model.safetensors"
    _full_disk(monkeypatch, checkpoint, 100_000)
    with pytest.raises(StageError) as info:
        lowbit_pipe.run("default", [*EXPORT, f"export.path={out}"], run_dir=tmp_path / "run")
    assert isinstance(info.value.cause, WriteError) and "disk full" in str(info.value) and str(out) in str(info.value)
    monkeypatch.undo()
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["status"] == "failed" and saved["stages"]["teardown"]["proven"]
    assert not out.exists() and _temps(out.parent) == []


def test_a_small_real_filesystem_fills(tmp_path):
    """A 2 MiB tmpfs in a user and mount namespace of the child (no root needed where user namespaces are allowed)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=2m none {tmp_path}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode()[-200:]}")
    target = tmp_path / "model.safetensors"
    script = f"mount -t tmpfs -o size=2m none {tmp_path} && exec {sys.executable} {CHILD} diskfull {target}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "disk full" in found["error"] and str(target) in found["error"] and "bytes free" in found["error"]
    assert found["unchanged"] and found["files"] == ["model.safetensors"]


def _export_child(out: Path, run_dir: Path, fmt: str, overwrite: bool) -> subprocess.Popen:
    args = [sys.executable, "-m", "lowbit_pipe", *EXPORT, f"quantize.default.format={fmt}", f"export.path={out}",
            "export.shard_bytes=1048576", f"hydra.run.dir={run_dir}", f"export.overwrite={str(overwrite).lower()}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.parametrize("overwrite", [True, False])
def test_two_sharded_exports_to_one_path_at_once_publish_whole(tmp_path, overwrite):
    """Asked to replace (overwrite): both finish and the set on disk is whole, of one export. Not asked: the one
    that publishes second finds the name taken, replaces nothing and says so (exit 1); the first's set is whole."""
    out = tmp_path / "out" / "model.safetensors"
    jobs = {fmt: _export_child(out, tmp_path / fmt, fmt, overwrite) for fmt in ("int8", "fp8")}
    codes, errors = [], []
    for fmt, job in jobs.items():
        _, err = job.communicate(timeout=180)
        codes.append(job.returncode)
        errors.append(err)
    if overwrite:
        assert codes == [0, 0], errors
    else:
        assert sorted(codes) in ([0, 1], [0, 2]), errors  # 2: the other had finished before this one's preflight
        loser = errors[codes.index(max(codes))]
        assert "nothing was replaced" in loser or "an export never replaces a file unless asked" in loser, loser
    index = json.loads(out.with_name("model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    formats = set()
    for name in shards:  # every shard the index names is of one and the same export
        with safe_open(str(out.parent / name), "pt") as f:
            formats.add(json.loads(f.metadata()["lowbit_pipe"])["recipe"]["quantize"]["default"]["format"])
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == name}
    assert len(formats) == 1 and formats <= {"int8", "fp8"} and _temps(out.parent) == []


def test_a_full_run_dir_still_tears_the_run_down(tmp_path, monkeypatch, tiny_model):
    """report.json cannot be updated as stages start: the run goes on with a warning and a passed-in model is
    still given back float; the last write names the disk."""
    model = tiny_model("krea2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    writes = {"n": 0}
    real = tempfiles.atomic_write_text

    def full_after_start(path, text):
        writes["n"] += Path(path).name == "report.json"
        if writes["n"] >= 4:  # from the evaluate stage's start on: the model is quantized by then
            raise WriteError(str(path), "disk full: test")
        return real(path, text)

    from lowbit_pipe.running import runner

    monkeypatch.setattr(runner, "atomic_write_text", full_after_start)
    with pytest.raises(WriteError, match="disk full"):
        lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate,teardown]"], model=model,
                        run_dir=tmp_path / "run")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_a_kill_between_the_lora_file_and_the_model_file_leaves_no_mismatched_pair(tmp_path):
    """The residual LoRA file is published first and the model file last, the old model removed before: killed
    between the two, the folder holds the new LoRA file and no model file, never the old model with the new LoRA."""
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    atomic_save({"previous": torch.ones(2)}, out)
    atomic_save({"previous": torch.ones(2)}, out.with_name("model.lora.safetensors"))
    proc = _child("kill", "published", str(tmp_path / "run"), "recipe=krea2_nvfp4_lora",
                  "pipeline=[load,detect,quantize,lora,export]", f"export.path={out}", "export.overwrite=true")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not out.exists() and "previous" not in _reloads(out.with_name("model.lora.safetensors"))
    assert _temps(out.parent) == [path for path in _temps(out.parent) if "model.safetensors" in path.name]
