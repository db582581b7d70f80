"""The Plan: what planning decided for one model, as one value. Per layer its format spec (format and options) or
float, each with the reason it was chosen; the attention format with its reason; and the figures of the
planners that ran (the byte budget's, quantize.target's).

Planning (lowbit_pipe.plan.planner) makes it; everything after reads it: the quantize stage applies its layer
part, the attention step its attention, streaming export quantizes per its layers, the ComfyUI node reports its
attention, and the report prints it (report.json: `plan` per layer and `plan_attention`; summary.txt: a count
per format and the attention line).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from lowbit_pipe.plan.policy import LayerPlan
from lowbit_pipe.recipe import STOCK_ATTENTION

# The options of a layer's format spec the report names beside its format (those set).
SPEC_OPTIONS = ("rotation", "rotation_group", "granularity", "activations", "rank", "act_granularity")


@dataclass(frozen=True)
class AttentionChoice:
    """The attention format the run applies, and why. `chosen_by`: the recipe key that decided it
    (attention.format, or quantize.target when its solver weighed the formats of quantize.target.attention)."""

    format: str
    reason: str
    chosen_by: str = "attention.format"

    @property
    def stock(self) -> bool:
        """The model's own attention (nothing to apply)."""
        return self.format == STOCK_ATTENTION

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format, "reason": self.reason, "chosen_by": self.chosen_by}


def recipe_attention(fmt: str) -> AttentionChoice:
    """The recipe's own attention.format, when no planner chooses it."""
    if fmt == STOCK_ATTENTION:
        return AttentionChoice(fmt, f"attention.format {fmt}: the model's own attention")
    return AttentionChoice(fmt, f"attention.format {fmt}: the recipe's")


def layer_row(p: LayerPlan) -> dict[str, Any]:
    """One layer of report.json's `plan`: name, shape, format (None: float), its options, the reason."""
    options = {k: getattr(p.spec, k) for k in SPEC_OPTIONS if p.spec is not None and getattr(p.spec, k) is not None}
    return {"name": p.name, "shape": list(p.shape), "format": p.spec.format if p.spec else None,
            "activations": p.spec.activations if p.spec else None, "options": options, "reason": p.reason}


@dataclass(frozen=True)
class Plan:
    """Every Linear's plan (in model order) and the attention choice; `budget`: quantize.budget_*'s report section
    (None: no budget); `target`: quantize.target's plan (lowbit_pipe.plan.target_plan.TargetPlan: its report, and
    what its whole-forward check after applying needs), None without a target."""

    layers: tuple[LayerPlan, ...]
    attention: AttentionChoice
    budget: dict[str, Any] | None = None
    target: Any = None

    @property
    def quantized(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.spec is not None]

    def counts(self) -> dict[str, int]:
        """Quantized layers per format."""
        return dict(Counter(p.spec.format for p in self.quantized))

    def float_reasons(self) -> dict[str, int]:
        """Float layers per reason."""
        return dict(Counter(p.reason for p in self.layers if p.spec is None))

    def rows(self) -> list[dict[str, Any]]:
        """report.json's `plan`: one row per layer (layer_row)."""
        return [layer_row(p) for p in self.layers]

    def line(self) -> str:
        """One line: layers per format (float last) and the attention."""
        counts = sorted(self.counts().items()) + [("float", len(self.layers) - len(self.quantized))]
        return (f"plan: {', '.join(f'{k} {v}' for k, v in counts if v)} layers; attention {self.attention.format} "
                f"({self.attention.reason})")


__all__ = ["AttentionChoice", "Plan", "layer_row", "recipe_attention"]
