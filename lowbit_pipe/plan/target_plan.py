"""quantize.target in the quantize stage: measure, time, solve, and afterwards check against the whole forward.

1. Each free layer's options (candidates that fit it, float) with bytes and error on its calibration inputs
   (lowbit_pipe.plan.error_model). Free: planned to be quantized and not by a recipe rule (a rule's format is
   the recipe's word, a constraint); keep-float layers stay float.
2. The rows each layer sees in one forward of the run's example inputs (evaluate's batch and token counts),
   and the speed table's times for those shapes on this device (measured once, cached).
3. The float forward's time on those inputs: the speedup's baseline; what is not a free layer's time is the
   fixed part of every prediction.
4. How each layer's error reaches the output (OutputErrorModel): a gain per layer (a probe forward with it alone at
   its least accurate option) and a scale per candidate (a probe with every layer that can take it at it).
5. The attention formats it may choose (quantize.target.attention; the recipe's attention.format when that is
   set, a constraint): each applied for one timed forward of the float layers, on a scratch ledger undone at once.
   Its time moves the fixed part; its output error against the stock attention's is added in quadrature. The
   attention's cost is measured in place, in the whole forward (its masks, layout changes and routing included),
   not summed from a per-shape table: one forward per format, as the float baseline is.
6. Each candidate's uniform probe (lowbit_pipe.plan.speed_model): its layers really quantized, the forward timed; their
   table times are scaled so a uniform plan's predicted time is its measured time.
7. The solver's plan and the frontier per attention format; the best met plan wins (least error; for an error
   target, least time). The winner's error is probed once and it is weighed against the uniform plans on measured
   figures (weigh_uniform). After quantization, with the chosen attention applied, `check` times the forward once
   more.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch
from torch import nn

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.ledger import Ledger, tensor_bytes
from lowbit_pipe.measure.metrics import rel_error
from lowbit_pipe.measure.timing import TimingSettings
from lowbit_pipe.plan import speed_table
from lowbit_pipe.plan.candidates import Candidate
from lowbit_pipe.plan.error_model import LayerOption, layer_calls, measure_options, quantized_bytes
from lowbit_pipe.plan.forward_timing import ExampleForward, ForwardCheck, time_forward
from lowbit_pipe.plan.policy import LayerPlan, spec_of
from lowbit_pipe.plan.solver import (
    LayerCosts,
    Prediction,
    Problem,
    Solution,
    frontier,
    meets,
    non_dominated,
    predict,
    reach,
    refuse,
    solve,
)
from lowbit_pipe.plan.speed_model import SpeedModel, measure_speed_model
from lowbit_pipe.plan.targets import Target
from lowbit_pipe.quant.swap import LayerSwapper
from lowbit_pipe.recipe import STOCK_ATTENTION


@dataclass
class TargetPlan:
    plans: list[LayerPlan]
    report: dict[str, Any]
    example: ExampleForward
    reference: torch.Tensor  # the float output on the example
    float_ms: float
    solution: Solution
    attention: str = STOCK_ATTENTION  # the attention format the plan was solved with (apply it before `check`)


@dataclass(frozen=True)
class AttentionOption:
    """One attention format as measured in the float model's forward on the example inputs."""

    format: str
    forward_ms: float  # the float layers' forward with this attention
    error: float  # its output's relative error against the stock attention's (the float reference)
    calls: dict[str, int]  # attention calls per path (format, or "stock: <why>"), as the dispatch counted them

    def as_dict(self) -> dict[str, Any]:
        return {"forward_ms": round(self.forward_ms, 6), "error": round(self.error, 8), "calls": self.calls}


class AttentionProbe(Protocol):
    """What the solver needs to weigh attention formats: one applied to a model through a ledger, for one timed
    forward (lowbit_pipe.attention.swapper.AttentionSwapper is the one the run applies its attention with)."""

    def probe(self, model: nn.Module, attention_format: str, ledger: Ledger) -> Mapping[str, int]:
        """Apply it; the live count of attention calls per path (read after the forward)."""


