"""Torch reference kernels: exact emulation of the quantized math, run anywhere."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def quantize_rows_int(x: torch.Tensor, qmax: float, eps: float,
                      static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integer codes in [-qmax, qmax]: per row (scale max(amax, eps) / qmax), or with one
    static per-tensor scale. Returns (codes int8, scale fp32 [rows, 1])."""
    xf = x.float()
    if static is not None:
        scale = static.float().reshape(1, 1).expand(xf.shape[0], 1).clone()
    else:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(eps) / qmax
    return torch.clamp(torch.round(xf / scale), -qmax, qmax).to(torch.int8), scale


def quantize_rows_int8(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (per-row) symmetric int8, or a static per-tensor scale: (codes int8, scale fp32 [rows, 1])."""
    return quantize_rows_int(x, 127.0, 1e-12, static)


# ---------------------------------------------------------------------------
# fp8 e4m3
# ---------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0


def fp8_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """comfy-kitchen's fp8 rounding: x * (1/scale), clamp to +-448, cast (round-to-nearest-even)."""
    return torch.clamp(x.float() * (1.0 / scale.float()), -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def positive_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax, with 1 where amax is 0 (all-zero rows decode to zero with any scale)."""
    scale = amax.float() / qmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 fp8: x [..., K] (already rotated) -> fp32 [..., N].

    Activations: static per-tensor `input_scale`, else dynamic per-token amax/448.
    Products of two e4m3 values are exact in fp32; sums accumulate in fp32.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    if input_scale is not None:
        xs = input_scale.float().reshape(())
    else:
        xs = positive_scale(x2.abs().amax(dim=-1, keepdim=True), FP8_E4M3_MAX)
    xq = fp8_quantize(x2, xs)
    acc = xq.float() @ w_q.float().t()
    ws = w_scale.float().reshape(1, -1) if w_scale.numel() > 1 else w_scale.float().reshape(())
    return (acc * xs * ws).reshape(*shape[:-1], w_q.shape[0])


# ---------------------------------------------------------------------------
# NVFP4: e2m1 codes, e4m3 block scales (16 along K), fp32 global scale
# ---------------------------------------------------------------------------

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision points between consecutive magnitudes; ties round to the even code
# (the magnitude below when its code is even), exactly like an RNE float cast.
_E2M1_EDGES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already clamped to +-6) -> 4-bit e2m1 codes (sign in bit 3) as int32.

    Round-to-nearest-even; the sign bit follows the float's sign bit, so -0.0 and
    small negatives that round to zero become code 8 (as comfy-kitchen does).
    """
    a = x.abs()
    mag = torch.zeros_like(a, dtype=torch.int32)
    for edge, inclusive in _E2M1_EDGES:
        mag += (a >= edge if inclusive else a > edge).to(torch.int32)
    return mag | (torch.signbit(x).to(torch.int32) << 3)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already clamped to +-6) -> its nearest e2m1 value, fp32: e2m1_decode(e2m1_encode(x)), -0.0 included,
    in a few elementwise ops and no table (GPTQ rounds one column at a time: each op is a launch on a GPU). The
    grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, all powers of two, so x / step is exact and
    torch.round's ties-to-even is e2m1's."""
    a = x.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, x)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (0..15) -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """[rows, cols] block scales -> cuBLAS 1x16 block-scale layout, shape
    (roundup(rows, 128), roundup(cols, 4)), zero padded.

    The matrix is cut into 128x4 tiles stored row-tile-major; inside a tile,
    element (r, c) with r = 32*i + j lands at byte 16*j + 4*i + c.
    """
    rows, cols = scales.shape
    prow, pcol = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scales.new_zeros((prow, pcol))
    padded[:rows, :cols] = scales
    tiles = padded.reshape(prow // 128, 128, pcol // 4, 4).permute(0, 2, 1, 3)  # [rt, ct, 128, 4]
    tiles = tiles.reshape(prow // 128, pcol // 4, 4, 32, 4).transpose(2, 3)  # [rt, ct, j, i, c]
    return tiles.reshape(prow, pcol)


def unswizzle_block_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_block_scales`, cropped to [rows, cols]."""
    prow, pcol = swizzled.shape
    tiles = swizzled.reshape(prow // 128, pcol // 4, 32, 4, 4).transpose(2, 3)  # [rt, ct, i, j, c]
    plain = tiles.reshape(prow // 128, pcol // 4, 128, 4).permute(0, 2, 1, 3).reshape(prow, pcol)
    return plain[:rows, :cols]


def nvfp4_quantize_blocks(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [rows, K] (K % 16 == 0) -> (codes int32 [rows, K], block scales e4m3 [rows, K/16]); `global_scale`
    a scalar, or [rows, 1] (one per row).

    Same arithmetic as comfy-kitchen's `quantize_nvfp4`: block = amax/6/global,
    clamped to 448 and cast to e4m3; codes = e2m1(x / (global * block)).
    """
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 16, 16)
    block_scale = blocks.abs().amax(dim=-1) / E2M1_MAX
    scaled = torch.clamp(block_scale / global_scale, max=FP8_E4M3_MAX)
    scaled_fp8 = scaled.to(torch.float8_e4m3fn)
    total = global_scale * scaled_fp8.float()
    zero = total == 0
    safe = torch.where(zero, torch.ones_like(total), total)
    data = blocks / safe.unsqueeze(-1)
    data = torch.where(zero.unsqueeze(-1), torch.zeros_like(data), data)
    data = torch.clamp(data, -E2M1_MAX, E2M1_MAX).reshape(rows, k)
    return e2m1_encode(data), scaled_fp8


def nvfp4_dequantize_blocks(codes: torch.Tensor, block_scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """codes int [rows, K], plain (unswizzled) e4m3 block scales [rows, K/16] -> fp32 [rows, K]."""
    rows, k = codes.shape
    total = global_scale.float() * block_scales.float()
    return (e2m1_decode(codes).reshape(rows, k // 16, 16) * total.unsqueeze(-1)).reshape(rows, k)


NVFP4_GLOBAL_DIV = E2M1_MAX * FP8_E4M3_MAX  # 6 * 448: a global scale is amax / this


def nvfp4_act_global_scale(x2: torch.Tensor, per_tensor: bool = False) -> torch.Tensor:
    """Dynamic NVFP4 activations' global scale of x2 [M, K], fp32: amax / (6 * 448) of each row ([M, 1], the
    default: a token's codes depend on that token alone) or, `per_tensor`, of the whole call's input (a scalar:
    stock ComfyUI / comfy-kitchen's, which makes every token depend on the others in the call)."""
    if per_tensor:
        return positive_scale(x2.abs().amax(), NVFP4_GLOBAL_DIV).reshape(())
    return positive_scale(x2.abs().amax(dim=-1, keepdim=True), NVFP4_GLOBAL_DIV)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor | None = None, per_tensor: bool = False) -> torch.Tensor:
    """Activation emulation: quantize rows of x [..., K] to NVFP4 and back (fp32).

    Global scale: `global_scale` (a static input_scale), else dynamic (`nvfp4_act_global_scale`): per token by
    default, one amax(x) / (6*448) over the whole tensor with `per_tensor` (what ComfyUI does).
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    g = nvfp4_act_global_scale(x2, per_tensor) if global_scale is None else global_scale.float().reshape(())
    codes, scales = nvfp4_quantize_blocks(x2, g)
    return nvfp4_dequantize_blocks(codes, scales, g).reshape(shape)


# ---------------------------------------------------------------------------
# int4 symmetric (ConvRot W4A4)
# ---------------------------------------------------------------------------

INT4_MAX = 7


def quantize_rows_int4(x: torch.Tensor, static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int4 in [-7, 7] (comfy-kitchen's: scale = max(amax, 1e-10) / 7), or a static
    per-tensor scale. Returns (codes int8 [rows, K], scale fp32 [rows, 1])."""
    return quantize_rows_int(x, float(INT4_MAX), 1e-10, static)


def int_linear_fp32(xq: torch.Tensor, xs: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Integer codes [M, K] (scales [M, 1]) times integer weight codes [N, K] (scale scalar, [N] or [N, 1]):
    exact integer accumulation (int64 on the CPU), then the scales in fp32: [M, N]."""
    acc = (xq.to(torch.int64) @ w_codes.to(torch.int64).t()).to(torch.float32)
    ws = w_scale.float().reshape(1, -1) if w_scale.numel() > 1 else w_scale.float().reshape(())
    return acc * xs * ws


def int4_linear(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                static: torch.Tensor | None = None) -> torch.Tensor:
    """W4A4: x [..., K] (already rotated) with per-token (or static) int4, times int4 codes [N, K]
    (unpacked, int8 storage) with per-row scale; exact integer accumulate; fp32 [..., N]."""
    shape = x.shape
    xq, xs = quantize_rows_int4(x.reshape(-1, shape[-1]), static)
    return int_linear_fp32(xq, xs, w_codes, w_scale).reshape(*shape[:-1], w_codes.shape[0])


def int8_linear_fp32(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor,
                     static: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8: x [..., K] (already rotated) with per-token (or static) int8, times int8 codes [N, K];
    no bias, no output cast: fp32 [..., N]."""
    shape = x.shape
    xq, xs = quantize_rows_int8(x.reshape(-1, shape[-1]), static)
    return int_linear_fp32(xq, xs, w_codes, w_scale).reshape(*shape[:-1], w_codes.shape[0])


# ---------------------------------------------------------------------------
# svdquant_w4a4 activations: x / smooth, int4 per row and group of 64, in the layer's dtype
# ---------------------------------------------------------------------------

SVDQUANT_GROUP = 64
SVDQUANT_INT4_MAX = 7


def svdquant_quantize_activations(x: torch.Tensor, smooth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x [M, K] (the layer's dtype) divided by smooth, quantized per group of 64: (codes [M, K] int8,
    scales [M, K/64] in x's dtype)."""
    m, k = x.shape
    groups = (x / smooth).view(m, k // SVDQUANT_GROUP, SVDQUANT_GROUP)
    scales = groups.abs().amax(dim=-1).clamp(min=1e-10) / SVDQUANT_INT4_MAX
    codes = (groups / scales.unsqueeze(-1)).round().clamp(-SVDQUANT_INT4_MAX, SVDQUANT_INT4_MAX).to(torch.int8)
    return codes.reshape(m, k), scales


def svdquant_activations(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """svdquant_w4a4's main-path A operand (comfy-kitchen's eager contract): codes times their group's scale
    [M, K], in x's dtype (the layer's)."""
    m, k = x.shape
    codes, scales = svdquant_quantize_activations(x, smooth)
    return (codes.to(x.dtype).view(m, k // SVDQUANT_GROUP, SVDQUANT_GROUP) * scales.to(x.dtype).unsqueeze(-1)).view(m, k)


def low_rank_delta(x: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(x @ down^T) @ up^T in x's dtype: a LoRA residual's output, unfused (LoraStack.forward, and the
    formats' non-GPU path with a branch)."""
    if down.dtype != x.dtype:
        down, up = down.to(x.dtype), up.to(x.dtype)
    return F.linear(F.linear(x, down), up)
