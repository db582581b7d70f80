"""The launcher's settings, registered as `hydra/launcher=lowbit_gpus` (conf/hydra/launcher/gpus.yaml extends it).
A typed schema, so a misspelt `hydra.launcher.*` key is refused by name."""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations.

from dataclasses import dataclass
from typing import List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class GpuLauncherConf:
    _target_: str = "hydra_plugins.lowbit_gpu_launcher.gpu_launcher.GpuLauncher"
    # The GPUs jobs run on, each what one job's CUDA_VISIBLE_DEVICES is set to: physical indices ([0, 1]) or UUIDs
    # ([GPU-8f3e..., ...], `nvidia-smi -L`). null: every visible GPU (CUDA_VISIBLE_DEVICES's entries, else 0..count-1).
    gpus: Optional[List[str]] = None
    # How often the driver looks for finished jobs (seconds).
    poll_seconds: float = 0.2
    # On Ctrl-C / SIGTERM: how long running jobs get to tear down after the signal is passed on, then they are killed.
    stop_seconds: float = 300.0


ConfigStore.instance().store(group="hydra/launcher", name="lowbit_gpus", node=GpuLauncherConf, provider="lowbit_pipe")
