"""Recipe checks that need the registries (formats, rotations, architectures) or value ranges.

Composition (lowbit_pipe.config.compose) refuses unknown keys and wrong types; `validate()` refuses
what types cannot say. Every error is a RecipeError naming the recipe path at fault. Nothing
here reads weights or touches the filesystem (that is lowbit_pipe.config.preflight).

One check per key, where the key's values are defined: the stage names and stage modes are the schema's
(recipe.PIPELINE_STAGES, COMPILE_MODES, LORA_MODES: nothing here imports a stage), an attention format is checked
by lowbit_pipe.attention.route.format_problem and a route by crossover.route_problem (which the code applying
them calls too); this module says which key is at fault.
"""

from __future__ import annotations

import re

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.plan.stream_choice import stream_blockers, stream_mode
from lowbit_pipe.recipe import (
    COMPILE_MODES,
    DTYPES,
    LORA_MODES,
    PIPELINE_STAGES,
    CompileConfig,
    EvaluateConfig,
    ExportConfig,
    FormatChoice,
    GPTQConfig,
    LayerRule,
    LoraConfig,
    QuantizeConfig,
    Recipe,
)

# The GPU kernels rotate with tl.dot, which needs 16 or more columns per group.
MIN_ROTATION_GROUP = 16
OBJECTIVES = ("psnr_db", "cosine", "sqnr_min_db", "rel_error", "trajectory_min_cosine")
# Upper bounds of the counts that multiply a run's forwards (a sample or seed is a whole denoising run; a step one
# forward of the model, twice in evaluate): far above any figure that means something, well below a value that
# would run for days without a word. A typo's extra zeros are refused naming the key and the bound.
MAX_COUNTS = {
    "quantize.calibration_samples": 10_000, "quantize.calibration_steps": 1_000,
    "evaluate.samples": 10_000, "evaluate.trajectory_seeds": 10_000, "evaluate.steps": 1_000,
    "evaluate.batch": 1_024, "evaluate.latency_iters": 100_000,
}


def check_counts(recipe: Recipe) -> None:
    """Each count of MAX_COUNTS at most its bound."""
    for path, bound in MAX_COUNTS.items():
        section, key = path.split(".")
        value = getattr(getattr(recipe, section), key)
        if value > bound:
            raise RecipeError(path, f"must be at most {bound:,}, got {value:,} (the bound on the counts that multiply "
                                    "a run's forwards of the model: lowbit_pipe.config.validate.MAX_COUNTS)")


def check_choice(path: str, choice: FormatChoice | LayerRule) -> None:
    from lowbit_pipe.formats import FORMATS
    from lowbit_pipe.formats.base import ACT_GRANULARITIES, ACTIVATION_MODES, GRANULARITIES, ROTATIONS
    from lowbit_pipe.plan.policy import spec_of

    if choice.format is not None and choice.format not in FORMATS:
        raise RecipeError(f"{path}.format", f"unknown format '{choice.format}' (known: {', '.join(sorted(FORMATS))})")
    if choice.rotation is not None and choice.rotation not in ROTATIONS:
        raise RecipeError(f"{path}.rotation", f"unknown rotation '{choice.rotation}' (known: {', '.join(ROTATIONS)})")
    if choice.granularity is not None and choice.granularity not in GRANULARITIES:
        raise RecipeError(f"{path}.granularity", f"must be one of {list(GRANULARITIES)}, got '{choice.granularity}'")
    if choice.activations is not None and choice.activations not in ACTIVATION_MODES:
        raise RecipeError(f"{path}.activations", f"must be one of {list(ACTIVATION_MODES)}, got '{choice.activations}'")
    if choice.act_granularity is not None and choice.act_granularity not in ACT_GRANULARITIES:
        raise RecipeError(f"{path}.act_granularity", f"must be one of {list(ACT_GRANULARITIES)}, "
                                                     f"got '{choice.act_granularity}'")
    if choice.act_granularity == "tensor" and choice.format is not None and \
            choice.act_granularity not in FORMATS[choice.format].act_granularities:
        raise RecipeError(f"{path}.act_granularity", f"format '{choice.format}' takes "
                                                     f"{list(FORMATS[choice.format].act_granularities)} only: its dynamic "
                                                     "activation scales come from each token alone")
    if choice.rank is not None and choice.rank < 1:
        raise RecipeError(f"{path}.rank", f"must be >= 1, got {choice.rank}")
    group = choice.rotation_group
    if group is not None and (group <= 0 or group & (group - 1)):
        raise RecipeError(f"{path}.rotation_group", f"must be a power of two, got {group}")
    if group is not None and group < MIN_ROTATION_GROUP:
        raise RecipeError(f"{path}.rotation_group", f"must be at least {MIN_ROTATION_GROUP} (the GPU kernels rotate "
                                                    f"with tensor-core dots of 16+ columns), got {group}")
    if isinstance(choice, FormatChoice):
        try:
            FORMATS[choice.format].check_spec(spec_of(choice))
        except ValueError as err:
            raise RecipeError(path, str(err)) from None


