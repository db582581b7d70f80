"""awq_w4a16: asymmetric 4-bit weight with a float scale and zero per group of 64 along K; float
activations (W4A16: the weight is dequantized and multiplied in the input's dtype).

Tensors (comfy-kitchen `TensorCoreAWQW4A16Layout`, record format `awq_w4a16`):
- weight int8 [N, K/2]: unsigned 4-bit codes u in [0, 15], column 2j in the LOW nibble.
- weight_scale bf16 [K/64, N] and weight_zeros bf16 [K/64, N] (fp16 read too).
Value = (u - 8) * scale + zero, computed in the scales' dtype (what comfy-kitchen's `gemv_awq_w4a16`
and dequantize do, so the dequantized weight is bit-exact with theirs).

Rounding: per (row, group) the range [lo, hi] = alpha * [min, max] is split in 15 steps:
scale = (hi - lo) / 15, zero = lo + 8 * scale, u = clamp(round((w - zero) / scale + 8), 0, 15).
RTN takes alpha = 1. With calibration (`quantize.gptq.enabled`), AWQ's clipping search picks alpha per
(row, group) from ALPHAS to minimise that group's output error against the input Hessian's diagonal
block, and GPTQ then rounds on that grid. comfy-kitchen writes no such files itself (its layout is
load-only); stock ComfyUI master has no `awq_w4a16` entry, so files with it need a loader that has
one (ComfyUI builds that add it, or comfy-kitchen directly).
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch

GROUP = 64
SCALE_DTYPE = torch.bfloat16
ALPHAS = tuple(1.0 - 0.05 * i for i in range(11))  # clipping ratios searched: 1.0 .. 0.5


def grid(w: torch.Tensor, alpha: torch.Tensor | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) in SCALE_DTYPE, [N, K/64], of w [N, K] with its group range clipped by `alpha`."""
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    lo = groups.amin(dim=-1).clamp(max=0.0) * alpha
    hi = groups.amax(dim=-1).clamp(min=0.0) * alpha
    scale = ((hi - lo) / 15.0).to(SCALE_DTYPE)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale, zero 0
    zero = (lo + 8.0 * scale.float()).to(SCALE_DTYPE)
    return scale, zero


def codes_on_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest codes u in [0, 15] of w [N, m] on per-column (scale, zero) [N, m]."""
    return torch.round((w.float() - zero.float()) / scale.float() + 8.0).clamp(0, 15)


def decode(u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(u - 8) * scale + zero in the scales' dtype (comfy-kitchen's arithmetic), as fp32."""
    return ((u.to(scale.dtype) - 8.0) * scale + zero).float()


