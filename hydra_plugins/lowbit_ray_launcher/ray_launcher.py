"""The Hydra Launcher plugin class: holds the settings and hands the jobs to `_core.launch`."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from hydra_plugins.lowbit_ray_launcher.config import RayLauncherConf


class RayLauncher(Launcher):
    def __init__(self, **settings: Any) -> None:
        # Hydra passes the `hydra.launcher` keys (already checked against RayLauncherConf).
        settings.pop("_target_", None)
        plain = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in settings.items()}
        self.settings = RayLauncherConf(**plain)
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.task_function = task_function
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from hydra_plugins.lowbit_ray_launcher import _core

        return _core.launch(self, job_overrides, initial_job_idx)
