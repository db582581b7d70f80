"""The whole forward, timed once before choosing (the float baseline) and once after (the check): layer times
add up only approximately (launch overlap, caches, fusion under compile), so the plan says how far off its
prediction was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.measure.timing import TimingSettings, time_ms


@dataclass(frozen=True)
class ExampleForward:
    """One seeded example input set and the call that runs the transformer on it (compiled or not)."""

    module: nn.Module
    inputs: dict[str, Any]
    output: Callable[[Any], torch.Tensor]  # arch.output_tensor
    compiled: bool = False
    backend: str = "inductor"

    def runner(self) -> Callable[[], torch.Tensor]:
        """A fresh callable: compiled anew each time, so the float and the quantized forwards compile alike."""
        fn = torch.compile(self.module, backend=self.backend) if self.compiled else self.module
        return lambda: self.output(fn(**self.inputs))


@dataclass(frozen=True)
class ForwardCheck:
    float_ms: float
    predicted_ms: float
    measured_ms: float
    predicted_error: float
    measured_error: float  # relative output error on the same example inputs, against the float output

    @property
    def off(self) -> float:
        """measured / predicted - 1: +0.05 means the forward took 5 % longer than predicted."""
        return self.measured_ms / self.predicted_ms - 1 if self.predicted_ms > 0 else float("inf")

    def as_dict(self) -> dict[str, float]:
        return {"float_ms": round(self.float_ms, 6), "predicted_ms": round(self.predicted_ms, 6),
                "measured_ms": round(self.measured_ms, 6), "off": round(self.off, 6),
                "predicted_speedup": round(self.float_ms / self.predicted_ms, 6) if self.predicted_ms > 0 else None,
                "measured_speedup": round(self.float_ms / self.measured_ms, 6),
                "predicted_error": round(self.predicted_error, 8), "measured_error": round(self.measured_error, 8)}


def time_forward(example: ExampleForward, device: torch.device, settings: TimingSettings = TimingSettings()
                 ) -> tuple[float, torch.Tensor]:
    """(ms per forward, the output) of the example as the module stands now."""
    run = example.runner()
    ms = time_ms(run, device, settings)
    with torch.no_grad():
        out = run()
    return ms, out
