"""quantize: swap nn.Linear for QuantLinear per the layer plan; every swap goes through the ledger."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from lowbit_pipe.context import Context
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.nn import QuantLinear
from lowbit_pipe.policy import LayerPlan, _spec, plan_layers
from lowbit_pipe.progress import progress
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.detect import linear_shapes


def _quantize_jointly(root: nn.Module, group: list[tuple[str, int, int | None]], spec) -> dict[str, QuantLinear]:
    """Quantize layers that one native module fuses as that fused weight, then split it by rows.

    This is what a quantizer working on the native file does (one per-tensor / global scale for the
    whole fused weight), so the native export of the parts is exact."""
    from lowbit_pipe.formats import QuantizedWeight, get_format
    from lowbit_pipe.layout import split_rows

    linears = [root.get_submodule(name) for name, _, _ in group]
    weight = torch.cat([lin.weight.detach() for lin in linears])
    fmt = get_format(spec.format)
    with torch.no_grad():
        q = fmt.quantize(weight, spec)
    bounds, start = [], 0
    for (name, _, _), lin in zip(group, linears):
        bounds.append((name, start, start + lin.out_features))
        start += lin.out_features
    parts = split_rows("+".join(n for n, _, _ in group), q.tensors, weight.shape[0], bounds)
    return {name: QuantLinear(QuantizedWeight(q.format, (stop - begin, weight.shape[1]), parts[name], dict(q.record)),
                              lin.bias)
            for (name, begin, stop), lin in zip(bounds, linears)}


def quantize_module(root: nn.Module, plans: list[LayerPlan], ledger, *, originals: str = "keep",
                    show_progress: bool = False, fused: list[list[tuple[str, int, int | None]]] = ()) -> dict[str, Any]:
    """Swap every planned Linear of `root`; returns counts and bytes. `fused`: groups quantized as one weight."""
    todo = [p for p in plans if p.spec is not None]
    by_name = {p.name: p for p in todo}
    joint: dict[str, QuantLinear] = {}
    for group in fused:
        joint.update(_quantize_jointly(root, group, by_name[group[0][0]].spec))
    counts: Counter[str] = Counter()
    bytes_before = bytes_after = 0
    for plan in progress(todo, "quantize", enabled=show_progress):
        linear = root.get_submodule(plan.name)
        if isinstance(linear, QuantLinear):
            raise ValueError(f"layer '{plan.name}' is already quantized ({linear.format.name})")
        qlinear = joint.pop(plan.name) if plan.name in joint else QuantLinear.from_linear(linear, plan.spec)
        bytes_before += tensor_bytes(linear)
        bytes_after += tensor_bytes(qlinear)
        ledger.swap_module(root, plan.name, qlinear, keep_original=originals)
        counts[plan.spec.format] += 1
    return {"layers": dict(counts), "bytes_before": bytes_before, "bytes_after": bytes_after}


def _budget_plans(ctx: Context, plans: list[LayerPlan]) -> tuple[list[LayerPlan], dict[str, Any]]:
    from lowbit_pipe.budget import plan_budget
    from lowbit_pipe.ledger import tensor_bytes

    cfg, ev = ctx.recipe.quantize, ctx.recipe.evaluate
    if ctx.arch is None:
        raise ValueError("quantize.budget_* needs a known architecture (its example inputs calibrate sensitivity)")
    model = ctx.transformer
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else int(cfg.budget_ratio * tensor_bytes(model))

    def calibrate() -> None:
        for i in range(cfg.calibration_samples):
            gen = torch.Generator().manual_seed(cfg.calibration_seed + i)
            inputs = ctx.arch.example_inputs(ctx.model_config, batch=ev.batch, image_tokens=ev.image_tokens,
                                             text_tokens=ev.text_tokens, generator=gen, dtype=ctx.dtype, device=ctx.device)
            model(**inputs)

    candidates = [_spec(c) for c in cfg.budget_candidates]
    result = plan_budget(model, plans, candidates, budget, calibrate, seed=cfg.calibration_seed,
                         allow_float=cfg.budget_allow_float)
    return result.plans, result.as_dict()


def native_groups(arch, arch_config, plans: list[LayerPlan]) -> list[list[tuple[str, int, int | None]]]:  # noqa: ANN001
    """Fused native modules whose parts are all planned alike: quantized jointly for an exact ComfyUI export."""
    from lowbit_pipe.layout import fused_groups

    if arch is None:
        return []
    specs = {p.name: p.spec for p in plans if p.spec is not None}
    out = []
    for native, group in fused_groups(arch, arch_config, list(specs)).items():
        expected = {n for n, _ in arch.from_native_name(native, arch_config)}
        if {n for n, _, _ in group} == expected and len({specs[n] for n, _, _ in group}) == 1:
            out.append(group)
    return out


@register
class Quantize(Stage):
    name = "quantize"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.quantize
        plans = plan_layers(linear_shapes(ctx.transformer), cfg, ctx.policy)
        budget = None
        if cfg.budget_bytes is not None or cfg.budget_ratio is not None:
            plans, budget = _budget_plans(ctx, plans)
        groups = native_groups(ctx.arch, ctx.arch_config, plans) if ctx.recipe.export.layout == "comfy" else []
        ctx.fused_groups = [[name for name, _, _ in group] for group in groups]
        result = quantize_module(ctx.transformer, plans, ctx.ledger, originals=cfg.originals, show_progress=True,
                                 fused=groups)
        if budget is not None:
            from lowbit_pipe.ledger import tensor_bytes

            budget["model_bytes"] = tensor_bytes(ctx.transformer)
            result["budget"] = budget
            ctx.report["plan"] = [{"name": p.name, "shape": list(p.shape), "format": p.spec.format if p.spec else None,
                                   "reason": p.reason} for p in plans]
        ctx.report["quantize"] = result
        return {"quantized_layers": sum(result["layers"].values()), "bytes_before": result["bytes_before"],
                "bytes_after": result["bytes_after"]}