@register
class AWQW4A16(Format):
    name = "awq_w4a16"
    comfy_name = "awq_w4a16"
    bits_per_weight = 4.5  # 4-bit codes + bf16 scale and zero per 64
    rotations = ("none",)
    row_axes = {"weight_scale": 1, "weight_zeros": 1}
    values_per_byte = 2
    no_static_reason = "activations stay in float (W4A16: 'dynamic' and 'none' both mean weight-only)"

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        return common.group_problem(in_features, GROUP)

    def _pack(self, u: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
        packed = common.pack_nibbles(u.to(torch.int32), even_high=False).view(torch.int8)
        tensors = {"weight": packed, "weight_scale": scale.t().contiguous(), "weight_zeros": zero.t().contiguous()}
        return QuantizedWeight(self.name, shape, tensors, {"format": self.comfy_name, "group_size": GROUP})

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        return self._quantize_alpha(self.checked_weight(weight), 1.0)

    def _quantize_alpha(self, w: torch.Tensor, alpha: torch.Tensor | float) -> QuantizedWeight:
        n, k = w.shape
        scale, zero = grid(w, alpha)
        u = codes_on_grid(w, scale.repeat_interleave(GROUP, 1), zero.repeat_interleave(GROUP, 1))
        return self._pack(u, scale, zero, (n, k))

    def calibrated_grid(self, weight: torch.Tensor, spec: FormatSpec, hessian: torch.Tensor) -> QuantizedWeight:
        """AWQ's clipping search: per (row, group) the ALPHAS entry whose rounding error e costs the group's
        output least, e^T H_gg e (H_gg: the input Hessian's diagonal 64x64 block), then RTN on that grid."""
        w = common.check_finite_weight(weight).to(hessian.device)
        n, k = w.shape
        g = k // GROUP
        blocks = torch.stack([hessian[i * GROUP:(i + 1) * GROUP, i * GROUP:(i + 1) * GROUP] for i in range(g)]).float()
        best_loss = torch.full((n, g), float("inf"), device=w.device)
        best_alpha = torch.ones(n, g, device=w.device)
        for alpha in ALPHAS:
            scale, zero = grid(w, alpha)
            s, z = scale.repeat_interleave(GROUP, 1), zero.repeat_interleave(GROUP, 1)
            err = (w - decode(codes_on_grid(w, s, z), s, z)).reshape(n, g, GROUP)
            loss = torch.einsum("ngi,gij,ngj->ng", err, blocks, err)
            better = loss < best_loss
            best_loss = torch.where(better, loss, best_loss)
            best_alpha = torch.where(better, torch.full_like(best_alpha, alpha), best_alpha)
        return self._quantize_alpha(w, best_alpha)

    def _grid(self, q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        return q.tensors["weight_scale"].t(), q.tensors["weight_zeros"].t()  # [N, K/64] each

    def codes(self, q: QuantizedWeight) -> torch.Tensor:
        return common.unpack_nibbles(q.tensors["weight"], even_high=False)

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        scale, zero = self._grid(q)  # nothing to read from the record: `plan` has nothing to add
        return decode(self.codes(q), scale.repeat_interleave(GROUP, 1), zero.repeat_interleave(GROUP, 1))

    def dequantize_like(self, q: QuantizedWeight, x: torch.Tensor, plan: LinearPlan | None = None) -> torch.Tensor:
        t = q.tensors
        if not dispatch.decode_supported(x, t["weight"]):
            return super().dequantize_like(q, x, plan)
        return dispatch.awq_weight(t["weight"], t["weight_scale"], t["weight_zeros"], q.shape[1], x.dtype)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        return self.weight_only_linear(x, q, bias, plan=plan)

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        scale, zero = self._grid(q)

        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            s, z = scale[:, cols // GROUP], zero[:, cols // GROUP]
            return decode(codes_on_grid(values, s, z), s, z)
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        scale, zero = self._grid(q)
        u = codes_on_grid(values, scale.repeat_interleave(GROUP, 1), zero.repeat_interleave(GROUP, 1))
        return self._pack(u, scale, zero, q.shape)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", "weight_scale", "weight_zeros"), where, fmt)
        w = common.packed_codes(tensors, where, fmt, "packed uint4")
        s = common.require(tensors, "weight_scale", where, fmt)
        z = common.require(tensors, "weight_zeros", where, fmt)
        group = common.record_int(record, "group_size", GROUP, where)
        if group != GROUP:
            raise FormatError(f"{where}: awq_w4a16 group_size {group}; only {GROUP} is supported")
        n, k = self.logical_shape(tuple(w.shape), record)
        if k % GROUP:
            raise FormatError(f"{where}.weight: {k} inputs, not a multiple of the group {GROUP}")
        for key, t in (("weight_scale", s), ("weight_zeros", z)):
            common.check_dtype(t, key, where, (torch.bfloat16, torch.float16))
            common.check_shape(t, key, where, (k // GROUP, n), "[K/64, N]")
            common.check_finite_scale(t, key, where)
        if s.dtype != z.dtype:
            raise FormatError(f"{where}: weight_scale is {s.dtype} but weight_zeros is {z.dtype}")
        tensors = {"weight": w, "weight_scale": s, "weight_zeros": z}
        return QuantizedWeight(self.name, (n, k), tensors, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        return out_features * in_features // 2 + 2 * 2 * out_features * (in_features // GROUP)
