"""Mixed precision by budget: per-layer formats so the transformer fits a byte budget.

Each quantizable layer gets a candidate list (cheapest first, float last). We
measure every candidate's output error on the layer's own calibration inputs
(captured from the float model on seeded example inputs), start every layer at
its cheapest candidate and then buy precision greedily where it removes the
most error per extra byte, as long as the total stays under the budget.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe.formats import FormatSpec, encode_record, get_format
from lowbit_pipe.kernels import rotation
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.measure.metrics import rel_error
from lowbit_pipe.plan.policy import LayerPlan


@dataclass(frozen=True)
class Candidate:
    spec: FormatSpec | None  # None: float
    nbytes: int
    rel_error: float


@dataclass(frozen=True)
class BudgetResult:
    plans: list[LayerPlan]
    total_bytes: int
    budget_bytes: int
    float_bytes: int
    sensitivity: dict[str, dict[str, float]]  # layer -> {format: rel_error}

    def as_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "total_bytes": self.total_bytes, "float_bytes": self.float_bytes,
                "fill": self.total_bytes / self.budget_bytes, "sensitivity": self.sensitivity}


@contextlib.contextmanager
def capture_inputs(model: nn.Module, names: list[str], rows: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Forward hooks (removed on exit) that keep up to `rows` input rows of each named Linear."""
    captured: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)

    def hook_for(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple, _out: Any) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu()
            if x.shape[0] > rows:
                x = x[torch.randperm(x.shape[0], generator=gen)[:rows]]
            captured[name] = torch.cat([captured[name], x])[-rows:] if name in captured else x
        return hook

    handles = [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in names]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def _layer_error(linear: nn.Linear, spec: FormatSpec, x: torch.Tensor) -> tuple[float, int]:
    fmt = get_format(spec.format)
    w = linear.weight.detach()
    x = x.to(w.device, torch.float32)
    amax = None
    if spec.activations == "static":  # the scale a static layer would get from these calibration rows
        kind, group = fmt.input_rotation(spec, x.shape[-1])
        amax = float(rotation.rotate_activation(x, kind, group or None)[0].abs().amax())
    q = fmt.with_activations(fmt.quantize(w, spec), spec.activations, amax)
    ref = x @ w.float().t()
    out = fmt.linear(x, q, None).float()
    record_bytes = encode_record(q.record).numel()  # the `.comfy_quant` buffer is stored too
    derived = sum(t.numel() * t.element_size() for t in fmt.derived_tensors(q).values())  # held in memory too
    return rel_error(ref, out), q.nbytes + record_bytes + derived


def plan_budget(model: nn.Module, plans: list[LayerPlan], candidates: list[FormatSpec], budget_bytes: int,
                run_calibration: Callable[[], None], *, rows: int = 256, seed: int = 0, allow_float: bool = True) -> BudgetResult:
    """Re-plan the quantizable layers of `plans` to fit `budget_bytes` (whole transformer, all tensors)."""
    names = [p.name for p in plans if p.spec is not None]
    with capture_inputs(model, names, rows, seed) as captured, torch.no_grad():
        run_calibration()
    float_total = tensor_bytes(model)
    layer_float = {n: tensor_bytes(model.get_submodule(n)) for n in names}
    fixed = float_total - sum(layer_float.values())
    options: dict[str, list[Candidate]] = {}
    sensitivity: dict[str, dict[str, float]] = {}
    for name in names:
        linear = model.get_submodule(name)
        if name not in captured:
            raise RuntimeError(f"calibration never ran layer '{name}': cannot measure its sensitivity")
        bias = tensor_bytes(linear.bias) if linear.bias is not None else 0
        opts = []
        for spec in candidates:
            if not get_format(spec.format).supports_shape(linear.out_features, linear.in_features):
                continue
            err, nbytes = _layer_error(linear, spec, captured[name])
            opts.append(Candidate(spec, nbytes + bias, err))
        if allow_float or not opts:
            opts.append(Candidate(None, layer_float[name], 0.0))
        opts.sort(key=lambda c: c.nbytes)
        options[name] = opts
        sensitivity[name] = {(c.spec.format if c.spec else "float"): round(c.rel_error, 6) for c in opts}
    choice = {n: 0 for n in names}
    total = fixed + sum(options[n][0].nbytes for n in names)
    if total > budget_bytes:
        raise ValueError(f"budget {budget_bytes} bytes is below the smallest possible size {total} bytes "
                         f"(every layer at its cheapest format, the rest float)")
    # Greedy: best error reduction per extra byte that still fits; squared errors add up like output noise power.
    while True:
        best, best_gain = None, 0.0
        for n in names:
            cur = options[n][choice[n]]
            for j in range(choice[n] + 1, len(options[n])):
                up = options[n][j]
                extra = up.nbytes - cur.nbytes
                if total + extra > budget_bytes:
                    continue
                gain = (cur.rel_error**2 - up.rel_error**2) / max(extra, 1)
                if gain > best_gain:
                    best, best_gain = (n, j), gain
        if best is None:
            break
        n, j = best
        total += options[n][j].nbytes - options[n][choice[n]].nbytes
        choice[n] = j
    by_name = {n: options[n][choice[n]] for n in names}
    new_plans = []
    for p in plans:
        if p.name in by_name:
            c = by_name[p.name]
            reason = f"budget ({'float' if c.spec is None else c.spec.format}, rel_error {c.rel_error:.4f})"
            new_plans.append(replace(p, spec=c.spec, reason=reason))
        else:
            new_plans.append(p)
    return BudgetResult(new_plans, total, budget_bytes, float_total, sensitivity)
