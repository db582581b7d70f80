"""Dataclass schemas of every stage config: plain data, no checks against the registries.

The schemas are registered in Hydra's ConfigStore, so an unknown key or a wrong
type is refused while composing. What types cannot say (format, rotation and
stage names, rule syntax, value ranges) is checked by `lowbit_pipe.config.validate`,
beside composition; every error names the recipe path at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """Where weights come from (the `load` stage's config)."""

    # Forces the architecture of a weights file (its header or key detection decides otherwise);
    # "generic" quantizes it as a plain module. Set by the user, never by a model group.
    arch: Optional[str] = None
    path: Optional[str] = None  # diffusers model dir or .safetensors file (or index); None = embedded tiny model
    tiny_arch: Optional[str] = None  # architecture of the embedded tiny model (set by the model group)
    seed: int = 0  # seed of the embedded tiny model's random weights
    dtype: Optional[str] = None  # compute dtype; None: float32, or a passed-in model's own dtype
    device: Optional[str] = None  # "cpu", "cuda", "cuda:N" or "auto"; None: cpu, or where a passed-in model is
    tiny_config: dict[str, Any] = field(default_factory=dict)  # diffusers config kwargs of the tiny model
    config: dict[str, Any] = field(default_factory=dict)  # config overrides for a state-dict file without one
    # Stream model.path through quantize into the export, one tensor at a time (bounded memory; the model is
    # never loaded): pipeline [load, detect, quantize, export(, teardown)], float weights, nothing calibrated on
    # forwards (static activations, budgets, GPTQ). "auto" (or null): stream whenever the run allows it; true:
    # stream, or refuse naming what prevents it; false: load the model whole. The plan line and report.json's
    # `stream` say which, and why (lowbit_pipe.plan.stream_choice; docs/streaming.md).
    stream: Any = "auto"


@dataclass
class FormatChoice:
    """A quantization choice for a layer: format plus its options."""

    format: str = "int8"
    rotation: str = "none"
    rotation_group: Optional[int] = None
    granularity: Optional[str] = None  # "row" or "tensor" weight scales (int8, fp8); None: the format's default
    activations: str = "dynamic"
    rank: Optional[int] = None  # low-rank branch of svdquant_w4a4; None: its default (32)
    # Dynamic activations' scale statistic: "token" (each token alone: an output never depends on its batch-mates
    # or padding; None means this) or "tensor" (nvfp4 only: one global scale from the whole input of the call, as
    # stock ComfyUI computes it, which makes a token's result depend on every other token in the call).
    act_granularity: Optional[str] = None


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
    rank: Optional[int] = None
    act_granularity: Optional[str] = None


@dataclass
class GPTQConfig:
    """GPTQ error feedback: each weight column is rounded on the round-to-nearest grid (same scales, same
    file layout) and its error pushed into the columns not yet rounded, weighted by the layer's calibrated
    input Hessian. Layers are quantized in sequential passes, each calibrated on the model whose earlier
    layers are already quantized."""

    enabled: bool = False
    block_size: int = 128  # columns per lazy batch update
    damp: float = 0.1  # added to the Hessian's diagonal, as a fraction of its mean (0.01 fits the calibration data
    # closer and generalizes worse: bench/results/gptq_sweep.md)
    act_order: bool = True  # round columns in order of decreasing input energy (bench/results/gptq_sweep.md)
    # fp32 Hessians (4 * in_features^2 bytes per layer) held at once: bounds a pass's layers.
    hessian_bytes: int = 4 << 30
    # CPU threads for GPTQ's matrix work; null: torch's count capped by the cores not busy with other processes
    # (the column loop always runs on one). Torch's count is restored after each layer.
    threads: Optional[int] = None
    # Layers up to this many inputs get their Hessian's eigenvalues for the report (rank, damping share): an extra
    # eigvalsh per layer; wider ones a free estimate from the Cholesky pivots.
    spectrum_max_width: int = 4096
    # The report warns when the damping outweighs the calibration data in at least this share of a layer's
    # Hessian directions (GPTQ's fit there is the damping's, not the data's). Trained layers' spectra are steep:
    # at damp 0.1 up to 82 % of an all-MiniLM-L6-v2 layer's eigenvalues lie below it, calibrated on 2,000 tokens.
    warn_damp_share: float = 0.9


@dataclass
class CalibrationKind:
    """One kind of calibration input of the arch's example inputs: its token counts relative to evaluate's and its
    text padding. Sample i of the calibration is of kind i % len(kinds)."""

    image_scale: float = 1.0  # image tokens: evaluate.image_tokens x this (a square grid: resolution)
    text_scale: float = 1.0  # text tokens: evaluate.text_tokens x this (prompt length)
    # Share of those text tokens attended, the rest padding under the arch's text mask (a short prompt padded to a
    # fixed length, as pipelines do); None: no mask. Archs without a text mask ignore it.
    text_valid: Optional[float] = None


def _calibration_kinds() -> list[CalibrationKind]:
    return [CalibrationKind(), CalibrationKind(image_scale=4.0, text_scale=4.0),
            CalibrationKind(image_scale=0.25, text_scale=8.0, text_valid=0.25),
            CalibrationKind(image_scale=2.25, text_scale=2.0, text_valid=0.5)]


@dataclass
class CalibrationConfig:
    """The calibration's own check (lowbit_pipe.plan.held_out): part of the calibration inputs is held out, and each
    calibrated layer (GPTQ, AWQ's clipping, SVDQuant's smoothing, static input scales) is compared on it with plain
    rounding; a layer worse there is rounded instead (or kept, on_harm: keep)."""

    kinds: list[CalibrationKind] = field(default_factory=_calibration_kinds)
    # Share of the calibration's input sets (samples or prompts) held out, drawn with calibration_seed; 0: none.
    held_out_fraction: float = 0.25
    # A held-out set of its own instead of a share: this many more seeded samples (seeds after the calibration's),
    # or with a pipeline these prompts.
    held_out_samples: int = 0
    held_out_prompts: list[str] = field(default_factory=list)
    on_harm: str = "fallback"  # a layer worse than rounding on held-out inputs: "fallback" (rounded) or "keep"
    # Fewer held-out rows (tokens) than this reaching a layer: too little to judge it (said, not guessed).
    min_held_out_tokens: int = 64
    # Static input scales cost some error against per-token ones by design; harm is their held-out cost over
    # their cost on the calibration inputs beyond this share (the scales clip inputs they did not see).
    static_tolerance: float = 0.5
    # The whole model's output on the held-out inputs against the all-rounded model's (holds a rounded copy of
    # the calibrated layers while it runs); a model worse than rounding by more than model_tolerance is rounded.
    model_check: bool = True
    model_tolerance: float = 0.01


def _target_candidates() -> list[FormatChoice]:
    return [FormatChoice(format="int8"), FormatChoice(format="int8", rotation="convrot"), FormatChoice(format="fp8"),
            FormatChoice(format="nvfp4")]


@dataclass
class TargetConfig:
    """The recipe that writes itself: per-layer formats chosen among `candidates` (and float) to meet one target
    with the least error, or, for an error target, the most speed (lowbit_pipe.plan.target_plan; docs/recipes.md)."""

    speedup: Optional[float] = None  # forward time of the float model over the quantized one's (1.6: 1.6x faster)
    bytes: Optional[int] = None  # the whole transformer's bytes (as quantize.budget_bytes)
    ratio: Optional[float] = None  # of the float transformer's bytes (as quantize.budget_ratio)
    error: Optional[float] = None  # relative output error on the calibration inputs
    candidates: list[FormatChoice] = field(default_factory=_target_candidates)  # a rotation is a candidate of its own
    allow_float: bool = True  # float is a candidate (the most sensitive or the fastest-in-float layers stay float)
    # Attention formats the solver may choose, one for the whole model (the `attention:` section's formats; its
    # `layers` still say which modules): each is applied for one timed forward, which also measures its output error,
    # and the plan is solved once per format. ["bf16"]: the model's own attention, as before.
    attention: list[str] = field(default_factory=lambda: ["bf16"])
    # What must load the export: "lowbit_pipe" (every format), "comfyui_pack" (ComfyUI with lowbit_pipe's node pack:
    # every format), "comfyui" (stock ComfyUI: the kinds its own loader knows). Candidates it cannot load are refused.
    loads_in: str = "lowbit_pipe"
    # Time the compiled layers (torch.compile with compile.backend) rather than eager ones; null: when the pipeline
    # has a compile stage.
    compiled: Optional[bool] = None
    check_forward: bool = True  # time the whole quantized forward once and report how far the prediction was off
    # One timed forward per candidate with every layer it fits really quantized at it (lowbit_pipe.plan.speed_model): the
    # candidate's layer times are scaled so a uniform plan's predicted time is its measured time, and the solver's
    # plan (its error probed in one forward) is weighed against the uniform plans that meet the target.
    uniform_probes: bool = True
    frontier_points: int = 16  # Lagrange multipliers per axis of the frontier sweep (points^2 solves, each ~1 ms)


@dataclass
class QuantizeConfig:
    default: FormatChoice = field(default_factory=FormatChoice)
    rules: list[LayerRule] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)  # extra keep-float patterns
    arch_keep_float: bool = True  # apply the architecture's keep-float list
    sensitive: Optional[FormatChoice] = None  # format for the arch's sensitive layers; None = default
    # Layers the chosen format cannot store (in_features not a multiple of its block or rotation group):
    # this format instead; None = they stay float. Either way the plan names each one with its reason.
    fallback: Optional[FormatChoice] = None
    originals: str = "keep"  # float layers swapped out: "keep" (exact evaluate and undo), "cpu", "drop"
    # Where round-to-nearest runs, one layer at a time, each result going back to its weight's device: None (where
    # the weights are), "auto" (the GPU when there is one), "cpu", "cuda", "cuda:N". A model on the CPU quantized
    # on a GPU costs one layer of GPU memory. GPTQ rounds where the model is.
    compute_device: Optional[str] = None
    # Mixed precision by budget (whole transformer bytes); set one of the two.
    budget_bytes: Optional[int] = None
    budget_ratio: Optional[float] = None  # fraction of the float transformer's bytes
    budget_candidates: list[FormatChoice] = field(
        default_factory=lambda: [FormatChoice(format="nvfp4"), FormatChoice(format="int8")])
    budget_allow_float: bool = True  # the most sensitive layers may stay float
    target: TargetConfig = field(default_factory=TargetConfig)  # one of speedup / bytes / ratio / error, or none
    # The speed table's directory (one JSON file per device and software versions); null: ~/.cache/lowbit_pipe.
    speed_cache: Optional[str] = None
    speed_refresh: bool = False  # time every entry again and rewrite the table
    # Seeded example-input sets (of calibration.kinds in turn): budget sensitivity, static scales, GPTQ Hessians.
    calibration_samples: int = 8
    calibration_seed: int = 20_000  # apart from evaluate's seeds (0.., trajectories 10_000..): held-out figures
    # Each sample runs the arch's Euler sampler for this many steps, calibrating on every step's input (DiT
    # activations change with the timestep); 0: one forward at the example's own timestep.
    calibration_steps: int = 4
    # Prompts to calibrate on instead of the arch's example inputs, when the run was given a diffusers pipeline
    # (lowbit_pipe.run(..., model=pipe)): each is generated with the pipeline's own text encoder and sampler for
    # calibration_steps steps (calibration_seed + i), so the hooks see real prompt embeddings at every step.
    calibration_prompts: list[str] = field(default_factory=list)
    calibration_resolution: Optional[int] = None  # height = width of those generations; None: the pipeline's own
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)  # kinds of inputs, held-out check
    # Keep each quantized layer's runtime form next to its stored one where the format has one (w4a8 / w6a8:
    # the decoded int8 grid, instead of a decode on every call; convrot_w4a4: its int4 codes unpacked to int8,
    # which the GEMM reads without unpacking nibbles); +8 bits per weight, the report gives the bytes.
    # Memory only: exports are unchanged. Applies to layers quantized here and to ones loaded quantized.
    prepack: bool = False
    # nvfp4 layers on a GPU without FP4 tensor cores (Hopper and older), where no GEMM takes NVFP4 activations:
    # "auto" computes them weight-only, as stock ComfyUI does there (elsewhere the file's activations);
    # "weight_only" everywhere; "nvfp4" emulates NVFP4 activations everywhere (Blackwell's numerics, to predict a
    # Blackwell deployment on another GPU); "fp8": the weight rounded to e4m3 per row in the GEMM's prologue, fp8
    # activations per token, an fp8 GEMM (fp8 tensor cores; more error). Run time only: exports are unchanged.
    nvfp4_compute: str = "auto"


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
    # An existing file at path (or its LoRA file, shard index) is refused before any work unless this is true; a file
    # that appears meanwhile (another run) is never replaced without it either.
    overwrite: bool = False


