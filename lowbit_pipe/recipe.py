"""Dataclass schemas of every stage config, and validation.

The schemas are registered in Hydra's ConfigStore, so an unknown key or a
wrong type is refused while composing; `validate()` then checks what types
cannot: format, rotation and stage names, rule syntax. Every error names the
recipe path at fault (`RecipeError`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from lowbit_pipe.errors import RecipeError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Where weights come from (the `load` stage's config)."""

    arch: Optional[str] = None  # tiny model's arch; with `path`, forces the file's arch ("generic" allowed)
    path: Optional[str] = None  # diffusers model dir or .safetensors file; None = embedded tiny model
    seed: int = 0  # seed of the embedded tiny model's random weights
    dtype: str = "float32"  # compute dtype
    device: str = "cpu"  # "cpu", "cuda", "cuda:N" or "auto"
    tiny_config: dict[str, Any] = field(default_factory=dict)  # diffusers config kwargs of the tiny model
    config: dict[str, Any] = field(default_factory=dict)  # config overrides for a state-dict file without one


@dataclass
class FormatChoice:
    """A quantization choice for a layer: format plus its options."""

    format: str = "int8"
    rotation: str = "none"
    rotation_group: Optional[int] = None
    granularity: str = "row"
    activations: str = "dynamic"


@dataclass
class LayerRule:
    """First match wins. `match` is a glob or `re:<regex>` on module names; `keep: true` stays float."""

    match: str = "*"
    keep: bool = False
    format: Optional[str] = None  # None: the default's
    rotation: Optional[str] = None
    rotation_group: Optional[int] = None
    granularity: Optional[str] = None
    activations: Optional[str] = None


@dataclass
class QuantizeConfig:
    default: FormatChoice = field(default_factory=FormatChoice)
    rules: list[LayerRule] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)  # extra keep-float patterns
    arch_keep_float: bool = True  # apply the architecture's keep-float list
    sensitive: Optional[FormatChoice] = None  # format for the arch's sensitive layers; None = default
    originals: str = "keep"  # float layers swapped out: "keep" (exact evaluate and undo), "cpu", "drop"
    # Mixed precision by budget (whole transformer bytes); set one of the two.
    budget_bytes: Optional[int] = None
    budget_ratio: Optional[float] = None  # fraction of the float transformer's bytes
    budget_candidates: list[FormatChoice] = field(
        default_factory=lambda: [FormatChoice(format="nvfp4"), FormatChoice(format="int8")])
    budget_allow_float: bool = True  # the most sensitive layers may stay float
    calibration_samples: int = 2  # seeded example-input sets for sensitivity
    calibration_seed: int = 0


@dataclass
class LoraFile:
    path: str = "???"
    strength: float = 1.0
    name: Optional[str] = None  # adapter name for swap/remove; None = file stem
    alpha: Optional[float] = None  # override the file's alpha (peft files without one: alpha = rank)


@dataclass
class LoraConfig:
    files: list[LoraFile] = field(default_factory=list)
    mode: str = "residual"  # "residual" (exact low-rank branches), "standard" or "stochastic" bake
    strict: bool = True  # unmatched LoRA keys: error (True) or warning (False)
    seed: int = 0  # stochastic bake rounding seed


@dataclass
class CompileConfig:
    mode: str = "regional"  # "regional" (each repeated block) or "full"
    backend: str = "inductor"  # any torch.compile backend name: inductor, aot_eager, eager, cudagraphs
    fullgraph: bool = False
    dynamic: bool = False
    inductor_mode: Optional[str] = None  # torch.compile(mode=...): default, reduce-overhead, max-autotune


@dataclass
class ExportConfig:
    path: Optional[str] = None  # None: <run_dir>/model.safetensors
    dtype: str = "auto"  # unquantized tensors: "auto" (compute dtype) or a dtype name
    layout: str = "comfy"  # "comfy": native ComfyUI/BFL key names (stock loader); "diffusers": module names
    shard_bytes: Optional[int] = None  # above this size, write shards + an index (ComfyUI wants one file: None)
    residual_lora: str = "separate"  # LoRA residual branches: "separate" (<stem>.lora.safetensors) or "error"