def _check_rule_act_granularity(path: str, rule: LayerRule, default: FormatChoice) -> None:
    """A rule takes the keys it leaves unset from quantize.default: a per-tensor act_granularity it inherits must fit
    the rule's format too."""
    from lowbit_pipe.formats import FORMATS

    if rule.keep or rule.act_granularity is not None or default.act_granularity != "tensor":
        return
    fmt = rule.format or default.format
    if fmt in FORMATS and "tensor" not in FORMATS[fmt].act_granularities:
        raise RecipeError(f"{path}.act_granularity", f"inherits 'tensor' from quantize.default, which format '{fmt}' "
                                                     "does not take (its dynamic activation scales come from each token "
                                                     "alone): set act_granularity: token on this rule")


def check_pattern(path: str, pattern: str) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as err:
            raise RecipeError(path, f"invalid regex '{pattern[3:]}': {err}") from None


def check_evaluate(cfg: EvaluateConfig) -> None:
    for key in ("samples", "batch", "image_tokens", "text_tokens", "steps", "latency_iters"):
        if getattr(cfg, key) < 1:
            raise RecipeError(f"evaluate.{key}", "must be >= 1")
    if cfg.text_valid is not None and not 1 <= cfg.text_valid <= cfg.text_tokens:
        raise RecipeError("evaluate.text_valid", f"must be in [1, evaluate.text_tokens={cfg.text_tokens}] (the "
                                                 f"attended text tokens; null: no padding mask), got {cfg.text_valid}")
    if cfg.trajectory_seeds < 0:
        raise RecipeError("evaluate.trajectory_seeds", "must be >= 0")
    if cfg.images and cfg.trajectory_seeds < 1:
        raise RecipeError("evaluate.images", "needs evaluate.trajectory_seeds >= 1 (images decode the trajectories)")
    if not -1.0 <= cfg.diverge_cosine <= 1.0:
        raise RecipeError("evaluate.diverge_cosine", f"must be in [-1, 1], got {cfg.diverge_cosine}")
    if cfg.objective not in OBJECTIVES:
        raise RecipeError("evaluate.objective", f"must be one of {list(OBJECTIVES)}, got '{cfg.objective}'")
    if cfg.budget_bytes is not None and cfg.budget_bytes <= 0:
        raise RecipeError("evaluate.budget_bytes", "must be > 0")