def measure_attention(ctx, example: ExampleForward, attention_format: str, reference: torch.Tensor,
                      timing: TimingSettings, swapper: AttentionProbe) -> AttentionOption:
    """Apply `attention_format` to the model on a scratch ledger, time the example forward and measure its error,
    then undo the swaps."""
    scratch = Ledger()
    try:
        counted = swapper.probe(example.module, attention_format, scratch)
        ms, out = time_forward(example, ctx.device, timing)
        calls = dict(sorted(counted.items()))
    finally:
        report = scratch.undo_all()
    if report.errors or report.unfreed:
        raise RuntimeError(f"quantize.target.attention: undoing the timed {attention_format} attention failed: "
                           f"{report.errors + report.unfreed}")
    return AttentionOption(attention_format, ms, rel_error(reference, out), calls)


def free_layers(plans: list[LayerPlan]) -> list[str]:
    """Layers the solver chooses for: quantized by the plan, not by a recipe rule."""
    return [p.name for p in plans if p.spec is not None and not p.reason.startswith("rule ")]


@contextlib.contextmanager
def _probe(model: nn.Module, specs: dict[str, FormatSpec]) -> Iterator[None]:
    """Forward hooks (removed on exit) that replace each named layer's output with its quantized output."""
    def hook(module: nn.Module, args: tuple, _out: Any, spec: FormatSpec) -> torch.Tensor:
        fmt = get_format(spec.format)
        q = fmt.with_activations(fmt.quantize(module.weight.detach(), spec), spec.activations, None)
        return fmt.linear(args[0], q, module.bias)

    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, a, o, s=s: hook(m, a, o, s)) for n, s in specs.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass(frozen=True)
class OutputErrorModel:
    """How a layer's own error reaches the model's output, measured by probe forwards on the example input.

    A layer's share of the output error is gain[layer] * its own error * scale[candidate]; shares add in
    quadrature. The gain is per layer because layers of the same own error move the output very differently (on the
    tiny Krea 2, 10x between an attention gate and an MLP gate): one probe per layer, alone at its least accurate
    option. The scale is per candidate because the output does not follow the layers' own errors alike across
    formats: one probe per candidate with every layer that can take it at it, so a uniform plan's prediction is its
    measured error. On the tiny Krea 2 this predicted a krea2_nvfp4-sized solver plan and krea2_nvfp4 within 2 %
    (and ranked them right); the candidates' scales without the layers' gains put the solver's plan 30 % low and
    picked it over krea2_nvfp4, which was better."""

    gains: dict[str, float]  # layer -> output error per unit of its own error (alone, at its least accurate option)
    scales: dict[str, dict[str, Any]]  # candidate label -> {"scale", probe figures} (or "from" when not probed)
    probes: int = 0  # probe forwards run

    def share(self, name: str, option: LayerOption) -> float:
        """The layer's share of the output error at `option`."""
        if option.rel_error <= 0:
            return 0.0
        return self.gains[name] * option.rel_error * self.scales[option.candidate.label]["scale"]

    def as_dict(self) -> dict[str, Any]:
        return {"scales": self.scales, "gains": {n: round(g, 6) for n, g in self.gains.items()},
                "probes": self.probes}


def _probe_error(example: ExampleForward, reference: torch.Tensor, specs: dict[str, FormatSpec]) -> float:
    with _probe(example.module, specs), torch.no_grad():
        out = ExampleForward(example.module, example.inputs, example.output).runner()()  # eager: hooks
    return rel_error(reference, out)


def measure_output_error(example: ExampleForward, reference: torch.Tensor, options: dict[str, list[LayerOption]]
                         ) -> OutputErrorModel:
    """The layers' gains and the candidates' scales (OutputErrorModel), from one probe forward per layer and one per
    candidate. Static activations have no probe (no static scale yet): a layer's gain comes from its least accurate
    dynamic or weight-only option, a static candidate takes the largest measured scale."""
    def probed(o: LayerOption) -> bool:
        return o.candidate.spec is not None and o.rel_error > 0 and o.candidate.spec.activations != "static"

    gains: dict[str, float] = {}
    by_label: dict[str, dict[str, LayerOption]] = {}
    probes = 0
    for name, opts in options.items():
        worst = max((o for o in opts if probed(o)), key=lambda o: o.rel_error, default=None)
        if worst is not None:
            gains[name] = _probe_error(example, reference, {name: worst.candidate.spec}) / worst.rel_error
            probes += 1
        elif any(o.rel_error > 0 for o in opts):
            gains[name] = 1.0  # only static options: unmeasured, counted at its own error
        for o in opts:
            if o.candidate.spec is not None and o.rel_error > 0:
                by_label.setdefault(o.candidate.label, {})[name] = o
    scales: dict[str, dict[str, Any]] = {}
    for label, layers in by_label.items():
        if not all(probed(o) for o in layers.values()):
            continue
        summed = math.sqrt(sum((gains[n] * o.rel_error) ** 2 for n, o in layers.items()))
        measured = _probe_error(example, reference, {n: o.candidate.spec for n, o in layers.items()})
        probes += 1
        scales[label] = {"scale": measured / summed if summed > 0 else 1.0, "probe_output_error": measured,
                         "layers": len(layers)}
    largest = max((v["scale"] for v in scales.values()), default=1.0)
    for label in by_label.keys() - scales.keys():
        scales[label] = {"scale": largest, "from": "the largest measured scale (static activations: no probe)"}
    return OutputErrorModel(gains, scales, probes)


