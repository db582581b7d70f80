"""How a pytest-xdist run (CI's `-n 2 --dist loadfile`) spreads the suite over its workers; plain runs untouched.

- Longest files first. With `--dist loadfile` each file is one unit of work, handed to whichever worker runs low; a
  long file handed out last runs alone while the other core idles. The files below (the ones that took a minute or
  more on 2 busy cores, longest first) are collected first and xdist keeps that order (its default re-sorts files by
  their number of tests, `--loadscope-reorder`, which this turns off for loadfile runs); every other file follows
  in pytest's own order.
- One torch thread per core and worker, children included. torch starts as many intra-op threads as there are cores
  in each process: two workers on two cores then run four busy threads that wait on each other at every parallel
  region, more with a child running. Each worker sets its own torch to cores // workers threads and OMP_NUM_THREADS
  to the same for the processes it starts (CLI runs, ComfyUI servers and children; a value the user set stays).
  The whole suite on a quiet 2-core machine: 864 s with the children on torch's default, 796 s with them on one
  thread (1692 / 1531 s of worker time); test_export_load alone 206 / 164 s on one thread against 330 / 265 s on
  two. A figure a worker computes and compares with a child's is computed at the children's count
  (`children_threads`): the server's every-kind check exports svdquant_w4a4 files whose SVD must match the one the
  server's Quantize node runs (1.19e-3 of a 1e-3 bound when the worker's SVD ran on one thread and the server's on
  two).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

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


CHILDREN_THREADS = pytest.StashKey[int]()  # the thread count the child processes start with


def _worker_count(config: pytest.Config) -> int | None:
    """The number of workers when this process is a pytest-xdist worker, else None."""
    workerinput = getattr(config, "workerinput", None)
    return None if workerinput is None else int(workerinput["workercount"])


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # the controller schedules in collection order: ours, below
    workers = _worker_count(config)
    if workers is None:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # the children's torch too (a user's setting stays)
    config.stash[CHILDREN_THREADS] = int(os.environ["OMP_NUM_THREADS"])


@contextlib.contextmanager
def children_threads(config: pytest.Config) -> Iterator[None]:
    """torch at the thread count the worker's child processes start with (OMP_NUM_THREADS, above) for the duration,
    then as before: for work whose figures are compared with a child's. Outside xdist: no change."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(config.stash.get(CHILDREN_THREADS, before))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _worker_count(config) is None:
        return  # a plain run keeps pytest's order

    def rank(item: pytest.Item) -> int:
        name = Path(str(item.path)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests, and the files outside the list, keep their order
