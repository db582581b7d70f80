"""A minimal Hydra app for hydra/launcher=gpus tests: each job records the GPU it was given and when it ran, then
does what `outcome` says (ok, raise, exit, die, or stage: a lowbit_pipe stage failure, a report.json saying so
and NaN returned, as lowbit_pipe's CLI does). No torch, so a job's process starts in about a second."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

ConfigStore.instance().store(name="gpus_app", node={"seconds": 1.0, "outcome": "ok"})


@hydra.main(version_base=None, config_name="gpus_app")
def job(cfg: DictConfig) -> float:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    record = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "start": time.time(),
              "cwd": os.getcwd()}
    (run_dir / "job.json").write_text(json.dumps(record))
    time.sleep(cfg.seconds)
    if cfg.outcome == "raise":
        raise RuntimeError(f"job {HydraConfig.get().job.num} raised on purpose")
    if cfg.outcome == "exit":
        sys.exit(3)
    if cfg.outcome == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.outcome == "stage":
        (run_dir / "report.json").write_text(json.dumps({"status": "failed", "error": "stage 'quantize' failed on purpose"}))
        return float("nan")
    record["end"] = time.time()
    (run_dir / "job.json").write_text(json.dumps(record))
    return float(HydraConfig.get().job.num)


if __name__ == "__main__":
    job()