def _check_pipeline(recipe: Recipe) -> None:
    for i, name in enumerate(recipe.pipeline):
        if name not in PIPELINE_STAGES:
            raise RecipeError(f"pipeline[{i}]", f"unknown stage '{name}' (known: {', '.join(PIPELINE_STAGES)})")
    if len(set(recipe.pipeline)) != len(recipe.pipeline):
        raise RecipeError("pipeline", f"a stage is listed twice: {recipe.pipeline}")
    order = [n for n in ("load", "detect", "quantize") if n in recipe.pipeline]
    if order != [n for n in recipe.pipeline if n in ("load", "detect", "quantize")]:
        raise RecipeError("pipeline", "load, detect and quantize must run in that order")
    if recipe.pipeline and recipe.pipeline[0] != "load":
        raise RecipeError("pipeline[0]", f"the first stage must be 'load', got '{recipe.pipeline[0]}'")
    if "teardown" in recipe.pipeline and recipe.pipeline[-1] != "teardown":
        raise RecipeError("pipeline", "'teardown' must be the last stage")
    if recipe.lora.files and "lora" not in recipe.pipeline:
        # Silently ignoring them would export a model without the LoRAs the user asked for.
        n = len(recipe.lora.files)
        raise RecipeError("lora.files", f"{n} LoRA file{'s' if n > 1 else ''} listed ({recipe.lora.files[0].path}"
                                        f"{', ...' if n > 1 else ''}), but the pipeline {list(recipe.pipeline)} has "
                                        "no 'lora' stage, so they would be ignored: add 'lora' after 'quantize' "
                                        "(e.g. pipeline=[load,detect,quantize,lora,evaluate,export,teardown], as "
                                        "recipe=krea2_nvfp4_lora has it), or leave lora.files empty")
    if "lora" in recipe.pipeline and "quantize" in recipe.pipeline and \
            recipe.pipeline.index("lora") < recipe.pipeline.index("quantize"):
        raise RecipeError("pipeline", "'lora' must come after 'quantize' (branches attach to quantized layers)")


def _check_attention(recipe: Recipe) -> None:
    from lowbit_pipe.attention.route import STOCK, format_problem

    a = recipe.attention
    if format_problem(a.format) is not None:
        raise RecipeError("attention.format", format_problem(a.format))
    if not a.layers:
        raise RecipeError("attention.layers", "lists the attention modules that get 8-bit attention: at least one "
                                              "pattern ('*' for all)")
    for i, pattern in enumerate(a.layers):
        if not isinstance(pattern, str) or not pattern:
            raise RecipeError(f"attention.layers[{i}]", f"must be a non-empty glob or re: pattern, got {pattern!r}")
        check_pattern(f"attention.layers[{i}]", pattern)
    chosen = list(recipe.quantize.target.attention)
    for i, fmt in enumerate(chosen):
        if format_problem(fmt) is not None:
            raise RecipeError(f"quantize.target.attention[{i}]", format_problem(fmt))
    if not chosen:
        raise RecipeError("quantize.target.attention", f"lists the attention formats the solver may choose: at least "
                                                       f"one ('{STOCK}': the model's own)")
    if chosen != [STOCK]:
        from lowbit_pipe.plan.targets import resolve_target

        if resolve_target(recipe.quantize) is None:
            raise RecipeError("quantize.target.attention", f"{chosen} is chosen among by the solver, which runs for a "
                                                           "quantize.target (speedup, bytes, ratio or error): set one, or "
                                                           "set attention.format yourself")
        if a.format != STOCK:
            raise RecipeError("quantize.target.attention", f"attention.format is '{a.format}' already (the recipe's "
                                                           "word, which the solver keeps): leave quantize.target.attention "
                                                           f"['{STOCK}'], or attention.format '{STOCK}' for the solver to choose")
    if a.format != STOCK and "quantize" not in recipe.pipeline:
        raise RecipeError("attention.format", f"'{a.format}' is applied by the quantize stage, which the pipeline "
                                              f"{list(recipe.pipeline)} lacks: add 'quantize', or leave attention.format "
                                              f"'{STOCK}'")
    if a.fused_norm_rope and "quantize" not in recipe.pipeline:
        raise RecipeError("attention.fused_norm_rope", f"is applied by the quantize stage, which the pipeline "
                                                       f"{list(recipe.pipeline)} lacks: add 'quantize', or set it false")
    from lowbit_pipe.attention.crossover import route_problem

    if route_problem(a.route) is not None:
        raise RecipeError("attention.route", route_problem(a.route))


