"""The calibration's own check (issue 44): part of the calibration's input sets is held out, and every calibrated
layer (GPTQ's codes, AWQ's clipping, SVDQuant's smoothing, which all come through GPTQ; static input scales) is
compared, on the inputs it was not calibrated on, with what plain rounding gives.

A calibration set is a list of input sets (`CalibrationUnits`: a seeded sample with its Euler steps, or one prompt's
generation), so a share of them can be kept aside (`split_units`, seeded) or a held-out set of its own named. Forward
hooks on the float layers run each candidate form of the layer (`measure`) on the layer's real input and sum its
squared output error against the float layer's on the calibration inputs and on the held-out ones; `judge` compares
them. The metric is the layer's whole output error, activations' quantization included, which is what a user sees.

Nothing here is kept after the call: hooks and temporary module swaps are undone in `finally` (the ledger records
only the swaps the quantize stage keeps).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class CalibrationUnits:
    """A calibration set as separate input sets, each a function that runs the model on it."""

    runs: tuple[Callable[[], None], ...] = ()
    labels: tuple[str, ...] = ()
    description: str = ""  # what the sets are, for the report's calibration source ("" : the caller's functions)

    def __len__(self) -> int:
        return len(self.runs)

    def run(self) -> None:
        for r in self.runs:
            r()


def as_units(run_examples: Callable[[], None] | Sequence[Callable[[], None]] | CalibrationUnits) -> CalibrationUnits:
    """A caller's calibration: one function (one input set: nothing can be held out of it) or a list of functions
    (one per input set)."""
    if isinstance(run_examples, CalibrationUnits):
        return run_examples
    if callable(run_examples):
        return CalibrationUnits((run_examples,), (getattr(run_examples, "description", "the calibrate function"),))
    runs = tuple(run_examples)
    bad = [i for i, r in enumerate(runs) if not callable(r)]
    if bad:
        raise TypeError(f"calibrate[{bad[0]}] is a {type(runs[bad[0]]).__name__}, not a function that runs the model")
    return CalibrationUnits(runs, tuple(f"calibrate[{i}]" for i in range(len(runs))))


@dataclass(frozen=True)
class Split:
    """The input sets calibrated on (`fit`) and those kept aside to check the calibration (`held`)."""

    fit: CalibrationUnits
    held: CalibrationUnits
    how: str  # how the held-out part was chosen, or why there is none

    def as_dict(self) -> dict[str, Any]:
        return {"how": self.how, "calibration": list(self.fit.labels), "held_out": list(self.held.labels)}


def split_units(units: CalibrationUnits, fraction: float, seed: int, held: CalibrationUnits | None = None) -> Split:
    """`held` when given (a held-out set of its own); else round(len * fraction) of the input sets, drawn with
    `seed`, at least one left to calibrate on. Too few sets to keep one aside: nothing held out, said in `how`."""
    if held is not None and len(held):
        return Split(units, held, f"a held-out set of its own ({len(held)} input sets)")
    n = len(units)
    k = min(n - 1, round(n * fraction))
    if k <= 0:
        why = "held_out_fraction is 0" if fraction == 0 else \
            f"{n} input set{'s' if n != 1 else ''} cannot spare {fraction:g} of them"
        return Split(units, CalibrationUnits(), f"none: {why}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    out = set(order[:k])
    pick = [(r, lab) for i, (r, lab) in enumerate(zip(units.runs, units.labels)) if i in out]
    keep = [(r, lab) for i, (r, lab) in enumerate(zip(units.runs, units.labels)) if i not in out]
    return Split(CalibrationUnits(*map(tuple, zip(*keep))), CalibrationUnits(*map(tuple, zip(*pick))),
                 f"{k} of {n} input sets (held_out_fraction {fraction:g}, drawn with seed {seed})")


@dataclass
class LayerErrors:
    """One layer's squared output error summed per form ("variant") and per part of the data ("fit", "held"),
    with the float output's energy and the rows seen."""

    err: dict[str, dict[str, float]]
    energy: dict[str, float] = field(default_factory=lambda: {"fit": 0.0, "held": 0.0})
    rows: dict[str, int] = field(default_factory=lambda: {"fit": 0, "held": 0})

    def add(self, other: LayerErrors) -> LayerErrors:
        """The sum of two parts' errors (a fused group judged as one)."""
        return LayerErrors({v: {b: e + other.err[v][b] for b, e in by.items()} for v, by in self.err.items()},
                           {b: e + other.energy[b] for b, e in self.energy.items()},
                           {b: max(r, other.rows[b]) for b, r in self.rows.items()})

    def rel(self, variant: str, bucket: str) -> float | None:
        """Relative output error of `variant` on `bucket`'s inputs (None: no data)."""
        return self.err[variant][bucket] / self.energy[bucket] if self.energy[bucket] > 0 else None


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first_tensor(out[0])
    return out.sample


