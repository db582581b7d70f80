"""quantize: swap nn.Linear for QuantLinear per the layer plan; every swap goes through the ledger."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lowbit_pipe.attention.swapper import AttentionSwapper
from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import FormatSpec, QuantizedWeight, get_format
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.plan.calibration import input_hessians, static_input_amax
from lowbit_pipe.plan.calibration_inputs import calibration_source, calibration_split
from lowbit_pipe.plan.held_out import (
    CalibrationCheck,
    CalibrationUnits,
    Split,
    as_units,
    check_messages,
)
from lowbit_pipe.plan.plan import Plan
from lowbit_pipe.plan.planner import make_plan
from lowbit_pipe.plan.policy import LayerPlan, unfit
from lowbit_pipe.progress import Console, progress
from lowbit_pipe.quant.gptq import GPTQSettings, gptq_quantize, gptq_threads, torch_threads
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.quant.swap import LayerSwapper
from lowbit_pipe.recipe import CalibrationConfig, GPTQConfig, QuantizeConfig
from lowbit_pipe.stages.attention import apply_planned_attention
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register

Quantizer = Callable[[str, torch.Tensor, FormatSpec], QuantizedWeight]  # (layer, weight, spec) -> its tensors


def _quantize_jointly(root: nn.Module, group: list[tuple[str, int, int | None]], spec: FormatSpec,
                      amax: dict[str, float], quantizer: Quantizer | None = None,
                      device: torch.device | None = None) -> dict[str, QuantLinear]:
    """Quantize layers that one native module fuses as that fused weight, then split it by rows.

    This is what a quantizer working on the native file does (one per-tensor / global scale for the
    whole fused weight), so the native export of the parts is exact. `device`: where the math runs."""
    from lowbit_pipe.files.layout import split_rows

    linears = [root.get_submodule(name) for name, _, _ in group]
    home = linears[0].weight.device
    weight = torch.cat([lin.weight.detach().to(device or home) for lin in linears])
    fmt = get_format(spec.format)
    with torch.no_grad():
        q = quantizer(group[0][0], weight, spec) if quantizer is not None else fmt.quantize(weight, spec)
    bounds, start = [], 0
    for (name, _, _), lin in zip(group, linears):
        bounds.append((name, start, start + lin.out_features))
        start += lin.out_features
    parts = split_rows("+".join(n for n, _, _ in group), q.tensors, weight.shape[0], bounds, fmt.row_axes)
    out = {}
    for (name, begin, stop), lin in zip(bounds, linears):
        part = QuantizedWeight(q.format, (stop - begin, weight.shape[1]), parts[name], dict(q.record))
        # The parts of one fused module read the same input: one input amax, one static scale.
        joint_amax = max((amax[n] for n, _, _ in group if n in amax), default=None)
        out[name] = QuantLinear(fmt.with_activations(part, spec.activations, joint_amax, name), lin.bias).to(home)
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


def warn_nothing_quantized(root: nn.Module, plans: list[LayerPlan], stacklevel: int = 3) -> None:
    """Warn when a quantize call quantizes no layer at all (a silent no-op otherwise), naming why the Linears stay
    float. Not for a model loaded quantized (its QuantLinears are not planned again: nothing to do is expected)."""
    if any(p.spec is not None for p in plans) or any(isinstance(m, QuantLinear) for m in root.modules()):
        return
    if not plans:
        warnings.warn(f"nothing was quantized: {type(root).__name__} has no nn.Linear layer", stacklevel=stacklevel)
        return
    reasons = Counter(p.reason.split(" (")[0] for p in plans)
    why = ", ".join(f"{r}: {n}" for r, n in reasons.most_common())
    hint = ""
    if "arch keep-float" in reasons:
        hint = ("; the architecture's keep-float list holds them (an unknown model's is its first and last Linear): "
                "quantize.arch_keep_float=false, or a rule naming them, quantizes them")
    warnings.warn(f"nothing was quantized: all {len(plans)} Linear layers stay float ({why}){hint}",
                  stacklevel=stacklevel)


def _build(root: nn.Module, todo: list[LayerPlan], fused: list[list[tuple[str, int, int | None]]],
           amax: dict[str, float], quantizer: Quantizer | None, bar: Callable[[list[LayerPlan]], Any],
           swapper: LayerSwapper) -> dict[str, QuantLinear]:
    """Quantize `todo` (fused groups jointly) into QuantLinears, not yet swapped in; the rounding runs where
    `swapper.device` says (None: where each weight is)."""
    by_name = {p.name: p for p in todo}
    built: dict[str, QuantLinear] = {}
    for group in fused:
        built.update(_quantize_jointly(root, group, by_name[group[0][0]].spec, amax, quantizer, swapper.device))
    for plan in bar(todo):
        linear = root.get_submodule(plan.name)
        if isinstance(linear, QuantLinear):
            raise ValueError(f"layer '{plan.name}' is already quantized ({linear.format.name})")
        if plan.name not in built:
            one = None if quantizer is None else (lambda w, spec, name=plan.name: quantizer(name, w, spec))
            built[plan.name] = swapper.build(linear, plan.spec, amax.get(plan.name), plan.name, one)
    return built


def _install(root: nn.Module, built: dict[str, nn.Module], todo: list[LayerPlan], ledger, swapper: LayerSwapper,
             counts: Counter) -> tuple[int, int]:
    """Swap each built layer in through the ledger (in plan order); (bytes before, after)."""
    counts.update(p.spec.format for p in todo)
    return swapper.install(root, {p.name: built[p.name] for p in todo}, ledger)


def _groups(todo: list[LayerPlan], fused: list[list[tuple[str, int, int | None]]]) -> list[list[str]]:
    """Layers judged as one: each fused group, every other layer alone."""
    grouped = [[n for n, _, _ in g] for g in fused]
    inside = {n for g in grouped for n in g}
    return [g for g in grouped if g[0] in {p.name for p in todo}] + [[p.name] for p in todo if p.name not in inside]


def _calibration_threads(root: nn.Module, gptq: GPTQConfig | None) -> int | None:
    """The CPU thread cap over the whole calibration (forwards, Hessians, GPTQ's matrix work; quantize.gptq.threads,
    else the cores other processes leave free): None for a model on a GPU."""
    p = next(root.parameters(), None)
    if p is not None and p.device.type != "cpu":
        return None
    return gptq_threads(gptq.threads if gptq is not None else None)


def quantize_module(root: nn.Module, plans: list[LayerPlan], ledger, *, originals: str = "keep",
                    console: Console | None = None, fused: list[list[tuple[str, int, int | None]]] = (),
                    input_amax: dict[str, float] | None = None, gptq: GPTQConfig | None = None,
                    run_examples: Callable[[], None] | Sequence[Callable[[], None]] | Split | None = None,
                    compute_device: torch.device | None = None,
                    calibration: CalibrationConfig | None = None) -> dict[str, Any]:
    """Swap every planned Linear of `root`; returns counts and bytes. `fused`: groups quantized as one weight;
    `input_amax`: input amax per layer for static activations (None: calibrated here on `run_examples`); `console`:
    progress; `gptq` (enabled): GPTQ rounding against Hessians measured where the model is; `run_examples`: runs
    `root` on calibration inputs (a function, a list of them (one per input set), or a Split with a held-out part,
    which `calibration` (its check's settings) judges every calibrated layer on); `compute_device`: where
    round-to-nearest runs (each layer's result goes back to its weight's device)."""
    unfit_counts = _warn_unfit(plans)
    warn_nothing_quantized(root, plans, stacklevel=4)
    swapper = LayerSwapper(originals=originals, device=compute_device)
    todo = [p for p in plans if p.spec is not None]
    counts: Counter[str] = Counter()
    result: dict[str, Any] = {}
    use_gptq = gptq is not None and gptq.enabled
    static = {p.name for p in todo if p.spec.activations == "static"}
    if use_gptq and run_examples is None:
        raise ValueError("GPTQ (quantize.gptq.enabled) needs calibration inputs: pass calibrate= (a function "
                         "that runs the module on representative inputs)")
    check = None
    if run_examples is not None and (use_gptq or (static and input_amax is None)):
        split = run_examples if isinstance(run_examples, Split) else \
            Split(as_units(run_examples), CalibrationUnits(), "none: the calibration was given as one set")
        check = CalibrationCheck(root, split, calibration or CalibrationConfig(), {p.name: p.spec.format for p in todo})
    with torch_threads(_calibration_threads(root, gptq) if check is not None else None):
        amax = input_amax if input_amax is not None else \
            static_input_amax(root, plans, check.split.fit.run) if check is not None and static else {}
        if check is not None:
            check.start()
        if use_gptq:
            result["gptq"], (before, after) = _gptq_swap(root, todo, list(fused), ledger, amax, swapper, counts,
                                                         gptq, check, console)
        else:
            def bar(items: list[LayerPlan]) -> Any:
                return progress(items, "quantize", enabled=console is not None, console=console)
            built = _build(root, todo, list(fused), amax, None, bar, swapper)
            if check is not None:
                built = check.choose({n: built[n] for n in static}, None, _groups(todo, list(fused)), static) | \
                    {n: q for n, q in built.items() if n not in static}
            before, after = _install(root, built, todo, ledger, swapper, counts)
        if check is not None:
            result["calibration_check"] = _finish_check(root, check, ledger, originals, result.get("gptq"))
    return {"layers": dict(counts), "bytes_before": before, "bytes_after": after,
            "float_layers": dict(Counter(p.reason for p in plans if p.spec is None)), "unfit": unfit_counts,
            "activations": dict(Counter(p.spec.activations for p in todo)), **result}


def _finish_check(root: nn.Module, check: CalibrationCheck, ledger, originals: str,
                  gptq_report: dict[str, Any] | None) -> dict[str, Any]:
    """The whole model's held-out check (its fallback swapped in through the ledger), the warnings the check
    earned, and its report entry."""
    for name, module in check.check_model().items():
        if root.get_submodule(name) is not module:
            ledger.swap_module(root, name, module, keep_original=originals)
    few = {}
    if gptq_report is not None:
        few = {n: (v["tokens"], v["width"]) for n, v in gptq_report["layers"].items() if v["tokens"] < v["width"]}
    for message in check_messages(check, few):
        warnings.warn(message, stacklevel=4)
    return check.as_dict()


def gptq_passes(todo: list[LayerPlan], fused: list[list[tuple[str, int, int | None]]],
                hessian_bytes: int) -> list[list[list[str]]]:
    """Layers in model order packed into passes whose fp32 Hessians (4 * in^2 bytes; one per fused group,
    whose parts share an input) fit `hessian_bytes`; a layer larger than that gets a pass of its own."""
    by_name = {p.name: p for p in todo}
    group_of = {name: [n for n, _, _ in g] for g in fused for name, _, _ in g}
    units, seen = [], set()
    for p in todo:
        if p.name not in seen:
            unit = group_of.get(p.name, [p.name])
            units.append(unit)
            seen.update(unit)
    passes: list[list[list[str]]] = []
    used = 0
    for unit in units:
        cost = 4 * by_name[unit[0]].shape[1] ** 2
        if not passes or used + cost > hessian_bytes:
            passes.append([])
            used = 0
        passes[-1].append(unit)
        used += cost
    return passes


def _gptq_quantizer(hessians: dict[str, Any], settings: GPTQSettings, layers: dict[str, dict[str, Any]],
                    rtn: dict[str, str], threads: set[int]) -> Quantizer:
    """GPTQ against `hessians` for one pass, each layer's figures into `layers` (a layer GPTQ cannot round: rounded
    to nearest, its reason into `rtn`)."""
    def quantizer(name: str, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        try:
            out = gptq_quantize(weight, spec, hessians[name].hessian, settings, name)
        except (NotImplementedError, FormatError) as err:
            rtn[name] = str(err)
            return get_format(spec.format).quantize(weight, spec)
        # tokens: the calibration rows the Hessian averages (every position of every forward), against the
        # layer's inputs: fewer leave it rank-deficient.
        layers[name] = {"rtn_loss": out.rtn_loss, "gptq_loss": out.gptq_loss, "damp": out.damp,
                        "tokens": hessians[name].rows, "width": int(weight.shape[1]), "rank": out.rank,
                        "damp_share": round(out.damp_share, 4), "damp_measure": out.damp_measure}
        if out.threads is not None:
            threads.add(out.threads)
        return out.qweight
    return quantizer


def _gptq_swap(root: nn.Module, todo: list[LayerPlan], fused: list[list[tuple[str, int, int | None]]], ledger,
               amax: dict[str, float], swapper: LayerSwapper, counts: Counter, cfg: GPTQConfig,
               check: CalibrationCheck, console: Console | None) -> tuple[dict[str, Any], tuple[int, int]]:
    """GPTQ in sequential passes: each pass calibrates its layers' Hessians on the model as it stands (earlier
    passes' layers already quantized, so later layers correct for their error) from the calibration's part that is
    not held out, rounds them, keeps per layer the form the held-out check prefers (GPTQ's or plain rounding's)
    and swaps it in. A format (or layer) without fixed-grid rounding is rounded to nearest, named in the report."""
    settings = GPTQSettings(block_size=cfg.block_size, damp=cfg.damp, act_order=cfg.act_order, threads=cfg.threads,
                            spectrum_max_width=cfg.spectrum_max_width)
    threads: set[int] = set()
    home = replace(swapper, device=None)  # GPTQ rounds where the model is (its Hessians are there)
    by_name = {p.name: p for p in todo}
    passes = gptq_passes(todo, fused, cfg.hessian_bytes)
    layers: dict[str, dict[str, float]] = {}
    rtn: dict[str, str] = {}
    before = after = 0
    static = {p.name for p in todo if p.spec.activations == "static"}
    for i, units in enumerate(passes):
        names = [n for unit in units for n in unit]
        with input_hessians(root, [by_name[unit[0]] for unit in units]) as hessians, torch.no_grad():
            check.split.fit.run()
        missing = [unit[0] for unit in units if unit[0] not in hessians]
        if missing:
            raise ValueError(f"GPTQ: the calibration inputs never reach {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                             "; keep those layers float or turn quantize.gptq off")

        def bar(items: list[LayerPlan], label: str = f"quantize: gptq pass {i + 1}/{len(passes)}") -> Any:
            return progress(items, label, enabled=console is not None, console=console)
        pass_todo = [by_name[n] for n in names]
        pass_fused = [g for g in fused if g[0][0] in names]
        calibrated = _build(root, pass_todo, pass_fused, amax, _gptq_quantizer(hessians, settings, layers, rtn,
                                                                                threads), bar, home)
        hessians.clear()  # freed before the check's forwards and the next pass's Hessians
        rounded = _build(root, pass_todo, pass_fused, amax, None, lambda items: items, home)
        chosen = check.choose(calibrated, rounded, _groups(pass_todo, pass_fused), static)
        b, a = _install(root, chosen, pass_todo, ledger, swapper, counts)
        before, after = before + b, after + a
    if rtn:
        first = next(iter(rtn))
        warnings.warn(f"GPTQ: {len(rtn)} layers rounded to nearest instead (e.g. {first}: {rtn[first]})", stacklevel=3)
    # No timing here: the stage's seconds hold it, and report["quantize"] stays reproducible (the thread count, which
    # follows the machine's load, goes to the stage's figures: quantize_module's caller pops "threads").
    report = {"passes": len(passes), "layers": layers, "hessians": hessian_notes(layers, cfg),
              "rtn_fallback": rtn, "block_size": cfg.block_size, "damp": cfg.damp, "act_order": cfg.act_order,
              "threads": sorted(threads)}
    return report, (before, after)


def hessian_notes(layers: dict[str, dict[str, Any]], cfg: GPTQConfig) -> dict[str, list[str]]:
    """The ways the calibration under-determined the layers' Hessians, for the report (the held-out check, not
    these, decides whether GPTQ's result is kept, and warns): fewer tokens than inputs (rank-deficient for
    certain), a numerical rank below the width, the damping outweighing the data in at least `cfg.warn_damp_share`
    of the directions (or raised to make H invertible). Worst layers first."""
    few = sorted((k for k, v in layers.items() if v["tokens"] < v["width"]),
                 key=lambda k: layers[k]["tokens"] / layers[k]["width"])
    low_rank = sorted((k for k, v in layers.items() if v["tokens"] >= v["width"] and v["rank"] is not None
                       and v["rank"] < v["width"]), key=lambda k: layers[k]["rank"] / layers[k]["width"])
    damped = sorted((k for k, v in layers.items() if v["damp_share"] >= cfg.warn_damp_share or v["damp"] > cfg.damp),
                    key=lambda k: (-(layers[k]["damp"] > cfg.damp), -layers[k]["damp_share"]))
    return {"few_tokens": few, "low_rank": low_rank, "damp": damped}


def runtime_settings(root: nn.Module, cfg: QuantizeConfig, ledger) -> dict[str, Any]:
    """The run-time settings of `quantize` (prepack, nvfp4_compute) on every QuantLinear under `root`, whether
    quantized now or loaded quantized: the report entries they add (quant.swap.LayerSwapper.runtime)."""
    return LayerSwapper.for_config(cfg).runtime(root, ledger)


def _check_target(ctx: Context, target_plan) -> dict[str, Any]:
    """The whole-forward check of a target plan (quantize.target.check_forward): into the report, and the stage's
    figures (predicted vs measured ms and by how much the prediction was off)."""
    from lowbit_pipe.plan.target_plan import check

    if not ctx.recipe.quantize.target.check_forward:
        return {}
    result = check(target_plan, ctx.device)
    target_plan.report["forward_check"] = result.as_dict()
    return {"target_predicted_ms": round(result.predicted_ms, 4), "target_measured_ms": round(result.measured_ms, 4),
            "target_off": round(result.off, 4)}


def native_groups(arch, arch_config, plans: list[LayerPlan]) -> list[list[tuple[str, int, int | None]]]:
    """Fused native modules whose parts are all planned alike: quantized jointly for an exact ComfyUI export."""
    from lowbit_pipe.files.layout import fused_groups

    if arch is None:
        return []
    specs = {p.name: p.spec for p in plans if p.spec is not None}
    out = []
    for native, group in fused_groups(arch, arch_config, list(specs)).items():
        expected = {n for n, _ in arch.from_native_name(native, arch_config)}
        if {n for n, _, _ in group} == expected and len({specs[n] for n, _, _ in group}) == 1:
            out.append(group)
    return out


def _streamed(ctx: Context, plan: Plan) -> dict[str, Any]:
    """A streamed run: nothing to swap (the export quantizes each layer per the Plan as it streams by)."""
    ctx.report["plan"] = plan.rows()
    ctx.report["plan_attention"] = plan.attention.as_dict()
    ctx.report["quantize"] = {"layers": plan.counts(), "streamed": True, "unfit": _warn_unfit(list(plan.layers)),
                              "float_layers": plan.float_reasons()}
    ctx.report["attention"] = apply_planned_attention(ctx, plan.attention)
    return {"planned_layers": len(plan.quantized), "streamed": True}


def _apply_layers(ctx: Context, plan: Plan, swapper: LayerSwapper) -> tuple[dict[str, Any], bool]:
    """The Plan's layer part on the live transformer (GPTQ, static scales and their held-out check as the recipe
    asks): the report's `quantize` section, and whether it calibrated."""
    cfg = ctx.recipe.quantize
    plans = list(plan.layers)
    static = any(p.spec.activations == "static" for p in plan.quantized)
    # Native fused modules (FLUX qkv) are one weight already on a native tree.
    groups = native_groups(ctx.arch, ctx.arch_config, plans) if ctx.recipe.export.layout == "comfy" and \
        not ctx.native else []
    ctx.fused_groups = [[name for name, _, _ in group] for group in groups]
    run_examples = None
    if cfg.gptq.enabled or static:  # static scales and GPTQ calibrate here, checked on a held-out part
        run_examples = calibration_split(ctx, "quantize.gptq" if cfg.gptq.enabled else "activations=static")
    result = quantize_module(ctx.transformer, plans, ctx.ledger, originals=swapper.originals, console=ctx.console,
                             fused=groups, gptq=cfg.gptq, run_examples=run_examples, calibration=cfg.calibration,
                             compute_device=swapper.device)
    result.update(swapper.runtime(ctx.transformer, ctx.ledger))
    if plan.budget is not None:
        result["budget"] = {**plan.budget, "model_bytes": tensor_bytes(ctx.transformer)}
    return result, run_examples is not None