def require_example_forward(ctx) -> None:
    """Refuse, naming quantize.target, a model whose forward the solver cannot time and probe."""
    if ctx.native:  # ComfyUI's own model classes: no example forward of ours to time and probe (yet)
        raise RecipeError("quantize.target", f"is solved on the diffusers {ctx.arch.id} model, whose forward it times "
                                             "and probes; this one has ComfyUI's native names (the Quantize node). "
                                             "Run the recipe with the CLI on the checkpoint and load its export in "
                                             "ComfyUI, or name the formats in the recipe")
    if ctx.arch is None:
        raise RecipeError("quantize.target", "times and probes the forward on a known architecture's example inputs; "
                                             "this model's architecture is not one (model.arch names one for a file)")


def _example(ctx, compiled: bool) -> ExampleForward:
    inputs = ctx.example_inputs(ctx.recipe.quantize.calibration_seed)
    return ExampleForward(ctx.transformer, inputs, ctx.arch.output_tensor, compiled, ctx.recipe.compile.backend)


def byte_floor(model: nn.Module, names: list[str], fixed_specs: dict[str, FormatSpec],
               candidates: list[Candidate]) -> int | None:
    """A lower bound of any plan's bytes, from the layer shapes alone (no calibration, nothing timed): each free
    layer at its smallest candidate that fits it (float when allowed), the rules' layers in their format, the rest
    as it is; a quantized layer counted by its stored tensors and bias (its record and derived buffers, which the
    solver adds, left out). None when some free layer has no candidate that fits (the solver names it)."""
    total = tensor_bytes(model)
    for name, specs in [*((n, [c.spec for c in candidates]) for n in names), *((n, [s]) for n, s in fixed_specs.items())]:
        linear = model.get_submodule(name)
        bias = tensor_bytes(linear.bias) if linear.bias is not None else 0
        sizes = [tensor_bytes(linear) if spec is None else
                 get_format(spec.format).storage_bytes(linear.out_features, linear.in_features, spec) + bias
                 for spec in specs
                 if spec is None or get_format(spec.format).supports_shape(linear.out_features, linear.in_features)]
        if not sizes:
            return None
        total += min(sizes) - tensor_bytes(linear)
    return total


def _refuse_below_floor(model: nn.Module, names: list[str], fixed_specs: dict[str, FormatSpec],
                        candidates: list[Candidate], target: Target) -> None:
    """A bytes / ratio target under what the layer shapes allow: refused before the calibration and the speed
    table (minutes on a large model), naming the key and the floor."""
    if target.kind not in ("bytes", "ratio"):
        return
    floor = byte_floor(model, names, fixed_specs, candidates)
    if floor is None:
        return
    float_bytes = tensor_bytes(model)
    bound = target.value if target.kind == "bytes" else target.value * float_bytes
    if floor > bound * (1 + 1e-9):
        reach = f"{floor} bytes" if target.kind == "bytes" else f"{floor / float_bytes:.4f} of the float transformer"
        raise RecipeError(target.key, f"{target.value:g} cannot be met with these candidates: the smallest plan they "
                                      f"allow takes at least {reach} ({floor:,} of {float_bytes:,} bytes, counted from "
                                      "the layer shapes, before any calibration; keep-float layers and the rules' "
                                      "formats included): add smaller candidates under quantize.target.candidates, "
                                      "or relax the target")


