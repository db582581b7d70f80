"""Launching a Triton kernel again with less host time than `kernel[grid](...)`.

Triton's own launch binds the arguments, specializes each (dtype, 16-byte alignment, integer value 1 / multiple of
16), hashes that into a cache key, runs the autotuner's dict building, reads its knobs and asks for the current
device and stream, on every call. A quantized linear launches two or three kernels per call; uncompiled (how ComfyUI
runs a model) such a call cost 0.13-0.21 ms of host time on an H100 against bf16's 0.015
(bench/results/host_cost_resolve_h100.md), most of it in those steps (the cProfile in host_cost_h200.md).

`FastLaunch(kernel)[grid](*args, **kwargs)` takes the same arguments. Its first call of a specialization goes
through Triton and keeps the CompiledKernel it returned (and the autotuner's chosen config) under a key that is at
least as fine as Triton's: per tensor its dtype and its address modulo 16, every scalar's type and
value (so Triton's integer specializations and the autotuner's key, which reads values, are both inside it), per
tensor descriptor its base's dtype and alignment, shape, strides, block shape and padding. Later calls with that key
call the compiled kernel's launcher directly (what Triton's run ends with). The key's finer grain costs a compile
lookup per new value (a new M), never a wrong kernel. Anything else takes Triton's path every time: an argument type
the key does not know, launch hooks set (a profiler such as proton reads them), the interpreter (TRITON_INTERPRET:
the kernel is not a JITFunction), a kernel's pre-run hooks, or an autotuner config with a pre-hook (each must run
before every launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

# A bound on each kernel's memo: one entry per distinct key (shapes, alignments); a long sweep of token counts
# clears it rather than growing without end.
MEMO_ENTRIES = 1024

_SCALARS = (int, bool, float, str, type(None), torch.dtype)


class _Unkeyable(Exception):
    """An argument whose specialization the key cannot state: the call goes through Triton."""


def _spec(v: Any) -> Any:
    """What of `v` Triton's specialization (and the autotuner's key) may read; a tensor's address modulo 16 (finer
    than Triton's aligned or not)."""
    t = type(v)
    if t in _SCALARS:
        return t, v
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() & 15
    if t.__name__ == "TensorDescriptor":
        b = v.base
        return (t, b.dtype, b.data_ptr() % 16 == 0, tuple(v.shape), tuple(v.strides), tuple(v.block_shape),
                getattr(v, "padding", None))
    raise _Unkeyable(t.__name__)


def _key(args: tuple, kwargs: dict) -> tuple:
    """`_spec` of every argument, the common kinds inline (a function call per argument is most of the key's cost:
    some 20 arguments per launch)."""
    return (tuple([(a.dtype, a.data_ptr() & 15) if type(a) is torch.Tensor else _spec(a) for a in args]),
            tuple(kwargs), tuple([(type(v), v) if type(v) in _SCALARS else _spec(v) for v in kwargs.values()]))


@dataclass(frozen=True)
class _Entry:
    """One specialization's compiled kernel, and how to lay the call's arguments out in the kernel's order:
    per parameter (0, i) = args[i], (1, name) = kwargs[name], (2, value) = a default or a constexpr (the
    launcher skips constexprs; it reads every other value)."""
    compiled: Any
    order: tuple[tuple[int, Any], ...]
    config: dict  # the autotuner's chosen config's values (empty without an autotuner)


class FastLaunch:
    """`kernel` (a JITFunction, or an Autotuner over one) with a memo of its compiled specializations."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.jit = getattr(kernel, "fn", kernel) if hasattr(kernel, "configs") else kernel
        self.memo: dict = {}
        self.device = self.stream = None  # the driver's current-device and current-stream functions, on first use

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        fast = isinstance(self.jit, JITFunction) and not self.jit.pre_run_hooks and _no_hooks()
        if fast:
            try:
                key = _key(args, kwargs)
            except _Unkeyable:
                fast = False
        if fast:
            if self.device is None:
                self.device, self.stream = triton.runtime.driver.active.get_current_device, \
                    triton.runtime.driver.active.get_current_stream
            device = self.device()
            entry = self.memo.get((device, key))
            if entry is not None:
                self._run(entry, grid, args, kwargs, device)
                return
        compiled = self.kernel[grid](*args, **kwargs)
        if fast:
            self._remember((device, key), compiled, args, kwargs)

    def _remember(self, key, compiled, args: tuple, kwargs: dict) -> None:
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if compiled is None or not hasattr(compiled, "packed_metadata"):
            return
        config = {}
        if self.jit is not self.kernel:
            best = self.kernel.best_config
            if best.pre_hook is not None:
                return
            config = best.all_kwargs()
        order = []
        for i, p in enumerate(self.jit.params):
            if i < len(args):
                order.append((0, i))
            elif p.name in kwargs:
                order.append((1, p.name))
            elif p.name in config or p.is_constexpr:
                order.append((2, config.get(p.name)))
            elif p.has_default:
                order.append((2, p.default))
            else:
                return  # Triton would have refused the call
        if len(self.memo) >= MEMO_ENTRIES:
            self.memo.clear()
        self.memo[key] = _Entry(compiled, tuple(order), config)

    def _run(self, entry: _Entry, grid, args: tuple, kwargs: dict, device: int) -> None:
        values = [args[x] if src == 0 else kwargs[x] if src == 1 else x for src, x in entry.order]
        if callable(grid):
            names = [p.name for p in self.jit.params]
            grid = grid({**dict(zip(names, values)), **entry.config})
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        c = entry.compiled
        c.run(grid[0], g1, g2, self.stream(device), c.function, c.packed_metadata, None, None, None,
              *values)


def _no_hooks() -> bool:
    """No launch hook set: Triton's knobs hold an empty HookChain (its `calls`) then, which the launcher would call
    for nothing; given None it calls nothing (Triton 3.6 and 3.9 alike). A hook of another kind counts as set."""
    return all(h is None or getattr(h, "calls", None) == []
               for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
