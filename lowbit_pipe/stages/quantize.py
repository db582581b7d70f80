"""quantize: swap nn.Linear for QuantLinear per the layer plan; every swap goes through the ledger."""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import FormatSpec, QuantizedWeight, get_format
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.plan.calibration import input_hessians, static_input_amax
from lowbit_pipe.plan.held_out import (
    CalibrationCheck,
    CalibrationUnits,
    Split,
    as_units,
    check_messages,
    split_units,
)
from lowbit_pipe.plan.policy import LayerPlan, _spec, plan_layers, unfit
from lowbit_pipe.progress import Console, progress
from lowbit_pipe.quant.gptq import GPTQSettings, gptq_quantize, gptq_threads, torch_threads
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.quant.swap import LayerSwapper, compute_device
from lowbit_pipe.recipe import CalibrationConfig, CalibrationKind, GPTQConfig, QuantizeConfig
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.detect import linear_shapes
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


def apply_recipe_attention(ctx: Context, chosen: str | None = None) -> dict[str, Any]:
    """The recipe's `attention:` on the loaded transformer (8-bit attention through its diffusers processors,
    every swap in the ledger): report.json's `attention`. `chosen`: the format quantize.target's solver picked
    (validate lets it choose only where attention.format is the stock one)."""
    from lowbit_pipe.attention import STOCK, apply_attention
    from lowbit_pipe.attention.processors import arch_keep

    cfg = ctx.recipe.attention
    fmt = chosen if chosen is not None else cfg.format
    by = {"chosen_by": "quantize.target"} if chosen is not None and cfg.format == STOCK else {}
    if fmt == STOCK and not cfg.fused_norm_rope:
        return {"format": STOCK, **by}
    if ctx.stream is not None:
        return {"format": fmt, "applied": False,
                "note": "a streamed run has no model in memory; the attention format is run time only (exports never "
                        "carry it)"}
    if ctx.native:
        out = {"format": STOCK, **by} if fmt == STOCK else {
            "format": fmt, "applied": False,
            "note": "natively named model (ComfyUI's): the node pack sets ComfyUI's attention override on the MODEL"}
        if cfg.fused_norm_rope:  # ComfyUI's own norm and attention modules (lowbit_pipe.comfy.fused)
            from lowbit_pipe.comfy.fused import apply_comfy_fused_norm_rope

            fused = apply_comfy_fused_norm_rope(ctx.transformer, ctx.ledger)
            out["fused_norm_rope"] = fused.as_dict()
            if not fused.norms and not fused.ropes:
                warnings.warn("attention.fused_norm_rope: no ComfyUI norm or attention module of a known class "
                              "(Krea 2, FLUX.1, Qwen-Image, comfy.ops RMSNorm) in this natively named model",
                              stacklevel=2)
        return out
    fused = {}
    if cfg.fused_norm_rope:  # before the 8-bit processors, which then build on these (processors.rebound_class)
        from lowbit_pipe.attention.fused import apply_fused_norm_rope

        fused = {"fused_norm_rope": apply_fused_norm_rope(ctx.transformer, ctx.ledger).as_dict()}
        idle = fused_norm_rope_idle(ctx.transformer)
        if idle is not None:  # applied (and undone by teardown) all the same: a model moved to a GPU later uses it
            fused["fused_norm_rope"]["note"] = idle
            warnings.warn(f"attention.fused_norm_rope=true did nothing in this run: {idle}", stacklevel=2)
    if fmt == STOCK:
        return {"format": STOCK, **by, **fused}
    applied = apply_attention(ctx.transformer, fmt, ctx.ledger, list(cfg.layers), keep=arch_keep(ctx.arch, cfg.arch_keep),
                              route=cfg.route, speed_cache=ctx.recipe.quantize.speed_cache, fold_qk=cfg.fold_qk)
    ctx.attention = applied
    ctx.ledger.record("attention8", "the run's 8-bit attention handle", lambda: setattr(ctx, "attention", None),
                      check=lambda: True if ctx.attention is None else "still set")
    if not applied.modules:
        why = next(iter(applied.kept.values()), "no diffusers attention module (a ComfyUI model takes the 8-bit "
                                                "attention node's override instead)")
        warnings.warn(f"attention.format={fmt}: no attention module got 8-bit attention ({why})", stacklevel=2)
    return {**applied.as_dict(), "applied": bool(applied.modules), **by, **fused}