@dataclass
class _Layers:
    """The layers the plan weighs: the free ones with their options, the rules' ones with their format."""

    names: list[str]  # free layers
    candidates: list[Candidate]
    fixed_specs: dict[str, FormatSpec]  # the rules' layers
    options: dict[str, list[LayerOption]]  # free layer -> its measured options
    fixed_options: dict[str, LayerOption]  # rule's layer -> its measured format


@dataclass(frozen=True)
class _Shapes:
    """The shapes each layer sees in the example forward, as speed table entries."""

    model: nn.Module
    calls: dict[str, list[int]]  # layer -> rows per call
    dtype: str
    compiled: bool
    prepack: bool

    def entries(self, name: str, cand: Candidate) -> list[speed_table.Entry]:
        lin = self.model.get_submodule(name)
        return [speed_table.Entry(cand.label, rows, lin.in_features, lin.out_features, self.dtype, self.compiled,
                                  self.prepack and cand.spec is not None) for rows in self.calls[name]]


@dataclass(frozen=True)
class _Times:
    """The speed table's times for those shapes."""

    shapes: _Shapes
    table: speed_table.SpeedTable
    needed: list[tuple[Candidate, speed_table.Entry]]
    seconds: float  # spent loading and filling the table

    def layer_ms(self, name: str, cand: Candidate) -> float:
        return sum(self.table.get(e) for e in self.shapes.entries(name, cand))


@dataclass
class _Solved:
    """The solver's answer over the attention formats, with the frontier it drew."""

    attention: str
    solution: Solution
    solved: dict[str, Solution]
    front: list[tuple[str, Any]]
    seconds: float


def _measure_layers(ctx, plans: list[LayerPlan], target: Target, run_calibration: Callable[[], None]) -> _Layers:
    """Each free layer's options and each rule's layer's format, measured on the calibration inputs (refused before
    that when the target is under the byte floor or a layer has no option)."""
    cfg = ctx.recipe.quantize
    t = cfg.target
    model = ctx.transformer
    names = free_layers(plans)
    candidates = [Candidate(spec_of(c)) for c in t.candidates] + ([Candidate(None)] if t.allow_float else [])
    fixed_specs = {p.name: p.spec for p in plans if p.spec is not None and p.name not in set(names)}  # rules' layers
    _refuse_below_floor(model, names, fixed_specs, candidates, target)
    per_layer = {**{n: candidates for n in names}, **{n: [Candidate(s)] for n, s in fixed_specs.items()}}
    measured = measure_options(model, list(per_layer), per_layer, run_calibration, seed=cfg.calibration_seed)
    options = {n: measured[n] for n in names}
    fixed_options = {n: measured[n][0] for n in fixed_specs if measured[n]}
    for name, opts in options.items():
        if not opts:
            raise RecipeError("quantize.target.candidates", f"no candidate fits layer '{name}' "
                                                            f"{tuple(model.get_submodule(name).weight.shape)} and "
                                                            "allow_float is off")
    return _Layers(names, candidates, fixed_specs, options, fixed_options)


def _layer_times(ctx, example: ExampleForward, layers: _Layers, compiled: bool, timing: TimingSettings) -> _Times:
    """Count the rows each layer sees in one forward, and fill the speed table (cached) for those shapes."""
    cfg = ctx.recipe.quantize
    model = ctx.transformer
    names, fixed_specs = layers.names, layers.fixed_specs
    calls = layer_calls(model, names + list(fixed_specs), example.runner() if not compiled else
                        ExampleForward(model, example.inputs, example.output).runner())
    shapes = _Shapes(model, calls, speed_table.dtype_name(ctx.dtype), compiled, cfg.prepack)
    float_cand = Candidate(None)
    needed = [(o.candidate, e) for n in names for o in layers.options[n] for e in shapes.entries(n, o.candidate)]
    needed += [(float_cand, e) for n in [*names, *fixed_specs] for e in shapes.entries(n, float_cand)]
    needed += [(Candidate(spec), e) for n, spec in fixed_specs.items() for e in shapes.entries(n, Candidate(spec))]
    started = time.perf_counter()
    table = speed_table.load(speed_table.cache_dir(cfg.speed_cache), speed_table.table_key(ctx.device),
                             cfg.speed_refresh)
    table = speed_table.ensure(table, needed, ctx.device, ctx.dtype, compile_backend=ctx.recipe.compile.backend,
                               timing=timing)
    return _Times(shapes, table, needed, time.perf_counter() - started)