def measure(root: nn.Module, variants: dict[str, dict[str, nn.Module]], split: Split) -> dict[str, LayerErrors]:
    """Run `split`'s input sets (calibration, then held out) with hooks on the float layers named in `variants`:
    each of a layer's forms runs on the layer's real input and its output error against the float output is
    summed. The model itself computes as before."""
    errors = {name: LayerErrors({v: {"fit": 0.0, "held": 0.0} for v in forms}) for name, forms in variants.items()}
    bucket = ["fit"]

    def hook_for(name: str) -> Callable:
        forms, acc = variants[name], errors[name]

        def hook(_module: nn.Module, args: tuple, out: Any) -> None:
            x, y = args[0], out.float()
            b = bucket[0]
            acc.energy[b] += float(y.double().pow(2).sum())
            acc.rows[b] += y.numel() // y.shape[-1]
            for v, module in forms.items():
                acc.err[v][b] += float((module(x).float() - y).double().pow(2).sum())
        return hook

    handles = [root.get_submodule(n).register_forward_hook(hook_for(n)) for n in variants]
    try:
        with torch.no_grad():
            for b, units in (("fit", split.fit), ("held", split.held)):
                bucket[0] = b
                units.run()
    finally:
        for h in handles:
            h.remove()
    return errors


@dataclass(frozen=True)
class Verdict:
    """What the held-out check found for one layer (or fused group) and what it kept."""

    check: str  # "calibration" (GPTQ / clipping / smoothing) or "static scales"
    fit_gain: float | None  # calibrated form's error over the rounded form's, on the calibration inputs
    held_gain: float | None  # the same on the held-out inputs
    held_tokens: int
    judged: bool
    harmed: bool
    result: str  # "calibrated", "rounded" (fallback), "kept" (harmed, on_harm: keep), "dynamic" (static's fallback)
    rel: dict[str, dict[str, float | None]]  # relative errors, form -> part of the data

    def as_dict(self) -> dict[str, Any]:
        r = {k: None if v is None else round(v, 4) for k, v in (("fit_gain", self.fit_gain),
                                                                 ("held_out_gain", self.held_gain))}
        return {"check": self.check, **r, "held_out_tokens": self.held_tokens, "judged": self.judged,
                "harmed": self.harmed, "result": self.result}


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def judge(errors: LayerErrors, calibrated: str, rounded: str, *, static: bool, tolerance: float,
          min_tokens: int, on_harm: str) -> Verdict:
    """Calibration (`static` False): harmed when the calibrated form's held-out error exceeds the rounded form's by
    more than `tolerance`. Static scales, which cost some error against per-token ones by design: harmed when that
    cost on the held-out inputs exceeds their cost on the calibration inputs by more than `tolerance` (the scales
    clip inputs they did not see). Fewer than `min_tokens` held-out rows: not judged, the calibrated form kept."""
    rel = {v: {b: errors.rel(v, b) for b in ("fit", "held")} for v in (calibrated, rounded)}
    fit_gain = _ratio(rel[calibrated]["fit"], rel[rounded]["fit"])
    held_gain = _ratio(rel[calibrated]["held"], rel[rounded]["held"])
    tokens = errors.rows["held"]
    judged = held_gain is not None and tokens >= max(1, min_tokens)
    bar = (fit_gain if fit_gain is not None else 1.0) if static else 1.0
    harmed = judged and held_gain > bar * (1.0 + tolerance)
    result = "calibrated"
    if harmed:
        result = "kept" if on_harm == "keep" else ("dynamic" if static else "rounded")
    return Verdict("static scales" if static else "calibration", fit_gain, held_gain, tokens, judged, harmed, result,
                   rel)


