"""The per-layer choice for a target: a multiple-choice knapsack solved by Lagrangian relaxation plus a greedy fill.

Each free layer picks one of its options (candidate formats that fit it, and float); every option has a
predicted time (the speed table), bytes and squared relative error (the error model). Predictions add up:
forward time = fixed_ms (all that is not a free layer: attention, norms, kept-float layers, measured as the
float forward minus the free layers' float times) + the chosen options' times; bytes likewise; output error =
error_scale * sqrt(sum of squared layer errors) (the scale measured on the model: lowbit_pipe.plan.target_plan).

A target is one constraint and one objective: speedup / bytes / ratio bound time or bytes and minimise error;
error bounds the error and minimises time. For a multiplier lam each layer independently takes
argmin(objective + lam * constraint); bisecting lam gives the cheapest plan on the lower convex hull that
meets the bound, and a greedy pass then spends what slack is left on the moves that gain most per unit of
it. Pure numpy: 300 layers x 10 candidates solve in well under a second (bench/solver_speed.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.plan.targets import Target

_TIE = 1e-9  # weight of the secondary figure (time for error objectives, error for time): breaks exact ties only


@dataclass(frozen=True)
class LayerCosts:
    name: str
    labels: tuple[str, ...]
    time_ms: tuple[float, ...]
    nbytes: tuple[int, ...]
    err2: tuple[float, ...]  # squared relative error of the layer's output


@dataclass(frozen=True)
class Problem:
    layers: list[LayerCosts]
    fixed_ms: float  # forward time outside the free layers
    fixed_bytes: int  # bytes outside the free layers
    float_ms: float  # the float model's forward time (speedup = float_ms / predicted time)
    float_bytes: int  # the float transformer's bytes (ratio = bytes / float_bytes)
    error_scale: float  # predicted output error = sqrt(error_scale^2 * (fixed_err2 + sum err2) + output_err2)
    fixed_err2: float = 0.0  # squared errors of the layers the recipe fixes (a rule's format)
    output_err2: float = 0.0  # squared output error measured as such, not per layer (the attention format's)

    def error(self, layer_err2: float) -> float:
        """Predicted relative output error for a plan whose free layers' squared errors sum to `layer_err2`."""
        return float(np.sqrt(self.error_scale ** 2 * (self.fixed_err2 + layer_err2) + self.output_err2))


@dataclass(frozen=True)
class Prediction:
    time_ms: float
    nbytes: int
    error: float
    speedup: float
    ratio: float

    def as_dict(self) -> dict:
        return {"time_ms": round(self.time_ms, 6), "bytes": int(self.nbytes), "error": round(self.error, 8),
                "speedup": round(self.speedup, 6), "ratio": round(self.ratio, 6)}


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]  # per layer, the index of its option
    prediction: Prediction
    target: Target
    met: bool

    def labels(self, problem: Problem) -> dict[str, str]:
        return {layer.name: layer.labels[j] for layer, j in zip(problem.layers, self.choice)}


@dataclass(frozen=True)
class Matrices:
    time: np.ndarray  # [layers, options], inf where a layer has fewer options
    nbytes: np.ndarray
    err2: np.ndarray
    valid: np.ndarray


def matrices(problem: Problem) -> Matrices:
    width = max((len(layer.labels) for layer in problem.layers), default=1)
    shape = (len(problem.layers), width)
    time, nbytes, err2 = np.full(shape, np.inf), np.full(shape, np.inf), np.full(shape, np.inf)
    for i, layer in enumerate(problem.layers):
        n = len(layer.labels)
        time[i, :n], nbytes[i, :n], err2[i, :n] = layer.time_ms, layer.nbytes, layer.err2
    return Matrices(time, nbytes, err2, np.isfinite(time) & np.isfinite(nbytes) & np.isfinite(err2))


