"""Planning for one run: the recipe's rules and the arch's lists (policy), then the byte budget or quantize.target's
solver, then the attention format: one Plan (lowbit_pipe.plan.plan) that the stages after it apply and report.

Nothing here changes the model for good: the budget's and the target's measurements run on the float model, and
the target's probes swap layers and attention with the same swappers the run applies the Plan with, on scratch
ledgers they undo at once. `ctx`: the run's Context (lowbit_pipe.stages.context), read only.
"""

from __future__ import annotations

from typing import Any

from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.plan.calibration_inputs import example_runner
from lowbit_pipe.plan.plan import AttentionChoice, Plan, recipe_attention
from lowbit_pipe.plan.policy import LayerPlan, linear_shapes, plan_layers, spec_of
from lowbit_pipe.plan.target_plan import AttentionProbe
from lowbit_pipe.quant.swap import LayerSwapper
from lowbit_pipe.recipe import STOCK_ATTENTION


def _budget_plans(ctx: Any, plans: list[LayerPlan]) -> tuple[list[LayerPlan], dict[str, Any]]:
    """quantize.budget_*: the layers re-planned to fit the byte budget, and the budget's report section."""
    from lowbit_pipe.plan.budget import plan_budget

    cfg = ctx.recipe.quantize
    model = ctx.transformer
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else int(cfg.budget_ratio * tensor_bytes(model))
    candidates = [spec_of(c) for c in cfg.budget_candidates]
    result = plan_budget(model, plans, candidates, budget, example_runner(ctx, "quantize.budget_*"),
                         seed=cfg.calibration_seed, allow_float=cfg.budget_allow_float)
    return result.plans, result.as_dict()


def _target_plan(ctx: Any, plans: list[LayerPlan], swapper: LayerSwapper, attention: AttentionProbe):
    """quantize.target: the solver's plan (lowbit_pipe.plan.target_plan), or None when the recipe sets no target."""
    from lowbit_pipe.plan.target_plan import plan_for_target, require_example_forward
    from lowbit_pipe.plan.targets import resolve_target

    target = resolve_target(ctx.recipe.quantize)
    if target is None:
        return None
    require_example_forward(ctx)  # before the calibration runner, whose own refusal would not name the target
    return plan_for_target(ctx, plans, target, example_runner(ctx, "quantize.target"), swapper, attention)


def target_attention(recipe: Any, target_plan: Any) -> AttentionChoice:
    """The attention a target plan was solved with, and why: the solver's choice among quantize.target.attention,
    or the recipe's attention.format, which the solver keeps (validate lets it choose only where that is stock)."""
    if recipe.attention.format != STOCK_ATTENTION:
        return recipe_attention(recipe.attention.format)
    weighed = list(dict.fromkeys(recipe.quantize.target.attention))
    pred = target_plan.solution.prediction
    why = f"quantize.target weighed {weighed}: its plan with it predicts {pred.speedup:.3g}x at error {pred.error:.3g}" \
        if len(weighed) > 1 else f"quantize.target.attention lists {weighed[0]} alone"
    return AttentionChoice(target_plan.attention, why, chosen_by="quantize.target")


def make_plan(ctx: Any, swapper: LayerSwapper, attention: AttentionProbe) -> Plan:
    """The run's Plan: every Linear of the transformer planned by the recipe's rules and the arch's lists, re-planned
    by quantize.budget_* or quantize.target when the recipe sets one, and the attention format (quantize.target's
    choice, else attention.format). `swapper` / `attention`: what the run applies the Plan with; quantize.target's
    probes apply theirs with them."""
    cfg = ctx.recipe.quantize
    plans = plan_layers(linear_shapes(ctx.transformer), cfg, ctx.policy, ctx.policy_name)
    budget = None
    if cfg.budget_bytes is not None or cfg.budget_ratio is not None:
        plans, budget = _budget_plans(ctx, plans)
    target = _target_plan(ctx, plans, swapper, attention)
    if target is None:
        return Plan(tuple(plans), recipe_attention(ctx.recipe.attention.format), budget)
    return Plan(tuple(target.plans), target_attention(ctx.recipe, target), budget, target)


__all__ = ["make_plan", "target_attention"]