def fused_norm_rope_idle(model: nn.Module) -> str | None:
    """Why attention.fused_norm_rope changes nothing a forward computes on this model (its kernels serve CUDA tensors
    only: lowbit_pipe.kernels.norm_rope.kernel_serves), or None when it can."""
    p = next(model.parameters(), None)
    if p is None or p.device.type == "cuda":
        return None
    return (f"its kernels run on CUDA only and the model is on {p.device.type}, so the norms and RoPE run torch's "
            "code, as without it (model.device=cuda uses them)")


def example_runner(ctx: Context, what: str) -> Callable[[], None]:
    """The calibration run `what` (a recipe key) needs, all of its input sets (example_units) in one function."""
    return example_units(ctx, what).run


def _kind_inputs(ctx: Context, seed: int, kind: CalibrationKind) -> dict[str, Any]:
    """The arch's seeded example forward at one calibration kind's token counts and text padding (evaluate's
    text_valid, capped by the kind's text tokens, where the kind sets none)."""
    ev = ctx.recipe.evaluate
    image, text = max(1, round(ev.image_tokens * kind.image_scale)), max(1, round(ev.text_tokens * kind.text_scale))
    inputs = ctx.arch.example_inputs(ctx.model_config, batch=ev.batch, image_tokens=image, text_tokens=text,
                                     generator=torch.Generator().manual_seed(seed), dtype=ctx.dtype, device=ctx.device)
    valid = round(text * kind.text_valid) if kind.text_valid is not None else ev.text_valid
    if valid is None or ctx.arch.text_mask_key is None:
        return inputs
    return ctx.arch.padded_text_inputs(inputs, max(1, min(valid, text)))


def _sample_units(ctx: Context, first: int, count: int) -> CalibrationUnits:
    """Input sets `first`.. of the arch's example inputs: sample i is of kind i % len(kinds), seeded
    calibration_seed + i, denoised by calibration_steps Euler steps (0: one forward at its own timestep)."""
    from lowbit_pipe.measure import sampler

    cfg, arch = ctx.recipe.quantize, ctx.arch
    kinds = cfg.calibration.kinds

    def forward(kwargs: dict[str, Any]) -> torch.Tensor:
        return arch.output_tensor(ctx.transformer(**kwargs))

    def unit(i: int) -> Callable[[], None]:
        def run() -> None:
            inputs = _kind_inputs(ctx, cfg.calibration_seed + i, kinds[i % len(kinds)])
            if cfg.calibration_steps:
                sampler.euler_sample(forward, inputs, cfg.calibration_steps, sampler.TIME_SCALE.get(arch.id, 1.0))
            else:
                ctx.transformer(**inputs)
        return run
    index = range(first, first + count)
    return CalibrationUnits(tuple(unit(i) for i in index), tuple(f"sample {i} (kind {i % len(kinds)})" for i in index))


def _prompt_units(ctx: Context, prompts: list[str], first_seed: int, what: str) -> CalibrationUnits:
    """One input set per prompt, each generated by the run's diffusers pipeline (seed first_seed + i)."""
    cfg = ctx.recipe.quantize
    runs = []
    for i, prompt in enumerate(prompts):
        run = ctx.adapter.prompt_runner(ctx.model, [prompt], cfg.calibration_steps, first_seed + i,
                                        cfg.calibration_resolution)
        if run is None:
            raise ValueError(f"quantize.calibration_prompts (for {what}) needs a diffusers pipeline to generate them: "
                             f"pass one as lowbit_pipe.run(..., model=pipe); this run's model is a {ctx.adapter.name}")
        runs.append(run)
    return CalibrationUnits(tuple(runs), tuple(f"prompt {first_seed - cfg.calibration_seed + i}" for i in
                                               range(len(prompts))))


