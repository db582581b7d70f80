"""The contract every tensor format implements, and the plain data it produces.

A format turns a float weight [out, in] into a `QuantizedWeight`: the exact
tensors ComfyUI stores for that layer (keyed by suffix: "weight",
"weight_scale", ...) plus the `.comfy_quant` record. Formats know nothing of
stages or recipes.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch.nn import functional as F

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats.common import check_finite_weight, record_rotation, spec_rotation
from lowbit_pipe.kernels import dispatch, rotation
from lowbit_pipe.kernels.reference import low_rank_delta, positive_scale

ROTATIONS = ("none", "convrot", "quarot", "hadanorm")
# What a quantized layer does with its input: "dynamic" quantizes it at run time from statistics of each token
# alone (per token, per block or per group: a token's result never depends on the other tokens of the call, its
# batch-mates or padding); "static" with one calibrated per-tensor scale, stored as the layer's `input_scale`;
# "none" not at all (weight-only: the dequantized weight times the input, in the input's dtype).
ACTIVATION_MODES = ("dynamic", "static", "none")
GRANULARITIES = ("row", "tensor")
# Where a dynamic activation scale's statistic is taken (FormatSpec.act_granularity): "token" (each row of the
# input: batch- and padding-invariant, the default) or "tensor" (the whole input of the call, every token of every
# sample in it: nvfp4's global scale as stock ComfyUI computes it; opt-in, formats listing it in
# `act_granularities` only).
ACT_GRANULARITIES = ("token", "tensor")
# The record key of a layer whose dynamic activations use a per-tensor statistic (only ever "tensor": absent means
# per token). An informational key: stock ComfyUI computes nvfp4's per tensor anyway.
ACT_GRANULARITY_KEY = "lowbit_act_granularity"
# The record key stock ComfyUI reads for weight-only layers (it then dequantizes the weight and
# runs the matmul in the compute dtype): how activations "none" is stored.
WEIGHT_ONLY_KEY = "full_precision_matrix_mult"
# GPTQ's column rounding on a fixed grid: (values [N, m], column indices [m]) -> dequantized values [N, m].
GridRounder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FormatSpec:
    """What a layer rule asks of a format."""

    format: str
    rotation: str = "none"  # one of ROTATIONS
    rotation_group: int | None = None  # None: the rotation's default (convrot 256, quarot 128)
    granularity: str | None = None  # int8 / fp8 weight scales: "row", "tensor", None = the format's default
    activations: str = "dynamic"  # "dynamic" per-token, "static" (calibrated input_scale), "none" (weight-only)
    rank: int | None = None  # low-rank branch (svdquant_w4a4); None: the format's default
    act_granularity: str | None = None  # dynamic activation scales: "token" / "tensor" (ACT_GRANULARITIES); None: "token"


@dataclass
class QuantizedWeight:
    """A quantized weight as plain data: on-disk tensors plus its record."""

    format: str  # registry name of the format that made it
    shape: tuple[int, int]  # logical (out_features, in_features)
    tensors: dict[str, torch.Tensor]  # suffix -> tensor, exactly as stored
    record: dict[str, Any] = field(default_factory=dict)  # the `.comfy_quant` JSON
    # Tensors derived from `tensors` for a faster forward (Format.derived_tensors: hadanorm's row sums;
    # Format.prepack: w4a8's decoded int8 grid), held in memory only: never exported, not counted in nbytes.
    runtime: dict[str, torch.Tensor] = field(default_factory=dict)
    # How a forward computes, where the format offers a choice the file does not fix (nvfp4: NVFP4_COMPUTE);
    # None: the format's default. A run-time setting: never exported.
    compute: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class LinearPlan:
    """How a layer's forward runs, as far as its record, the names of its stored tensors and its run-time settings
    fix it: resolved once by `Format.linear_plan`, so a call reads attributes instead of parsing the record.

    A QuantLinear keeps one and resolves it again where what it reads may change (a device move, `compute`, a
    load). Nothing in it comes from tensor values, so tensors replaced by others of the same names and shapes (a
    LoRA bake, or its undo, which swap buffer slots directly) leave it valid; and the device facts are used only
    for an input on the device they were taken for, so tensors moved without `_apply` leave it correct too."""

    shape: tuple[int, int]  # logical (out_features, in_features)
    rotation: str  # the rotation the stored weight carries ("none", or one of ROTATIONS), and its group
    group: int
    activations: str  # one of ACTIVATION_MODES (`Format.activation_mode`)
    per_tensor: bool  # dynamic activation scales from the whole call (`Format.act_per_tensor`)
    compute: str | None  # QuantizedWeight.compute
    device: torch.device | None  # the device `facts` were settled for; None: nothing settled
    facts: dispatch.DeviceFacts | None

    def facts_for(self, x: torch.Tensor) -> dispatch.DeviceFacts | None:
        """The settled device facts when x is on the device they were taken for, else None (decided per call)."""
        return self.facts if self.facts is not None and x.device == self.device else None


MAX_RECORD_BYTES = 65536  # a `.comfy_quant` record is a few hundred bytes of JSON: a larger one is refused unparsed


def encode_record(record: dict[str, Any]) -> torch.Tensor:
    """`.comfy_quant` tensor: compact JSON bytes as uint8."""
    data = json.dumps(record, separators=(",", ":"), sort_keys=False).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.uint8)


def decode_record(tensor: torch.Tensor, where: str) -> dict[str, Any]:
    """Parse a `.comfy_quant` tensor; `where` names the file and key for errors."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise FormatError(f"{where}: .comfy_quant must be a 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    if tensor.numel() > MAX_RECORD_BYTES:
        raise FormatError(f"{where}: .comfy_quant record of {tensor.numel()} bytes, over the {MAX_RECORD_BYTES} a "
                          "record may take (ours are under 1 KiB)")
    try:
        record = json.loads(tensor.contiguous().cpu().numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise FormatError(f"{where}: .comfy_quant is not valid JSON ({str(err)[:200]})") from None
    if not isinstance(record, dict) or "format" not in record:
        raise FormatError(f"{where}: .comfy_quant record has no 'format' field: {str(record)[:200]}")
    for key in ("format", "lowbit_format"):
        if key in record and not isinstance(record[key], str):
            raise FormatError(f"{where}: .comfy_quant '{key}' is {str(record[key])[:80]}, not a format name")
    return record


class Format(ABC):
    """One tensor format. Subclasses are stateless; register them in formats/__init__.py."""

    name: ClassVar[str]  # our name, used in recipes ("int8", "nvfp4", ...)
    comfy_name: ClassVar[str]  # the "format" string in `.comfy_quant`
    bits_per_weight: ClassVar[float]  # storage cost including scales, for planning
    rotations: ClassVar[tuple[str, ...]] = ("none",)  # rotations this format can carry
    fused_lora_on_cuda: ClassVar[bool] = False  # `linear(..., lora=(down, up))` fuses the LoRA branch on CUDA
    act_qmax: ClassVar[float]  # activation code range: a static input_scale is input amax / act_qmax
    stock_input_scale: ClassVar[bool] = False  # stock ComfyUI reads `input_scale` for this format
    no_static_reason: ClassVar[str] = ""  # why activations=static is refused ("" = it is supported)
    act_granularities: ClassVar[tuple[str, ...]] = ("token",)  # FormatSpec.act_granularity values it computes
    # Stored tensors whose output rows are not on dim 0: 1 for those stored [.., N] (transposed), None for
    # input-side tensors that the parts of a fused layer share. The rest: per row on dim 0, or shared scalars.
    row_axes: ClassVar[dict[str, int | None]] = {}
    values_per_byte: ClassVar[int] = 1  # stored `weight` columns hold this many inputs (packed 4-bit: 2)

    @abstractmethod
    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        """Quantize a float weight [out, in] (any float dtype)."""

    @abstractmethod
    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        """Float32 weight [out, in] in the ORIGINAL (unrotated) basis. `plan`: q's, already resolved (a layer's
        forward), so the record is not read again; None: read from q."""

    @abstractmethod
    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        """y = x W^T + b with this format's weight and activation quantization; returns x.dtype. `plan`:
        `linear_plan(q)` as a layer settled it; None resolves it from q on this call."""

    @abstractmethod
    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        """Rebuild from stored tensors, checking shapes and dtypes against the record.

        `where` names the file and layer; every FormatError raised names it.
        """

    def check_spec(self, spec: FormatSpec) -> None:
        """Raise ValueError if this format cannot honour `spec` (checked at recipe validation)."""
        if spec.rotation not in self.rotations:
            raise ValueError(f"format '{self.name}' does not support rotation '{spec.rotation}' (supports {list(self.rotations)})")
        if spec.activations not in ACTIVATION_MODES:
            raise ValueError(f"format '{self.name}': activations must be one of {list(ACTIVATION_MODES)}, "
                             f"got '{spec.activations}'")
        if spec.activations == "static" and self.no_static_reason:
            raise ValueError(f"{self.name}: {self.no_static_reason}; use activations 'dynamic' or 'none' "
                             "(no static input_scale)")
        if spec.act_granularity is not None and spec.act_granularity not in ACT_GRANULARITIES:
            raise ValueError(f"format '{self.name}': act_granularity must be one of {list(ACT_GRANULARITIES)}, "
                             f"got '{spec.act_granularity}'")
        if spec.act_granularity not in (None, *self.act_granularities):
            raise ValueError(f"format '{self.name}' takes act_granularity {list(self.act_granularities)} only: its dynamic "
                             "activation scales come from each token alone")

    def act_per_tensor(self, q: QuantizedWeight) -> bool:
        """Whether the layer's dynamic activations take their scale from the whole input of the call (the record's
        ACT_GRANULARITY_KEY, an opt-in) rather than from each token."""
        return q.record.get(ACT_GRANULARITY_KEY) == "tensor"

    def checked_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """fp32 2-D copy of a finite weight this format can store; FormatError naming the problem otherwise."""
        w = check_finite_weight(weight)
        problem = self.shape_problem(*w.shape)
        if problem:
            raise FormatError(f"{self.name}: {problem}")
        return w

    # ---- the forward's plan -----------------------------------------------------------------
    def stored_rotation(self, q: QuantizedWeight) -> tuple[str, int]:
        """(kind, group) the stored weight is rotated with, from its record; formats whose rotation is part of the
        format (ConvRot's) override it."""
        return record_rotation(q.record, q.format)

    def linear_plan(self, q: QuantizedWeight, device: torch.device | None = None) -> LinearPlan:
        """What `linear` and `dequantize` read from q's record and settings, resolved once. `device`: settle the
        device facts of the GPU paths for it (a layer's device); None leaves them to each call."""
        kind, group = self.stored_rotation(q)
        facts = dispatch.device_facts(device) if device is not None else None
        return LinearPlan(q.shape, kind, group, self.activation_mode(q), self.act_per_tensor(q), q.compute, device,
                          facts)

    def rotation_of(self, q: QuantizedWeight, plan: LinearPlan | None) -> tuple[str, int]:
        """(kind, group) from the plan when there is one, else from q's record."""
        return (plan.rotation, plan.group) if plan is not None else self.stored_rotation(q)

    # ---- activations ------------------------------------------------------------------------
    def activation_mode(self, q: QuantizedWeight) -> str:
        """"none" (the record's weight-only key), "static" (an input_scale is stored) or "dynamic"."""
        if q.record.get(WEIGHT_ONLY_KEY):
            return "none"
        return "static" if "input_scale" in q.tensors else "dynamic"

    def input_rotation(self, spec: FormatSpec, in_features: int) -> tuple[str, int]:
        """(kind, group) the layer applies to its input before quantizing it: a static input_scale is
        calibrated on the input after this rotation."""
        return spec_rotation(spec, in_features)

    def with_activations(self, q: QuantizedWeight, mode: str, input_amax: float | torch.Tensor | None = None,
                         where: str = "") -> QuantizedWeight:
        """`q` set up for activation `mode`: "none" writes the weight-only record key, "static" stores
        input_scale = input_amax / act_qmax (`input_amax`: of the rotated input), "dynamic" neither."""
        # the per-tensor activation marker means something for dynamic activations only
        drop = (WEIGHT_ONLY_KEY,) if mode == "dynamic" else (WEIGHT_ONLY_KEY, ACT_GRANULARITY_KEY)
        record = {k: v for k, v in q.record.items() if k not in drop}
        tensors = {k: v for k, v in q.tensors.items() if k != "input_scale"}
        if mode == "none":
            record[WEIGHT_ONLY_KEY] = True
        elif mode == "static":
            if input_amax is None:
                raise FormatError(f"{where or self.name}: static activations need the calibrated input amax")
            amax = torch.as_tensor(input_amax, dtype=torch.float32).reshape(())
            tensors["input_scale"] = positive_scale(amax, self.act_qmax)
        elif mode != "dynamic":
            raise FormatError(f"{where or self.name}: unknown activation mode '{mode}' (known: {list(ACTIVATION_MODES)})")
        return QuantizedWeight(q.format, q.shape, tensors, record)

    def attach_input_scale(self, q: QuantizedWeight, input_amax: float | torch.Tensor) -> QuantizedWeight:
        """Static activations: input_scale = input_amax / act_qmax (amax of the ROTATED input if rotated)."""
        return self.with_activations(q, "static", input_amax)

    def derived_tensors(self, q: QuantizedWeight) -> dict[str, torch.Tensor]:
        """Small tensors a forward needs that follow from `q.tensors` alone, computed once per layer (a QuantLinear
        keeps them as non-exported buffers, recomputed when its tensors change): hadanorm's group row sums."""
        kind, group = record_rotation(q.record, q.format)
        if kind != "hadanorm":
            return {}
        return {"hadanorm_rowsums": rotation.group_rowsums(self.dequantize(q), group)}

    def hadanorm_rowsums(self, q: QuantizedWeight, group: int) -> torch.Tensor:
        """The layer's hadanorm row sums: its derived buffer, or computed from the weight (a bare QuantizedWeight)."""
        rowsums = q.runtime.get("hadanorm_rowsums")
        return rowsums if rowsums is not None else rotation.group_rowsums(self.dequantize(q), group)

    def prepack(self, q: QuantizedWeight) -> dict[str, torch.Tensor] | None:
        """Runtime tensors that make `linear` faster at a memory cost (recipe `quantize.prepack`), or None
        where the format has nothing to prepack. Derived from `q.tensors` alone; `linear` must give the same
        result with or without them."""
        return None

    def weight_only_linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None,
                           lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                           plan: LinearPlan | None = None) -> torch.Tensor:
        """Activations "none": x @ dequantize(W)^T in x's dtype (what stock ComfyUI computes for a
        weight-only layer), on any device; a LoRA branch is added after."""
        w = self.dequantize_like(q, x, plan)
        y = F.linear(x, w, bias.to(x.dtype) if bias is not None else None)
        return y + low_rank_delta(x, *lora) if lora is not None else y

    def dequantize_like(self, q: QuantizedWeight, x: torch.Tensor, plan: LinearPlan | None = None) -> torch.Tensor:
        """The dequantized weight [N, K] in x's dtype on x's device, for a weight-only matmul: `dequantize` in torch;
        formats with a GPU decode kernel (kernels.decode) override it for GPU inputs, with the same values."""
        return self.dequantize(q, plan).to(device=x.device, dtype=x.dtype)

    def logical_shape(self, weight_shape: tuple[int, ...], record: dict[str, Any]) -> tuple[int, int]:
        """Logical (out, in) of a layer from its stored `weight` shape (formats whose record says more override)."""
        return (int(weight_shape[0]), int(weight_shape[1]) * self.values_per_byte)

    # ---- fixed-grid rounding (GPTQ) ----------------------------------------------------------
    def calibrated_grid(self, weight: torch.Tensor, spec: FormatSpec, hessian: torch.Tensor) -> QuantizedWeight:
        """The grid GPTQ rounds on, given the input Hessian (rotated basis): round-to-nearest's by default; a
        format with an activation-aware grid search (awq_w4a16's clipping) overrides it."""
        return self.quantize(weight, spec)

    def grid_target(self, q: QuantizedWeight, weight: torch.Tensor, spec: FormatSpec,
                    hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, Hessian) GPTQ rounds on `q`'s grid: the weight in the stored basis and the Hessian of the input
        that meets it. Default: the rotated weight against the rotated input's Hessian; svdquant_w4a4 gives its
        smoothed residual (weight minus the low-rank branch, times the smoothing) and the smoothed input's."""
        kind, group = self.input_rotation(spec, weight.shape[1])
        return rotation.rotate_weight(weight, kind, group or None), hessian

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        """`round(values, cols)`: `values` [N, m] (the stored, rotated basis) of weight columns `cols` [m]
        rounded to the grid `q`'s scales define (they stay fixed), dequantized, fp32. What error-feedback
        quantizers (GPTQ) round each column with, so only the stored codes change, never the scales or the
        layout. The per-column scale table is built once here, not per column."""
        raise NotImplementedError(f"format '{self.name}' has no fixed-grid rounding (GPTQ)")

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        """`q` with its codes replaced by those of `values` [N, K] (rotated basis) on `q`'s fixed grid."""
        raise NotImplementedError(f"format '{self.name}' has no fixed-grid rounding (GPTQ)")

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        """Why a layer of this shape cannot be stored in this format, or None when it can."""
        return None

    def supports_shape(self, out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape can be stored in this format (else it stays float or falls back)."""
        return self.shape_problem(out_features, in_features) is None

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        """Bytes the stored tensors of one layer take (formats override with the exact count)."""
        return int(round(self.bits_per_weight * out_features * in_features / 8))
