"""The driver: every job's config composed and checked, then each job started in its own Python process with
CUDA_VISIBLE_DEVICES set to a free GPU, as GPUs free up (`assign.GpuQueue`), until every job has ended.

A job's process gets its payload (Hydra's context, the task function, the job's config) through files in a
temporary folder, runs Hydra's `run_job` (`worker`) and leaves its JobReturn there. One that dies without one (a
crash, SIGKILL, out of memory) becomes a FAILED JobReturn naming its GPU and exit status; the other jobs run on.
Each job's run dir gets `launcher.json` (its GPU, process, start, end, exit status), written by the driver, so a
job that died still says where it ran.

Ctrl-C / SIGTERM in the driver: the signal is passed to every running job (each tears its run down in order, as
lowbit_pipe does on a signal), the driver waits for them (at most hydra.launcher.stop_seconds, then kills what is
left and says so), and then stops the sweep.
"""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations.

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_plugins.lowbit_gpu_launcher.assign import GpuQueue, check_job_device
from lowbit_pipe.running.sweep_outcome import failed_jobs, print_failed

if TYPE_CHECKING:
    from hydra_plugins.lowbit_gpu_launcher.gpu_launcher import GpuLauncher

log = logging.getLogger(__name__)

CLOUDPICKLE_MISSING = "hydra/launcher=gpus needs cloudpickle: pip install '.[sweep]' (lowbit_pipe[sweep])"
RECORD = "launcher.json"  # in each job's run dir


class JobCrashed(RuntimeError):
    """A job's process ended without handing back a result (killed, crashed, out of memory)."""


@dataclass
class Job:
    num: int
    config: DictConfig
    overrides: Sequence[str]
    run_dir: Path


@dataclass
class Running:
    job: Job
    gpu: str
    proc: subprocess.Popen
    started: float
    result: Path


def _cloudpickle() -> Any:
    try:
        import cloudpickle
    except ImportError:
        raise ImportError(CLOUDPICKLE_MISSING) from None
    return cloudpickle


def compose_jobs(launcher: "GpuLauncher", job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Job]:
    """Each job's config, as the basic launcher composes it, checked before any job starts."""
    assert launcher.config is not None and launcher.hydra_context is not None
    jobs = []
    for idx, overrides in enumerate(job_overrides):
        num = initial_job_idx + idx
        config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = f"{config.hydra.job.name}_{num}"
            config.hydra.job.num = num
        check_job_device(OmegaConf.select(config, "model.device", default=None), num)
        run_dir = Path(str(config.hydra.sweep.dir)) / str(OmegaConf.select(config, "hydra.sweep.subdir"))
        jobs.append(Job(num, config, overrides, run_dir))
    return jobs


def child_env(gpu: str) -> dict[str, str]:
    """The environment of a job's process: this one's, its GPU as the only visible device, and this process's
    code first on the path (the worker imports the same lowbit_pipe and plugins as the driver)."""
    import importlib.util

    import hydra_plugins.lowbit_gpu_launcher as plugin

    ours = importlib.util.find_spec("lowbit_pipe")  # found, not imported: the driver of a plain Hydra app needs no torch
    roots = [str(Path(plugin.__file__).resolve().parents[2])]
    roots += [str(Path(ours.origin).resolve().parents[1])] if ours is not None and ours.origin else []
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def _start(job: Job, gpu: str, common: Path, tmp: Path) -> Running:
    pickle = _cloudpickle()
    payload, result = tmp / f"job{job.num}.pkl", tmp / f"job{job.num}.result"
    payload.write_bytes(pickle.dumps(job.config))
    cmd = [sys.executable, "-m", "hydra_plugins.lowbit_gpu_launcher.worker", str(common), str(payload), str(result)]
    proc = subprocess.Popen(cmd, env=child_env(gpu), cwd=str(job.config.hydra.runtime.cwd))
    log.info(f"\t#{job.num} : {' '.join(filter_overrides(job.overrides))}  [GPU {gpu}, pid {proc.pid}]")
    return Running(job, gpu, proc, time.time(), result)


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def collect(run: Running) -> JobReturn:
    """The job's JobReturn (its own, or a FAILED one saying how its process ended), and its launcher.json."""
    returncode = run.proc.returncode
    ended = time.time()
    returned = None
    if run.result.is_file():
        returned = _cloudpickle().loads(run.result.read_bytes())
    if returned is None:
        returned = JobReturn(overrides=list(run.job.overrides), cfg=run.job.config, hydra_cfg=run.job.config,
                             status=JobStatus.FAILED)
        returned.return_value = JobCrashed(
            f"job #{run.job.num} on GPU {run.gpu} ended without a result ({exit_status(returncode)}); its run dir "
            f"{run.job.run_dir} says how far it got (report.json, {RECORD})")
    record = {"launcher": "gpus", "job": run.job.num, "gpu": run.gpu, "cuda_visible_devices": run.gpu,
              "pid": run.proc.pid, "started_unix": round(run.started, 3), "ended_unix": round(ended, 3),
              "seconds": round(ended - run.started, 3), "returncode": returncode,
              "status": returned.status.name if returned.status is not None else None}
    write_record(run.job.run_dir, record)
    ok = returned.status == JobStatus.COMPLETED
    (log.info if ok else log.error)(f"#{run.job.num} on GPU {run.gpu}: {'done' if ok else 'FAILED'} in "
                                    f"{record['seconds']:.1f} s ({exit_status(returncode)})")
    return returned


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    from lowbit_pipe.files.tempfiles import atomic_write_text

    run_dir.mkdir(parents=True, exist_ok=True)  # a job that died before run_job made it
    atomic_write_text(run_dir / RECORD, json.dumps(record, indent=2))


