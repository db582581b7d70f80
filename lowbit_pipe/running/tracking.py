"""MLflow tracking of runs and sweeps, as a Hydra callback: `python -m lowbit_pipe -m hydra/callbacks=mlflow ...`.

Per job (`on_job_end`, in the process that ran the job, whichever the launcher), one MLflow run:
params = the resolved recipe, flattened (`quantize.default.format`); metrics = every number report.json
holds (`evaluate.rel_error`, `evaluate.trajectory.mean_cosine`, `stages.load.seconds`, ...); tags = git
sha, arch, formats, status, run dir, overrides and the export's path (the file itself only with
`log_export: true`); artifacts = report.json, summary.txt and images.png. A failed job is a FAILED run
with its error as the `lowbit.error` tag. At the sweep's end its report.png (`python -m
lowbit_pipe.report`) is logged too, when it is there. Configured in conf/hydra/callbacks/mlflow.yaml.

The default store is local: `sqlite:///<the folder holding the sweep (or run) dir>/mlflow/mlflow.db`,
artifacts beside it. Not inside the sweep dir, where `python -m lowbit_pipe.report` would count the
artifact copies of report.json as runs; and not MLflow's `file:` store, which MLflow 3 refuses unless
MLFLOW_ALLOW_FILE_STORE=true (any `tracking_uri`, that one too, can be configured).

The callback keeps no client or run between calls (Hydra pickles it into joblib and Ray workers) and
uses MlflowClient only, never the fluent API's process-wide active run. A tracking failure (a server
down) is a warning from Hydra, never a failed job.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lowbit_pipe.report import flatten

MLFLOW_MISSING = "hydra/callbacks=mlflow needs MLflow: `pip install '.[mlflow]'` (lowbit_pipe[mlflow])"
CONFIG_KEY = "hydra.callbacks.mlflow"
ARTIFACTS = ("report.json", "summary.txt", "images.png")
SWEEP_ARTIFACTS = ("report.png", "report.md", "report.csv")
STAGE_MEASURES = {"seconds", "peak_host_bytes", "peak_device_bytes"}
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


@dataclass(frozen=True)
class MlflowTrackingConfig:
    # Any MLflow URI ("http://mlflow:5000", "sqlite:///x.db", "databricks"); null: the local store above.
    tracking_uri: str | None = None
    # null: the recipe's name (`name:`), so runs of one recipe compare side by side.
    experiment_name: str | None = None
    # Copy the exported .safetensors into the artifact store (it is referenced by path otherwise).
    log_export: bool = False


def tracking_config(settings: dict[str, Any]) -> MlflowTrackingConfig:
    known = {f.name for f in fields(MlflowTrackingConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"{CONFIG_KEY}.{unknown[0]}: no such key (known: {', '.join(sorted(known))})")
    return MlflowTrackingConfig(**settings)


def _mlflow_client(uri: str) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ImportError(MLFLOW_MISSING) from None
    return MlflowClient(tracking_uri=uri)


def default_store(run_or_sweep_dir: Path) -> tuple[str, str]:
    """(tracking URI, artifact location) of the local store beside `run_or_sweep_dir`."""
    store = run_or_sweep_dir.resolve().parent / "mlflow"
    store.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()


def recipe_params(recipe: dict[str, Any]) -> dict[str, str]:
    """The recipe as MLflow params: strings as they are, anything else as JSON (null, true, [..])."""
    params = {}
    for key, value in flatten(recipe).items():
        text = value if isinstance(value, str) else json.dumps(value)
        params[key] = text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 1] + "…"
    return params


def report_metrics(report: dict[str, Any]) -> dict[str, float]:
    """Every number in report.json, keyed by its path: the sections' figures (evaluate, quantize, export,
    teardown, ...) and each stage's seconds and peak memory; a stage's figures that its own section
    repeats are taken once, from the section. Booleans count 0/1; null (not measured, or an exact match's
    infinite PSNR) is left out."""
    metrics: dict[str, float] = {}
    for section, value in report.items():
        if section in ("recipe", "plan", "warnings", "stages"):
            continue
        metrics.update(_numbers(flatten(value, f"{section}.")))
    for stage, entry in (report.get("stages") or {}).items():
        own = {k: v for k, v in entry.items() if k in STAGE_MEASURES or stage not in report}
        metrics.update(_numbers(flatten(own, f"stages.{stage}.")))
    return metrics


def _numbers(flat: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in flat.items()
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))}


def report_tags(report: dict[str, Any], environment: dict[str, Any]) -> dict[str, str]:
    quantize = report.get("quantize") or {}
    formats = sorted(quantize.get("layers") or (report.get("detect") or {}).get("plan", {}).get("layers") or {})
    tags = {
        "lowbit.status": report.get("status"),
        "lowbit.arch": (report.get("detect") or {}).get("arch"),
        "lowbit.formats": ",".join(f for f in formats if f != "float") or None,
        "lowbit.export_path": (report.get("export") or {}).get("path"),
        "lowbit.git_sha": environment.get("git_sha"),
        "lowbit.device": environment.get("device"),
        "mlflow.source.git.commit": environment.get("git_sha"),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _composed_recipe(job_return: JobReturn) -> dict[str, Any]:
    """The job's config, for a job that failed before it wrote report.json."""
    if job_return.cfg is None:
        return {}
    try:
        return OmegaConf.to_container(job_return.cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve: log it as written
        return OmegaConf.to_container(job_return.cfg, resolve=False)  # type: ignore[return-value]


def _job_error(job_return: JobReturn) -> str | None:
    if job_return.status != JobStatus.FAILED:
        return None
    # JobReturn.return_value re-raises a failed job's exception; the stored value is what we want.
    error = getattr(job_return, "_return_value", None)
    return f"{type(error).__name__}: {error}" if error is not None else "failed"


class MlflowCallback(Callback):
    """Logs each job to MLflow (see the module's docstring); settings: MlflowTrackingConfig."""

    def __init__(self, **settings: Any) -> None:
        # Hydra makes the callback at start-up: a missing MLflow is refused there, before any job runs
        # (an error inside a callback's hook is only a warning to Hydra).
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError(MLFLOW_MISSING)
        self.settings = tracking_config(settings)

    # Where the store is and which experiment: resolved per call from the config Hydra passes.
    def _store(self, run_or_sweep_dir: Path) -> tuple[Any, str | None]:
        if self.settings.tracking_uri:
            return _mlflow_client(self.settings.tracking_uri), None
        uri, artifacts = default_store(run_or_sweep_dir)
        return _mlflow_client(uri), artifacts

    def _experiment_id(self, client: Any, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # another job's process created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _experiment_name(self, config: DictConfig) -> str:
        return self.settings.experiment_name or str(OmegaConf.select(config, "name", default=None) or "lowbit_pipe")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Create the store and the experiment once, before the jobs' processes log to them at the same time
        # (two processes creating a fresh SQLite store race on its tables).
        client, artifacts = self._store(Path(str(config.hydra.sweep.dir)))
        self._experiment_id(client, self._experiment_name(config), artifacts)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.runtime.output_dir))
        multirun = OmegaConf.select(config, "hydra.mode", default=None) == RunMode.MULTIRUN
        report = _read_json(run_dir / "report.json")
        environment = _read_json(run_dir / "environment.json")
        recipe = report.get("recipe") or _composed_recipe(job_return)

        client, artifacts = self._store(Path(str(config.hydra.sweep.dir)) if multirun else run_dir)
        experiment_id = self._experiment_id(client, self._experiment_name(config), artifacts)
        error = report.get("error") or _job_error(job_return)  # the stage's own message, when it wrote one
        status = ("KILLED" if report.get("status") == "interrupted" else
                  "FAILED" if error or report.get("status") == "failed" else "FINISHED")
        overrides = " ".join(str(o) for o in (job_return.overrides or []))
        tags = {"lowbit.run_dir": str(run_dir), "lowbit.overrides": overrides,
                "mlflow.runName": f"{config.hydra.job.num}: {overrides}" if multirun else run_dir.name,
                **report_tags(report, environment)}
        if multirun:
            tags.update({"lowbit.sweep_dir": str(Path(str(config.hydra.sweep.dir)).resolve()),
                         "lowbit.job_num": str(config.hydra.job.num)})
        if error:
            tags["lowbit.error"] = error[:5000]

        end_ms = int(time.time() * 1000)
        seconds = sum((s or {}).get("seconds", 0) for s in (report.get("stages") or {}).values())
        run = client.create_run(experiment_id, start_time=end_ms - int(seconds * 1000), tags=tags)
        run_id = run.info.run_id
        from mlflow.entities import Metric, Param

        client.log_batch(run_id,
                         metrics=[Metric(k, v, end_ms, 0) for k, v in report_metrics(report).items()],
                         params=[Param(k, v) for k, v in recipe_params(recipe).items()])
        for name in ARTIFACTS:
            if (run_dir / name).is_file():
                client.log_artifact(run_id, str(run_dir / name))
        export = (report.get("export") or {}).get("path")
        if self.settings.log_export and export and Path(export).is_file():
            client.log_artifact(run_id, export, artifact_path="export")
        client.set_terminated(run_id, status=status, end_time=end_ms)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # The sweep's comparison (python -m lowbit_pipe.report <sweep dir>), when it has been made.
        sweep_dir = Path(str(config.hydra.sweep.dir))
        present = [sweep_dir / name for name in SWEEP_ARTIFACTS if (sweep_dir / name).is_file()]
        if not any(p.name == "report.png" for p in present):
            return
        client, artifacts = self._store(sweep_dir)
        experiment_id = self._experiment_id(client, self._experiment_name(config), artifacts)
        run = client.create_run(experiment_id, tags={"mlflow.runName": f"sweep {sweep_dir.name}",
                                                      "lowbit.sweep_dir": str(sweep_dir.resolve()),
                                                      "lowbit.kind": "sweep report"})
        for path in present:
            client.log_artifact(run.info.run_id, str(path))
        client.set_terminated(run.info.run_id, status="FINISHED")
