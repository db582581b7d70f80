"""lowbit_pipe's Ray launcher for Hydra sweeps: `python -m lowbit_pipe -m hydra/launcher=ray ...`.

Each job runs as one Ray task with Hydra's own `run_job` (run dirs, .hydra/, callbacks, multirun.yaml as
with the basic launcher), asking Ray for one GPU when its recipe's `model.device` is cuda/auto and the
cluster has GPUs, else for CPU only, so an 8-GPU host runs 8 jobs at once, each on its own GPU.

Why our own plugin and not Hydra's `hydra-ray-launcher` (1.2.2, tried with Python 3.11, Ray 2.60 and
hydra-core 1.3.8): it runs, but it pins `cloudpickle<3`, which breaks `joblib>=1.6` (`cloudpickle>=3`),
the dependency of the joblib launcher in our `sweep` extra, so the two extras cannot share an
environment; it pulls `ray[default]` and boto3 (its AWS launcher) as well; and its Ray resources are one
fixed `ray.remote` setting for every job, so it cannot give GPUs to the cuda jobs of a sweep only.

Hydra finds plugins only in the `hydra_plugins` namespace, hence this package; it imports Ray only when
a sweep is launched (Hydra imports every plugin module at each start).
"""
