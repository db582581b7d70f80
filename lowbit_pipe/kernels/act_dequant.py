"""Activation quantize-dequantize kernels, for formats whose activation codes this GPU's tensor cores cannot
multiply as codes: each writes the dequantized activations in a 16-bit dtype that holds them, the A operand
of a 16-bit tensor-core GEMM. One memory-bound pass each: x read once, the result written once.

1. `svdquant_act` (svdquant_w4a4; dispatch.svdquant_linear): x / smooth quantized per row and group of 64 to
   int4 codes, times their group's scale, in the layer's dtype -- bit for bit the eager contract's operand:

       xs = x / smooth                               rounded to the dtype
       a  = max(amax_group |xs|, 1e-10) / 7          rounded to the dtype
       c  = clamp(rne(xs / a  rounded to the dtype), +-7)
       out = c * a                                   rounded to the dtype (c * a is exact in fp32)

   Under torch.compile the dispatch uses the torch reference (reference.svdquant_activations, also the
   format's own forward) instead, which Inductor fuses into the op before.
2. `mxfp8_act` (mxfp8 dynamic; dispatch.mxfp8_linear): each row's blocks of 32 to E8M0-scaled e4m3 and back,
   formats.mxfp8.fake_quant's values, written in bf16, which holds every e4m3 code times a power of two
   (fp16's range does not). The block exponent ceil(log2(max(amax / 448, 2^-127))) comes from the bits of
   amax / 448 (its exponent, plus one unless a power of two): torch's log2 agrees for bf16 / fp16 inputs,
   whose amax / 448 is never within a few ulps above a power of two; an fp32 input can be, and there the
   kernel keeps the exact ceiling.

Divisions are `div_rn` (Triton's `/` on fp32 is approximate on the GPU); rounding half to even through the
1.5*2^23 trick (torch.round's rule) and Triton's round-to-nearest e4m3 conversion.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.reference import SVDQUANT_GROUP as GROUP

BLOCK_M = 8
BLOCK_K = 512
MX_BLOCK = 32


@triton.jit
def _svdquant_act_kernel(x_ptr, smooth_ptr, out_ptr, M, K, stride_xm, stride_om,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    smooth = tl.load(smooth_ptr + cols, mask=cols < K, other=1.0).to(tl.float32)
    xs = tl.math.div_rn(x, smooth[None, :]).to(dt).to(tl.float32)
    groups = tl.reshape(xs, (BLOCK_M, BLOCK_K // GROUP, GROUP))
    amax = tl.max(tl.abs(groups), axis=2)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10).to(dt).to(tl.float32), 7.0).to(dt).to(tl.float32)
    t = tl.math.div_rn(groups, scale[:, :, None]).to(dt).to(tl.float32)
    t = (t + 12582912.0) - 12582912.0  # round half to even, |t| <= 7-ish
    codes = tl.minimum(tl.maximum(t, -7.0), 7.0)
    out = tl.reshape(codes * scale[:, :, None], (BLOCK_M, BLOCK_K))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(dt), mask=ok)


def svdquant_act(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """x [M, K] and smooth [K] in the layer's dtype (bf16 or fp16; K a multiple of 64) -> the dequantized int4
    activations [M, K] in that dtype (reference.svdquant_activations' values)."""
    if x.dim() != 2 or x.shape[1] % GROUP or smooth.shape != (x.shape[1],):
        raise ValueError(f"svdquant_act: x {tuple(x.shape)} / smooth {tuple(smooth.shape)}: want [M, K] and [K], "
                         f"K a multiple of {GROUP}")
    if x.dtype not in (torch.bfloat16, torch.float16) or smooth.dtype != x.dtype:
        raise ValueError(f"svdquant_act: x {x.dtype} / smooth {smooth.dtype}: want one dtype, bf16 or fp16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
        _svdquant_act_kernel[grid](x, smooth.contiguous(), out, m, k, x.stride(0), out.stride(0),
                                   GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, num_warps=4)
    return out


@triton.jit
def _mxfp8_act_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_om, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    blocks = tl.reshape(x, (BLOCK_M, BLOCK_K // BLOCK, BLOCK))
    amax = tl.max(tl.abs(blocks), axis=2)
    needed = tl.math.div_rn(amax, 448.0)
    bits = needed.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 255
    frac = bits & 0x7FFFFF
    # biased ceil(log2(max(needed, 2^-127))): the exponent field, plus one unless a power of two; below 2^-126
    # (subnormal) e = 1 above 2^-127, else 0 -- the reference's clamp (a constant 2^-127 would be fp64 in Triton)
    e = tl.where(biased == 0, tl.where(frac > 0x400000, 1, 0), biased + tl.where(frac != 0, 1, 0))
    e = tl.where(amax == 0, 0, tl.minimum(e, 254))
    scale = tl.where(e == 0, 0.0, (e << 23).to(tl.float32, bitcast=True))  # 2^(e - 127); e = 0: a zero block
    safe = tl.where(e == 0, 1.0, scale)
    data = tl.where((e == 0)[:, :, None], 0.0, tl.math.div_rn(blocks, safe[:, :, None]))
    codes = tl.clamp(data, -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
    out = tl.reshape(codes * scale[:, :, None], (BLOCK_M, BLOCK_K))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def mxfp8_act(x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [M, K] (fp32 / bf16 / fp16; K a multiple of 32) -> its MXFP8 fake quantization [M, K] in bf16 (or fp32,
    for the interpreter tests)."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mxfp8_act: out_dtype must be bf16 or fp32 (both hold every value), got {out_dtype}")
    if x.dim() != 2 or x.shape[1] % MX_BLOCK or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mxfp8_act: x {tuple(x.shape)} {x.dtype}: want [M, K], K a multiple of {MX_BLOCK}, "
                         "fp32 / bf16 / fp16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=out_dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))
        _mxfp8_act_kernel[grid](x, out, m, k, x.stride(0), out.stride(0), BLOCK=MX_BLOCK, BLOCK_M=BLOCK_M,
                                BLOCK_K=BLOCK_K, num_warps=4)
    return out


@torch.library.custom_op("lowbit_pipe::mxfp8_act", mutates_args=())
def mxfp8_act_op(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return mxfp8_act(x, out_dtype)


@mxfp8_act_op.register_fake
def _(x, out_dtype):
    return x.new_empty(tuple(x.shape), dtype=out_dtype)
