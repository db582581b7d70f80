"""quantize: swap nn.Linear for QuantLinear per the layer plan; every swap goes through the ledger."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.calibration import static_input_amax
from lowbit_pipe.context import Context
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.nn import QuantLinear
from lowbit_pipe.policy import LayerPlan, _spec, plan_layers, unfit
from lowbit_pipe.progress import Console, progress
from lowbit_pipe.stages.registry import register
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.detect import linear_shapes


def _quantize_jointly(root: nn.Module, group: list[tuple[str, int, int | None]], spec,  # noqa: ANN001
                      amax: dict[str, float]) -> dict[str, QuantLinear]:
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
    out = {}
    for (name, begin, stop), lin in zip(bounds, linears):
        part = QuantizedWeight(q.format, (stop - begin, weight.shape[1]), parts[name], dict(q.record))
        # The parts of one fused module read the same input: one input amax, one static scale.
        joint_amax = max((amax[n] for n, _, _ in group if n in amax), default=None)
        out[name] = QuantLinear(fmt.with_activations(part, spec.activations, joint_amax, name), lin.bias)
    return out


def _warn_unfit(plans: list[LayerPlan]) -> dict[str, int]:
    """One warning per kind of layer the asked format could not take; their counts for the report."""
    groups = unfit(plans)
    by_name = {p.name: p for p in plans}
    for kind, names in groups.items():
        if not names:
            continue
        first = by_name[names[0]]
        what = {"float": "stay float", "fallback": "use quantize.fallback", "unrotated": "are stored unrotated"}[kind]
        hint = "; set quantize.fallback to quantize them in another format" if kind == "float" else ""
        warnings.warn(f"{len(names)} of {len(plans)} layers {what}: the format cannot take their shape "
                      f"(e.g. {first.name}: {first.reason}){hint}", stacklevel=3)
    return {kind: len(names) for kind, names in groups.items()}


def quantize_module(root: nn.Module, plans: list[LayerPlan], ledger, *, originals: str = "keep",  # noqa: ANN001
                    console: Console | None = None, fused: list[list[tuple[str, int, int | None]]] = (),
                    input_amax: dict[str, float] | None = None) -> dict[str, Any]:
    """Swap every planned Linear of `root`; returns counts and bytes. `fused`: groups quantized as one weight;
    `input_amax`: calibrated input amax per layer (static activations); `console`: progress."""
    unfit_counts = _warn_unfit(plans)
    todo = [p for p in plans if p.spec is not None]
    by_name = {p.name: p for p in todo}
    amax = input_amax or {}
    joint: dict[str, QuantLinear] = {}
    for group in fused:
        joint.update(_quantize_jointly(root, group, by_name[group[0][0]].spec, amax))
    counts: Counter[str] = Counter()
    bytes_before = bytes_after = 0
    for plan in progress(todo, "quantize", enabled=console is not None, console=console):
        linear = root.get_submodule(plan.name)
        if isinstance(linear, QuantLinear):
            raise ValueError(f"layer '{plan.name}' is already quantized ({linear.format.name})")
        qlinear = joint.pop(plan.name) if plan.name in joint else \
            QuantLinear.from_linear(linear, plan.spec, amax.get(plan.name), plan.name)
        bytes_before += tensor_bytes(linear)
        bytes_after += tensor_bytes(qlinear)
        ledger.swap_module(root, plan.name, qlinear, keep_original=originals)
        counts[plan.spec.format] += 1
    return {"layers": dict(counts), "bytes_before": bytes_before, "bytes_after": bytes_after,
            "float_layers": dict(Counter(p.reason for p in plans if p.spec is None)), "unfit": unfit_counts,
            "activations": dict(Counter(p.spec.activations for p in todo))}


def example_runner(ctx: Context) -> Callable[[], None]:
    """Run the transformer on `quantize.calibration_samples` seeded example input sets (the arch's own)."""
    cfg, ev = ctx.recipe.quantize, ctx.recipe.evaluate
    if ctx.native:
        raise ValueError("calibration (activations=static, quantize.budget_*) runs the arch's example inputs, which "
                         "fit its diffusers class, not this natively named model (a ComfyUI model); use activations "
                         "dynamic or none, or lowbit_pipe.quantize(..., calibrate=...) with your own inputs")

    def run() -> None:
        for i in range(cfg.calibration_samples):
            gen = torch.Generator().manual_seed(cfg.calibration_seed + i)
            inputs = ctx.arch.example_inputs(ctx.model_config, batch=ev.batch, image_tokens=ev.image_tokens,
                                             text_tokens=ev.text_tokens, generator=gen, dtype=ctx.dtype, device=ctx.device)
            ctx.transformer(**inputs)
    return run


def _budget_plans(ctx: Context, plans: list[LayerPlan]) -> tuple[list[LayerPlan], dict[str, Any]]:
    from lowbit_pipe.budget import plan_budget

    cfg = ctx.recipe.quantize
    if ctx.arch is None:
        raise ValueError("quantize.budget_* needs a known architecture (its example inputs calibrate sensitivity)")
    model = ctx.transformer
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else int(cfg.budget_ratio * tensor_bytes(model))
    candidates = [_spec(c) for c in cfg.budget_candidates]
    result = plan_budget(model, plans, candidates, budget, example_runner(ctx), seed=cfg.calibration_seed,
                         allow_float=cfg.budget_allow_float)
    return result.plans, result.as_dict()


def _plan_report(plans: list[LayerPlan]) -> list[dict[str, Any]]:
    return [{"name": p.name, "shape": list(p.shape), "format": p.spec.format if p.spec else None,
             "activations": p.spec.activations if p.spec else None, "reason": p.reason} for p in plans]


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
        plans = plan_layers(linear_shapes(ctx.transformer), cfg, ctx.policy, ctx.policy_name)
        budget = None
        if cfg.budget_bytes is not None or cfg.budget_ratio is not None:
            plans, budget = _budget_plans(ctx, plans)
        amax = {}
        if any(p.spec is not None and p.spec.activations == "static" for p in plans):
            if ctx.arch is None:
                raise ValueError("activations=static needs calibration inputs, which only a known architecture "
                                 "provides (model.arch); use activations=dynamic or none")
            amax = static_input_amax(ctx.transformer, plans, example_runner(ctx))
        # Native fused modules (FLUX qkv) are one weight already on a native tree.
        ctx.plans = plans
        if ctx.stream is not None:  # the export quantizes each layer as it streams by
            counts = Counter(p.spec.format for p in plans if p.spec is not None)
            unfit_counts = _warn_unfit(plans)
            ctx.report["plan"] = _plan_report(plans)
            ctx.report["quantize"] = {"layers": dict(counts), "streamed": True, "unfit": unfit_counts,
                                      "float_layers": dict(Counter(p.reason for p in plans if p.spec is None))}
            return {"planned_layers": sum(counts.values()), "streamed": True}
        groups = native_groups(ctx.arch, ctx.arch_config, plans) if ctx.recipe.export.layout == "comfy" and \
            not ctx.native else []
        ctx.fused_groups = [[name for name, _, _ in group] for group in groups]
        result = quantize_module(ctx.transformer, plans, ctx.ledger, originals=cfg.originals, console=ctx.console,
                                 fused=groups, input_amax=amax)
        if budget is not None:
            budget["model_bytes"] = tensor_bytes(ctx.transformer)
            result["budget"] = budget
        ctx.report["plan"] = _plan_report(plans)
        ctx.report["quantize"] = result
        return {"quantized_layers": sum(result["layers"].values()), "bytes_before": result["bytes_before"],
                "bytes_after": result["bytes_after"], "float_layers": sum(result["float_layers"].values())}
