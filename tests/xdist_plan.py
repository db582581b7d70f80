"""How a pytest-xdist run (CI's `-n 2 --dist loadfile`) spreads the suite over its workers; plain runs untouched.

- Longest files first. With `--dist loadfile` each file is one unit of work, handed to whichever worker runs low; a
  long file handed out last runs alone while the other core idles. The files below (the ones that took a minute or
  more on 2 busy cores, longest first) are collected first and xdist keeps that order (its default re-sorts files by
  their number of tests, `--loadscope-reorder`, which this turns off for loadfile runs); every other file follows
  in pytest's own order.
- One torch thread count per worker and its children. torch starts as many intra-op threads as there are cores in
  each process: two workers on two cores then run four busy threads that wait on each other at every parallel
  region, more with a child running. Each worker sets OMP_NUM_THREADS to cores // workers, unless the user set it,
  and takes that count itself; the processes it starts (CLI runs, ComfyUI servers and children) inherit it. The
  whole suite on a quiet 2-core machine: 864 s with the children on torch's default, 796 s with them on one thread
  (1692 / 1531 s of worker time); test_export_load alone 206 / 164 s on one thread against 330 / 265 s on two.
  One count for both matters beyond speed: figures a worker computes are compared with a child's, such as the
  server's every-kind check, whose svdquant_w4a4 files (exported in the worker) must match the SVD the server's
  Quantize node runs (1.19e-3 of a 1e-3 bound when the worker's SVD ran on one thread and the server's on two).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Longest first: every file that took over a minute in one worker (both sets, `-n 2 --dist loadfile --durations`,
# 2 cores shared with other work, this commit's parent). The browser test is left out on purpose: it waits for the
# server Python that test_comfyui_server.py's worker builds (conftest.py server_python), so it should come later.
LONGEST_FIRST = (
    "test_comfyui_server.py",
    "test_readme.py",
    "test_comfy_stock_lora_comfyui.py",
    "test_comfy_fused.py",
    "test_held_out.py",
    "test_comfy_compile.py",
    "test_signals.py",
    "test_comfy_attention.py",
    "test_solver.py",
    "test_stream.py",
    "test_kill.py",
    "test_teardown.py",
    "test_tracking.py",
    "test_cli.py",
    "test_new_user.py",
    "test_calibration_prompts.py",
    "test_export_load.py",
)


def _worker_count(config: pytest.Config) -> int | None:
    """The number of workers when this process is a pytest-xdist worker, else None."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else int(workerinput["workercount"])


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # the controller schedules in collection order: ours, below
    workers = _worker_count(config)
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return  # a plain run, or the user's count (torch takes it, and the children inherit it)
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the children's torch
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _worker_count(config) is None:
        return  # a plain run keeps pytest's order

    def rank(item: pytest.Item) -> int:
        name = Path(str(item.path)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests, and the files outside the list, keep their order
