"""The public Python API: run a recipe; quantize a module per a policy; tear a run down."""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import OmegaConf
from torch import nn

from lowbit_pipe.arch import detect_module
from lowbit_pipe.config.validate import validate
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.recipe import QuantizeConfig, Recipe
from lowbit_pipe.running.runner import Runner, RunResult
from lowbit_pipe.stages.context import Context


def run(recipe: str | Path | dict | Recipe | None = "default", overrides: list[str] | tuple[str, ...] = (), *,
        model: Any = None, run_dir: str | Path | None = None, calibrate: Callable[[], None] | Sequence[Callable[[], None]] | None = None,
        allow_resolvers: bool = False) -> RunResult:
    """Run a recipe (packaged name, YAML path, dict, or a composed Recipe) with CLI-style overrides.

    A YAML file or dict is data (lowbit_pipe.config.untrusted: no `_target_`, no Hydra callbacks, no YAML anchors);
    `allow_resolvers=True` lets it call OmegaConf resolvers such as ${oc.env:NAME}.

    `model`: a diffusers model or pipeline, or an nn.Module, used instead of `model.path`; the caller keeps
    ownership (teardown restores it rather than dropping it) and its device and dtype (unless model.device /
    model.dtype say otherwise; a move is undone by teardown). Raises RecipeError before any work for a bad
    recipe or inputs that cannot work (no run dir is made), StageError when a stage fails (the run dir then
    holds report.json with status "failed").

    `calibrate`: a function that runs `model` on representative inputs; where the recipe calibrates (static
    activations, a byte budget, GPTQ) it is called instead of the arch's example inputs, and it is what makes a
    natively named model (a ComfyUI diffusion model) calibratable at all. The ComfyUI Quantize node passes one
    that samples with ComfyUI's own model forward.
    """
    from lowbit_pipe.config.compose import compose_recipe
    from lowbit_pipe.config.preflight import preflight

    if isinstance(recipe, Recipe):
        if overrides:
            raise ValueError("a composed Recipe takes no overrides: compose it with them (compose_recipe)")
        rec = validate(recipe)
    else:
        rec = compose_recipe(recipe, list(overrides), allow_resolvers=allow_resolvers)
    preflight(rec, model_given=model is not None)
    run_dir = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y-%m-%d/%H-%M-%S") / f"{time.time_ns() % 10**9}"
    return Runner(rec, run_dir, model=model, calibrate=calibrate).run()


def quantize(module: nn.Module, config: dict[str, Any] | QuantizeConfig, *, ledger: Ledger | None = None,
             calibrate: Callable[[], None] | Sequence[Callable[[], None]] | None = None) -> dict[str, Any]:
    """Quantize `module` in place per a `quantize:` config (dict or QuantizeConfig); no recipe, no run dir.

    The layer plan is a recipe's: the detected architecture's keep-float and sensitive lists apply (a module of
    no known architecture gets the generic policy, which keeps its first and its last Linear float, so a 2-layer
    MLP quantizes nothing unless `arch_keep_float: False`); the result's `kept_float` names each float layer with
    its reason, `arch` the policy used, and a call that quantizes nothing warns.
    Pass a Ledger to be able to undo it (`ledger.unwind()`); returns the counts and bytes. `calibrate`:
    a function that runs `module` on representative inputs, needed by layers with activations=static
    (their input_scale is the amax of the input it sees, after the layer's rotation) and by GPTQ
    (`gptq: {enabled: true}`; it is called once per pass, on the module as quantized so far).
    """
    from lowbit_pipe.arch import generic_policy
    from lowbit_pipe.plan.held_out import as_units, split_units
    from lowbit_pipe.plan.policy import plan_layers
    from lowbit_pipe.quant.swap import compute_device
    from lowbit_pipe.stages.detect import linear_shapes
    from lowbit_pipe.stages.quantize import native_groups, quantize_module, runtime_settings

    config = _fixed_plan_config(config)
    found = detect_module(module)
    policy = found.arch.policy if found else generic_policy(module)
    plans = plan_layers(linear_shapes(module), config, policy, found.policy_name if found else None)
    # Layers ComfyUI's native layout fuses (FLUX qkv, linear1) are quantized as one weight, so export is exact
    # (a natively named module has them fused already).
    groups = native_groups(found.arch, found.config, plans) if found and not found.native else []
    if calibrate is None and any(p.spec is not None and p.spec.activations == "static" for p in plans):
        first = next(p.name for p in plans if p.spec is not None and p.spec.activations == "static")
        raise ValueError(f"layer '{first}' asks for activations=static: pass calibrate= (a function that runs the "
                         "module on representative inputs) so its input_scale can be measured")
    # A list of functions (one per input set) lets a share of them be held out to check the calibration.
    split = split_units(as_units(calibrate), config.calibration.held_out_fraction, config.calibration_seed) \
        if calibrate is not None else None
    ledger = ledger if ledger is not None else Ledger()
    result = quantize_module(module, plans, ledger, originals=config.originals, fused=groups, gptq=config.gptq,
                             run_examples=split, compute_device=compute_device(config.compute_device),
                             calibration=config.calibration)
    # Which layers stayed float and why, by name: with the generic policy (a module of no known architecture) the
    # first and the last Linear stay float, so a 2-layer MLP gets nothing quantized (warned about, above).
    kept = {p.name: p.reason for p in plans if p.spec is None}
    return {**result, **runtime_settings(module, config, ledger), "arch": found.arch.id if found else "generic",
            "kept_float": kept}



