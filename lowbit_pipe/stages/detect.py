"""detect: which architecture this is, its structural config, and the layer plan."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import asdict
from typing import Any

from torch import nn

from lowbit_pipe.arch import detect_model, get_arch
from lowbit_pipe.arch.base import LayerPolicy
from lowbit_pipe.context import Context
from lowbit_pipe.formats import get_format
from lowbit_pipe.policy import plan_layers
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage


def linear_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    return {n: (m.out_features, m.in_features) for n, m in module.named_modules() if isinstance(m, nn.Linear)}


def generic_policy(module: nn.Module) -> LayerPolicy:
    """Unknown model: quantize every Linear but the first and the last."""
    names = list(linear_shapes(module))
    return LayerPolicy(keep_float=tuple(names[:1] + names[-1:]))


@register
class Detect(Stage):
    name = "detect"

    def run(self, ctx: Context) -> dict[str, Any]:
        forced = ctx.recipe.model.arch if ctx.source.get("layout") not in ("tiny",) else None
        arch = get_arch(forced) if forced not in (None, "generic") else detect_model(ctx.transformer)
        if arch is None:
            warnings.warn(f"unknown model class {type(ctx.transformer).__name__}: using the generic policy "
                          "(every Linear but the first and last is quantized)", stacklevel=2)
            ctx.arch, ctx.arch_config, ctx.policy = None, None, generic_policy(ctx.transformer)
        else:
            ctx.arch, ctx.policy = arch, arch.policy
            ctx.arch_config = arch.config_from_model(ctx.transformer)
        plans = plan_layers(linear_shapes(ctx.transformer), ctx.recipe.quantize, ctx.policy)
        counts = Counter(p.spec.format if p.spec else "float" for p in plans)
        bytes_before = sum(o * i for o, i in (p.shape for p in plans)) * ctx.dtype.itemsize
        bytes_after = sum(o * i * (get_format(p.spec.format).bits_per_weight / 8 if p.spec else ctx.dtype.itemsize)
                          for p in plans for o, i in [p.shape])
        result = {
            "arch": arch.id if arch else "generic",
            "config": asdict(ctx.arch_config) if ctx.arch_config else {},
            "plan": {"layers": dict(counts), "linear_bytes_before": int(bytes_before), "linear_bytes_after": int(bytes_after)},
        }
        ctx.report["detect"] = result
        ctx.report["plan"] = [{"name": p.name, "shape": list(p.shape), "format": p.spec.format if p.spec else None,
                               "reason": p.reason} for p in plans]
        return {"arch": result["arch"], **{f"layers_{k}": v for k, v in counts.items()}}