def predict(problem: Problem, choice: np.ndarray | tuple[int, ...], m: Matrices | None = None) -> Prediction:
    m = m or matrices(problem)
    rows = np.arange(len(problem.layers))
    idx = np.asarray(choice, dtype=int)
    time = problem.fixed_ms + float(m.time[rows, idx].sum())
    nbytes = problem.fixed_bytes + int(m.nbytes[rows, idx].sum())
    error = problem.error(float(m.err2[rows, idx].sum()))
    return Prediction(time, nbytes, error, problem.float_ms / time if time > 0 else float("inf"),
                      nbytes / problem.float_bytes)


def _normalised(a: np.ndarray, valid: np.ndarray) -> np.ndarray:
    top = float(np.abs(a[valid]).max()) if valid.any() else 1.0
    return np.where(valid, a / (top or 1.0), np.inf)


def _pick(f: np.ndarray, g: np.ndarray, lam: float, valid: np.ndarray) -> np.ndarray:
    return np.argmin(np.where(valid, f + lam * g, np.inf), axis=1)


def mckp(f: np.ndarray, g: np.ndarray, cap: float, valid: np.ndarray) -> np.ndarray | None:
    """argmin sum f[i, c_i] subject to sum g[i, c_i] <= cap (one option per row); None when even the smallest
    g exceeds cap. f, g: normalised, inf outside `valid`."""
    rows = np.arange(f.shape[0])
    if float(np.where(valid, g, np.inf).min(axis=1).sum()) > cap:
        return None
    choice = _pick(f, g, 0.0, valid)
    if g[rows, choice].sum() > cap:
        lo, hi = 0.0, 1.0
        while g[rows, _pick(f, g, hi, valid)].sum() > cap:
            lo, hi = hi, hi * 8.0
            if hi > 1e30:
                break
        for _ in range(60):
            mid = (lo + hi) / 2
            if g[rows, _pick(f, g, mid, valid)].sum() > cap:
                lo = mid
            else:
                hi = mid
        choice = _pick(f, g, hi, valid)
        if g[rows, choice].sum() > cap:  # ties at the bound: fall back to the smallest g per row
            choice = np.argmin(np.where(valid, g + _TIE * f, np.inf), axis=1)
    # Greedy fill: the move with the most f gained per unit of g spent that still fits, until none is left.
    for _ in range(f.size):
        cur_f, cur_g = f[rows, choice], g[rows, choice]
        slack = cap - cur_g.sum()
        df = f - cur_f[:, None]
        dg = g - cur_g[:, None]
        ok = valid & (df < 0) & (dg <= slack)
        if not ok.any():
            break
        with np.errstate(invalid="ignore", divide="ignore"):  # inf - inf outside `valid`, masked by `ok`
            score = np.where(ok, -df / np.maximum(dg, 1e-15), -np.inf)
        i, j = np.unravel_index(int(np.argmax(score)), score.shape)
        choice[i] = j
    return choice


def solve(problem: Problem, target: Target) -> Solution:
    """The plan that meets `target` with the least predicted error (an error target: the least time). Raises a
    RecipeError naming the target's key, with the best reachable value, when no plan meets it."""
    m = matrices(problem)
    if not problem.layers:
        choice = np.zeros(0, dtype=int)
        pred = predict(problem, choice, m)
        return Solution((), pred, target, meets(pred, target))
    t, b, e = (_normalised(a, m.valid) for a in (m.time, m.nbytes, m.err2))
    if target.kind == "error":
        if problem.error_scale <= 0:
            cap_raw = np.inf if target.value ** 2 >= problem.output_err2 else -1.0
        else:
            cap_raw = (target.value ** 2 - problem.output_err2) / problem.error_scale ** 2 - problem.fixed_err2
        top = float(m.err2[m.valid].max()) or 1.0
        f, g, cap = t + _TIE * e, e, cap_raw / top
    elif target.kind == "speedup":
        top = float(m.time[m.valid].max()) or 1.0
        f, g, cap = e + _TIE * t, t, (problem.float_ms / target.value - problem.fixed_ms) / top
    else:
        budget = target.value if target.kind == "bytes" else target.value * problem.float_bytes
        top = float(m.nbytes[m.valid].max()) or 1.0
        f, g, cap = e + _TIE * t, b, (budget - problem.fixed_bytes) / top
    f, g = np.where(m.valid, f, 0.0), np.where(m.valid, g, 0.0)  # finite (0 * inf is nan); `valid` masks them
    choice = mckp(f, g, cap * (1 + 1e-12), m.valid)
    if choice is None:
        refuse(target, reach(problem, target, m))
    pred = predict(problem, choice, m)
    return Solution(tuple(int(c) for c in choice), pred, target, meets(pred, target))