def _check_device(path: str, device: str | None) -> None:
    if device is not None and not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device):
        raise RecipeError(path, f"must be cpu, cuda, cuda:N or auto, got '{device}'")


def _check_model(recipe: Recipe) -> None:
    from lowbit_pipe.arch import ARCHS

    m = recipe.model
    if m.dtype is not None and m.dtype not in DTYPES:
        raise RecipeError("model.dtype", f"must be one of {list(DTYPES)}, got '{m.dtype}'")
    _check_device("model.device", m.device)
    _check_device("quantize.compute_device", recipe.quantize.compute_device)
    for key in ("arch", "tiny_arch"):
        value = getattr(m, key)
        if value is not None and value not in ARCHS and not (key == "arch" and value == "generic"):
            raise RecipeError(f"model.{key}", f"unknown arch '{value}' (known: {', '.join(sorted(ARCHS))}"
                                              f"{', generic' if key == 'arch' else ''})")
    if m.path is None and m.arch is not None and m.tiny_arch is not None and m.arch != m.tiny_arch:
        raise RecipeError("model.arch", f"'{m.arch}' does not match the embedded tiny model ({m.tiny_arch}); "
                                        f"pick it with model=tiny_{m.arch}")


def _check_stream(recipe: Recipe) -> None:
    """model.stream=true: what streaming (no model in memory, no forward) cannot do is refused here."""
    if stream_mode(recipe.model.stream) != "true":
        return
    if recipe.model.path is None:
        raise RecipeError("model.stream", "streams a checkpoint file: set model.path")
    blockers = stream_blockers(recipe)
    if blockers:
        key, why = blockers[0]
        raise RecipeError(key, f"{why}: not with model.stream=true, which never loads the model (model.stream=auto "
                               "or false loads it)")


def _check_target(q: QuantizeConfig) -> None:
    """quantize.target: one target, in range; candidates valid and loadable by quantize.target.loads_in."""
    from lowbit_pipe.plan.loadable import LOADERS, loadable
    from lowbit_pipe.plan.policy import spec_of
    from lowbit_pipe.plan.targets import resolve_target

    t = q.target
    target = resolve_target(q)
    if t.loads_in not in LOADERS:
        raise RecipeError("quantize.target.loads_in", f"must be one of {list(LOADERS)}, got '{t.loads_in}'")
    if t.frontier_points < 2:
        raise RecipeError("quantize.target.frontier_points", f"must be >= 2, got {t.frontier_points}")
    if target is None:
        return
    if q.budget_bytes is not None or q.budget_ratio is not None:
        key = "quantize.budget_bytes" if q.budget_bytes is not None else "quantize.budget_ratio"
        raise RecipeError(key, f"set {target.key} or a budget, not both (target.bytes / target.ratio are the "
                               "budget with speed reported)")
    if not t.candidates and not t.allow_float:
        raise RecipeError("quantize.target.candidates", "no candidate: list formats, or allow_float")
    for i, choice in enumerate(t.candidates):
        path = f"quantize.target.candidates[{i}]"
        check_choice(path, choice)
        if not loadable(spec_of(choice), t.loads_in):
            raise RecipeError(path, f"{choice.format} (rotation {choice.rotation}) writes a kind stock ComfyUI does not "
                                    "load: drop it, or set quantize.target.loads_in to comfyui_pack (ComfyUI with "
                                    "lowbit_pipe's node pack) or lowbit_pipe")


