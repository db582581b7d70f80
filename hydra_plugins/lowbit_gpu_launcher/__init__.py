"""lowbit_pipe's local multi-GPU launcher for Hydra sweeps, without Ray: `python -m lowbit_pipe -m hydra/launcher=gpus ...`.

One worker process per job, at most one job per GPU at a time: each job is started (a fresh Python process) with
CUDA_VISIBLE_DEVICES set to its own GPU, so it sees exactly that device as cuda:0, and jobs queue until a GPU is
free. Inside the worker the job runs through Hydra's own `run_job` (run dirs, .hydra/, callbacks), as under the
Ray launcher. A job that fails or whose process dies leaves the others running; the launcher names it and the sweep
exits 1 at its end.

Modules: `assign` (which GPUs, which job on which GPU: pure, no torch, no Hydra), `config` (the typed settings),
`gpu_launcher` (the Hydra plugin class), `_core` (the driver loop), `worker` (a job's process).
"""
