"""hydra/callbacks=mlflow (lowbit_pipe/running/tracking.py): one MLflow run per job holding the recipe as params,
report.json's numbers as metrics and its files as artifacts; a failed job is a FAILED run with its error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

import lowbit_pipe
from lowbit_pipe import report
from lowbit_pipe.errors import StageError
from lowbit_pipe.running.tracking import MlflowCallback, default_store

pytest.importorskip("mlflow", reason="hydra/callbacks=mlflow needs `pip install '.[mlflow]'`")

HEADLINE = ["evaluate.rel_error", "evaluate.cosine", "evaluate.psnr_db", "evaluate.sqnr_min_db", "evaluate.weight_bytes",
            "evaluate.trajectory.mean_cosine", "evaluate.trajectory.min_cosine", "export.bytes"]


def numbers(data, prefix=""):
    """Every number in a report.json, by key path (the test's own walk, independent of tracking.py)."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in numbers(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: float(data)} if isinstance(data, (int, float)) else {}


def client_for(run_or_sweep_dir: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(default_store(run_or_sweep_dir)[0])


def runs_of(client, experiment="default"):
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    return client.search_runs([experiment_id])


def artifact_names(client, run) -> set[str]:
    return {Path(a.path).name for a in client.list_artifacts(run.info.run_id)}


@pytest.mark.slow  # ~23 s: MLflow's import and its SQLite store's creation take ~10 s of it
def test_sweep_logs_one_run_per_job_with_the_reports_figures(tmp_path):
    proc = cli(["-m", "hydra/callbacks=mlflow", "quantize.default.format=int8,fp8", "evaluate.samples=1",
                "evaluate.trajectory_seeds=1", "evaluate.steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = [p for p in (tmp_path / "runs" / "multirun").glob("*/*") if p.is_dir() and p.name != "mlflow"]
    client = client_for(sweep)
    runs = runs_of(client)
    assert len(runs) == 2

    for run in runs:
        run_dir = Path(run.data.tags["lowbit.run_dir"])
        assert run_dir.parent == sweep.resolve() and run.info.status == "FINISHED"
        data = json.loads((run_dir / "report.json").read_text())
        figures = numbers({k: v for k, v in data.items() if k not in ("recipe", "plan")})
        logged = run.data.metrics
        assert set(HEADLINE) <= set(logged)
        assert {f"stages.{s}.seconds" for s in data["stages"]} <= set(logged)
        assert {f"stages.{s}.peak_host_bytes" for s in data["stages"]} <= set(logged)
        assert {k: v for k, v in logged.items() if figures.get(k) != v} == {}  # each metric is report.json's value
        assert run.data.params["quantize.default.format"] == data["recipe"]["quantize"]["default"]["format"]
        assert run.data.params["evaluate.steps"] == "2" and run.data.params["name"] == "default"
        tags = run.data.tags
        assert tags["lowbit.formats"] == data["recipe"]["quantize"]["default"]["format"]
        assert tags["lowbit.arch"] == "krea2" and tags["lowbit.export_path"] == data["export"]["path"]
        sha = json.loads((run_dir / "environment.json").read_text())["git_sha"]
        assert tags.get("lowbit.git_sha") == sha
        assert {"report.json", "summary.txt"} <= artifact_names(client, run)
        assert "model.safetensors" not in artifact_names(client, run)  # referenced by path, not copied

    # The store lies beside the sweep dir, so the sweep's report still sees exactly its two runs.
    assert len(report.collect([sweep])) == 2
    # At a sweep's end its report.png, once `python -m lowbit_pipe.report` has made it, goes in too.
    assert report.main([str(sweep)]) == 0
    MlflowCallback().on_multirun_end(OmegaConf.create({"name": "default", "hydra": {"sweep": {"dir": str(sweep)}}}))
    (sweep_run,) = [r for r in runs_of(client) if r.data.tags.get("lowbit.kind") == "sweep report"]
    assert "report.png" in artifact_names(client, sweep_run)


def _job_config(run_dir: Path) -> OmegaConf:
    return OmegaConf.create({"name": "default", "hydra": {
        "mode": RunMode.RUN, "runtime": {"output_dir": str(run_dir)}, "sweep": {"dir": str(run_dir.parent)},
        "job": {"num": 0}}})


def test_a_failed_job_is_a_failed_run_with_its_error(tmp_path):
    from test_pipeline import _unknown_arch_file

    run_dir = tmp_path / "runs" / "failed"
    with pytest.raises(StageError) as info:  # fails in its load stage, after preflight: report.json says so
        lowbit_pipe.run("default", [f"model.path={_unknown_arch_file(tmp_path)}"], run_dir=run_dir)
    job = JobReturn(overrides=["model.path=unknown.safetensors"], status=JobStatus.FAILED)
    job.return_value = info.value
    MlflowCallback().on_job_end(_job_config(run_dir), job)

    client = client_for(run_dir)
    (run,) = runs_of(client)
    assert run.info.status == "FAILED"
    assert "stage 'load' failed" in run.data.tags["lowbit.error"] and run.data.tags["lowbit.status"] == "failed"
    assert run.data.params["model.path"].endswith("unknown.safetensors")
    assert "report.json" in artifact_names(client, run)


def test_settings_are_typed_and_a_misspelt_key_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a configured SQLite URI keeps artifacts in MLflow's default, ./mlruns
    with pytest.raises(ValueError, match=r"hydra\.callbacks\.mlflow\.tracking_ur: no such key"):
        MlflowCallback(tracking_ur="sqlite:///x.db")
    # Any URI by config, an experiment name of one's own; the export copied when asked.
    run_dir = tmp_path / "run"
    lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]"], run_dir=run_dir)
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    job = JobReturn(overrides=[], status=JobStatus.COMPLETED)
    job.return_value = None
    MlflowCallback(tracking_uri=uri, experiment_name="mine", log_export=True).on_job_end(_job_config(run_dir), job)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = runs_of(client, "mine")
    assert run.info.status == "FINISHED" and "stages.export.seconds" in run.data.metrics
    assert [a.path for a in client.list_artifacts(run.info.run_id, "export")] == ["export/model.safetensors"]
    assert not (tmp_path / "mlflow").exists()  # nothing written to the default store
    assert (tmp_path / "mlruns").is_dir()


@pytest.mark.slow
def test_ray_sweep_records_a_failing_job_as_failed_and_finishes_the_others(tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="hydra/launcher=ray needs `pip install '.[ray]'`")
    from test_pipeline import _unknown_arch_file
    from test_sweep_ray import RAY_LOCAL

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    bad = _unknown_arch_file(tmp_path)
    proc = cli(["-m", "hydra/callbacks=mlflow", *RAY_LOCAL, "evaluate.samples=1", "evaluate.trajectory_seeds=0",
                f"model.path=null,{bad}"], tmp_path)
    # A failed stage's job returns (NaN) instead of exiting: callbacks see it, the other job runs to the end, and
    # the sweep exits 1 naming the failed job (lowbit_pipe.running.sweep_outcome).
    assert proc.returncode == 1 and "lowbit_pipe: 1 job(s) of the sweep failed:" in proc.stderr
    (sweep,) = [p for p in (tmp_path / "runs" / "multirun").glob("*/*") if p.is_dir() and p.name != "mlflow"]
    by_status = {r.info.status: r for r in runs_of(client_for(sweep))}
    assert sorted(by_status) == ["FAILED", "FINISHED"]
    failed = by_status["FAILED"]
    assert failed.data.tags["lowbit.job_num"] == "1" and "no known architecture" in failed.data.tags["lowbit.error"]
    assert by_status["FINISHED"].data.metrics["evaluate.rel_error"] > 0