def _check_held_out(q: QuantizeConfig) -> None:
    """quantize.calibration: its kinds and the held-out check's settings."""
    c = q.calibration
    if not c.kinds:
        raise RecipeError("quantize.calibration.kinds", "needs at least one kind of input")
    for i, kind in enumerate(c.kinds):
        if kind.image_scale <= 0 or kind.text_scale <= 0:
            raise RecipeError(f"quantize.calibration.kinds[{i}]", "image_scale and text_scale must be > 0")
        if kind.text_valid is not None and not 0 < kind.text_valid <= 1:
            raise RecipeError(f"quantize.calibration.kinds[{i}].text_valid", f"must be in (0, 1] or null, got "
                              f"{kind.text_valid}")
    if not 0 <= c.held_out_fraction < 1:
        raise RecipeError("quantize.calibration.held_out_fraction", f"must be in [0, 1), got {c.held_out_fraction}")
    if c.held_out_samples < 0:
        raise RecipeError("quantize.calibration.held_out_samples", f"must be >= 0, got {c.held_out_samples}")
    if any(not isinstance(t, str) or not t.strip() for t in c.held_out_prompts):
        raise RecipeError("quantize.calibration.held_out_prompts", "each prompt must be a non-empty string")
    if c.on_harm not in ("fallback", "keep"):
        raise RecipeError("quantize.calibration.on_harm", f"must be 'fallback' or 'keep', got '{c.on_harm}'")
    for key in ("min_held_out_tokens", "static_tolerance", "model_tolerance"):
        if getattr(c, key) < 0:
            raise RecipeError(f"quantize.calibration.{key}", f"must be >= 0, got {getattr(c, key)}")


def _check_export(export: ExportConfig) -> None:
    """export.*: dtype, layout, shard size, residual LoRA."""
    if export.dtype not in DTYPES + ("auto",):
        raise RecipeError("export.dtype", f"must be 'auto' or one of {list(DTYPES)}, got '{export.dtype}'")
    if export.layout not in ("comfy", "diffusers"):
        raise RecipeError("export.layout", f"must be 'comfy' or 'diffusers', got '{export.layout}'")
    if export.shard_bytes is not None and export.shard_bytes < 1 << 20:
        raise RecipeError("export.shard_bytes", "must be at least 1 MiB (or null for one file)")
    if export.residual_lora not in ("separate", "error"):
        raise RecipeError("export.residual_lora", f"must be 'separate' or 'error', got '{export.residual_lora}'")


def _check_compile(compile_cfg: CompileConfig) -> None:
    """compile.*: the mode and a backend dynamo knows (checked when the pipeline compiles)."""
    if compile_cfg.mode not in COMPILE_MODES:
        raise RecipeError("compile.mode", f"must be one of {list(COMPILE_MODES)}, got '{compile_cfg.mode}'")
    import torch._dynamo

    backends = torch._dynamo.list_backends(exclude_tags=())
    if compile_cfg.backend not in backends:
        raise RecipeError("compile.backend", f"unknown backend '{compile_cfg.backend}' (known: {', '.join(backends)})")


def _check_lora_mode(lora: LoraConfig) -> None:
    """lora.mode: one the lora stage has."""
    if lora.mode not in LORA_MODES:
        raise RecipeError("lora.mode", f"must be one of {list(LORA_MODES)}, got '{lora.mode}'")


def _check_calibration(q: QuantizeConfig) -> None:
    """quantize.calibration_*: counts, prompts and resolution."""
    if q.calibration_samples < 1:
        raise RecipeError("quantize.calibration_samples", "must be >= 1")
    if q.calibration_steps < 0:
        raise RecipeError("quantize.calibration_steps", "must be >= 0 (0: one forward per sample)")
    if any(not isinstance(t, str) or not t.strip() for t in q.calibration_prompts):
        raise RecipeError("quantize.calibration_prompts", "each prompt must be a non-empty string")
    if q.calibration_resolution is not None and q.calibration_resolution < 1:
        raise RecipeError("quantize.calibration_resolution", "must be a positive number of pixels (or null)")
    if q.calibration_prompts and q.calibration_steps < 1:
        raise RecipeError("quantize.calibration_steps", "must be >= 1 with quantize.calibration_prompts (each prompt "
                          "is a generation of that many steps)")