def reach(problem: Problem, target: Target, m: Matrices | None = None) -> Prediction:
    """The plan that goes furthest toward the target's bound: each layer's fastest option (speedup), smallest
    (bytes, ratio) or most accurate (error)."""
    m = m or matrices(problem)
    g = {"speedup": m.time, "bytes": m.nbytes, "ratio": m.nbytes, "error": m.err2}[target.kind]
    return predict(problem, np.argmin(np.where(m.valid, g, np.inf), axis=1), m)


def refuse(target: Target, best: Prediction, where: str = "") -> None:
    """Raise the RecipeError of an unmet target, naming its key and `best` (what `reach` gives) as reachable."""
    value = {"speedup": f"{best.speedup:.3f}x", "bytes": f"{best.nbytes} bytes", "ratio": f"{best.ratio:.4f}",
             "error": f"{best.error:.5f}"}[target.kind]
    raise RecipeError(target.key, f"{target.value:g} cannot be met with these candidates: the best plan they allow "
                                  f"is predicted at {value}{where} (add faster / smaller / more accurate candidates "
                                  "under quantize.target.candidates, or relax the target)")


def meets(pred: Prediction, target: Target) -> bool:
    tol = 1e-9
    return {"speedup": pred.speedup >= target.value * (1 - tol), "bytes": pred.nbytes <= target.value,
            "ratio": pred.ratio <= target.value * (1 + tol), "error": pred.error <= target.value * (1 + tol)}[target.kind]


@dataclass(frozen=True)
class FrontierPoint:
    prediction: Prediction
    choice: tuple[int, ...]
    counts: dict[str, int]  # layers per candidate label

    def as_dict(self) -> dict:
        return {**self.prediction.as_dict(), "layers": self.counts}


def frontier(problem: Problem, points: int = 16) -> list[FrontierPoint]:
    """The Pareto frontier of (predicted time, bytes, error) over the plans the Lagrangian reaches: each layer's
    argmin of error + a * time + b * bytes for a grid of (a, b), plus the all-fastest / smallest / most accurate
    plans; the ones no other plan beats on all three, by time."""
    m = matrices(problem)
    if not problem.layers:
        return []
    t, b, e = (_normalised(a, m.valid) for a in (m.time, m.nbytes, m.err2))
    lams = np.concatenate([[0.0], np.logspace(-6, 3, points - 1)])
    seen: dict[tuple[int, ...], Prediction] = {}
    t, b, e = (np.where(m.valid, a, 0.0) for a in (t, b, e))  # finite everywhere: 0 * inf is nan; masked below
    extremes = [t + _TIE * e, b + _TIE * e, e + _TIE * t]
    for score in extremes + [e + a * t + c * b for a in lams for c in lams]:
        choice = tuple(int(x) for x in np.argmin(np.where(m.valid, score, np.inf), axis=1))
        if choice not in seen:
            seen[choice] = predict(problem, choice, m)
    items = list(seen.items())
    out = []
    for i in non_dominated([p for _, p in items]):
        choice, pred = items[i]
        counts: dict[str, int] = {}
        for layer, j in zip(problem.layers, choice):
            counts[layer.labels[j]] = counts.get(layer.labels[j], 0) + 1
        out.append(FrontierPoint(pred, choice, dict(sorted(counts.items()))))
    return out


def non_dominated(predictions: list[Prediction]) -> list[int]:
    """Indices of the predictions no other beats on all of (time, bytes, error), by time."""
    figures = np.array([[p.time_ms, p.nbytes, p.error] for p in predictions]).reshape(-1, 3)
    keep = [i for i in range(len(figures))
            if not (np.all(figures <= figures[i], axis=1) & np.any(figures < figures[i], axis=1)).any()]
    return sorted(keep, key=lambda k: figures[k][0])