def capture_outputs(root: nn.Module, units: CalibrationUnits) -> list[torch.Tensor]:
    """`root`'s output tensor of every forward while `units` run (float32, on its device)."""
    outs: list[torch.Tensor] = []
    handle = root.register_forward_hook(lambda _m, _a, out: outs.append(_first_tensor(out).detach().float()))
    try:
        with torch.no_grad():
            units.run()
    finally:
        handle.remove()
    return outs


def output_error(reference: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    """sum ||got - reference||^2 / sum ||reference||^2 over matching forwards."""
    if len(reference) != len(got):
        raise RuntimeError(f"the held-out check ran {len(got)} forwards against {len(reference)} for the float "
                           "model: the calibration inputs are not deterministic")
    num = sum(float((g - r).double().pow(2).sum()) for r, g in zip(reference, got))
    den = sum(float(r.double().pow(2).sum()) for r in reference)
    return num / den if den > 0 else 0.0


@contextlib.contextmanager
def swapped(root: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """`root`'s submodules named in `modules` replaced inside the `with`, the originals back after (even on error):
    nothing outlives the call, so the ledger has nothing to record."""
    before: dict[str, nn.Module] = {}
    try:
        for name, module in modules.items():
            parent, _, leaf = name.rpartition(".")
            owner = root.get_submodule(parent) if parent else root
            before[name] = getattr(owner, leaf)
            setattr(owner, leaf, module)
        yield
    finally:
        for name, module in before.items():
            parent, _, leaf = name.rpartition(".")
            setattr(root.get_submodule(parent) if parent else root, leaf, module)


def dynamic_form(q: nn.Module) -> nn.Module:
    """A QuantLinear's same weight with per-token (dynamic) activations: a static layer's form without calibration."""
    from lowbit_pipe.formats import QuantizedWeight
    from lowbit_pipe.quant.nn import QuantLinear

    stored = q.qweight
    plain = QuantizedWeight(stored.format, stored.shape, stored.tensors, stored.record)
    return QuantLinear(q.format.with_activations(plain, "dynamic"), q.bias, q.format)


@dataclass
class CalibrationCheck:
    """The held-out check of one quantize call: which forms of each calibrated layer it kept and why, and the
    whole model's held-out error against the rounded model's. `formats`: each checked layer's format name."""

    root: nn.Module
    split: Split
    cfg: Any  # recipe.CalibrationConfig
    formats: dict[str, str]
    verdicts: dict[str, dict[str, Verdict]] = field(default_factory=dict)
    baseline: dict[str, nn.Module] = field(default_factory=dict)  # each layer's uncalibrated form: the model check's
    reference: list[torch.Tensor] | None = None
    model: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        """The float model's held-out outputs, before any layer is swapped (for the model check)."""
        if len(self.split.held) and self.cfg.model_check:
            self.reference = capture_outputs(self.root, self.split.held)

    def choose(self, calibrated: dict[str, nn.Module], rounded: dict[str, nn.Module] | None,
               groups: list[list[str]], static: set[str]) -> dict[str, nn.Module]:
        """The form each layer keeps: `calibrated` (GPTQ) against `rounded` (None: nothing but static scales were
        calibrated), and static layers' scales against dynamic activations; `groups`: layers judged as one."""
        variants: dict[str, dict[str, nn.Module]] = {}
        for name, q in calibrated.items():
            forms = {"calibrated": q, "rounded": rounded[name]} if rounded is not None else {}
            if name in static:
                forms.update(static=q, dynamic=dynamic_form(q))
            if forms:
                variants[name] = forms
        errors = measure(self.root, variants, self.split)
        chosen = dict(calibrated)
        for group in groups:
            names = [n for n in group if n in variants]
            if names:
                self._judge_group(names, errors, rounded, static, chosen)
        return chosen

    def _judge_group(self, names: list[str], errors: dict[str, LayerErrors], rounded: dict[str, nn.Module] | None,
                     static: set[str], chosen: dict[str, nn.Module]) -> None:
        err = errors[names[0]]
        for n in names[1:]:
            err = err.add(errors[n])
        common = {"min_tokens": self.cfg.min_held_out_tokens, "on_harm": self.cfg.on_harm}
        for n in names:
            self.verdicts.setdefault(n, {})
        if rounded is not None:
            v = judge(err, "calibrated", "rounded", static=False, tolerance=0.0, **common)
            for n in names:
                self.verdicts[n]["calibration"] = v
                self.baseline[n] = rounded[n]
                if v.result == "rounded":
                    chosen[n] = rounded[n]
        if names[0] in static:
            v = judge(err, "static", "dynamic", static=True, tolerance=self.cfg.static_tolerance, **common)
            for n in names:
                self.verdicts[n]["static scales"] = v
                self.baseline.setdefault(n, dynamic_form(chosen[n]))
                if v.result == "dynamic":
                    chosen[n] = dynamic_form(chosen[n])

    def check_model(self) -> dict[str, nn.Module]:
        """The calibrated model's held-out output error against the uncalibrated one's (`baseline` swapped in for
        the call); returns the layers to round when it is worse by more than model_tolerance (GPTQ's calibration
        only: static scales' cost against dynamic activations is by design) and on_harm is fallback."""
        if self.reference is None:
            self.model = {"checked": False, "why": "no held-out inputs" if not len(self.split.held) else
                          "quantize.calibration.model_check is false"}
            return {}
        final = output_error(self.reference, capture_outputs(self.root, self.split.held))
        with swapped(self.root, self.baseline):
            base = output_error(self.reference, capture_outputs(self.root, self.split.held))
        weights = any("calibration" in v for v in self.verdicts.values())
        harmed = weights and final > base * (1.0 + self.cfg.model_tolerance)
        self.model = {"checked": True, "baseline": "rounded" if weights else "dynamic activations",
                      "held_out_error": final, "baseline_error": base, "held_out_gain": _ratio(final, base),
                      "harmed": harmed}
        if not harmed or self.cfg.on_harm == "keep":
            self.model["result"] = "calibrated"
            return {}
        self.model["result"] = "rounded"
        return {n: self.baseline[n] for n, v in self.verdicts.items() if "calibration" in v}

    def by_format(self) -> dict[str, dict[str, Any]]:
        """Per format and check: layers, the gain on the calibration inputs and on the held-out ones (sums of the
        layers' relative errors, calibrated over rounded), the held-out gain of the forms kept, and the counts."""
        out: dict[str, dict[str, Any]] = {}
        for name, checks in self.verdicts.items():
            for check, v in checks.items():
                row = out.setdefault(f"{self.formats[name]}" + (" static scales" if check != "calibration" else ""),
                                     {"layers": 0, "judged": 0, "harmed": 0, "result": {}, "_sums": [0.0] * 5})
                row["layers"] += 1
                row["judged"] += v.judged
                row["harmed"] += v.harmed
                row["result"][v.result] = row["result"].get(v.result, 0) + 1
                forms = list(v.rel)
                cal, rnd = v.rel[forms[0]], v.rel[forms[1]]
                kept = rnd if v.result in ("rounded", "dynamic") else cal
                for i, x in enumerate((cal["fit"], rnd["fit"], cal["held"], rnd["held"], kept["held"])):
                    row["_sums"][i] += x or 0.0
        for row in out.values():
            s = row.pop("_sums")
            row["fit_gain"], row["held_out_gain"], row["held_out_gain_kept"] = (
                None if b == 0 else round(a / b, 4) for a, b in ((s[0], s[1]), (s[2], s[3]), (s[4], s[3])))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"split": self.split.as_dict(), "on_harm": self.cfg.on_harm,
                "by_format": self.by_format(), "model": self.model,
                "layers": {n: {c: v.as_dict() for c, v in checks.items()} for n, checks in self.verdicts.items()}}


def _worst(names: list[str], check: CalibrationCheck, kind: str) -> str:
    """'e.g. NAME: ...' for the layer whose held-out gain is the worst, and up to two more names."""
    ranked = sorted(names, key=lambda n: -(check.verdicts[n][kind].held_gain or 0.0))
    v = check.verdicts[ranked[0]][kind]
    base = "rounding's" if kind == "calibration" else "dynamic activations'"
    fit = f", {v.fit_gain:.2f}x on the calibration inputs" if v.fit_gain is not None else ""
    more = f"; also {', '.join(ranked[1:3])}" + (f" and {len(ranked) - 3} more" if len(ranked) > 3 else "") \
        if len(ranked) > 1 else ""
    return f"e.g. {ranked[0]}: held-out error {v.held_gain:.2f}x {base}{fit}{more}"


def check_messages(check: CalibrationCheck, few_tokens: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """The warnings a check earns: measured harm, or too little held-out data to judge (with the calibration's own
    thinness, `few_tokens`: layer -> (tokens, inputs) of layers that saw fewer tokens than they have inputs). None
    for a calibration that held out enough and did no harm."""
    out = []
    keep = check.cfg.on_harm == "keep"
    hint = ("calibrate on more and more varied inputs (quantize.calibration_samples and calibration.kinds, or "
            "calibration_prompts)")
    for kind, what, after in (("calibration", "calibrated layers were worse than rounding on held-out inputs",
                               "kept rounded"),
                              ("static scales", "static input scales were worse on held-out inputs than on the "
                               "calibration inputs", "computed with dynamic activations instead")):
        layers = [n for n, c in check.verdicts.items() if kind in c]
        harmed = [n for n in layers if check.verdicts[n][kind].harmed]
        if harmed:
            then = "kept calibrated (quantize.calibration.on_harm: keep)" if keep else after
            out.append(f"calibration: {what}: {len(harmed)} of {len(layers)}, {then} ({_worst(harmed, check, kind)})"
                       f"; {hint}")
    unjudged = [n for n, c in check.verdicts.items() if any(not v.judged for v in c.values())]
    if unjudged:
        thin = [n for n in unjudged if n in (few_tokens or {})]
        facts = ""
        if thin:
            t, w = few_tokens[thin[0]]
            facts = (f"; {len(thin)} of them saw fewer calibration tokens than they have inputs (e.g. {thin[0]}: "
                     f"{t} tokens for {w} inputs), where GPTQ fits those inputs and can be worse than rounding")
        why = check.split.how if not len(check.split.held) else \
            f"under {check.cfg.min_held_out_tokens} held-out tokens reach them (quantize.calibration.min_held_out_tokens)"
        out.append(f"calibration: too little held-out data to judge {len(unjudged)} of {len(check.verdicts)} "
                   f"calibrated layers ({why}): they keep their calibrated form unchecked{facts}; hold some inputs out: "
                   "more quantize.calibration_samples or calibration_prompts, quantize.calibration.held_out_samples, "
                   "or a list of calibrate functions (one per input set)")
    if check.model.get("harmed"):
        m = check.model
        then = "kept calibrated (quantize.calibration.on_harm: keep)" if keep else \
            f"all {sum('calibration' in c for c in check.verdicts.values())} calibrated layers rounded"
        out.append(f"calibration: the calibrated model was worse than the rounded one on held-out inputs (output error "
                   f"{m['held_out_error']:.4g} against {m['baseline_error']:.4g}): {then}")
    return out