def _check_gptq(gptq: GPTQConfig) -> None:
    """quantize.gptq.*: block size, damping, memory, threads and the warnings' thresholds."""
    if gptq.block_size < 1:
        raise RecipeError("quantize.gptq.block_size", f"must be >= 1, got {gptq.block_size}")
    if not 0 < gptq.damp < 1:
        raise RecipeError("quantize.gptq.damp", f"must be in (0, 1), got {gptq.damp}")
    if gptq.hessian_bytes < 1:
        raise RecipeError("quantize.gptq.hessian_bytes", "must be > 0")
    if gptq.threads is not None and gptq.threads < 1:
        raise RecipeError("quantize.gptq.threads", f"must be >= 1 or null (automatic), got {gptq.threads}")
    if gptq.spectrum_max_width < 0:
        raise RecipeError("quantize.gptq.spectrum_max_width", f"must be >= 0, got {gptq.spectrum_max_width}")
    if not 0 < gptq.warn_damp_share <= 1:
        raise RecipeError("quantize.gptq.warn_damp_share", f"must be in (0, 1], got {gptq.warn_damp_share}")


def _check_quantize(q: QuantizeConfig) -> None:
    """quantize.*: formats, rules, budget, calibration, GPTQ, target and keep patterns."""
    from lowbit_pipe.formats.nvfp4 import NVFP4_COMPUTE

    if q.nvfp4_compute not in NVFP4_COMPUTE:
        raise RecipeError("quantize.nvfp4_compute", f"must be one of {', '.join(NVFP4_COMPUTE)}, got '{q.nvfp4_compute}'")
    if q.originals not in ("keep", "cpu", "drop"):
        raise RecipeError("quantize.originals", f"must be keep, cpu or drop, got '{q.originals}'")
    check_choice("quantize.default", q.default)
    if q.sensitive is not None:
        check_choice("quantize.sensitive", q.sensitive)
    if q.fallback is not None:
        check_choice("quantize.fallback", q.fallback)
    for i, rule in enumerate(q.rules):
        check_pattern(f"quantize.rules[{i}].match", rule.match)
        check_choice(f"quantize.rules[{i}]", rule)
        _check_rule_act_granularity(f"quantize.rules[{i}]", rule, q.default)
    if q.budget_bytes is not None and q.budget_ratio is not None:
        raise RecipeError("quantize.budget_ratio", "set budget_bytes or budget_ratio, not both")
    if q.budget_bytes is not None and q.budget_bytes <= 0:
        raise RecipeError("quantize.budget_bytes", "must be > 0")
    if q.budget_ratio is not None and not 0 < q.budget_ratio <= 1:
        raise RecipeError("quantize.budget_ratio", f"must be in (0, 1], got {q.budget_ratio}")
    _check_calibration(q)
    _check_gptq(q.gptq)
    for i, choice in enumerate(q.budget_candidates):
        check_choice(f"quantize.budget_candidates[{i}]", choice)
    _check_target(q)
    _check_held_out(q)
    for i, pattern in enumerate(q.keep):
        check_pattern(f"quantize.keep[{i}]", pattern)


def validate(recipe: Recipe) -> Recipe:
    """Checks types cannot express; raises RecipeError naming the path."""
    _check_pipeline(recipe)
    _check_model(recipe)
    _check_stream(recipe)
    _check_attention(recipe)
    _check_export(recipe.export)
    if "compile" in recipe.pipeline:
        _check_compile(recipe.compile)
    _check_lora_mode(recipe.lora)
    _check_quantize(recipe.quantize)
    check_evaluate(recipe.evaluate)
    check_counts(recipe)
    return recipe
