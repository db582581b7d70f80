"""hydra/launcher=gpus (hydra_plugins/lowbit_gpu_launcher) on the CPU, with simulated GPUs: each job's process is
started with CUDA_VISIBLE_DEVICES set to its "GPU" (checked inside the job), jobs queue one per GPU, a job that
raises, exits or dies leaves the others running and is named at the sweep's end (exit 1), no GPU is one clear error,
and report.json says which device a run used (`device`), whatever the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli, has_module
from omegaconf import OmegaConf

import lowbit_pipe
from lowbit_pipe import report
from lowbit_pipe.running.device_record import device_record, physical_index

APP = Path(__file__).with_name("gpus_app.py")
FAKE = ["GPU-aaaa-0000", "GPU-bbbb-1111"]  # simulated GPUs: only their names reach the jobs
QUICK = ["evaluate.samples=1", "evaluate.trajectory_seeds=0"]

pytestmark = pytest.mark.skipif(not has_module("cloudpickle"), reason="hydra/launcher=gpus needs `pip install '.[sweep]'`")


def run(cmd: list[str], cwd: Path, env_changes: dict[str, str | None], timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, *cmd], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def records(sweep: Path, name: str) -> dict[int, dict]:
    return {int(p.parent.name): json.loads(p.read_text()) for p in sweep.glob(f"*/{name}")}


def test_preset_composes_and_refuses_a_misspelt_key(tmp_path):
    proc = cli(["hydra/launcher=gpus", "--cfg", "hydra", "--package", "hydra.launcher"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = OmegaConf.create(proc.stdout)
    assert launcher["_target_"] == "hydra_plugins.lowbit_gpu_launcher.gpu_launcher.GpuLauncher"
    assert launcher["gpus"] is None and launcher["stop_seconds"] == 300

    proc = cli(["hydra/launcher=gpus", "hydra.launcher.gpu=[0]", "--cfg", "hydra"], tmp_path)
    assert proc.returncode != 0 and "Key 'gpu' not in 'GpuLauncherConf'" in proc.stderr


def test_no_gpu_stops_the_sweep_before_any_job_with_one_clear_line(tmp_path):
    proc = run(["-m", "lowbit_pipe", "-m", "hydra/launcher=gpus", "quantize.default.format=int8,fp8"], tmp_path,
               {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 1
    assert "hydra/launcher=gpus found no GPU to run on (CUDA_VISIBLE_DEVICES ''" in proc.stderr
    assert "hydra/launcher=local" in proc.stderr
    assert not (tmp_path / "runs").exists()  # refused at the launcher's setup: no sweep dir, no job


def test_jobs_run_on_their_own_gpu_one_per_gpu_and_failures_leave_the_others_running(tmp_path):
    outcomes = ["ok", "raise", "die", "exit", "stage", "ok"]
    proc = run([str(APP), "-m", "hydra/launcher=lowbit_gpus", f"hydra.launcher.gpus=[{','.join(FAKE)}]",
                f"outcome={','.join(outcomes)}", "seconds=0.5", "hydra.sweep.dir=sweep"], tmp_path,
               {"CUDA_VISIBLE_DEVICES": None})
    sweep = tmp_path / "sweep"
    launched, seen = records(sweep, "launcher.json"), records(sweep, "job.json")
    assert sorted(launched) == sorted(seen) == list(range(6)), proc.stdout[-3000:] + proc.stderr[-3000:]

    # Each job's process saw exactly its own GPU, and ran where the sweep was started.
    for num, job in seen.items():
        assert job["cuda_visible_devices"] == launched[num]["gpu"] in FAKE
        assert job["pid"] == launched[num]["pid"] and Path(job["cwd"]) == tmp_path
    # One job per GPU at a time, both GPUs busy at once.
    for gpu in FAKE:
        spans = sorted((r["started_unix"], r["ended_unix"]) for r in launched.values() if r["gpu"] == gpu)
        assert len(spans) == 3 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    first = [launched[n] for n in (0, 1)]
    assert {r["gpu"] for r in first} == set(FAKE) and max(r["started_unix"] for r in first) < min(r["ended_unix"] for r in first)

    # The failures: recorded, named at the end, and the jobs after them still ran to their end.
    assert [launched[n]["status"] for n in range(6)] == ["COMPLETED", "FAILED", "FAILED", "FAILED", "COMPLETED", "COMPLETED"]
    assert launched[2]["returncode"] == -9 and "end" not in seen[2]
    assert all("end" in seen[n] for n in (0, 5)) and "end" not in seen[4]
    assert proc.returncode == 1
    assert "hydra/launcher=gpus: 3 of 6 job(s) failed; the others ran to their end:" in proc.stderr
    assert "RuntimeError: job 1 raised on purpose" in proc.stderr
    assert f"JobCrashed: job #2 on GPU {launched[2]['gpu']} ended without a result (killed by SIGKILL)" in proc.stderr
    assert "JobExited: job exited with status 3" in proc.stderr
    # A stage failure (NaN and a failed report.json) is not a failed job, but it is named too: Hydra raises the first
    # failed job's error and never calls lowbit_pipe's sweep-outcome callback, which would list it.
    assert "lowbit_pipe: 1 job(s) of the sweep failed:" in proc.stderr
    assert "stage 'quantize' failed on purpose" in proc.stderr


def test_a_job_asking_for_cuda_1_is_refused_before_any_job_runs(tmp_path):
    # (lowbit_pipe's CLI refuses cuda:1 on a host without two GPUs before Hydra starts: the plain app reaches the launcher)
    proc = run([str(APP), "-m", "hydra/launcher=lowbit_gpus", f"hydra.launcher.gpus=[{FAKE[0]}]",
                "+model.device=cpu,cuda:1", "hydra.sweep.dir=sweep"], tmp_path, {"CUDA_VISIBLE_DEVICES": None})
    assert proc.returncode == 1
    assert "job #1: model.device=cuda:1: under hydra/launcher=gpus each job sees only its own GPU" in proc.stderr
    assert not list((tmp_path / "sweep").glob("*/job.json"))


@pytest.mark.slow
def test_lowbit_sweep_on_two_simulated_gpus_says_which_gpu_each_job_used(tmp_path):
    proc = run(["-m", "lowbit_pipe", "-m", "hydra/launcher=gpus", f"hydra.launcher.gpus=[{','.join(FAKE)}]",
                "quantize.default.format=int8,fp8", "hydra.sweep.dir=sweep", *QUICK], tmp_path,
               {"CUDA_VISIBLE_DEVICES": None}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    launched, reports = records(sweep, "launcher.json"), records(sweep, "report.json")
    assert sorted(reports) == [0, 1]
    for num, rep in reports.items():
        assert rep["status"] == "ok" and rep["stages"]["teardown"]["proven"]
        assert rep["device"] == {"type": "cpu", "cuda_visible_devices": launched[num]["gpu"]}
    assert {r["gpu"] for r in launched.values()} == set(FAKE)
    assert report.main([str(sweep)]) == 0  # the comparison table reads the sweep as with any launcher


def test_report_json_says_which_device_the_run_used(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cafe-0001")
    result = lowbit_pipe.run("default", ["pipeline=[load,detect]"], run_dir=tmp_path / "run")
    written = json.loads((tmp_path / "run" / "report.json").read_text())
    assert written["device"] == result.report["device"] == {"type": "cpu", "cuda_visible_devices": "GPU-cafe-0001"}


class FakeProps:
    name, total_memory = "NVIDIA H100 80GB HBM3", 85_000_000_000
    uuid = "8f3e0b6c-0000-1111-2222-333344445555"


def test_device_record_on_a_simulated_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: FakeProps())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    expected = {"type": "cuda", "index": 1, "count": 2, "name": FakeProps.name, "uuid": f"GPU-{FakeProps.uuid}",
                "total_memory_bytes": FakeProps.total_memory, "physical_index": 7, "cuda_visible_devices": "5,7"}
    assert device_record("cuda:1") == expected
    assert device_record("auto")["index"] == device_record("cuda")["index"] == 0
    assert device_record("auto")["physical_index"] == 5
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_record("cuda:1")["physical_index"] == 1 and device_record("cuda:1")["cuda_visible_devices"] is None
    assert device_record("cpu") == device_record(None) == {"type": "cpu", "cuda_visible_devices": None}
    assert device_record(None, torch.nn.Linear(2, 2))["type"] == "cpu"  # a passed-in model's own device
    # Past what the process sees (a recipe not checked first): no properties to read, still a record.
    assert device_record("cuda:3") == {"type": "cuda", "index": 3, "count": 2, "physical_index": 3,
                                       "cuda_visible_devices": None}


def test_physical_index_is_null_when_the_gpu_was_given_by_uuid():
    assert physical_index("GPU-8f3e,GPU-1c2d", 0) is None  # the uuid says which GPU
    assert physical_index("3", 0) == 3 and physical_index(None, 2) == 2


def test_ctrl_c_on_the_sweep_reaches_every_running_job(tmp_path):
    """SIGINT to the driver alone (a shell's Ctrl-C reaches the whole process group; `kill -INT` or a scheduler
    reaches only the driver): it is passed on to the running jobs, the driver waits for them, and no job outlives it."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    driver = subprocess.Popen([sys.executable, str(APP), "-m", "hydra/launcher=lowbit_gpus",
                               f"hydra.launcher.gpus=[{','.join(FAKE)}]", "outcome=ok,ok,ok", "seconds=120",
                               "hydra.sweep.dir=sweep"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    sweep, deadline = tmp_path / "sweep", time.monotonic() + 120
    while len(records(sweep, "job.json")) < 2 and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    jobs = records(sweep, "job.json")
    assert sorted(jobs) == [0, 1], driver.communicate()[1][-3000:] if driver.poll() is not None else "jobs did not start"
    start = time.monotonic()
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=60)
    assert driver.returncode != 0 and time.monotonic() - start < 60  # far short of the jobs' 120 s
    for job in jobs.values():
        with pytest.raises(ProcessLookupError):
            os.kill(job["pid"], 0)  # the job's process is gone
    assert 2 not in records(sweep, "job.json")  # the queued third job never started
    launched = records(sweep, "launcher.json")  # the stopped jobs still say where they ran and how they ended
    assert sorted(launched) == [0, 1] and all(r["status"] == "FAILED" for r in launched.values()), err[-3000:]
    assert {r["gpu"] for r in launched.values()} == set(FAKE)


def test_a_recipe_file_may_set_the_gpu_list_but_not_choose_the_launcher():
    from lowbit_pipe.config.untrusted import check_data
    from lowbit_pipe.errors import RecipeError

    check_data({"hydra": {"launcher": {"gpus": [0, 1], "stop_seconds": 60}}}, "team.yaml")  # data: allowed
    with pytest.raises(RecipeError, match=r"team\.yaml: defaults\[0\].*choose it on the command line"):
        check_data({"defaults": [{"override /hydra/launcher": "gpus"}]}, "team.yaml")