def _base_problem(model: nn.Module, layers: _Layers, times: _Times, errors: OutputErrorModel, speed: SpeedModel,
                  float_ms: float) -> tuple[list[LayerCosts], Problem]:
    """The free layers' costs and the problem with the stock attention."""
    names, fixed_specs, options = layers.names, layers.fixed_specs, layers.options
    costs = [LayerCosts(n, tuple(o.candidate.label for o in options[n]),
                        tuple(times.layer_ms(n, o.candidate) * speed.scale(o.candidate.label) for o in options[n]),
                        tuple(o.nbytes for o in options[n]), tuple(errors.share(n, o) ** 2 for o in options[n]))
             for n in names]
    float_bytes = tensor_bytes(model)
    float_cand = Candidate(None)
    # Fixed: all but the free layers, the rules' layers as quantized (their float time and bytes swapped out).
    fixed_ms = float_ms - sum(times.layer_ms(n, float_cand) for n in [*names, *fixed_specs]) + \
        sum(times.layer_ms(n, Candidate(spec)) for n, spec in fixed_specs.items())
    fixed_bytes = float_bytes - sum(tensor_bytes(model.get_submodule(n)) for n in [*names, *fixed_specs]) + \
        sum(quantized_bytes(model.get_submodule(n), spec) for n, spec in fixed_specs.items())
    base = Problem(costs, fixed_ms=fixed_ms, fixed_bytes=fixed_bytes,
                   float_ms=float_ms, float_bytes=float_bytes, error_scale=1.0,  # the shares are output errors
                   fixed_err2=sum(errors.share(n, o) ** 2 for n, o in layers.fixed_options.items()))
    return costs, base


def _solve_all(problems: dict[str, Problem], target: Target, frontier_points: int) -> _Solved:
    """The best plan over the attention formats, and the non-dominated frontier of them all."""
    started = time.perf_counter()
    chosen_attention, solution, solved = solve_per_attention(problems, target)
    fronts = [(fmt, point) for fmt, problem in problems.items() for point in frontier(problem, frontier_points)]
    front = [fronts[i] for i in non_dominated([p.prediction for _, p in fronts])]
    return _Solved(chosen_attention, solution, solved, front, time.perf_counter() - started)


def _select(problem: Problem, solution: Solution, speed: SpeedModel, specs: dict[str, FormatSpec],
            example: ExampleForward, reference: torch.Tensor, target: Target
            ) -> tuple[Solution, dict[str, Any] | None]:
    """The solver's plan weighed against the uniform probes (weigh_uniform), when there are probes and no static
    activations."""
    if not speed.probes:
        return solution, None
    if any(s.activations == "static" for s in specs.values()):  # their input scales are calibrated after planning
        return solution, {"chosen": "solver", "skipped": "the plan has static activations, not calibrated yet: no probe"}
    return weigh_uniform(problem, solution, speed, _probe_error(example, reference, specs), target)


def _apply_choice(plans: list[LayerPlan], chosen: dict[str, LayerOption], times: _Times, target: Target
                  ) -> list[LayerPlan]:
    """The plans with each free layer's chosen option and its reason."""
    new_plans = []
    for p in plans:
        opt = chosen.get(p.name)
        if opt is None:
            new_plans.append(p)
            continue
        ms = times.layer_ms(p.name, opt.candidate)
        reason = f"target {target.kind} ({opt.candidate.label}, rel_error {opt.rel_error:.4f}, {ms:.4g} ms)"
        new_plans.append(replace(p, spec=opt.candidate.spec, reason=reason, unfit=None, unrotated=False))
    return new_plans


