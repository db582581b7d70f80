"""mxfp8: fp8 e4m3 weight with one power-of-two (E8M0) scale per block of 32 along K (OCP MX).

Tensors (ComfyUI `mxfp8` / comfy-kitchen `TensorCoreMXFP8Layout`):
- weight float8_e4m3fn [N, K]; N and K multiples of 32 (comfy-kitchen pads to 32 x 32, but
  ComfyUI's weight-only fallback would then see the padded shape, so such layers are refused).
- weight_scale float8_e8m0fnu [roundup(N,128), roundup(K/32,4)]: biased exponents e (value 2^(e-127),
  e = 0 read as 0: a zero block) in the cuBLAS swizzled 128x4 tile layout, the same tiling as nvfp4's
  block scales.
Quantization is comfy-kitchen's `quantize_mxfp8`: e = ceil(log2(max(amax / 448, 2^-127))) + 127
clamped to [0, 254]; codes = fp8(clamp(w / 2^(e-127), +-448)); an all-zero block stores e = 0 and
zero codes. A non-zero block so small that e = 0 (amax < 448 * 2^-127) gets zero codes here, where
comfy-kitchen divides by its zero scale; both dequantize it to 0.

Activations (reference `linear`): "dynamic" quantizes each input row to MXFP8 the same way (what ComfyUI
does where it runs MXFP8 natively: SM >= 10.0); on a GPU (dispatch.mxfp8_linear) both operands' exact
values in bf16 on its tensor cores, the reference up to the order of the fp32 sum;
"none" is weight-only (what stock ComfyUI computes on older GPUs and the CPU, where it treats mxfp8
as emulated). No static scales: activation scales are per block, found at run time.
Rotations are ours only (markers, as for nvfp4).
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation

BLOCK = 32
E8M0_BIAS = 127


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


def _exponent_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (int32) -> fp32 2^(e-127), 0 for e = 0 (comfy-kitchen's e8m0_to_f32)."""
    bits = e.to(torch.int32) << 23
    return torch.where(e == 0, torch.zeros_like(bits), bits).view(torch.float32)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [rows, K] (K % 32 == 0) -> (codes fp8 e4m3 [rows, K], biased exponents int32 [rows, K/32])."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    needed = torch.clamp(amax / reference.FP8_E4M3_MAX, min=2.0 ** -127)
    e = (torch.ceil(torch.log2(needed)).to(torch.int32) + E8M0_BIAS).clamp(0, 254)
    e = torch.where(amax == 0, torch.zeros_like(e), e)
    scale = _exponent_to_scale(e)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    data = torch.where((scale == 0).unsqueeze(-1), torch.zeros_like(blocks), blocks / safe)
    codes = data.clamp(-reference.FP8_E4M3_MAX, reference.FP8_E4M3_MAX).reshape(rows, k).to(torch.float8_e4m3fn)
    return codes, e