@dataclass
class EvaluateConfig:
    seed: int = 1234
    samples: int = 2  # seeded input sets
    batch: int = 1
    image_tokens: int = 64
    text_tokens: int = 8
    # Of text_tokens, how many are attended: the rest is padding under the text mask pipelines pass when they pad
    # prompts to a fixed length (Krea2Pipeline: 512 always). It changes attention's work and error. None: no mask.
    text_valid: Optional[int] = None
    layers: bool = True  # per-layer SQNR (forward hooks during the float pass)
    trajectory_seeds: int = 2  # Euler sampling trajectories (float vs quantized); 0 = off
    steps: int = 4  # Euler steps per trajectory
    diverge_cosine: float = 0.9  # final-latent cosine under this counts as a diverged trajectory
    images: bool = False  # decode the trajectories' final latents: PSNR, SSIM, images.png grid
    latency: bool = True  # forward latency with CUDA events (CUDA only; null on CPU)
    latency_iters: int = 10
    objective: str = "psnr_db"  # the figure a sweeper maximises (evaluate.objective in report.json)
    budget_bytes: Optional[int] = None  # over this many weight bytes the objective is a penalty


@dataclass
class TeardownConfig:
    empty_cuda_cache: bool = True
    clear_kernel_caches: bool = True  # process caches of lowbit_pipe.kernels (Hadamard matrices): pure, rebuilt on use


