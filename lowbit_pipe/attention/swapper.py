"""The attention swapper: the recipe's `attention:` settings (layers, the arch's keep list, route, fold_qk) bound once,
applying a format to a model through a ledger.

One object that both sides use, as lowbit_pipe.quant.swap.LayerSwapper is for layers: quantize.target's solver
times each attention format it weighs with `probe` (on a scratch ledger it undoes at once; it reaches the solver
as lowbit_pipe.plan.target_plan.AttentionProbe, so the planner imports nothing of attention/), and the attention
step (lowbit_pipe.stages.attention) applies the Plan's format with `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from lowbit_pipe.attention.processors import AppliedAttention, apply_attention, arch_keep
from lowbit_pipe.ledger import Ledger


@dataclass(frozen=True)
class AttentionSwapper:
    """`layers`: attention.layers; `keep`: the arch's attention_keep (when attention.arch_keep); `route`,
    `fold_qk`: attention.route / fold_qk; `speed_cache`: quantize.speed_cache (the crossover's measured times)."""

    layers: tuple[str, ...] = ("*",)
    keep: tuple[str, ...] = ()
    route: str = "auto"
    fold_qk: bool = True
    speed_cache: str | None = None

    @classmethod
    def for_recipe(cls, recipe: Any, arch: Any) -> AttentionSwapper:
        """The swapper of a recipe's attention section on a model of `arch` (None: no arch keep list)."""
        cfg = recipe.attention
        return cls(tuple(cfg.layers), arch_keep(arch, cfg.arch_keep), cfg.route, cfg.fold_qk,
                   recipe.quantize.speed_cache)

    def apply(self, model: nn.Module, attention_format: str, ledger: Ledger) -> AppliedAttention | None:
        """`attention_format` on `model`'s attention modules, every swap in `ledger` (None for the stock one)."""
        return apply_attention(model, attention_format, ledger, list(self.layers), keep=self.keep, route=self.route,
                               speed_cache=self.speed_cache, fold_qk=self.fold_qk)

    def probe(self, model: nn.Module, attention_format: str, ledger: Ledger) -> Mapping[str, int]:
        """`attention_format` on `model` for one timed forward of the solver: the live count of attention calls per
        path, as the dispatch counts them (read it after the forward). The recipe's route and speed cache as `apply`
        uses them: the probe times the attention the run will have."""
        applied = self.apply(model, attention_format, ledger)
        return applied.calls if applied is not None else {}


__all__ = ["AttentionSwapper"]