def dequantize_blocks(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    rows, k = codes.shape
    return (codes.float().reshape(rows, k // BLOCK, BLOCK) * _exponent_to_scale(e).unsqueeze(-1)).reshape(rows, k)


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Activation emulation: rows of x [..., K] quantized to MXFP8 and back, fp32."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    return dequantize_blocks(*quantize_blocks(x2)).reshape(x.shape)


@register
class MXFP8(Format):
    name = "mxfp8"
    comfy_name = "mxfp8"
    bits_per_weight = 8.25
    rotations = ("none", "convrot", "quarot", "hadanorm")
    act_qmax = reference.FP8_E4M3_MAX
    no_static_reason = "activations are scaled per block of 32 at run time"

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        return common.block_problem(out_features, in_features, BLOCK, "MXFP8")

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = self.checked_weight(weight)
        n, k = w.shape
        kind, group = common.spec_rotation(spec, k)
        codes, e = quantize_blocks(rotation.rotate_weight(w, kind, group))
        scales = reference.swizzle_block_scales(e.to(torch.uint8)).view(torch.float8_e8m0fnu)
        record = common.rotation_record({"format": self.comfy_name}, self.name, kind, group, stock_convrot=False)
        return QuantizedWeight(self.name, (n, k), {"weight": codes, "weight_scale": scales}, record)

    def _exponents(self, q: QuantizedWeight) -> torch.Tensor:
        n, k = q.shape
        return reference.unswizzle_block_scales(q.tensors["weight_scale"].view(torch.uint8), n, k // BLOCK).to(torch.int32)

    def _dequantize_rotated(self, q: QuantizedWeight) -> torch.Tensor:
        return dequantize_blocks(q.tensors["weight"], self._exponents(q))

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        kind, group = self.rotation_of(q, plan)
        return rotation.unrotate_weight(self._dequantize_rotated(q), kind, group)

    def dequantize_like(self, q: QuantizedWeight, x: torch.Tensor, plan: LinearPlan | None = None) -> torch.Tensor:
        t = q.tensors
        kind, _ = self.rotation_of(q, plan)
        if kind != "none" or not dispatch.decode_supported(x, t["weight"]):  # rotated: unrotated in torch
            return super().dequantize_like(q, x, plan)
        return dispatch.mxfp8_weight(t["weight"], t["weight_scale"], x.dtype)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        plan = plan if plan is not None else self.linear_plan(q)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, plan=plan)
        kind, group, facts, t = plan.rotation, plan.group, plan.facts_for(x), q.tensors
        if kind == "hadanorm" and dispatch.mxfp8_supported(x, t["weight"], "none"):
            def unrotated(xr: torch.Tensor) -> torch.Tensor:
                return dispatch.mxfp8_linear(xr, t["weight"], t["weight_scale"], bias, facts=facts)
            return dispatch.hadanorm_linear(x, group, unrotated, self.hadanorm_rowsums(q, group))
        if dispatch.mxfp8_supported(x, t["weight"], kind):  # GPU: Triton fake quant + decode, bf16 tensor cores
            return dispatch.mxfp8_linear(x, t["weight"], t["weight_scale"], bias, kind, group, facts=facts)
        x_rot, mu = rotation.rotate_activation(x, kind, group)
        y = fake_quant(x_rot) @ self._dequantize_rotated(q).to(x.device).t()
        if mu is not None:
            y = y + rotation.mean_correction(mu, self.hadanorm_rowsums(q, group))
        return common.out_dtype_result(y, bias, x.dtype)

    # ---- fixed-grid rounding (GPTQ): the block exponents stay, the codes change --------------------
    def _block_scales(self, q: QuantizedWeight) -> torch.Tensor:
        """fp32 2^(e-127) per (row, block of 32), [N, K/32] (unswizzled)."""
        return _exponent_to_scale(self._exponents(q))

    @staticmethod
    def _grid_codes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        data = torch.where(scale == 0, torch.zeros_like(values.float()), values.float() / safe)
        return data.clamp(-reference.FP8_E4M3_MAX, reference.FP8_E4M3_MAX).to(torch.float8_e4m3fn)

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        scales = self._block_scales(q)  # unswizzled once

        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            scale = scales[:, cols // BLOCK]
            return self._grid_codes(values, scale).float() * scale
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        scale = self._block_scales(q).repeat_interleave(BLOCK, dim=1)
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": self._grid_codes(values, scale)},
                               dict(q.record))

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", "weight_scale"), where, fmt)
        w = common.require(tensors, "weight", where, fmt)
        s = common.require(tensors, "weight_scale", where, fmt)
        common.check_dtype(w, "weight", where, (torch.float8_e4m3fn, torch.uint8))
        w = w.view(torch.float8_e4m3fn) if w.dtype == torch.uint8 else w
        if w.dim() != 2:
            raise FormatError(f"{where}.weight: expected 2-D, got shape {tuple(w.shape)}")
        n, k = int(w.shape[0]), int(w.shape[1])
        problem = self.shape_problem(n, k)
        if problem:
            raise FormatError(f"{where}.weight: {problem}")
        common.check_dtype(s, "weight_scale", where, (torch.float8_e8m0fnu, torch.uint8))
        s = s.view(torch.float8_e8m0fnu) if s.dtype == torch.uint8 else s
        common.check_shape(s, "weight_scale", where, (_roundup(n, 128), _roundup(k // BLOCK, 4)),
                           "swizzled 128x4 tiles of E8M0 block scales")
        if bool((s.view(torch.uint8) == 255).any()):
            raise FormatError(f"{where}.weight_scale: E8M0 exponent 255 (NaN)")
        common.check_rotation_fits(record, k, where)
        return QuantizedWeight(self.name, (n, k), {"weight": w, "weight_scale": s}, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        return out_features * in_features + _roundup(out_features, 128) * _roundup(in_features // BLOCK, 4)
