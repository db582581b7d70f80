"""svdquant_w4a4's activations on the GPU: x / smooth quantized per row and group of 64 to int4 codes, and
those codes times their group's scale, back in the layer's dtype -- the A operand of a 16-bit tensor-core
GEMM (dispatch.svdquant_linear), bit for bit the eager contract's dequantized activations:

    xs = x / smooth                  rounded to the dtype
    a  = max(amax_group |xs|, 1e-10) / 7     rounded to the dtype
    c  = clamp(rne(xs / a  rounded to the dtype), +-7)
    out = c * a                      rounded to the dtype (c * a is exact in fp32)

One memory-bound pass: x read once, the result written once. Divisions are `div_rn` (Triton's `/` on fp32
is approximate on the GPU); rounding half to even through the 1.5*2^23 trick (torch.round's rule). Under
torch.compile the dispatch uses the torch reference (reference.svdquant_activations, also the format's own
forward) instead, which Inductor fuses into the op before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.reference import SVDQUANT_GROUP as GROUP

BLOCK_M = 8
BLOCK_K = 512


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
    activations [M, K] in that dtype (formats.svdquant_w4a4.dequantized_activations' values)."""
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

