"""svdquant_w4a4: SVDQuant (Li et al. 2024, Nunchaku): smoothing, a low-rank branch that takes the
weight's largest singular directions, and a 4-bit residual; 4-bit activations.

Tensors (comfy-kitchen `TensorCoreSVDQuantW4A4Layout`, natural layout; record format `svdquant_w4a4`):
- weight int8 [N, K/2]: residual codes in [-7, 7], column 2j in the LOW nibble (two's complement nibbles).
- weight_scale [K/64, N]: residual scale per (group of 64 inputs, row).
- weight_proj_down [K, R], weight_proj_up [N, R]: the low-rank branch, x @ proj_down @ proj_up^T.
- weight_smooth_factor [K]: the main path sees x / smooth.
All float tensors in one dtype (bf16 here; fp16 read too): the layer computes in it.

Forward (comfy-kitchen's eager contract, reproduced bit for bit for inputs in that dtype): the input is
cast to the layer's dtype; main path x / smooth, quantized per row and group of 64 (scale absmax / 7,
codes rounded and clamped to [-7, 7]), times the dequantized residual (codes * scale), in that dtype;
plus (x @ proj_down) @ proj_up^T accumulated in fp32 and cast; plus bias. Activations "none": x times the
effective weight (residual / smooth + proj_up proj_down^T) in the input's dtype. On the GPU
(dispatch.svdquant_linear): the same two dequantized operands bit for bit, multiplied on 16-bit tensor cores
with the branch (and a LoRA's factors, concatenated to it) as the GEMM's initial accumulator, one rounding:
within the contract's own bf16 roundings of it, not bit for bit.

Quantization. Without calibration (`Format.quantize`): smooth = 1, the rank-R truncated SVD of W is the
branch (its bf16 factors), the residual W - proj_up proj_down^T is rounded to nearest per group. With
calibration (`quantize.gptq.enabled`, `calibrated_grid`): SmoothQuant's smoothing from the input Hessian,
smooth_k = rms(x_k)^0.5 / max|W[:, k]|^0.5, the SVD of the smoothed weight W * smooth, and GPTQ on the
smoothed residual against the smoothed input's Hessian (`grid_target`). comfy-kitchen writes no such
files (its layout is load-only) and stock ComfyUI master has no `svdquant_w4a4` entry: the node pack
registers one where it is missing.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference
from lowbit_pipe.kernels.reference import SVDQUANT_GROUP as GROUP
from lowbit_pipe.kernels.reference import SVDQUANT_INT4_MAX as INT4_MAX

RANK = 32
DTYPE = torch.bfloat16
ALPHA = 0.5  # SmoothQuant's migration strength
SIDE = ("weight_scale", "weight_proj_down", "weight_proj_up", "weight_smooth_factor")


def _group_scales(r: torch.Tensor) -> torch.Tensor:
    """Per (row, group of 64) absmax / 7 of a residual [N, K], in DTYPE; 1 for an all-zero group."""
    n, k = r.shape
    scale = (r.float().reshape(n, k // GROUP, GROUP).abs().amax(dim=-1) / INT4_MAX).to(DTYPE)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _codes(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Nearest codes in [-7, 7] of `values` [N, m] on per-column scales [N, m]."""
    return torch.round(values.float() / scale.float()).clamp(-INT4_MAX, INT4_MAX)