@register
class Quantize(Stage):
    name = "quantize"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.quantize
        swapper = LayerSwapper.for_config(cfg)
        plan = make_plan(ctx, swapper, AttentionSwapper.for_recipe(ctx.recipe, ctx.arch))
        ctx.plan = plan
        if ctx.stream is not None:
            return _streamed(ctx, plan)
        result, calibrated = _apply_layers(ctx, plan, swapper)
        gptq_threads = result["gptq"].pop("threads", None) if "gptq" in result else None
        # The attention goes on before the target's check: the plan's predicted time and error include it.
        attention = apply_planned_attention(ctx, plan.attention)
        figures_target = {}
        if plan.target is not None:
            result["target"] = plan.target.report
            figures_target = _check_target(ctx, plan.target)
        if plan.budget is not None or plan.target is not None or calibrated:
            result["calibration"] = calibration_source(cfg) if ctx.calibrate is None else {
                "source": getattr(ctx.calibrate, "description", "") or "the caller's calibrate function"}
        ctx.report["plan"] = plan.rows()
        ctx.report["plan_attention"] = plan.attention.as_dict()
        ctx.report["quantize"] = result
        ctx.report["attention"] = attention
        figures = {"quantized_layers": sum(result["layers"].values()), "bytes_before": result["bytes_before"],
                   "bytes_after": result["bytes_after"], "float_layers": sum(result["float_layers"].values()),
                   **figures_target}
        if gptq_threads:  # the CPU threads GPTQ's matrix work ran on (gptq_threads: they follow the machine's load)
            figures["gptq_threads"] = gptq_threads
        return figures