@dataclass
class EvaluateConfig:
    seed: int = 1234
    samples: int = 2  # seeded input sets
    batch: int = 1
    image_tokens: int = 64
    text_tokens: int = 8
    layers: bool = True  # per-layer SQNR (forward hooks during the float pass)
    trajectory_seeds: int = 2  # Euler sampling trajectories (float vs quantized); 0 = off
    steps: int = 4  # Euler steps per trajectory
    diverge_cosine: float = 0.9  # final-latent cosine under this counts as a diverged trajectory
    images: bool = False  # decode the trajectories' final latents: PSNR, SSIM, images.png grid
    latency: bool = True  # forward latency with CUDA events (CUDA only; null on CPU)
    latency_iters: int = 10
    objective: str = "psnr_db"  # the figure a sweeper maximises (evaluate.objective in report.json)
    budget_bytes: Optional[int] = None  # over this many weight bytes the objective is a penalty

    def check(self) -> None:
        """Raises RecipeError naming the evaluate key at fault."""
        for key in ("samples", "batch", "image_tokens", "text_tokens", "steps", "latency_iters"):
            if getattr(self, key) < 1:
                raise RecipeError(f"evaluate.{key}", "must be >= 1")
        if self.trajectory_seeds < 0:
            raise RecipeError("evaluate.trajectory_seeds", "must be >= 0")
        if self.images and self.trajectory_seeds < 1:
            raise RecipeError("evaluate.images", "needs evaluate.trajectory_seeds >= 1 (images decode the trajectories)")
        if not -1.0 <= self.diverge_cosine <= 1.0:
            raise RecipeError("evaluate.diverge_cosine", f"must be in [-1, 1], got {self.diverge_cosine}")
        objectives = ("psnr_db", "cosine", "sqnr_min_db", "rel_error", "trajectory_min_cosine")
        if self.objective not in objectives:
            raise RecipeError("evaluate.objective", f"must be one of {list(objectives)}, got '{self.objective}'")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise RecipeError("evaluate.budget_bytes", "must be > 0")


@dataclass
class TeardownConfig:
    empty_cuda_cache: bool = True
    clear_kernel_caches: bool = True  # process caches of lowbit_pipe.kernels (Hadamard matrices): pure, rebuilt on use