STOCK_ATTENTION = "bf16"  # attention.format for the model's own attention, whatever its dtype
ATTENTION_FORMATS = (STOCK_ATTENTION, "int8", "fp8")  # int8 / fp8: the format of Q·Kᵀ (P·V is fp8 in both)


@dataclass
class AttentionConfig:
    """8-bit attention (lowbit_pipe.kernels.attention8) in place of the model's own scaled dot-product attention:
    Q·Kᵀ in int8 or fp8 with per-block scales and K smoothing, P·V in fp8, fp32 online softmax. Run time only
    (exports are unchanged); applied with the quantize stage, undone by teardown."""

    # "bf16": the model's own attention, unchanged (whatever its dtype); "int8" / "fp8": the format of Q·Kᵀ.
    format: str = "bf16"
    # Attention modules (diffusers names, e.g. transformer_blocks.*.attn; globs or re:) that get it; the rest keep
    # their own. Calls sdpa8 cannot serve (a mask other than key padding, cross-attention) run the model's own attention anyway.
    layers: list[str] = field(default_factory=lambda: ["*"])
    # The architecture's own list of attention modules that keep the model's attention (Krea 2: the text fusion,
    # short sequences where 8-bit attention costs accuracy and saves no time); false: `layers` alone decides.
    arch_keep: bool = True
    # The uncompiled path: the norms of known classes (Krea 2's RMSNorm, diffusers' RMSNorm) and the processors' RoPE
    # (apply_rotary_emb) as one-pass kernels on CUDA (lowbit_pipe.kernels.norm_rope); torch.compile fuses them anyway.
    # On a ComfyUI model: ComfyUI's own RMSNorms and RoPE (Krea 2, FLUX.1, Qwen-Image; lowbit_pipe.attention.comfy_fused).
    # Independent of `format`: bf16 attention gets it too.
    fused_norm_rope: bool = False
    # On a GPU, the kernel per call shape: "auto" the fastest of cuDNN's FP8 attention (fp8 only, the `cudnn` extra),
    # the Triton kernel and the model's own attention, from times measured once per device and cached beside the speed
    # table (quantize.speed_cache); "cudnn" / "triton" that kernel wherever it serves (lowbit_pipe.attention.crossover).
    route: str = "auto"
    # cuDNN's FP8 attention with q and k written in e4m3 by the RoPE kernel (lowbit_pipe.attention.fold; eager, Krea 2
    # and FLUX processors): no quantize pass over q and k. Checked and timed on an H100 (bench/attention_fold_gpu.py):
    # cosine 0.99997 to bf16, 2-5 % faster than the unfolded call at every shape the router gives cuDNN.
    fold_qk: bool = True


# The names a `pipeline:` may list (lowbit_pipe.stages registers one class per name, and only these), and the modes of
# the stages that have them: the schema's word, checked by lowbit_pipe.config.validate without importing the stages.
PIPELINE_STAGES = ("load", "detect", "quantize", "lora", "compile", "evaluate", "export", "teardown")
COMPILE_MODES = ("regional", "full")  # compile.mode
BAKE_MODES = ("standard", "stochastic")  # lora.mode's ways to bake LoRAs into the weights (lowbit_pipe.lora.bake)
LORA_MODES = ("residual",) + BAKE_MODES  # lora.mode


@dataclass
class Recipe:
    """The whole run: ordered stage names plus one key per stage."""

    name: str = "default"
    seed: int = 0
    pipeline: list[str] = field(default_factory=lambda: ["load", "detect", "quantize", "evaluate", "export", "teardown"])
    model: ModelConfig = field(default_factory=ModelConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    teardown: TeardownConfig = field(default_factory=TeardownConfig)
