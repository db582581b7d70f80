"""quantize.target in the quantize stage: measure, time, solve, and afterwards check against the whole forward.

1. Each free layer's options (candidates that fit it, float) with bytes and error on its calibration inputs
   (lowbit_pipe.error_model). Free: planned to be quantized and not by a recipe rule (a rule's format is
   the recipe's word, a constraint); keep-float layers stay float.
2. The rows each layer sees in one forward of the run's example inputs (evaluate's batch and token counts),
   and the speed table's times for those shapes on this device (measured once, cached).
3. The float forward's time on those inputs: the speedup's baseline; what is not a free layer's time is the
   fixed part of every prediction.
4. The error scale: one forward with every free layer at its least accurate option maps the sum of squared
   layer errors to the model's output error.
5. The solver's plan and the frontier; after quantization, `check` times the forward once more.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe import speed_table
from lowbit_pipe.candidates import Candidate
from lowbit_pipe.error_model import LayerOption, layer_calls, measure_options, quantized_bytes
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.forward_timing import ExampleForward, ForwardCheck, time_forward
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.metrics import rel_error
from lowbit_pipe.policy import LayerPlan, _spec
from lowbit_pipe.solver import LayerCosts, Problem, Solution, frontier, solve
from lowbit_pipe.targets import Target
from lowbit_pipe.timing import TimingSettings


@dataclass
class TargetPlan:
    plans: list[LayerPlan]
    report: dict[str, Any]
    example: ExampleForward
    reference: torch.Tensor  # the float output on the example
    float_ms: float
    solution: Solution


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


def error_scale(example: ExampleForward, reference: torch.Tensor, options: dict[str, list[LayerOption]]) -> dict[str, Any]:
    """Output error over sqrt(sum of squared layer errors), measured with every free layer at its least accurate
    option (dynamic or weight-only activations: a probe has no static scale). 1.0 when nothing has an error."""
    probe = {}
    for name, opts in options.items():
        worst = max((o for o in opts if o.candidate.spec is not None and o.candidate.spec.activations != "static"),
                    key=lambda o: o.rel_error, default=None)
        if worst is not None and worst.rel_error > 0:
            probe[name] = worst
    layer_sum = math.sqrt(sum(o.rel_error ** 2 for o in probe.values()))
    if layer_sum == 0:
        return {"scale": 1.0, "probe_output_error": 0.0, "probe_layer_error": 0.0}
    with _probe(example.module, {n: o.candidate.spec for n, o in probe.items()}), torch.no_grad():
        out = ExampleForward(example.module, example.inputs, example.output).runner()()  # eager: hooks
    measured = rel_error(reference, out)
    return {"scale": measured / layer_sum, "probe_output_error": measured, "probe_layer_error": layer_sum}


def _example(ctx, compiled: bool) -> ExampleForward:  # noqa: ANN001 - Context
    if ctx.arch is None or ctx.native:
        raise RecipeError("quantize.target", "times and measures the forward on a known architecture's example inputs "
                                             "(model.arch, diffusers names); this model has none")
    cfg, ev = ctx.recipe.quantize, ctx.recipe.evaluate
    inputs = ctx.arch.example_inputs(ctx.model_config, batch=ev.batch, image_tokens=ev.image_tokens,
                                     text_tokens=ev.text_tokens, generator=torch.Generator().manual_seed(cfg.calibration_seed),
                                     dtype=ctx.dtype, device=ctx.device)
    return ExampleForward(ctx.transformer, inputs, ctx.arch.output_tensor, compiled, ctx.recipe.compile.backend)


def plan_for_target(ctx, plans: list[LayerPlan], target: Target, run_calibration: Callable[[], None],  # noqa: ANN001
                    timing: TimingSettings | None = None) -> TargetPlan:
    cfg = ctx.recipe.quantize
    timing = timing or TimingSettings.for_device(ctx.device)
    t = cfg.target
    model = ctx.transformer
    device, dtype = ctx.device, ctx.dtype
    compiled = t.compiled if t.compiled is not None else "compile" in ctx.recipe.pipeline
    example = _example(ctx, compiled)
    names = free_layers(plans)
    candidates = [Candidate(_spec(c)) for c in t.candidates] + ([Candidate(None)] if t.allow_float else [])
    fixed_specs = {p.name: p.spec for p in plans if p.spec is not None and p.name not in set(names)}  # rules' layers
    per_layer = {**{n: candidates for n in names}, **{n: [Candidate(s)] for n, s in fixed_specs.items()}}
    measured = measure_options(model, list(per_layer), per_layer, run_calibration, seed=cfg.calibration_seed)
    options = {n: measured[n] for n in names}
    fixed_options = {n: measured[n][0] for n in fixed_specs if measured[n]}
    for name, opts in options.items():
        if not opts:
            raise RecipeError("quantize.target.candidates", f"no candidate fits layer '{name}' "
                                                            f"{tuple(model.get_submodule(name).weight.shape)} and "
                                                            "allow_float is off")
    calls = layer_calls(model, names + list(fixed_specs), example.runner() if not compiled else
                        ExampleForward(model, example.inputs, example.output).runner())
    float_cand = Candidate(None)
    dt = speed_table.dtype_name(dtype)

    def entries(name: str, cand: Candidate) -> list[speed_table.Entry]:
        lin = model.get_submodule(name)
        return [speed_table.Entry(cand.label, rows, lin.in_features, lin.out_features, dt, compiled,
                                  cfg.prepack and cand.spec is not None) for rows in calls[name]]

    needed = [(o.candidate, e) for n in names for o in options[n] for e in entries(n, o.candidate)]
    needed += [(float_cand, e) for n in [*names, *fixed_specs] for e in entries(n, float_cand)]
    needed += [(Candidate(spec), e) for n, spec in fixed_specs.items() for e in entries(n, Candidate(spec))]
    started = time.perf_counter()
    table = speed_table.load(speed_table.cache_dir(cfg.speed_cache), speed_table.table_key(device), cfg.speed_refresh)
    table = speed_table.ensure(table, needed, device, dtype, compile_backend=ctx.recipe.compile.backend, timing=timing)
    table_seconds = time.perf_counter() - started
    float_ms, reference = time_forward(example, device, timing)
    scale = error_scale(example, reference, {**options, **{n: [o] for n, o in fixed_options.items()}})

    def layer_ms(name: str, cand: Candidate) -> float:
        return sum(table.get(e) for e in entries(name, cand))

    layers = [LayerCosts(n, tuple(o.candidate.label for o in options[n]),
                         tuple(layer_ms(n, o.candidate) for o in options[n]),
                         tuple(o.nbytes for o in options[n]), tuple(o.rel_error ** 2 for o in options[n]))
              for n in names]
    float_bytes = tensor_bytes(model)
    # Fixed: all but the free layers, the rules' layers as quantized (their float time and bytes swapped out).
    fixed_ms = float_ms - sum(layer_ms(n, float_cand) for n in [*names, *fixed_specs]) + \
        sum(layer_ms(n, Candidate(spec)) for n, spec in fixed_specs.items())
    fixed_bytes = float_bytes - sum(tensor_bytes(model.get_submodule(n)) for n in [*names, *fixed_specs]) + \
        sum(quantized_bytes(model.get_submodule(n), spec) for n, spec in fixed_specs.items())
    problem = Problem(layers, fixed_ms=fixed_ms, fixed_bytes=fixed_bytes,
                      float_ms=float_ms, float_bytes=float_bytes, error_scale=scale["scale"],
                      fixed_err2=sum(o.rel_error ** 2 for o in fixed_options.values()))
    started = time.perf_counter()
    solution = solve(problem, target)
    front = frontier(problem, t.frontier_points)
    solver_seconds = time.perf_counter() - started
    chosen = {layer.name: options[layer.name][j] for layer, j in zip(layers, solution.choice)}
    new_plans = []
    for p in plans:
        opt = chosen.get(p.name)
        if opt is None:
            new_plans.append(p)
            continue
        ms = layer_ms(p.name, opt.candidate)
        reason = f"target {target.kind} ({opt.candidate.label}, rel_error {opt.rel_error:.4f}, {ms:.4g} ms)"
        new_plans.append(replace(p, spec=opt.candidate.spec, reason=reason, unfit=None, unrotated=False))
    counts: dict[str, int] = {}
    for opt in chosen.values():
        counts[opt.candidate.label] = counts.get(opt.candidate.label, 0) + 1
    report = {
        "target": target.as_dict(), "loads_in": t.loads_in, "compiled": compiled, "met": solution.met,
        "predicted": solution.prediction.as_dict(), "layers": dict(sorted(counts.items())),
        "candidates": [c.label for c in candidates], "free_layers": len(names),
        "float_ms": round(float_ms, 6), "fixed_ms": round(problem.fixed_ms, 6), "error_scale": scale,
        "frontier": [p.as_dict() for p in front],
        "speed_table": {"path": str(table.path), "device": table.key.device, "entries": len(needed),
                        "measured": table.measured, "reused": len(set(e.key() for _, e in needed)) - table.measured,
                        "seconds": round(table_seconds, 3)},
        "solver_seconds": round(solver_seconds, 4),
        "sensitivity": {n: {o.candidate.label: round(o.rel_error, 6) for o in options[n]} for n in names},
    }
    return TargetPlan(new_plans, report, example, reference, float_ms, solution)


def check(tp: TargetPlan, device: torch.device, timing: TimingSettings | None = None) -> ForwardCheck:
    """Time the quantized forward once on the same example and measure its output error against the float's."""
    measured_ms, out = time_forward(tp.example, device, timing or TimingSettings.for_device(device))
    pred = tp.solution.prediction
    return ForwardCheck(tp.float_ms, pred.time_ms, measured_ms, pred.error, rel_error(tp.reference, out))


__all__ = ["TargetPlan", "check", "error_scale", "free_layers", "plan_for_target"]