def _report(t, target: Target, compiled: bool, layers: _Layers, times: _Times, chosen: dict[str, LayerOption],
            solution: Solution, solved: _Solved, problem: Problem, float_ms: float, errors: OutputErrorModel,
            speed: SpeedModel, selection: dict[str, Any] | None, attention: dict[str, AttentionOption]
            ) -> dict[str, Any]:
    """The target's section of the report."""
    counts: dict[str, int] = {}
    for opt in chosen.values():
        counts[opt.candidate.label] = counts.get(opt.candidate.label, 0) + 1
    table, needed = times.table, times.needed
    return {
        "target": target.as_dict(), "loads_in": t.loads_in, "compiled": compiled, "met": solution.met,
        "predicted": solution.prediction.as_dict(), "layers": dict(sorted(counts.items())),
        "candidates": [c.label for c in layers.candidates], "free_layers": len(layers.names),
        "float_ms": round(float_ms, 6), "fixed_ms": round(problem.fixed_ms, 6), "error_model": errors.as_dict(),
        "speed_model": speed.as_dict(), "selection": selection,
        "frontier": [{**p.as_dict(), "attention": fmt} for fmt, p in solved.front],
        "attention": {"chosen": solved.attention, "options": {
            fmt: {**a.as_dict(),
                  "predicted": solved.solved[fmt].prediction.as_dict() if fmt in solved.solved else None,
                  "met": fmt in solved.solved and solved.solved[fmt].met} for fmt, a in attention.items()}},
        "speed_table": {"path": str(table.path), "device": table.key.device, "entries": len(needed),
                        "measured": table.measured, "reused": len(set(e.key() for _, e in needed)) - table.measured,
                        "seconds": round(times.seconds, 3)},
        "solver_seconds": round(solved.seconds, 4),
        "choice": {n: o.candidate.label for n, o in chosen.items()},  # each free layer's candidate
        "sensitivity": {n: {o.candidate.label: round(o.rel_error, 6) for o in layers.options[n]}
                        for n in layers.names},
    }


def plan_for_target(ctx, plans: list[LayerPlan], target: Target, run_calibration: Callable[[], None],
                    swapper: LayerSwapper, attention: AttentionProbe, timing: TimingSettings | None = None
                    ) -> TargetPlan:
    """`run_calibration`: runs the model on calibration inputs; `swapper`: the layer swapper the plan is applied with
    (the uniform probes swap their layers with it); `attention`: the run's attention swapper (each attention format
    weighed is applied with it for a timed forward)."""
    t = ctx.recipe.quantize.target
    timing = timing or TimingSettings.for_device(ctx.device)
    model = ctx.transformer
    compiled = t.compiled if t.compiled is not None else "compile" in ctx.recipe.pipeline
    example = _example(ctx, compiled)
    layers = _measure_layers(ctx, plans, target, run_calibration)
    options = layers.options
    times = _layer_times(ctx, example, layers, compiled, timing)
    float_ms, reference = time_forward(example, ctx.device, timing)
    errors = measure_output_error(example, reference,
                                  {**options, **{n: [o] for n, o in layers.fixed_options.items()}})
    speed = measure_speed_model(example, reference, options, layers.fixed_specs, times.layer_ms, float_ms, swapper,
                                ctx.device, timing) if t.uniform_probes else SpeedModel({})
    costs, base = _base_problem(model, layers, times, errors, speed, float_ms)
    attention = {fmt: (AttentionOption(fmt, float_ms, 0.0, {}) if fmt == STOCK_ATTENTION else
                       measure_attention(ctx, example, fmt, reference, timing, attention))
                 for fmt in attention_formats(ctx)}
    # Each format moves the fixed part by its forward's difference from the stock one and adds its output error.
    problems = {fmt: replace(base, fixed_ms=base.fixed_ms + a.forward_ms - float_ms, output_err2=a.error ** 2)
                for fmt, a in attention.items()}
    solved = _solve_all(problems, target, t.frontier_points)
    problem = problems[solved.attention]
    specs = {**layers.fixed_specs, **{c.name: options[c.name][j].candidate.spec
                                      for c, j in zip(costs, solved.solution.choice)
                                      if options[c.name][j].candidate.spec is not None}}
    solution, selection = _select(problem, solved.solution, speed, specs, example, reference, target)
    chosen = {c.name: options[c.name][j] for c, j in zip(costs, solution.choice)}
    report = _report(t, target, compiled, layers, times, chosen, solution, solved, problem, float_ms, errors, speed,
                     selection, attention)
    return TargetPlan(_apply_choice(plans, chosen, times, target), report, example, reference, float_ms, solution,
                      solved.attention)


def attention_formats(ctx) -> list[str]:
    """The attention formats the solver weighs: the recipe's attention.format when it sets one (validate refuses
    both), else quantize.target.attention."""
    fixed = ctx.recipe.attention.format
    return [fixed] if fixed != STOCK_ATTENTION else list(dict.fromkeys(ctx.recipe.quantize.target.attention))