@register
class SVDQuantW4A4(Format):
    name = "svdquant_w4a4"
    comfy_name = "svdquant_w4a4"
    bits_per_weight = 4.25  # + the branch: 16 * R * (N + K) / (N * K) bits per weight
    rotations = ("none",)
    act_qmax = float(INT4_MAX)
    row_axes = {"weight_scale": 1, "weight_proj_down": None, "weight_smooth_factor": None}
    values_per_byte = 2
    fused_lora_on_cuda = True
    no_static_reason = "activations are scaled per row and group of 64 at run time"

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        return common.group_problem(in_features, GROUP)

    @staticmethod
    def _rank(spec: FormatSpec, n: int, k: int) -> int:
        return max(1, min(spec.rank or RANK, n, k))

    # ---- building a layer ------------------------------------------------------------------------
    def _build(self, w: torch.Tensor, smooth: torch.Tensor, rank: int) -> QuantizedWeight:
        """Branch from the rank-`rank` SVD of W * smooth, residual rounded to nearest (smoothed basis)."""
        n, k = w.shape
        smooth = smooth.to(DTYPE)
        s = smooth.float()
        u, sv, vh = torch.linalg.svd(w * s, full_matrices=False)
        proj_up = (u[:, :rank] * sv[:rank]).to(DTYPE)  # [N, R]
        proj_down = (vh[:rank].t() / s.unsqueeze(1)).to(DTYPE)  # [K, R]: the branch reads the unsmoothed input
        residual = (w - proj_up.float() @ proj_down.float().t()) * s  # what the main path must carry
        scale = _group_scales(residual)
        codes = _codes(residual, scale.repeat_interleave(GROUP, 1))
        return self._pack(codes, scale, proj_down, proj_up, smooth)

    def _pack(self, codes: torch.Tensor, scale: torch.Tensor, proj_down: torch.Tensor, proj_up: torch.Tensor,
              smooth: torch.Tensor) -> QuantizedWeight:
        n, k = codes.shape
        tensors = {"weight": common.pack_nibbles(codes.to(torch.int32) & 0xF, even_high=False).view(torch.int8),
                   "weight_scale": scale.t().contiguous(), "weight_proj_down": proj_down.contiguous(),
                   "weight_proj_up": proj_up.contiguous(), "weight_smooth_factor": smooth.contiguous()}
        return QuantizedWeight(self.name, (n, k), tensors, {"format": self.comfy_name})

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = self.checked_weight(weight)
        n, k = w.shape
        return self._build(w, torch.ones(k, device=w.device), self._rank(spec, n, k))

    def calibrated_grid(self, weight: torch.Tensor, spec: FormatSpec, hessian: torch.Tensor) -> QuantizedWeight:
        w = common.check_finite_weight(weight).to(hessian.device)
        n, k = w.shape
        act = torch.diag(hessian).float().clamp(min=0).sqrt()  # rms of each input channel
        wmax = w.abs().amax(dim=0)
        smooth = act.pow(ALPHA) / wmax.pow(1 - ALPHA)
        ok = (act > 0) & (wmax > 0) & torch.isfinite(smooth)
        smooth = torch.where(ok, smooth, torch.ones_like(smooth)).clamp(1e-4, 1e4)
        return self._build(w, smooth, self._rank(spec, n, k))

    def grid_target(self, q: QuantizedWeight, weight: torch.Tensor, spec: FormatSpec,
                    hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.tensors
        s = t["weight_smooth_factor"].float()
        residual = (weight.float() - t["weight_proj_up"].float() @ t["weight_proj_down"].float().t()) * s
        return residual, hessian / (s.unsqueeze(1) * s.unsqueeze(0))

    # ---- reading a layer -------------------------------------------------------------------------
    def codes(self, q: QuantizedWeight) -> torch.Tensor:
        return common.to_signed4(common.unpack_nibbles(q.tensors["weight"], even_high=False))

    def _residual(self, q: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """codes * scale [N, K] in `dtype` (the smoothed basis)."""
        n, k = q.shape
        scale = q.tensors["weight_scale"].t().to(dtype).unsqueeze(-1)  # [N, K/64, 1]
        return (self.codes(q).to(dtype).view(n, k // GROUP, GROUP) * scale).view(n, k)

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        t = q.tensors  # nothing to read from the record: `plan` has nothing to add
        smooth = t["weight_smooth_factor"].float()
        return self._residual(q, torch.float32) / smooth + t["weight_proj_up"].float() @ t["weight_proj_down"].float().t()

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None,
               lora: tuple[torch.Tensor, torch.Tensor] | None = None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        """`lora` (down [R, K], up [N, R]): a LoRA residual; on the GPU concatenated to the SVD branch
        (dispatch.svdquant_linear), elsewhere added after the reference as (x @ down^T) @ up^T."""
        plan = plan if plan is not None else self.linear_plan(q)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, lora, plan)
        t = q.tensors
        n, k = plan.shape
        if dispatch.svdquant_supported(x, t["weight"]):
            return dispatch.svdquant_linear(x, t, n, bias, lora, plan.facts_for(x))
        if lora is not None:
            return self.linear(x, q, bias, plan=plan) + reference.low_rank_delta(x, *lora)
        dtype = t["weight_scale"].dtype
        x2 = x.reshape(-1, k).to(dtype)
        branch = x2.float() @ t["weight_proj_down"].float()
        y = reference.svdquant_activations(x2, t["weight_smooth_factor"]) @ self._residual(q, dtype).t()
        y = y + (branch @ t["weight_proj_up"].float().t()).to(y.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    # ---- fixed-grid rounding (GPTQ): the residual's group scales stay, its codes change --------------
    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        scales = q.tensors["weight_scale"].t()

        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            scale = scales[:, cols // GROUP]
            return _codes(values, scale) * scale.float()
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        t = q.tensors
        scale = t["weight_scale"].t()
        codes = _codes(values, scale.repeat_interleave(GROUP, 1))
        return self._pack(codes, scale, t["weight_proj_down"], t["weight_proj_up"], t["weight_smooth_factor"])

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", *SIDE), where, fmt)
        w = common.packed_codes(tensors, where, fmt, "[N, K/2] (comfy-kitchen's tile-packed layout is not read; "
                                                     "store the natural layout)")
        side = {key: common.require(tensors, key, where, fmt) for key in SIDE}
        n, k = self.logical_shape(tuple(w.shape), record)
        if k % GROUP:
            raise FormatError(f"{where}.weight: {k} inputs, not a multiple of the group {GROUP}")
        dtype = side["weight_scale"].dtype
        rank = int(side["weight_proj_up"].shape[-1]) if side["weight_proj_up"].dim() == 2 else -1
        expected = {"weight_scale": (k // GROUP, n), "weight_proj_down": (k, rank), "weight_proj_up": (n, rank),
                    "weight_smooth_factor": (k,)}
        for key, t in side.items():
            common.check_dtype(t, key, where, (torch.bfloat16, torch.float16))
            if t.dtype != dtype:
                raise FormatError(f"{where}.{key}: {t.dtype}, but weight_scale is {dtype} (one compute dtype)")
            common.check_shape(t, key, where, expected[key])
            common.check_finite_scale(t, key, where)
        if bool((side["weight_smooth_factor"] == 0).any()):
            raise FormatError(f"{where}.weight_smooth_factor: zero entries (the input is divided by it)")
        return QuantizedWeight(self.name, (n, k), {"weight": w, **side}, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        rank = self._rank(spec or FormatSpec(self.name), out_features, in_features)
        return (out_features * in_features // 2 + 2 * out_features * (in_features // GROUP)
                + 2 * rank * (in_features + out_features) + 2 * in_features)
