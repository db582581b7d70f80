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
from typing import Any

import torch

from lowbit_pipe.context import Context
from lowbit_pipe.ledger import TeardownReport
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage


def clear_kernel_caches(report: TeardownReport) -> None:
    """Clear the process-wide caches of lowbit_pipe.kernels (pure caches: clearing costs only a rebuild
    for another live run), with their byte counts where the kernel module can tell them."""
    from lowbit_pipe.kernels import rotation

    clear = getattr(rotation, "clear_cache", None)
    if clear is None:
        report.unproven.append("lowbit_pipe.kernels.rotation has no clear_cache(): Hadamard cache not cleared")
        return
    cached = getattr(rotation, "_hadamard_cpu", None)
    info = getattr(cached, "cache_info", None)
    entries = info().currsize if info is not None else None
    if entries == 0:
        return
    size = getattr(rotation, "cache_bytes", None)
    nbytes = int(size()) if size is not None else None
    clear()
    verified = info is not None and info().currsize == 0
    report.caches.append({"name": "kernels.rotation (Hadamard matrices)", "bytes": nbytes, "entries": entries,
                          "verified": verified})
    if nbytes:
        report.bytes_freed += nbytes
    else:
        report.notes.append("kernels.rotation cleared; its byte count is unknown (the module offers no cache_bytes())")
    if not verified:
        report.unproven.append("kernels.rotation cache: cannot check that it is empty")


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
