"""Which GPUs a sweep runs on, and which job runs on which GPU: plain values in, plain values out (no torch, no Hydra).

A GPU is named by what a job's CUDA_VISIBLE_DEVICES is set to: a physical index ("3", in CUDA_DEVICE_ORDER, which
the jobs inherit) or a UUID ("GPU-8f3e...", "MIG-..."). CUDA reads that variable this way (and so does `parse_visible`):
a comma-separated list, the first entry deciding the kind (indices, or UUIDs with the prefix GPU- / MIG-); the list
ends at the first entry of another kind (a negative index, a word); a repeated entry makes the list empty.
"""

# No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations.

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

_INDEX = re.compile(r"^\d+$")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/_.-]+$")


class GpuListError(ValueError):
    """No GPU to run on, or a GPU list the launcher cannot use; the message names the setting."""


def parse_visible(value: str) -> tuple[str, ...]:
    """The devices a CUDA_VISIBLE_DEVICES value leaves visible, as CUDA reads it (module docstring)."""
    entries = [e.strip() for e in value.split(",")]
    uuids = entries[0].startswith(("GPU-", "MIG-"))
    out: list[str] = []
    for entry in entries:
        if not (_UUID.match(entry) if uuids else _INDEX.match(entry)):
            break
        if entry in out:
            return ()
        out.append(entry if uuids else str(int(entry)))
    return tuple(out)


def _check_entry(entry: str, where: str) -> str:
    text = str(entry).strip()
    if not (_INDEX.match(text) or _UUID.match(text)):
        raise GpuListError(f"{where}={entry!r}: a GPU is a physical index (0, 1, ...) or a UUID (GPU-..., MIG-..., "
                           "as `nvidia-smi -L` lists them)")
    return str(int(text)) if _INDEX.match(text) else text


def launcher_gpus(configured: Sequence[str] | None, visible_env: str | None, device_count: int) -> tuple[str, ...]:
    """The GPUs a sweep runs on, each the CUDA_VISIBLE_DEVICES value one job gets.

    `configured` (hydra.launcher.gpus) when given: each entry checked, none repeated, and, when CUDA_VISIBLE_DEVICES
    is set, each one of its entries (a launcher never reaches a GPU the shell hid). Else every visible GPU: the first
    `device_count` entries of CUDA_VISIBLE_DEVICES when it is set, else indices 0 .. device_count - 1.
    No GPU at all is an error (not a CPU fallback: a GPU host whose driver fails would otherwise run the whole
    sweep serially on its CPU); hydra/launcher=local is the CPU sweep."""
    visible = parse_visible(visible_env) if visible_env is not None else None
    if configured is not None:
        gpus = tuple(_check_entry(e, f"hydra.launcher.gpus[{i}]") for i, e in enumerate(configured))
        repeated = sorted({g for g in gpus if gpus.count(g) > 1})
        if repeated:
            raise GpuListError(f"hydra.launcher.gpus lists {repeated[0]} twice: jobs never share a GPU")
        hidden = [g for g in gpus if visible is not None and g not in visible]
        if hidden:
            raise GpuListError(f"hydra.launcher.gpus: {hidden[0]} is not one of CUDA_VISIBLE_DEVICES={visible_env!r}; "
                               "list GPUs as written there (index or UUID), or unset CUDA_VISIBLE_DEVICES")
    elif visible is not None:
        gpus = visible[:device_count]
    else:
        gpus = tuple(str(i) for i in range(device_count))
    if not gpus:
        shown = "unset" if visible_env is None else repr(visible_env)
        raise GpuListError(f"hydra/launcher=gpus found no GPU to run on (CUDA_VISIBLE_DEVICES {shown}, torch sees "
                           f"{device_count} CUDA device(s)); list them with hydra.launcher.gpus=[0,1], or sweep on the "
                           "CPU with hydra/launcher=local")
    return gpus


def check_job_device(device: object, job: int) -> None:
    """Refuse a job whose model.device names a GPU other than the one it will see (its own, as cuda:0)."""
    if isinstance(device, str) and device.startswith("cuda:") and device != "cuda:0":
        raise GpuListError(f"job #{job}: model.device={device}: under hydra/launcher=gpus each job sees only its own "
                           "GPU, as cuda:0; use model.device=cuda")


@dataclass
class GpuQueue:
    """Jobs 0 .. jobs - 1 in order onto `gpus`, at most one job per GPU at a time.

    `assign()` hands out every (job, gpu) pair that can start now; `release(job)` frees that job's GPU whatever its
    outcome (a failed or dead job frees it too). Pure bookkeeping: the caller starts and watches the processes."""

    jobs: int
    gpus: tuple[str, ...]
    _waiting: deque[int] = field(init=False)
    _free: deque[str] = field(init=False)
    _running: dict[int, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not self.gpus:
            raise GpuListError("GpuQueue needs at least one GPU")
        if len(set(self.gpus)) != len(self.gpus):
            raise GpuListError(f"GpuQueue: a GPU listed twice in {list(self.gpus)}")
        self._waiting = deque(range(self.jobs))
        self._free = deque(self.gpus)

    def assign(self) -> list[tuple[int, str]]:
        pairs = []
        while self._waiting and self._free:
            job, gpu = self._waiting.popleft(), self._free.popleft()
            self._running[job] = gpu
            pairs.append((job, gpu))
        return pairs

    def release(self, job: int) -> str:
        if job not in self._running:
            raise KeyError(f"job #{job} is not running")
        gpu = self._running.pop(job)
        self._free.append(gpu)
        return gpu

    @property
    def running(self) -> dict[int, str]:
        return dict(self._running)

    @property
    def done(self) -> bool:
        return not self._waiting and not self._running
