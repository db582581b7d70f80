"""int8_tensorwise: int8 weight, fp32 per-row [N, 1] or per-tensor scalar scale; int8 activations,
dynamic per token (scale amax_row / 127), static (a calibrated per-tensor `input_scale`, ours: stock
ComfyUI ignores it and quantizes per token) or none (weight-only, the record's stock
`full_precision_matrix_mult`).

Quantization is comfy-kitchen's: scale = max(amax / 127, 1e-30), codes =
clamp(round_half_even(w / scale), -128, 127) (never below -127 in practice).
ConvRot (stock): record {"format": "int8_tensorwise", "convrot": true,
"convrot_groupsize": g}; the weight is stored rotated (W @ H^T per group) and
ComfyUI rotates activations online. Layers whose in_features is not a multiple
of the group are stored unrotated and the record omits "convrot". quarot and
hadanorm are ours (record markers, not loadable by stock ComfyUI).
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation


def quantize_int8(w: torch.Tensor, per_row: bool, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (codes int8, scale fp32 [N, 1] or scalar), comfy-kitchen's arithmetic.

    `generator` switches to stochastic rounding floor(x + U[0, 1)) (for LoRA bakes).
    """
    amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax()
    scale = (amax.float() / 127.0).clamp(min=1e-30)
    scaled = w / scale
    if generator is None:
        rounded = scaled.round()
    else:
        rounded = torch.floor(scaled + torch.rand(scaled.shape, generator=generator, device=scaled.device))
    return rounded.clamp(-128.0, 127.0).to(torch.int8), scale


@register
class Int8(Format):
    name = "int8"
    comfy_name = "int8_tensorwise"
    bits_per_weight = 8.0
    fused_lora_on_cuda = True
    rotations = ("none", "convrot", "quarot", "hadanorm")
    act_qmax = 127.0

    def check_spec(self, spec: FormatSpec) -> None:
        super().check_spec(spec)
        if spec.granularity not in (None, "row", "tensor"):
            raise ValueError(f"int8: granularity must be 'row' or 'tensor', got '{spec.granularity}'")
        if spec.rotation != "none":
            rotation.resolve_group(spec.rotation, spec.rotation_group)

    def quantize(self, weight: torch.Tensor, spec: FormatSpec, generator: torch.Generator | None = None) -> QuantizedWeight:
        w = common.check_finite_weight(weight)
        n, k = w.shape
        kind, group = common.spec_rotation(spec, k)
        codes, scale = quantize_int8(rotation.rotate_weight(w, kind, group), spec.granularity != "tensor", generator)
        record = common.rotation_record({"format": self.comfy_name}, self.name, kind, group, stock_convrot=True)
        return QuantizedWeight(self.name, (n, k), {"weight": codes, "weight_scale": scale}, record)

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        w_rot = q.tensors["weight"].float() * q.tensors["weight_scale"].float()
        kind, group = self.rotation_of(q, plan)
        return rotation.unrotate_weight(w_rot, kind, group)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        """`lora` (down [R, K], up [N, R]): a LoRA residual fused into the GPU path (GEMM epilogue);
        elsewhere added after the reference as (x @ down^T) @ up^T."""
        plan = plan if plan is not None else self.linear_plan(q)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, lora, plan)
        kind, group = plan.rotation, plan.group
        static = q.tensors.get("input_scale")
        w, ws = q.tensors["weight"], q.tensors["weight_scale"]
        if kind == "hadanorm" and dispatch.int8_supported(x, "none"):
            return dispatch.hadanorm_linear(x, group, lambda xr: dispatch.int8_linear(xr, w, ws, bias, input_scale=static),
                                            self.hadanorm_rowsums(q, group), lora)
        if dispatch.int8_supported(x, kind):  # GPU: Triton quant (+rotation) and INT8 GEMM
            down, up = lora if lora is not None else (None, None)
            return dispatch.int8_linear(x, w, ws, bias, kind, group, lora_down=down, lora_up=up, input_scale=static)
        if lora is not None:
            return self.linear(x, q, bias, plan=plan) + reference.low_rank_delta(x, *lora)
        x_rot, mu = rotation.rotate_activation(x, kind, group)
        y = reference.int8_linear_fp32(x_rot, w, ws, static)
        if mu is not None:
            y = y + rotation.mean_correction(mu, self.hadanorm_rowsums(q, group))
        return common.out_dtype_result(y, bias, x.dtype)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", "weight_scale", "input_scale"), where, fmt)
        w = common.require(tensors, "weight", where, fmt)
        s = common.require(tensors, "weight_scale", where, fmt)
        common.check_dtype(w, "weight", where, (torch.int8,))
        if w.dim() != 2:
            raise FormatError(f"{where}.weight: expected a 2-D int8 tensor, got shape {tuple(w.shape)}")
        common.check_dtype(s, "weight_scale", where, (torch.float32, torch.bfloat16, torch.float16))
        s = common.scalar_or_row_scale(s, w.shape[0], "weight_scale", where)
        common.check_rotation_fits(record, w.shape[1], where)
        out = {"weight": w, "weight_scale": s, **common.optional_input_scale(tensors, where)}
        return QuantizedWeight(self.name, (int(w.shape[0]), int(w.shape[1])), out, dict(record))

    @staticmethod
    def _codes(q: QuantizedWeight, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = q.tensors["weight_scale"].float()
        s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(())
        return (values.float() / s).round().clamp(-128.0, 127.0), s

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            codes, s = self._codes(q, values)
            return codes * s
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        codes, _ = self._codes(q, values)
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": codes.to(torch.int8)}, dict(q.record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        per_row = spec is None or spec.granularity != "tensor"  # per row by default (stock ComfyUI takes both)
        return out_features * in_features + 4 * (out_features if per_row else 1)
