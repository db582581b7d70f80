"""The Hydra Launcher plugin class: holds the settings, picks the GPUs at setup and hands the jobs to `_core.launch`."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.lowbit_gpu_launcher.assign import launcher_gpus
from hydra_plugins.lowbit_gpu_launcher.config import GpuLauncherConf


def cuda_device_count() -> int:
    """GPUs torch sees in this (driver) process; it starts no CUDA context (the jobs are other processes)."""
    import torch

    return torch.cuda.device_count()


class GpuLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        # Hydra passes the `hydra.launcher` keys (already checked against GpuLauncherConf).
        settings.pop("_target_", None)
        plain = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in settings.items()}
        self.settings = GpuLauncherConf(**plain)
        self.gpus: tuple[str, ...] = ()
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        # Before the sweeper makes the sweep dir: no GPU -> one error line, nothing written.
        configured = self.settings.gpus
        count = cuda_device_count() if configured is None else 0
        self.gpus = launcher_gpus(configured, os.environ.get("CUDA_VISIBLE_DEVICES"), count)
        self.config = config
        self.task_function = task_function
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hydra_plugins.lowbit_gpu_launcher import _core

        return _core.launch(self, job_overrides, initial_job_idx)