def example_units(ctx: Context, what: str) -> CalibrationUnits:
    """The calibration `what` (a recipe key) needs, one function per input set. With `quantize.calibration_prompts`:
    the prompts generated by the diffusers pipeline the run was given. Otherwise the transformer on
    `quantize.calibration_samples` seeded example input sets (the arch's own, of `calibration.kinds` in turn); with
    `calibration_steps` > 0 each set is denoised by the Euler sampler, so every timestep's input is seen. A caller's
    calibrate function (or list of them) instead of either."""
    cfg = ctx.recipe.quantize
    if ctx.calibrate is not None:
        return as_units(ctx.calibrate)
    if cfg.calibration_prompts:
        return _prompt_units(ctx, list(cfg.calibration_prompts), cfg.calibration_seed, what)
    if ctx.arch is None:
        raise ValueError(f"{what} needs calibration inputs: a known architecture's example inputs (model.arch), or "
                         "quantize.calibration_prompts with a diffusers pipeline passed as the model")
    if ctx.native:
        raise ValueError("calibration (activations=static, quantize.budget_*, quantize.gptq) runs the arch's example "
                         "inputs, which fit its diffusers class, not this natively named model (a ComfyUI model); use "
                         "lowbit_pipe.quantize(..., calibrate=...) with your own inputs")
    return _sample_units(ctx, 0, cfg.calibration_samples)


def calibration_split(ctx: Context, what: str) -> Split:
    """example_units split for the held-out check: quantize.calibration's own held-out set (held_out_prompts with
    prompts, held_out_samples more seeded samples otherwise) or its held_out_fraction of the input sets."""
    cfg = ctx.recipe.quantize
    units = example_units(ctx, what)
    held = None
    if ctx.calibrate is None and cfg.calibration_prompts and cfg.calibration.held_out_prompts:
        held = _prompt_units(ctx, list(cfg.calibration.held_out_prompts),
                             cfg.calibration_seed + len(cfg.calibration_prompts), what)
    elif ctx.calibrate is None and not cfg.calibration_prompts and cfg.calibration.held_out_samples:
        held = _sample_units(ctx, cfg.calibration_samples, cfg.calibration.held_out_samples)
    return split_units(units, cfg.calibration.held_out_fraction, cfg.calibration_seed, held)


def calibration_source(cfg: QuantizeConfig) -> dict[str, Any]:
    """What the calibration ran on, for report.json."""
    if cfg.calibration_prompts:
        return {"source": "pipeline prompts", "prompts": len(cfg.calibration_prompts), "steps": cfg.calibration_steps,
                "resolution": cfg.calibration_resolution, "seed": cfg.calibration_seed}
    return {"source": "arch example inputs", "samples": cfg.calibration_samples, "steps": cfg.calibration_steps,
            "seed": cfg.calibration_seed, "kinds": len(cfg.calibration.kinds)}


def _budget_plans(ctx: Context, plans: list[LayerPlan]) -> tuple[list[LayerPlan], dict[str, Any]]:
    from lowbit_pipe.plan.budget import plan_budget

    cfg = ctx.recipe.quantize
    model = ctx.transformer
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else int(cfg.budget_ratio * tensor_bytes(model))
    candidates = [_spec(c) for c in cfg.budget_candidates]
    result = plan_budget(model, plans, candidates, budget, example_runner(ctx, "quantize.budget_*"),
                         seed=cfg.calibration_seed,
                         allow_float=cfg.budget_allow_float)
    return result.plans, result.as_dict()