def solve_per_attention(problems: dict[str, Problem], target: Target) -> tuple[str, Solution, dict[str, Solution]]:
    """(attention format, its solution, every format's solution) for the best plan over the formats: among those
    that meet the target, the least predicted error (an error target: the least time). When none meets it, the
    RecipeError names what the format that comes closest reaches."""
    solved: dict[str, Solution] = {}
    for fmt, problem in problems.items():
        try:
            solved[fmt] = solve(problem, target)
        except RecipeError:
            continue
    met = {fmt: s for fmt, s in solved.items() if s.met}
    if not met:
        order = {"speedup": lambda p: -p.speedup, "bytes": lambda p: p.nbytes, "ratio": lambda p: p.ratio,
                 "error": lambda p: p.error}[target.kind]
        reaches = {fmt: reach(problem, target) for fmt, problem in problems.items()}
        best = min(reaches, key=lambda fmt: order(reaches[fmt]))
        where = "" if list(problems) == [STOCK_ATTENTION] else \
            f" (attention {best}" + (f", the closest of {list(problems)})" if len(problems) > 1 else ")")
        refuse(target, reaches[best], where)
    rank = (lambda s: (s.prediction.time_ms, s.prediction.error)) if target.kind == "error" else \
        (lambda s: (s.prediction.error, s.prediction.time_ms))
    fmt = min(met, key=lambda f: rank(met[f]))
    return fmt, met[fmt], solved


def weigh_uniform(problem: Problem, solution: Solution, speed: SpeedModel, plan_error: float, target: Target
                  ) -> tuple[Solution, dict[str, Any]]:
    """The solver's plan against each candidate on every layer it fits (float elsewhere), on measured figures:
    the plan's output error from one probe forward (its layers' quantized outputs hooked in), a uniform plan's time
    and error from its speed probe (the time calibrated so, the error measured as the real quantized forward's).
    The error model adds the layers' shares in quadrature, and on the full-size Krea 2 it put an int8 / fp8 / float
    plan at 4.0e-3 that measured 5.5e-3, above all-int8's 5.3e-3 at the same speed: the measured figures decide.
    Both errors take the attention format's error in quadrature (problem.output_err2). Returns the winner (the
    solver's plan unless a met uniform plan beats it: less error, or for an error target less time) and the
    report's `selection`."""
    def with_error(pred: Prediction, error: float) -> Prediction:
        return replace(pred, error=math.sqrt(error ** 2 + problem.output_err2))

    entries: dict[str, tuple[Solution, Prediction]] = {"solver": (solution, with_error(solution.prediction, plan_error))}
    for label, probe in speed.probes.items():
        if probe.error is None:
            continue
        choice = []
        for layer in problem.layers:
            if label in layer.labels:
                choice.append(layer.labels.index(label))
            elif "float" in layer.labels:
                choice.append(layer.labels.index("float"))
            else:
                break
        else:
            pred = with_error(predict(problem, choice), probe.error)
            entries[label] = (Solution(tuple(choice), pred, target, meets(pred, target)), pred)
    met = {k: v for k, v in entries.items() if meets(v[1], target)}
    rank = (lambda p: (p.time_ms, p.error)) if target.kind == "error" else (lambda p: (p.error, p.time_ms))
    pick = min(met, key=lambda k: rank(met[k][1])) if met else "solver"
    report = {"chosen": pick, "plan_probe_error": round(plan_error, 8),
              "plans": {k: {**p.as_dict(), "met": meets(p, target)} for k, (_, p) in entries.items()}}
    return (solution if pick == "solver" else entries[pick][0]), report


def check(tp: TargetPlan, device: torch.device, timing: TimingSettings | None = None) -> ForwardCheck:
    """Time the quantized forward once on the same example and measure its output error against the float's."""
    measured_ms, out = time_forward(tp.example, device, timing or TimingSettings.for_device(device))
    pred = tp.solution.prediction
    return ForwardCheck(tp.float_ms, pred.time_ms, measured_ms, pred.error, rel_error(tp.reference, out))


__all__ = ["OutputErrorModel", "TargetPlan", "check", "measure_output_error", "free_layers", "plan_for_target"]
