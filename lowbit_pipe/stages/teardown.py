"""teardown: unwind the ledger, drop what the run owns, clear the caches it filled, and prove it.

Order: (1) undo every ledger entry in reverse (module swaps, patches, hooks,
compile caches, CUDA graphs, owned tensors); (2) drop the model if `load`
built it (a model handed in by the caller is restored, never dropped);
(3) clear the process caches the kernels keep (Hadamard matrices);
(4) collect garbage, empty the CUDA cache, then prove: weakrefs of everything
the run created (and of an owned model) dead, every patch `is` its original,
device memory back to the pre-load baseline. What cannot be freed or proved
is named in `unfreed` / `unproven`.

Idempotent: a second call undoes nothing and re-proves whatever was still
alive (a reference the user dropped in between then shows as freed). Safe
after a failed stage, with no model, and when the user already dropped theirs.
"""

from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from lowbit_pipe.ledger import TeardownReport
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register


def _device_bytes() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def _kernel_caches() -> list[tuple[str, Callable[[], int | None], Callable[[], None]]]:
    """(name, entries, clear) of every process-wide cache lowbit_pipe's kernels fill."""
    from lowbit_pipe.kernels import rotation

    caches = [("kernels.rotation (Hadamard matrices, host and device)", rotation.cached_entries, rotation.clear_cache)]
    clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_cublas is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        # cuBLAS keeps a workspace per stream in the caching allocator once a GEMM ran (32 MiB on Hopper).
        caches.append(("cuBLAS workspaces (device)", lambda: None, clear_cublas))
    return caches


def clear_kernel_caches(report: TeardownReport) -> None:
    """Clear the process-wide kernel caches (pure caches: clearing costs another live run only a rebuild).
    Device bytes are measured (allocated before minus after); host cache sizes are not known."""
    for name, entries, clear in _kernel_caches():
        count = entries()
        if count == 0:
            continue
        before = _device_bytes()
        clear()
        freed = before - _device_bytes()
        after = entries()
        report.caches.append({"name": name, "entries": count, "device_bytes": freed, "verified": after in (0, None)})
        report.bytes_freed += max(freed, 0)
        if after not in (0, None):
            report.unproven.append(f"{name}: still holds {after} entries after clearing")


def teardown(ctx: Context) -> dict[str, Any]:
    """Unwind the run and prove it; the result goes to report.json as `teardown`. Idempotent."""
    cfg = ctx.recipe.teardown
    ledger = ctx.ledger
    report = TeardownReport()
    had_swaps = bool(ledger.swapped())
    ledger.undo_all(report)
    if ctx.owns_model and ctx.model is not None:
        model = ctx.model
        ledger.watch(f"model ({type(model).__name__})", model)
        ctx.model = None
        ctx.adapter = None
        ctx.owns_model = False
        del model
    elif ctx.model is None and had_swaps:
        report.notes.append("the model was already dropped: swaps had nothing to restore, originals released")
    if cfg.clear_kernel_caches:
        clear_kernel_caches(report)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()  # free dead tensors before the cache is emptied (prove() collects again)
        torch.cuda.synchronize()
        if cfg.empty_cuda_cache:
            torch.cuda.empty_cache()
    ledger.prove(report)
    result = report.as_dict()
    ctx.report["teardown"] = result
    return result


@register
class Teardown(Stage):
    name = "teardown"

    def run(self, ctx: Context) -> dict[str, Any]:
        return teardown(ctx)
