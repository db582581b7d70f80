"""The formats a target may choose from, one label each: float, and each recipe candidate (a rotation is a
candidate of its own: int8 and int8+convrot differ in speed and in error)."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit_pipe.formats import FormatSpec

FLOAT = "float"


def spec_label(spec: FormatSpec | None) -> str:
    """A short, stable name: `int8`, `int8+convrot`, `nvfp4+convrot/256`, `fp8 act=none`, `float`."""
    if spec is None:
        return FLOAT
    label = spec.format
    if spec.rotation != "none":
        label += f"+{spec.rotation}" + (f"/{spec.rotation_group}" if spec.rotation_group else "")
    if spec.granularity:
        label += f" w={spec.granularity}"
    if spec.activations != "dynamic":
        label += f" act={spec.activations}"
    if spec.rank is not None:
        label += f" rank={spec.rank}"
    if spec.act_granularity:
        label += f" act_gran={spec.act_granularity}"
    return label


@dataclass(frozen=True)
class Candidate:
    """One choice for a layer: a format spec, or float (spec None)."""

    spec: FormatSpec | None

    @property
    def label(self) -> str:
        return spec_label(self.spec)
