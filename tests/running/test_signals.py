"""SIGINT and SIGTERM at every stage of a run and of a sweep job: the run is torn down (proven), report.json says
`interrupted: {stage, signal}`, no partial export and no temporary file stays, the signal handlers are given back,
and the command line exits 130 / 143 with one line on stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT

import lowbit_pipe
from lowbit_pipe.__main__ import stopped_line
from lowbit_pipe.files import checkpoint
from lowbit_pipe.running.interrupts import Interrupted, OrderlyStop
from lowbit_pipe.stages import STAGES

CHILD = str(Path(__file__).with_name("fault_child.py"))
PIPELINE = ["load", "detect", "quantize", "evaluate", "export", "teardown"]  # the default recipe's
FAST = {("TERM", "export"), ("INT", "quantize")}


def _signal_at_start(monkeypatch, stage: str, signum: int) -> None:
    """Send the signal to this process as `stage` starts (the handler raises at the next bytecode)."""
    if stage == "teardown":
        from lowbit_pipe.running import runner

        real = runner.teardown
        monkeypatch.setattr(runner, "teardown", lambda ctx: (os.kill(os.getpid(), signum), real(ctx))[1])
        return
    cls = STAGES[stage]
    real = cls.run
    monkeypatch.setattr(cls, "run", lambda self, ctx: (os.kill(os.getpid(), signum), real(self, ctx))[1])


def _temps(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("sig, stage", [
    pytest.param(sig, stage, marks=() if (sig, stage) in FAST else pytest.mark.slow)
    for sig in ("TERM", "INT") for stage in PIPELINE])
def test_a_signal_at_any_stage_stops_the_run_in_order(tmp_path, monkeypatch, sig, stage):
    signum = getattr(signal, f"SIG{sig}")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _signal_at_start(monkeypatch, stage, signum)
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(Interrupted) as info:
        lowbit_pipe.run("default", [f"export.path={out}"], run_dir=tmp_path / "run")
    assert info.value.signum == signum and info.value.stage == stage and info.value.exit_code == 128 + signum
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "interrupted" and report["stage"] == stage
    assert report["interrupted"] == {"stage": stage, "signal": f"SIG{sig}"}
    teardown = report["stages"]["teardown"]
    assert teardown["proven"] and teardown["retained_bytes"] == 0 and teardown["unfreed"] == []
    assert report["signals"]["restored"] and {s: signal.getsignal(s) for s in handlers} == handlers
    # the export is whole (the signal came after it) or absent; never a temporary file
    assert out.exists() == (stage == "teardown") and _temps(tmp_path) == []
    # the command line's one line (its exit code and stderr: test_the_command_line_exits_..., slow)
    written = f"export complete: {out}" if stage == "teardown" else "no export written"
    assert stopped_line(info.value) == f"stopped by SIG{sig} during stage '{stage}'; torn down (proven); {written}"


def test_a_signal_mid_write_leaves_no_partial_export(tmp_path, monkeypatch):
    write = checkpoint.StreamingWriter.write

    def signalled_write(self, key, tensor):
        write(self, key, tensor)
        if self.offset > 100_000:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(checkpoint.StreamingWriter, "write", signalled_write)
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    out.write_bytes(b"the previous export")
    with pytest.raises(Interrupted):  # asked to replace it: the previous file stays whole until the new one is
        lowbit_pipe.run("default", [f"export.path={out}", "export.overwrite=true"], run_dir=tmp_path / "run")
    assert out.read_bytes() == b"the previous export" and _temps(tmp_path) == []
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["interrupted"]["stage"] == "export" and report["stages"]["teardown"]["proven"]


def test_signals_after_the_first_do_not_cut_the_teardown(tmp_path, monkeypatch):
    from lowbit_pipe.running import runner

    real = runner.teardown

    def teardown_under_fire(ctx):
        os.kill(os.getpid(), signal.SIGTERM)  # a second and third signal while tearing down
        os.kill(os.getpid(), signal.SIGINT)
        return real(ctx)

    monkeypatch.setattr(runner, "teardown", teardown_under_fire)
    _signal_at_start(monkeypatch, "evaluate", signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        lowbit_pipe.run("default", [], run_dir=tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert info.value.signal_name == "SIGTERM" and report["stages"]["teardown"]["proven"]
    assert report["signals"]["received"] == ["SIGTERM", "SIGTERM", "SIGINT"]


def test_orderly_stop_leaves_host_handlers_and_other_threads_alone():
    def host(signum, frame):
        return None

    previous = signal.signal(signal.SIGTERM, host)
    try:
        with OrderlyStop() as stop:
            assert stop.handled == ["SIGINT"] and signal.getsignal(signal.SIGTERM) is host
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    installed = []
    thread = threading.Thread(target=lambda: installed.append(OrderlyStop().install()))
    thread.start()
    thread.join()
    assert installed == [[]]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHILD, "signal", *args], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "lowbit_pipe:" in line]  # not progress lines
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("sig, stage, code", [
    pytest.param("TERM", "export", 143, marks=pytest.mark.slow),
    pytest.param("INT", "load", 130, marks=pytest.mark.slow),
    pytest.param("TERM", "startup", 143, marks=pytest.mark.slow),  # before the run: in Hydra's task, no Runner yet
])
def test_the_command_line_exits_with_the_signals_code_and_one_line(tmp_path, sig, stage, code):
    out = tmp_path / "out" / "model.safetensors"
    proc = _cli(sig, stage, f"export.path={out}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == code, proc.stderr[-3000:]
    line = _one_line(proc.stderr)
    if stage == "startup":
        assert line.startswith(f"lowbit_pipe: stopped by SIG{sig} before the run started"), line
        return
    assert line.startswith(f"lowbit_pipe: stopped by SIG{sig} during stage '{stage}'; torn down (proven); "
                           "no export written (run dir: "), line
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["interrupted"] == {"stage": stage, "signal": f"SIG{sig}"} and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["export"])
def test_a_signal_in_a_sweep_job_stops_the_sweep(tmp_path, stage):
    sweep = tmp_path / "sweep"
    proc = _cli("TERM", stage, "-m", "quantize.default.format=int8,fp8", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert _one_line(proc.stderr).startswith(f"[job 0] lowbit_pipe: stopped by SIGTERM during stage '{stage}'")
    report = json.loads((sweep / "0" / "report.json").read_text())
    assert report["status"] == "interrupted" and report["stages"]["teardown"]["proven"]
    assert not (sweep / "0" / "model.safetensors").exists() and not (sweep / "1").exists()


@pytest.mark.slow
def test_a_sigterm_from_outside_mid_evaluate(tmp_path):
    """What `timeout`, Slurm and `docker stop` do: the signal comes from another process, whenever it comes."""
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lowbit_pipe", "evaluate.samples=400", f"hydra.run.dir={run_dir}",
                             f"export.path={tmp_path / 'out' / 'model.safetensors'}"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # report.json names the stage under way as it starts
        try:
            stage = json.loads((run_dir / "report.json").read_text()).get("stage")
        except (OSError, ValueError):  # not written yet
            stage = None
        if stage == "evaluate":
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM during stage 'evaluate'; torn down (proven); no export written" in _one_line(err)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["interrupted"] == {"stage": "evaluate", "signal": "SIGTERM"} and _temps(tmp_path) == []


def test_a_signal_to_a_sweeps_own_process_does_not_claim_nothing_was_written():
    """A launcher that runs jobs in other processes (hydra/launcher=gpus) passes a signal on and re-raises it in the
    sweep's process, where no run report exists: the line says jobs were stopped, not 'nothing was written'."""
    stopped = Interrupted(signal.SIGINT, None)
    assert stopped_line(stopped) == "stopped by SIGINT before the run started; nothing was written"
    line = stopped_line(stopped, sweep=True)
    assert line.startswith("stopped by SIGINT during the sweep;") and "nothing was written" not in line