def wait_any(running: dict[int, Running], poll_seconds: float) -> list[int]:
    """The jobs whose processes have ended; waits until there is at least one."""
    while True:
        ended = [num for num, run in running.items() if run.proc.poll() is not None]
        if ended:
            return ended
        time.sleep(poll_seconds)


def stop_all(running: dict[int, Running], signum: int, stop_seconds: float) -> None:
    """Pass the driver's signal on to every running job, wait for their orderly stop, kill what outlasts it; each
    stopped job gets its launcher.json."""
    for run in running.values():
        if run.proc.poll() is None:
            run.proc.send_signal(signum)
    deadline = time.monotonic() + stop_seconds
    for run in running.values():
        try:
            run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
            log.error(f"#{run.job.num} on GPU {run.gpu} did not stop within {stop_seconds:g} s: killed")
        collect(run)  # its launcher.json: where it ran and how it ended


def run_queue(jobs: list[Job], gpus: tuple[str, ...], common: Path, tmp: Path,
              poll_seconds: float, stop_seconds: float) -> dict[int, JobReturn]:
    """Every job on the GPUs, one job per GPU at a time; returns by job index."""
    queue = GpuQueue(len(jobs), gpus)
    running: dict[int, Running] = {}
    returns: dict[int, JobReturn] = {}
    try:
        while not queue.done:
            for index, gpu in queue.assign():
                running[index] = _start(jobs[index], gpu, common, tmp)
            for index in wait_any(running, poll_seconds):
                queue.release(index)
                returns[index] = collect(running.pop(index))
    except KeyboardInterrupt as err:  # SIGINT / SIGTERM (lowbit_pipe.running.interrupts.Interrupted carries which)
        stop_all(running, int(getattr(err, "signum", signal.SIGINT)), stop_seconds)
        raise
    return returns


def launch(launcher: "GpuLauncher", job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
    assert launcher.config is not None and launcher.task_function is not None and launcher.hydra_context is not None
    setup_globals()
    config, settings = launcher.config, launcher.settings
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    jobs = compose_jobs(launcher, job_overrides, initial_job_idx)
    log.info(f"GPU launcher: {len(jobs)} jobs on {len(launcher.gpus)} GPU(s) [{', '.join(launcher.gpus)}], one job "
             f"per GPU at a time; sweep output dir: {sweep_dir}")
    with tempfile.TemporaryDirectory(prefix="lowbit-gpus-") as folder:
        tmp = Path(folder)
        common = tmp / "common.pkl"
        common.write_bytes(_cloudpickle().dumps((launcher.hydra_context, launcher.task_function,
                                                 Singleton.get_state())))
        returns = run_queue(jobs, launcher.gpus, common, tmp, settings.poll_seconds, settings.stop_seconds)
    ordered = [returns[i] for i in range(len(jobs))]
    report_failures(jobs, ordered, sweep_dir)
    return ordered


def report_failures(jobs: list[Job], returns: list[JobReturn], sweep_dir: Path) -> None:
    """One stderr line per job that failed or died, once every job has ended (Hydra then raises the first one's
    error and the sweep exits 1). A lowbit_pipe stage failure returns NaN, not a failure: lowbit_pipe.running.
    sweep_outcome names those at the sweep's end, but Hydra skips that callback when it raises here, so where a job
    died they are listed here too."""
    failed = [(job, r) for job, r in zip(jobs, returns) if r.status != JobStatus.COMPLETED]
    if not failed:
        return
    stage_failures = failed_jobs(sweep_dir)
    print(f"hydra/launcher=gpus: {len(failed)} of {len(jobs)} job(s) failed; the others ran to their end:",
          file=sys.stderr)
    for job, r in failed:
        error = getattr(r, "_return_value", None)
        print(f"  #{job.num} {job.run_dir}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
              file=sys.stderr)
    if stage_failures:
        print_failed(stage_failures)
