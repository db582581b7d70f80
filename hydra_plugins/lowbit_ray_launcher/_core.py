"""Runs each job of a sweep as one Ray task, with Hydra's own `run_job` inside the task.

The driver composes every job's config (as the basic launcher does), picks its Ray resources from the
recipe's `model.device`, submits all jobs and waits for them in order; Ray runs as many at once as the
cluster's CPUs and GPUs allow, each GPU job on its own GPU (Ray sets CUDA_VISIBLE_DEVICES per task).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.lowbit_ray_launcher.config import RayLauncherConf
from lowbit_pipe.running.sweep_outcome import failed_jobs, print_failed

if TYPE_CHECKING:
    from hydra_plugins.lowbit_ray_launcher.ray_launcher import RayLauncher

log = logging.getLogger(__name__)

RAY_MISSING = "hydra/launcher=ray needs Ray: `pip install '.[ray]'` (lowbit_pipe[ray])"
LOCAL_ONLY = ("num_cpus", "num_gpus", "object_store_memory")


class JobExited(RuntimeError):
    """A job's task function called sys.exit with a failure status (lowbit_pipe's CLI does when interrupted; a
    failed stage in a sweep returns NaN instead, see lowbit_pipe.running.sweep_outcome)."""


@dataclass(frozen=True)
class FailureOnExit:
    """The task function, with a failing `sys.exit` turned into an exception.

    `run_job` records an exception as a failed job (JobStatus.FAILED) and still calls the callbacks'
    `on_job_end` (MLflow logs the FAILED run); a SystemExit would pass through `run_job`, skip
    `on_job_end` and end the Ray worker. The sweeper reports the failed job and exits 1 once every job
    has finished (the basic launcher instead stops the sweep at the first such exit)."""

    task_function: TaskFunction

    def __call__(self, cfg: DictConfig) -> Any:
        try:
            return self.task_function(cfg)
        except SystemExit as exit_:
            if exit_.code in (0, None):
                return None
            raise JobExited(f"job exited with status {exit_.code} (its run dir's report.json says why)") from None


def execute_job(sweep_config: DictConfig, hydra_context: HydraContext, task_function: TaskFunction,
                singleton_state: Dict[Any, Any]) -> JobReturn:
    """One job, inside a Ray worker: the joblib launcher's steps, then Hydra's `run_job`."""
    setup_globals()
    Singleton.set_state(singleton_state)  # the driver's ConfigStore (our recipe schema) and JobRuntime
    # Jobs run where the sweep was started, as with the basic launcher: relative run dirs, model paths and
    # exports resolve the same (a local Ray worker's own cwd is not the driver's).
    driver_cwd = str(sweep_config.hydra.runtime.cwd)
    if os.path.isdir(driver_cwd):
        os.chdir(driver_cwd)
    HydraConfig.instance().set_config(sweep_config)
    return run_job(hydra_context=hydra_context, config=sweep_config, task_function=FailureOnExit(task_function),
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def wants_gpu(device: Any) -> bool:
    return isinstance(device, str) and (device == "auto" or device.split(":")[0] == "cuda")


def job_resources(sweep_config: DictConfig, settings: RayLauncherConf, cluster_gpus: float) -> Dict[str, float]:
    """What one job asks Ray for: GPUs only for a cuda/auto recipe on a cluster that has them."""
    device = OmegaConf.select(sweep_config, "model.device", default=None)
    if not (wants_gpu(device) and cluster_gpus > 0):
        return {"num_cpus": settings.cpus_per_job, "num_gpus": 0}
    index = device.split(":")[1] if ":" in device else "0"
    if not index.isdigit() or int(index) >= max(1, int(settings.gpus_per_job)):
        raise ValueError(f"model.device={device}: under hydra/launcher=ray each job sees only the "
                         f"{settings.gpus_per_job:g} GPU(s) Ray gives it (hydra.launcher.gpus_per_job), as cuda:0...; "
                         "use model.device=cuda")
    return {"num_cpus": settings.cpus_per_job, "num_gpus": settings.gpus_per_job}


def init_ray(settings: RayLauncherConf) -> Any:
    """Ray, started (local instance) or joined (hydra.launcher.address) once per process."""
    try:
        import ray
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    if ray.is_initialized():
        return ray
    kwargs: Dict[str, Any] = {"address": settings.address, "runtime_env": settings.runtime_env or None}
    local = {key: getattr(settings, key) for key in LOCAL_ONLY if getattr(settings, key) is not None}
    if settings.address is None:
        kwargs.update(local, include_dashboard=settings.include_dashboard)
    elif local:
        key = next(iter(local))
        raise ValueError(f"hydra.launcher.{key}={local[key]} sizes a local Ray instance; hydra.launcher.address="
                         f"{settings.address} joins a running cluster, which keeps its own (set it back to null)")
    ray.init(**kwargs)
    return ray


def launch(launcher: "RayLauncher", job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> Sequence[JobReturn]:
    assert launcher.config is not None and launcher.task_function is not None and launcher.hydra_context is not None
    setup_globals()
    config, settings = launcher.config, launcher.settings
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)

    ray = init_ray(settings)
    cluster = ray.cluster_resources()
    cluster_gpus = cluster.get("GPU", 0)
    log.info(f"Ray launcher: {len(job_overrides)} jobs on {cluster.get('CPU', 0):g} CPUs, {cluster_gpus:g} GPUs "
             f"({settings.address or 'local instance'}); sweep output dir: {sweep_dir}")
    # Sent once, shared by every task.
    context_ref = ray.put(launcher.hydra_context)
    task_ref = ray.put(launcher.task_function)
    state_ref = ray.put(Singleton.get_state())
    remote_job = ray.remote(execute_job)

    submitted: List[tuple[Any, DictConfig, Sequence[str]]] = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        sweep_config = launcher.hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{num}"
            sweep_config.hydra.job.num = num
        resources = job_resources(sweep_config, settings, cluster_gpus)
        log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}"
                 + (f"  [{resources['num_gpus']:g} GPU]" if resources["num_gpus"] else ""))
        # Never retried: a rerun would rewrite a run dir that callbacks may already have logged.
        ref = remote_job.options(**resources, max_retries=0).remote(sweep_config, context_ref, task_ref, state_ref)
        submitted.append((ref, sweep_config, overrides))
    returns = [_result(ray, ref, sweep_config, overrides) for ref, sweep_config, overrides in submitted]
    stage_failures = failed_jobs(sweep_dir)
    if stage_failures and any(r.status != JobStatus.COMPLETED for r in returns):
        # Hydra raises the failed job's error and skips lowbit_pipe's sweep-outcome callback, which lists these.
        print_failed(stage_failures)
    return returns


def _result(ray: Any, ref: Any, sweep_config: DictConfig, overrides: Sequence[str]) -> JobReturn:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as err:  # the task never returned (worker killed, out of memory, lost node)
        failed = JobReturn(overrides=list(overrides), hydra_cfg=sweep_config, status=JobStatus.FAILED)
        failed.return_value = err
        return failed