def _target_plan(ctx: Context, plans: list[LayerPlan]):
    """quantize.target: the solver's plan (lowbit_pipe.plan.target_plan), or None when the recipe sets no target."""
    from lowbit_pipe.plan.target_plan import plan_for_target, require_example_forward
    from lowbit_pipe.plan.targets import resolve_target

    target = resolve_target(ctx.recipe.quantize)
    if target is None:
        return None
    require_example_forward(ctx)  # before the calibration runner, whose own refusal would not name the target
    return plan_for_target(ctx, plans, target, example_runner(ctx, "quantize.target"),
                           LayerSwapper.for_config(ctx.recipe.quantize))


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


def _plan_report(plans: list[LayerPlan]) -> list[dict[str, Any]]:
    return [{"name": p.name, "shape": list(p.shape), "format": p.spec.format if p.spec else None,
             "activations": p.spec.activations if p.spec else None, "reason": p.reason} for p in plans]


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


@register
class Quantize(Stage):
    name = "quantize"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.quantize
        plans = plan_layers(linear_shapes(ctx.transformer), cfg, ctx.policy, ctx.policy_name)
        budget = None
        if cfg.budget_bytes is not None or cfg.budget_ratio is not None:
            plans, budget = _budget_plans(ctx, plans)
        target_plan = _target_plan(ctx, plans)
        if target_plan is not None:
            plans = target_plan.plans
        static = any(p.spec is not None and p.spec.activations == "static" for p in plans)
        # Native fused modules (FLUX qkv) are one weight already on a native tree.
        ctx.plans = plans
        if ctx.stream is not None:  # the export quantizes each layer as it streams by
            counts = Counter(p.spec.format for p in plans if p.spec is not None)
            unfit_counts = _warn_unfit(plans)
            ctx.report["plan"] = _plan_report(plans)
            ctx.report["quantize"] = {"layers": dict(counts), "streamed": True, "unfit": unfit_counts,
                                      "float_layers": dict(Counter(p.reason for p in plans if p.spec is None))}
            ctx.report["attention"] = apply_recipe_attention(ctx)
            return {"planned_layers": sum(counts.values()), "streamed": True}
        groups = native_groups(ctx.arch, ctx.arch_config, plans) if ctx.recipe.export.layout == "comfy" and \
            not ctx.native else []
        ctx.fused_groups = [[name for name, _, _ in group] for group in groups]
        run_examples = None
        if cfg.gptq.enabled or static:  # static scales and GPTQ calibrate here, checked on a held-out part
            run_examples = calibration_split(ctx, "quantize.gptq" if cfg.gptq.enabled else "activations=static")
        result = quantize_module(ctx.transformer, plans, ctx.ledger, originals=cfg.originals, console=ctx.console,
                                 fused=groups, gptq=cfg.gptq, run_examples=run_examples, calibration=cfg.calibration,
                                 compute_device=compute_device(cfg.compute_device))
        result.update(runtime_settings(ctx.transformer, cfg, ctx.ledger))
        gptq_threads = result["gptq"].pop("threads", None) if "gptq" in result else None
        if budget is not None:
            budget["model_bytes"] = tensor_bytes(ctx.transformer)
            result["budget"] = budget
        # The attention goes on before the target's check: the plan's predicted time and error include it.
        attention = apply_recipe_attention(ctx, target_plan.attention if target_plan is not None else None)
        if target_plan is not None:
            result["target"] = target_plan.report
            figures_target = _check_target(ctx, target_plan)
        if budget is not None or target_plan is not None or run_examples is not None:
            result["calibration"] = calibration_source(cfg) if ctx.calibrate is None else {
                "source": getattr(ctx.calibrate, "description", "") or "the caller's calibrate function"}
        ctx.report["plan"] = _plan_report(plans)
        ctx.report["quantize"] = result
        ctx.report["attention"] = attention
        figures = {"quantized_layers": sum(result["layers"].values()), "bytes_before": result["bytes_before"],
                   "bytes_after": result["bytes_after"], "float_layers": sum(result["float_layers"].values())}
        if target_plan is not None:
            figures.update(figures_target)
        if gptq_threads:  # the CPU threads GPTQ's matrix work ran on (gptq_threads: they follow the machine's load)
            figures["gptq_threads"] = gptq_threads
        return figures
