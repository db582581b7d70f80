"""The launcher's settings, registered as `hydra/launcher=lowbit_ray` (conf/hydra/launcher/ray.yaml
extends it). A typed schema, so a misspelt `hydra.launcher.*` key is refused by name."""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations.

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.lowbit_ray_launcher.ray_launcher.RayLauncher"
    # A running cluster to join ("auto", "ray://head:10001", "head:6379"); null starts a local instance.
    address: Optional[str] = None
    # Local instance only (Ray refuses them when joining a cluster): CPUs / GPUs it may use (null: all),
    # its object store in bytes (jobs pass only configs and small results through it).
    num_cpus: Optional[int] = None
    num_gpus: Optional[int] = None
    object_store_memory: Optional[int] = None
    include_dashboard: bool = False
    # Passed to ray.init, e.g. {env_vars: {...}, py_modules: [...]} so a remote cluster's workers find the code.
    runtime_env: Dict[str, Any] = field(default_factory=dict)
    # What each job asks Ray for: CPUs always; GPUs when model.device is cuda/cuda:N/auto and the cluster has GPUs.
    cpus_per_job: float = 1
    gpus_per_job: float = 1


ConfigStore.instance().store(group="hydra/launcher", name="lowbit_ray", node=RayLauncherConf, provider="lowbit_pipe")
