"""The command line as a user meets it: Hydra's flags, --help, refusals before any work (exit 2, one
line, no run dir), sweep output with job numbers, warnings as one clean line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cli, one_line_refusal


def test_hydra_flags_with_a_value_are_not_overrides(tmp_path):
    # `--cfg job`, `-c job` and `--info config` take a value: it must not be read as an override.
    proc = cli(["--cfg", "job"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pipeline:" in proc.stdout and "tiny_arch: krea2" in proc.stdout
    proc = cli(["-c", "job", "quantize.default.format=fp8", "--package", "quantize"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "format: fp8" in proc.stdout and "pipeline:" not in proc.stdout
    proc = cli(["--info", "defaults", "-cn", "config"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recipe/default" in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_help_says_what_and_lists_what_a_recipe_can_name(tmp_path):
    proc = cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "quantize a diffusion transformer" in out
    assert "python -m lowbit_pipe recipe=krea2_nvfp4" in out  # the README's example commands
    for name in ("krea2_nvfp4", "flux1_fp8", "tiny_flux1", "nvfp4 (nvfp4)", "convrot_w4a4", "float8_e4m3fn",
                 "qwen_image", "hadanorm", "static"):
        assert name in out, name
    assert "$CONFIG" not in out and "model:\n  arch" not in out  # not a config dump


def test_refusals_before_any_work(tmp_path):
    not_st = tmp_path / "weights.safetensors"
    not_st.write_bytes(b"\x00" * 4096)  # a zeroed file: a length of 0, then no JSON header
    one_line_refusal(cli([f"model.path={not_st}"], tmp_path), "model.path", "not a safetensors file", str(not_st))
    one_line_refusal(cli(["recipe=no_such_recipe"], tmp_path), "unknown recipe 'no_such_recipe'", "krea2_nvfp4")
    assert not (tmp_path / "runs").exists()  # nothing ran, no run dir


@pytest.mark.slow
def test_more_refusals_before_any_work(tmp_path):
    one_line_refusal(cli(["model.path=missing.safetensors"], tmp_path), "model.path", "missing.safetensors")
    one_line_refusal(cli(["recipe=krea2_nvfp4_lora", "lora.files=[{path: gone.safetensors}]"], tmp_path),
                      "lora.files[0].path", "gone.safetensors")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    one_line_refusal(cli([f"export.path={blocker}/out.safetensors"], tmp_path), "export.path", "not a writable")
    if not torch.cuda.is_available():
        one_line_refusal(cli(["model.device=cuda"], tmp_path), "model.device", "no CUDA device")
    assert not (tmp_path / "runs").exists()


def test_sweep_lines_carry_the_job_number_and_warnings_are_one_line(tmp_path):
    # Tiny Krea 2's 64-wide text layers cannot take w4a8 (ConvRot group 256): a warning, in job 1 only.
    proc = cli(["-m", "quantize.default.format=int8,w4a8", "quantize.arch_keep_float=false",
                "pipeline=[load,detect,quantize]"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(line.startswith("[job 0] detect: krea2") for line in proc.stdout.splitlines())
    assert any(line.startswith("[job 1] lowbit_pipe run: ok") for line in proc.stdout.splitlines())
    warned = [line for line in proc.stderr.splitlines() if "warning:" in line]
    assert warned and all(line.startswith("[job 1] warning: ") for line in warned), proc.stderr
    assert "stay float" in warned[0] and "quantize.fallback" in warned[0]
    assert "UserWarning" not in proc.stderr and "warnings.warn" not in proc.stderr


def test_a_failed_job_does_not_stop_the_sweep_and_the_sweep_exits_1(tmp_path):
    """Job 0's budget is impossible (its quantize stage fails); job 1 still runs, and the sweep's exit code and
    last lines name the failure."""
    import json

    proc = cli(["-m", "quantize.budget_bytes=1,null", "pipeline=[load,detect,quantize]"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    reports = {p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "runs" / "multirun").rglob("report.json")}
    assert reports["0"]["status"] == "failed" and reports["1"]["status"] == "ok"
    tail = proc.stderr.strip().splitlines()[-2:]
    assert tail[0] == "lowbit_pipe: 1 job(s) of the sweep failed:"
    assert tail[1].strip().startswith(str(Path("runs") / "multirun")) and "budget 1 bytes" in tail[1], tail


@pytest.mark.slow
def test_interrupt_exit_code_is_130_after_teardown(tmp_path):
    """A real SIGINT in the middle of a run: exit code 130, and the run dir's report says it tore down."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, "-m", "lowbit_pipe", "evaluate.samples=200", "evaluate.trajectory_seeds=0",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # a background parent may ignore SIGINT; the child must not inherit that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (tmp_path / "run" / "recipe.yaml").exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(8)  # inside evaluate's 200 samples
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "interrupted"
    assert report["stages"]["teardown"]["retained_bytes"] == 0
