"""teardown: unwind the ledger, drop what the run owns, and prove it."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from lowbit_pipe.context import Context
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage


def teardown(ctx: Context) -> dict[str, Any]:
    """Idempotent: safe after a failed stage, twice, or with no model."""
    device_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    owned = ctx.owns_model and ctx.model is not None
    model_ref = weakref.ref(ctx.transformer) if owned else None
    report = ctx.ledger.unwind()
    if owned:
        ctx.model = None
        ctx.adapter = None
        ctx.owns_model = False
    gc.collect()
    if model_ref is not None and model_ref() is not None:
        report.unfreed.append("model (still referenced outside the pipeline)")
    if torch.cuda.is_available() and ctx.recipe.teardown.empty_cuda_cache:
        torch.cuda.empty_cache()
    result = report.as_dict()
    if device_before is not None:
        result["device_bytes_freed"] = device_before - torch.cuda.memory_allocated()
    ctx.report["teardown"] = result
    return result


@register
class Teardown(Stage):
    name = "teardown"

    def run(self, ctx: Context) -> dict[str, Any]:
        return teardown(ctx)
