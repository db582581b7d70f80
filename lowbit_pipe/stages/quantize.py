"""quantize: swap nn.Linear for QuantLinear per the layer plan; every swap goes through the ledger."""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn

from lowbit_pipe.context import Context
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.nn import QuantLinear
from lowbit_pipe.policy import LayerPlan, plan_layers
from lowbit_pipe.progress import progress
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.detect import linear_shapes


def quantize_module(root: nn.Module, plans: list[LayerPlan], ledger, *, originals: str = "keep",
                    show_progress: bool = False) -> dict[str, Any]:
    """Swap every planned Linear of `root`; returns counts and bytes."""
    todo = [p for p in plans if p.spec is not None]
    counts: Counter[str] = Counter()
    bytes_before = bytes_after = 0
    for plan in progress(todo, "quantize", enabled=show_progress):
        linear = root.get_submodule(plan.name)
        if isinstance(linear, QuantLinear):
            raise ValueError(f"layer '{plan.name}' is already quantized ({linear.format.name})")
        qlinear = QuantLinear.from_linear(linear, plan.spec)
        bytes_before += tensor_bytes(linear)
        bytes_after += tensor_bytes(qlinear)
        ledger.swap_module(root, plan.name, qlinear, keep_original=originals)
        counts[plan.spec.format] += 1
    return {"layers": dict(counts), "bytes_before": bytes_before, "bytes_after": bytes_after}


@register
class Quantize(Stage):
    name = "quantize"

    def run(self, ctx: Context) -> dict[str, Any]:
        plans = plan_layers(linear_shapes(ctx.transformer), ctx.recipe.quantize, ctx.policy)
        result = quantize_module(ctx.transformer, plans, ctx.ledger, originals=ctx.recipe.quantize.originals,
                                 show_progress=True)
        ctx.report["quantize"] = result
        return {"quantized_layers": sum(result["layers"].values()), "bytes_before": result["bytes_before"],
                "bytes_after": result["bytes_after"]}
