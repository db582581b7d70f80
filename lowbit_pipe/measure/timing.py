"""Timing one callable: CUDA events on a GPU, wall clock with warm-up and the fastest call on the CPU.

Shared by the speed table (one linear per candidate format) and the whole-forward check, so a layer's
predicted time and the forward's measured time come from the same clock.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass(frozen=True)
class TimingSettings:
    warmup: int = 2  # calls before timing (first-call allocations, Triton / Inductor compilation, caches)
    reps: int = 7  # timed calls (CPU: the fastest single call; GPU: one event pair around all of them)

    @staticmethod
    def for_device(device: torch.device) -> "TimingSettings":
        """GPU calls are cheap and short ones jitter by launch: more of them; a CPU call can take 100 ms."""
        return TimingSettings(warmup=3, reps=20) if device.type == "cuda" else TimingSettings()


def time_ms(fn: Callable[[], Any], device: torch.device, settings: TimingSettings = TimingSettings()) -> float:
    """Milliseconds per call of `fn()` on `device`, after `settings.warmup` untimed calls.

    CUDA: events around `reps` back-to-back calls on the current stream (GPU time, launch overhead included as
    the model would see it). CPU: the fastest of `reps` single calls: other processes only ever add time, and on
    a shared machine a time slice lost to them (10+ ms) lands in more than half of the calls of a small layer,
    where even the median then measures the neighbours (seen: 1.0 vs 16.8 ms for one 256x256 layer)."""
    if settings.reps < 1 or settings.warmup < 0:
        raise ValueError(f"timing needs reps >= 1 and warmup >= 0, got {settings}")
    with torch.no_grad():
        for _ in range(settings.warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(settings.reps):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / settings.reps
        with _one_thread():
            samples = []
            for _ in range(settings.reps):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return min(samples)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's CPU thread count set to 1 while timing, restored after. On a machine whose cores other processes
    share, torch's threads wait on each other at every op: a tiny Krea 2 forward took 30-580 ms on 2 threads and
    15-35 ms on one (2 cores, loaded). One thread times the arithmetic, the same for the layers and the forward."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