def _fixed_plan_config(config: dict[str, Any] | QuantizeConfig) -> QuantizeConfig:
    """`lowbit_pipe.quantize`'s config, validated, with what only a run can plan (targets, byte budgets) and a
    CUDA device this machine lacks refused before any work."""
    if isinstance(config, dict):
        unknown = set(config) - {f.name for f in fields(QuantizeConfig)}
        if unknown:
            from lowbit_pipe.errors import RecipeError

            raise RecipeError(f"quantize.{sorted(unknown)[0]}", "no such key")
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantizeConfig), config))
    validate(Recipe(pipeline=["load"], quantize=config))
    from lowbit_pipe.config.preflight import check_device

    check_device(config.compute_device, "quantize.compute_device")  # no CUDA here: said now, not mid-way
    from lowbit_pipe.plan.targets import resolve_target

    target = resolve_target(config)
    if target is not None:  # it would be ignored here: no arch example inputs to time or calibrate the forward on
        from lowbit_pipe.errors import RecipeError

        raise RecipeError(target.key, "is planned by a run (lowbit_pipe.run or the command line), which times the "
                                      "forward on the architecture's example inputs; lowbit_pipe.quantize takes a "
                                      "fixed plan")
    for key in ("budget_bytes", "budget_ratio"):  # the byte planner needs a run too: never ignore it silently
        if getattr(config, key) is not None:
            from lowbit_pipe.errors import RecipeError

            raise RecipeError(f"quantize.{key}", "is planned by a run (lowbit_pipe.run or the command line), which "
                                                 "measures each layer's sensitivity on the architecture's example "
                                                 "inputs; lowbit_pipe.quantize takes a fixed plan (default and rules)")
    return config


def export(model: Any, path: str | Path, *, layout: str = "comfy", dtype: Any = None,
           shard_bytes: int | None = None, residual_lora: str = "separate", overwrite: bool = False) -> dict[str, Any]:
    """Write a (quantized) model or pipeline's transformer as ComfyUI / lowbit_pipe reads it; no recipe.

    `layout`: "comfy" (native key names, the stock loader's) or "diffusers"; `dtype`: of the float tensors
    (default: as they are); `overwrite`: replace an existing file (refused otherwise, naming it). Returns the
    export figures (path, bytes, files, layout, ...).
    """
    import torch

    from lowbit_pipe.adapters import adapter_for
    from lowbit_pipe.recipe import ExportConfig
    from lowbit_pipe.stages.export import write_export

    adapter = adapter_for(model)
    transformer = adapter.transformer(model)
    cfg = ExportConfig(path=str(path), layout=layout, shard_bytes=shard_bytes, residual_lora=residual_lora,
                       overwrite=overwrite)
    validate(Recipe(pipeline=["load"], export=cfg))
    from lowbit_pipe.config.preflight import check_export_path

    check_export_path(Path(path), "path", overwrite=overwrite)
    found = detect_module(transformer)
    if dtype is None:
        from lowbit_pipe.arch.base import compute_dtype

        dtype = compute_dtype(transformer, torch.float32)
    return write_export(transformer, Path(path), cfg, float_dtype=dtype, arch=found.arch if found else None,
                        arch_config=found.config if found else None, model_config=adapter.model_config(model),
                        native=bool(found and found.native))


def teardown(ctx_or_result: Context | RunResult | Ledger) -> dict[str, Any]:
    """Purge a live run: unwind its ledger, drop what it owns, clear the caches it filled, prove it.

    Takes the RunResult of `run`, its Context, or a bare Ledger (from `quantize(..., ledger=)`).
    Returns the teardown report (`bytes_freed`, `retained_bytes`, `patches_restored`, `unfreed`,
    `proven`, ...). A model the run loaded itself is dropped (drop your own references to
    `result.model` first, or it is reported as still referenced); a model you passed in is restored
    to float and kept. Idempotent: a second call undoes nothing and re-checks what was still alive.
    """
    from lowbit_pipe.stages.teardown import teardown as _teardown

    if isinstance(ctx_or_result, Ledger):
        return ctx_or_result.unwind().as_dict()
    if isinstance(ctx_or_result, RunResult):
        ctx = ctx_or_result.context
        if ctx is None:
            raise ValueError("this RunResult carries no Context (nothing to tear down)")
        if ctx.owns_model or ctx.model is None:
            ctx_or_result.model = None  # our reference must go before the proof, or it keeps the model alive
    elif isinstance(ctx_or_result, Context):
        ctx = ctx_or_result
    else:
        raise TypeError(f"teardown() takes a RunResult, Context or Ledger, not {type(ctx_or_result).__name__}")
    return _teardown(ctx)