@dataclass
class Recipe:
    """The whole run: ordered stage names plus one key per stage."""

    name: str = "default"
    seed: int = 0
    pipeline: list[str] = field(default_factory=lambda: ["load", "detect", "quantize", "evaluate", "export", "teardown"])
    model: ModelConfig = field(default_factory=ModelConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    teardown: TeardownConfig = field(default_factory=TeardownConfig)


def _check_choice(path: str, choice: FormatChoice | LayerRule) -> None:
    from lowbit_pipe.formats import FORMATS, FormatSpec
    from lowbit_pipe.formats.base import ACTIVATION_MODES, GRANULARITIES, ROTATIONS

    if choice.format is not None and choice.format not in FORMATS:
        raise RecipeError(f"{path}.format", f"unknown format '{choice.format}' (known: {', '.join(sorted(FORMATS))})")
    if choice.rotation is not None and choice.rotation not in ROTATIONS:
        raise RecipeError(f"{path}.rotation", f"unknown rotation '{choice.rotation}' (known: {', '.join(ROTATIONS)})")
    if choice.granularity is not None and choice.granularity not in GRANULARITIES:
        raise RecipeError(f"{path}.granularity", f"must be one of {list(GRANULARITIES)}, got '{choice.granularity}'")
    if choice.activations is not None and choice.activations not in ACTIVATION_MODES:
        raise RecipeError(f"{path}.activations", f"must be one of {list(ACTIVATION_MODES)}, got '{choice.activations}'")
    if choice.rotation_group is not None and (choice.rotation_group <= 0 or choice.rotation_group & (choice.rotation_group - 1)):
        raise RecipeError(f"{path}.rotation_group", f"must be a power of two, got {choice.rotation_group}")
    if isinstance(choice, FormatChoice):
        try:
            FORMATS[choice.format].check_spec(FormatSpec(choice.format, choice.rotation, choice.rotation_group,
                                                          choice.granularity, choice.activations))
        except ValueError as err:
            raise RecipeError(path, str(err)) from None


def check_pattern(path: str, pattern: str) -> None:
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as err:
            raise RecipeError(path, f"invalid regex '{pattern[3:]}': {err}") from None


def validate(recipe: Recipe) -> Recipe:
    """Checks types cannot express; raises RecipeError naming the path."""
    from lowbit_pipe.stages import STAGES

    for i, name in enumerate(recipe.pipeline):
        if name not in STAGES:
            raise RecipeError(f"pipeline[{i}]", f"unknown stage '{name}' (known: {', '.join(STAGES)})")
    if len(set(recipe.pipeline)) != len(recipe.pipeline):
        raise RecipeError("pipeline", f"a stage is listed twice: {recipe.pipeline}")
    order = [n for n in ("load", "detect", "quantize") if n in recipe.pipeline]
    if order != [n for n in recipe.pipeline if n in ("load", "detect", "quantize")]:
        raise RecipeError("pipeline", "load, detect and quantize must run in that order")
    if recipe.pipeline and recipe.pipeline[0] != "load":
        raise RecipeError("pipeline[0]", f"the first stage must be 'load', got '{recipe.pipeline[0]}'")
    if "teardown" in recipe.pipeline and recipe.pipeline[-1] != "teardown":
        raise RecipeError("pipeline", "'teardown' must be the last stage")
    if recipe.model.dtype not in DTYPES:
        raise RecipeError("model.dtype", f"must be one of {list(DTYPES)}, got '{recipe.model.dtype}'")
    if recipe.export.dtype not in DTYPES + ("auto",):
        raise RecipeError("export.dtype", f"must be 'auto' or one of {list(DTYPES)}, got '{recipe.export.dtype}'")
    if recipe.export.layout not in ("comfy", "diffusers"):
        raise RecipeError("export.layout", f"must be 'comfy' or 'diffusers', got '{recipe.export.layout}'")
    if recipe.export.shard_bytes is not None and recipe.export.shard_bytes < 1 << 20:
        raise RecipeError("export.shard_bytes", "must be at least 1 MiB (or null for one file)")
    if "compile" in recipe.pipeline:
        from lowbit_pipe.stages.compile import MODES as COMPILE_MODES

        if recipe.compile.mode not in COMPILE_MODES:
            raise RecipeError("compile.mode", f"must be one of {list(COMPILE_MODES)}, got '{recipe.compile.mode}'")
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if recipe.compile.backend not in backends:
            raise RecipeError("compile.backend", f"unknown backend '{recipe.compile.backend}' (known: {', '.join(backends)})")
    if recipe.export.residual_lora not in ("separate", "error"):
        raise RecipeError("export.residual_lora", f"must be 'separate' or 'error', got '{recipe.export.residual_lora}'")
    from lowbit_pipe.stages.lora import MODES as LORA_MODES

    if recipe.lora.mode not in LORA_MODES:
        raise RecipeError("lora.mode", f"must be one of {list(LORA_MODES)}, got '{recipe.lora.mode}'")
    if "lora" in recipe.pipeline and "quantize" in recipe.pipeline and \
            recipe.pipeline.index("lora") < recipe.pipeline.index("quantize"):
        raise RecipeError("pipeline", "'lora' must come after 'quantize' (branches attach to quantized layers)")
    if recipe.quantize.originals not in ("keep", "cpu", "drop"):
        raise RecipeError("quantize.originals", f"must be keep, cpu or drop, got '{recipe.quantize.originals}'")
    _check_choice("quantize.default", recipe.quantize.default)
    if recipe.quantize.sensitive is not None:
        _check_choice("quantize.sensitive", recipe.quantize.sensitive)
    for i, rule in enumerate(recipe.quantize.rules):
        check_pattern(f"quantize.rules[{i}].match", rule.match)
        _check_choice(f"quantize.rules[{i}]", rule)
    q = recipe.quantize
    if q.budget_bytes is not None and q.budget_ratio is not None:
        raise RecipeError("quantize.budget_ratio", "set budget_bytes or budget_ratio, not both")
    if q.budget_bytes is not None and q.budget_bytes <= 0:
        raise RecipeError("quantize.budget_bytes", "must be > 0")
    if q.budget_ratio is not None and not 0 < q.budget_ratio <= 1:
        raise RecipeError("quantize.budget_ratio", f"must be in (0, 1], got {q.budget_ratio}")
    for i, choice in enumerate(q.budget_candidates):
        _check_choice(f"quantize.budget_candidates[{i}]", choice)
    for i, pattern in enumerate(recipe.quantize.keep):
        check_pattern(f"quantize.keep[{i}]", pattern)
    if recipe.model.arch is not None:
        from lowbit_pipe.arch import ARCHS

        if recipe.model.arch not in ARCHS and recipe.model.arch != "generic":
            raise RecipeError("model.arch", f"unknown arch '{recipe.model.arch}' (known: {', '.join(sorted(ARCHS))})")
    recipe.evaluate.check()
    return recipe
