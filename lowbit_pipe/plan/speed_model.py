"""How the speed table's layer times add up in the whole forward, per candidate: one timed forward per candidate.

The table times each layer alone. In the forward the same layers run among attention, norms and the other layers'
launches: on an H100 an INT8 / FP8 plan ran 4 % faster than the table's sum predicted and a W4A4 plan 6 % (their
savings 1.3x and 1.8x the predicted), differently per format. So each candidate is probed once: every free layer it
fits is really quantized at it (the rules' layers at theirs) on a scratch ledger, the example forward is timed, and
the swaps are undone. The candidate's layer times are then multiplied by

    scale = (probe forward - what the prediction puts outside those layers) / (their table times),

so a uniform plan's predicted time is its measured time, as the error model's candidate scales make its
predicted error its measured error. The probe's output error is the uniform plan's measured error; the solver's
plan is weighed against the uniform plans that meet the target with those measured figures (target_plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.measure.metrics import rel_error
from lowbit_pipe.measure.timing import TimingSettings
from lowbit_pipe.plan.candidates import Candidate
from lowbit_pipe.plan.error_model import LayerOption
from lowbit_pipe.plan.forward_timing import ExampleForward, time_forward
from lowbit_pipe.quant.swap import LayerSwapper

_FLOOR = 0.05  # a scale below this means the probe timed faster than everything outside the layers: noise, clamped
STAND_IN_AMAX = 4.0  # static activations: the input scale's value does not change the time (speed_table likewise)


@dataclass(frozen=True)
class UniformProbe:
    """One candidate on every free layer it fits, really quantized, the example forward timed once."""

    label: str
    layers: list[str]  # the free layers it fits (the others stayed float)
    measured_ms: float  # the probe forward
    table_ms: float  # the speed table's time of those layers at this candidate
    scale: float  # applied to those layers' table times at this candidate
    error: float | None  # the uniform plan's output error (None: static activations, timed with a stand-in scale)

    def as_dict(self) -> dict[str, Any]:
        return {"scale": round(self.scale, 6), "measured_ms": round(self.measured_ms, 6),
                "table_ms": round(self.table_ms, 6), "layers": len(self.layers),
                "error": None if self.error is None else round(self.error, 8)}


@dataclass(frozen=True)
class SpeedModel:
    probes: dict[str, UniformProbe]  # candidate label -> its probe (float: none, its times are the baseline's)

    def scale(self, label: str) -> float:
        probe = self.probes.get(label)
        return 1.0 if probe is None else probe.scale

    def as_dict(self) -> dict[str, Any]:
        return {label: p.as_dict() for label, p in self.probes.items()}


def measure_speed_model(example: ExampleForward, reference: torch.Tensor, options: dict[str, list[LayerOption]],
                        fixed_specs: dict[str, FormatSpec], layer_ms: Callable[[str, Candidate], float],
                        float_ms: float, swapper: LayerSwapper, device: torch.device, timing: TimingSettings
                        ) -> SpeedModel:
    """One probe per candidate in `options` (free layer -> its options); `fixed_specs`: the rules' layers, quantized
    in every probe as in every plan; `layer_ms`: the table's time of a layer at a candidate; `float_ms`: the float
    forward's measured time; `swapper`: the layer swapper the quantize stage applies the plan with (its probe form:
    originals kept, undone at once)."""
    model = example.module
    float_cand = Candidate(None)
    # Outside every free layer, as the prediction has it: the float forward with the rules' layers swapped.
    outside = float_ms + sum(layer_ms(n, Candidate(s)) - layer_ms(n, float_cand) for n, s in fixed_specs.items())
    by_label: dict[str, dict[str, LayerOption]] = {}
    for name, opts in options.items():
        for o in opts:
            if o.candidate.spec is not None:
                by_label.setdefault(o.candidate.label, {})[name] = o
    probes = {}
    for label, layers in by_label.items():
        specs = {**fixed_specs, **{n: o.candidate.spec for n, o in layers.items()}}
        static = next(iter(layers.values())).candidate.spec.activations == "static"
        amax = {n: STAND_IN_AMAX for n, s in specs.items() if s.activations == "static"}
        scratch = Ledger()
        try:
            swapper.for_probes().swap(model, specs, scratch, amax)
            ms, out = time_forward(example, device, timing)
        finally:
            report = scratch.undo_all()
        if report.errors or report.unfreed:
            raise RuntimeError(f"quantize.target: undoing the {label} speed probe failed: "
                               f"{report.errors + report.unfreed}")
        table_ms = sum(layer_ms(n, o.candidate) for n, o in layers.items())
        in_forward = ms - (outside - sum(layer_ms(n, float_cand) for n in layers))
        scale = max(in_forward / table_ms, _FLOOR) if table_ms > 0 else 1.0
        probes[label] = UniformProbe(label, list(layers), ms, table_ms, scale,
                                     None if static else rel_error(reference, out))
    return SpeedModel(probes)


__all__ = ["SpeedModel", "UniformProbe", "measure_speed_model"]
