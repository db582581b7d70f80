"""The public Python API: run a recipe; quantize a module per a policy; tear a run down."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from torch import nn

from lowbit_pipe.arch import detect_model
from lowbit_pipe.context import Context
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.recipe import QuantizeConfig
from lowbit_pipe.runner import RunResult, Runner


def run(recipe: str | Path | dict | None = "default", overrides: list[str] | tuple[str, ...] = (), *,
        model: Any = None, run_dir: str | Path | None = None) -> RunResult:
    """Run a recipe (packaged name, YAML path or dict) with CLI-style overrides.

    `model`: a diffusers model or pipeline, or an nn.Module, used instead of `model.path`; the caller keeps
    ownership (teardown restores it rather than dropping it). Raises StageError on failure (the run dir still
    holds report.json with status "failed").
    """
    from lowbit_pipe.compose import compose_recipe

    rec = compose_recipe(recipe, list(overrides))
    run_dir = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y-%m-%d/%H-%M-%S") / f"{time.time_ns() % 10**9}"
    return Runner(rec, run_dir, model=model).run()


def quantize(module: nn.Module, config: dict[str, Any] | QuantizeConfig, *, ledger: Ledger | None = None) -> dict[str, Any]:
    """Quantize `module` in place per a `quantize:` config (dict or QuantizeConfig); no recipe, no run dir.

    Pass a Ledger to be able to undo it (`ledger.unwind()`); returns the counts and bytes.
    """
    from lowbit_pipe.compose import register_schema
    from lowbit_pipe.policy import plan_layers
    from lowbit_pipe.recipe import Recipe, validate
    from lowbit_pipe.stages.detect import generic_policy, linear_shapes
    from lowbit_pipe.stages.quantize import quantize_module

    register_schema()
    if isinstance(config, dict):
        unknown = set(config) - {f.name for f in fields(QuantizeConfig)}
        if unknown:
            from lowbit_pipe.errors import RecipeError

            raise RecipeError(f"quantize.{sorted(unknown)[0]}", "no such key")
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantizeConfig), config))
    validate(Recipe(pipeline=["load"], quantize=config))
    arch = detect_model(module)
    policy = arch.policy if arch else generic_policy(module)
    plans = plan_layers(linear_shapes(module), config, policy)
    return quantize_module(module, plans, ledger if ledger is not None else Ledger(), originals=config.originals)


def teardown(ctx_or_result: Context | RunResult) -> dict[str, Any]:
    """Purge a live run: unwind its ledger, drop what it owns, prove it. Idempotent."""
    from lowbit_pipe.stages.teardown import teardown as _teardown

    ctx = ctx_or_result.context if isinstance(ctx_or_result, RunResult) else ctx_or_result
    result = _teardown(ctx)
    if isinstance(ctx_or_result, RunResult):
        ctx_or_result.model = None
    return result
