"""bench/sweep_gpus.py (issue 46's GPU table): its checks on made-up job rows (a job on the wrong GPU, two jobs on
one GPU at once, the one-GPU time and the target), and its --cpu-smoke run end to end through hydra/launcher=gpus."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import has_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import sweep_gpus


def row(job: str, gpu: str, span: tuple[float, float], **kw) -> dict:
    base = {"job": job, "status": "ok", "assigned_gpu": gpu, "cuda_visible_devices": gpu, "device_type": "cuda",
            "visible_count": 1, "uuid": f"GPU-{gpu}", "span": span, "job_s": span[1] - span[0], "stages_s": 8.0,
            "startup_s": span[1] - span[0] - 8.0, "peak_device_bytes": 30 * 2**30, "teardown_proven": True,
            "retained_bytes": 0, "unfreed": []}
    return {**base, **kw}


def test_a_job_on_another_gpu_or_seeing_several_is_caught():
    assert sweep_gpus.wrong_gpu(row("0", "1", (0, 10)), smoke=False) is None
    assert "was given '1'" in sweep_gpus.wrong_gpu(row("0", "1", (0, 10), cuda_visible_devices="0"), smoke=False)
    assert "seeing 8 GPU(s)" in sweep_gpus.wrong_gpu(row("0", "1", (0, 10), visible_count=8), smoke=False)
    assert "ran on cpu" in sweep_gpus.wrong_gpu(row("0", "1", (0, 10), device_type="cpu"), smoke=False)
    assert sweep_gpus.wrong_gpu(row("0", "1", (0, 10), device_type="cpu"), smoke=True) is None  # simulated GPUs
    assert sweep_gpus.wrong_gpu(row("0", "1", (0, 10), status="failed"), smoke=True) == "status failed"


def test_two_jobs_on_one_gpu_at_once_are_caught():
    rows = [row("0", "0", (0, 10)), row("1", "1", (0, 10)), row("2", "0", (10, 20)), row("3", "1", (9, 20))]
    assert sweep_gpus.shared_gpus(rows) == ["GPU-1: jobs 1 and 3"]
    assert sweep_gpus.shared_gpus(rows[:3]) == []


def test_one_gpu_time_and_target():
    rows = [row(str(i), str(i % 2), (0, 20)) for i in range(4)]  # 4 jobs of 20 s (12 s start-up) on 2 GPUs
    base_rows = [row("0", "0", (0, 18)), row("1", "0", (18, 36))]
    baseline = {"wall_s": 40.0, "jobs": 2}
    one_gpu, how = sweep_gpus.one_gpu_seconds("sample", baseline, base_rows, rows, 2)
    assert one_gpu == 2 * 36 + 4 and "N x" in how  # N x (fp8 + int8 job) + the driver's 4 s once
    assert sweep_gpus.one_gpu_seconds("full", {"wall_s": 77.0}, [], rows, 2)[0] == 77.0
    assert sweep_gpus.one_gpu_seconds("none", None, [], rows, 2)[0] == 80.0

    # No run dirs: nothing found, no one-GPU time, so the target is not met (never met by default).
    empty = sweep_gpus.summarize({"wall_s": 10.0, "returncode": 0, "jobs": 4, "sweep_dir": "/nonexistent"}, None,
                                 "none", 2, smoke=False)
    assert empty["jobs_found"] == 0 and empty["target_met"] is False


@pytest.mark.slow
@pytest.mark.skipif(not has_module("cloudpickle"), reason="hydra/launcher=gpus needs `pip install '.[sweep]'`")
def test_cpu_smoke_runs_the_sweep_on_two_simulated_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "smoke.json"
    code = sweep_gpus.main(["--cpu-smoke", "--baseline", "none", "--scratch", str(tmp_path / "scratch"),
                            "--out", str(out)])
    result = json.loads(out.read_text())
    s = result["summary"]
    assert code == 0, result["sweep"]["stderr_tail"]
    assert s["jobs_found"] == s["jobs_expected"] == 4
    assert s["wrong_gpu"] == {} and s["shared_gpu"] == [] and s["teardown_not_proven"] == []
    assert sorted(r["cuda_visible_devices"] for r in s["jobs"]) == sorted(2 * list(sweep_gpus.SMOKE_GPUS))
    assert {(r["format"], r["seed"]) for r in s["jobs"]} == {(f, i) for f in ("fp8", "int8") for i in (0, 1)}
    assert all(r["startup_s"] is not None and r["startup_s"] > 0 for r in s["jobs"])
    assert "| GPU-smoke-0 |" in out.with_suffix(".md").read_text()
