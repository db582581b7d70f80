"""float8_e4m3fn: fp8 e4m3 weight with an fp32 scale; fp8 activations.

Tensors: weight fp8 e4m3 [N, K]; weight_scale fp32 scalar (granularity "tensor", the
default: what stock ComfyUI's fp8 matmul takes) or [N, 1] (granularity "row": more
accurate, but stock ComfyUI's fp8 GPU matmul raises on it, so the record is our kind
`lowbit_fp8` with `lowbit_granularity: row`, refused by stock ComfyUI as a whole, run by
lowbit_pipe and its ComfyUI node pack); input_scale fp32 scalar, optional (static
activations, set by `attach_input_scale`). Files of other tools with a per-row scale under
`float8_e4m3fn` load too.

Quantization is comfy-kitchen's `quantize_per_tensor_fp8`: q = fp8(clamp(w *
(1/scale), ±448)) with scale = amax / 448 (bit-exact for fp32 input). Weight
rotation (quarot / hadanorm / convrot) is ours only: the record gets
`lowbit_*` markers.

Activations (reference `linear`): static per-tensor x * (1/input_scale) when
input_scale is stored, weight-only when the record has `full_precision_matrix_mult`,
else dynamic per-token scale amax_row / 448.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation


def _nonzero_scales(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A zero weight scale (an all-zero row or tensor, written by another tool as amax / 448 = 0) becomes
    1 with its codes zeroed: the same dequantized weight, and every scale can be divided by (the
    Hopper GEMM starts its accumulator at the LoRA branch / (a_scale w_scale))."""
    zero = s == 0
    if not bool(zero.any()):
        return w, s
    rows = zero.reshape(-1, 1) if zero.dim() else zero
    codes = torch.where(rows, torch.zeros((), dtype=torch.uint8), w.view(torch.uint8)).view(torch.float8_e4m3fn)
    return codes, torch.where(zero, torch.ones((), dtype=s.dtype), s)


@register
class FP8(Format):
    name = "fp8"
    comfy_name = "float8_e4m3fn"
    bits_per_weight = 8.0
    fused_lora_on_cuda = True
    rotations = ("none", "convrot", "quarot", "hadanorm")
    act_qmax = reference.FP8_E4M3_MAX
    stock_input_scale = True

    def check_spec(self, spec: FormatSpec) -> None:
        super().check_spec(spec)
        if spec.granularity not in (None, "row", "tensor"):
            raise ValueError(f"fp8: granularity must be 'row' or 'tensor', got '{spec.granularity}'")

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = common.check_finite_weight(weight)
        n, k = w.shape
        kind, group = common.spec_rotation(spec, k)
        w_rot = rotation.rotate_weight(w, kind, group)
        if spec.granularity != "row":  # one scale per tensor by default: what stock ComfyUI's fp8 matmul takes
            scale = reference.positive_scale(w_rot.abs().amax(), reference.FP8_E4M3_MAX)
        else:
            scale = reference.positive_scale(w_rot.abs().amax(dim=1, keepdim=True), reference.FP8_E4M3_MAX)
        q = reference.fp8_quantize(w_rot, scale)
        record = common.rotation_record({"format": self.comfy_name}, self.name, kind, group, stock_convrot=False)
        if scale.numel() > 1:  # stock ComfyUI's fp8 GPU matmul takes one weight scale: per row is our kind
            record = {**common.lowbit_kind(record, self.name), "lowbit_granularity": "row"}
        return QuantizedWeight(self.name, (n, k), {"weight": q, "weight_scale": scale}, record)

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        w_rot = q.tensors["weight"].float() * q.tensors["weight_scale"].float()
        kind, group = self.rotation_of(q, plan)
        return rotation.unrotate_weight(w_rot, kind, group)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        """`lora` (down [R, K], up [N, R]): a LoRA residual fused into the GPU path (on Hopper the
        fp8 GEMM's initial accumulator, else an in-place addmm_ into cuBLAS's output); on the CPU
        added after the reference as (x @ down^T) @ up^T."""
        plan = plan if plan is not None else self.linear_plan(q)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, lora, plan)
        kind, group = plan.rotation, plan.group
        t, facts = q.tensors, plan.facts_for(x)
        if kind == "hadanorm" and dispatch.fp8_supported(x, t["weight"], "none", facts):
            def unrotated(xr: torch.Tensor) -> torch.Tensor:
                return dispatch.fp8_linear(xr, t["weight"], t["weight_scale"], t.get("input_scale"), bias, facts=facts)
            return dispatch.hadanorm_linear(x, group, unrotated, self.hadanorm_rowsums(q, group), lora)
        if dispatch.fp8_supported(x, t["weight"], kind, facts):  # GPU: Triton quant + fp8 GEMM
            down, up = lora if lora is not None else (None, None)
            return dispatch.fp8_linear(x, t["weight"], t["weight_scale"], t.get("input_scale"), bias, kind, group,
                                       lora_down=down, lora_up=up, facts=facts)
        if lora is not None:
            return self.linear(x, q, bias, plan=plan) + reference.low_rank_delta(x, *lora)
        x_rot, mu = rotation.rotate_activation(x, kind, group)
        y = reference.fp8_linear(x_rot, t["weight"], t["weight_scale"], t.get("input_scale"))
        if mu is not None:
            y = y + rotation.mean_correction(mu, self.hadanorm_rowsums(q, group))
        return common.out_dtype_result(y, bias, x.dtype)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        common.check_no_unknown(tensors, ("weight", "weight_scale", "input_scale"), where, self.comfy_name)
        w = common.require(tensors, "weight", where, self.comfy_name)
        s = common.require(tensors, "weight_scale", where, self.comfy_name)
        common.check_dtype(w, "weight", where, (torch.float8_e4m3fn,))
        if w.dim() != 2:
            raise FormatError(f"{where}.weight: expected 2-D, got shape {tuple(w.shape)}")
        common.check_dtype(s, "weight_scale", where, (torch.float32,))
        s = common.scalar_or_row_scale(s, w.shape[0], "weight_scale", where)
        w, s = _nonzero_scales(w, s)
        out = {"weight": w, "weight_scale": s, **common.optional_input_scale(tensors, where)}
        common.check_rotation_fits(record, w.shape[1], where)
        return QuantizedWeight(self.name, (int(w.shape[0]), int(w.shape[1])), out, dict(record))

    @staticmethod
    def _scale(q: QuantizedWeight) -> torch.Tensor:
        s = q.tensors["weight_scale"].float()
        return s.reshape(-1, 1) if s.numel() > 1 else s.reshape(())

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        s = self._scale(q)
        return lambda values, cols: reference.fp8_quantize(values, s).float() * s

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        codes = reference.fp8_quantize(values, self._scale(q))
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": codes}, dict(q.record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        per_row = spec is not None and spec.granularity == "row"
        return out_features * in_features + 4 * (out_features if per_row else 1)
