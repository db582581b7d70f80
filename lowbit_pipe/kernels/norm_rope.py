"""RMSNorm and rotary embedding as one memory pass each, for the uncompiled (eager) path.

diffusers' DiT blocks run these as chains of torch ops: Krea 2's RMSNorm upcasts to fp32 (a copy), norms, and
casts back (another); `apply_rotary_emb` builds the rotated copy (negate, stack), upcasts both, and runs three
fp32 elementwise ops before the cast back. Uncompiled, each op is a kernel reading and writing the whole tensor:
on the full-size Krea 2 they are most of the 90 ms of eager elementwise time per forward
(bench/results/forward_profile_eager_h200.md). Under torch.compile Inductor fuses the same chains by itself, so
the callers use these kernels in eager only.

Both compute in fp32 what the torch code computes, and round once to the output dtype:

    rms_norm:  y = x * rsqrt(mean(x^2) + eps) * (weight + offset)      (Krea 2: offset 1, zero-centred weight;
                                                                         diffusers' RMSNorm: x̂ rounded first
                                                                         when its weight is 16-bit, as it does)
    rope:      y[2i]   = x[2i]   * cos[2i]   - x[2i+1] * sin[2i]        (interleaved pairs: FLUX, Krea 2)
               y[2i+1] = x[2i+1] * cos[2i+1] + x[2i]   * sin[2i+1]

The fp32 sums may round differently from torch's (order, fused multiply-add): within an fp32 ulp or two, so
the rounded outputs agree but for a rare bf16 ulp (tests/test_kernels.py, case norm_rope).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_DIM = 16384  # one row in registers per program
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, M, D, eps, offset,
                     WEIGHT: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    if WEIGHT:
        if ROUND_FIRST:  # diffusers' RMSNorm with a 16-bit weight: x̂ in the weight's dtype, then the product
            y = y.to(dt).to(tl.float32)
        y = y * (tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) + offset)[None, :]
    tl.store(out_ptr + offs, y.to(dt), mask=ok)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, D, S, ROW_DIV,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    partner = tl.load(x_ptr + rows[:, None].to(tl.int64) * D + (cols ^ 1)[None, :], mask=ok, other=0.0).to(tl.float32)
    rotated = tl.where((cols % 2 == 0)[None, :], -partner, partner)
    token = (rows // ROW_DIV) % S  # the row's position in the sequence: [B, S, H, D] or [B, H, S, D] rows
    t_offs = token[:, None].to(tl.int64) * D + cols[None, :]
    c = tl.load(cos_ptr + t_offs, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t_offs, mask=ok, other=0.0)
    y = x * c + rotated * s
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _blocks(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps): about 4096 elements per program, whole rows."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, 4096 // block_d)
    return block_m, block_d, 8 if block_d >= 4096 else 4


def kernel_serves(x: torch.Tensor, d: int) -> bool:
    """The kernels take CUDA tensors of a 16/32-bit float dtype, contiguous, rows up to MAX_DIM."""
    return x.is_cuda and x.dtype in DTYPES and x.is_contiguous() and 0 < d <= MAX_DIM and x.numel() > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, *,
             round_first: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over x's last dim (x contiguous, CUDA), fp32 math, the result in `out_dtype` (x's by default).
    `weight` None: no scale. `round_first`: x̂ rounded to `out_dtype` before the weight multiplies (diffusers'
    RMSNorm with a 16-bit weight)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    m = x.numel() // d
    block_m, block_d, warps = _blocks(d)
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](x, weight if weight is not None else x, out, m, d, float(eps),
                                                 float(offset), WEIGHT=weight is not None, ROUND_FIRST=round_first,
                                                 BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """Interleaved-pair rotary embedding of x [B, S, H, D] (sequence_dim 1) or [B, H, S, D] (2), x contiguous;
    cos / sin [S, D] fp32, contiguous. The result in x's dtype."""
    d = x.shape[-1]
    s_len = x.shape[sequence_dim]
    row_div = x.shape[2] if sequence_dim == 1 else 1
    out = torch.empty_like(x)
    m = x.numel() // d
    block_m, block_d, warps = _blocks(d)
    _rope_kernel[(triton.cdiv(m, block_m),)](x, cos, sin, out, m, d, s_len, row_div,
                                             BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, *,
                       round_first: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch form of `rms_norm` (diffusers' RMSNorm op for op with `round_first` for a 16-bit weight; Krea 2's
    with offset 1, within an ulp of its F.rms_norm): the tests' and the bench's comparison. On the CPU and under
    torch.compile the models' own modules run, not this."""
    out_dtype = out_dtype or x.dtype
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(out_dtype)
    if round_first:
        y = y.to(out_dtype).float()
    return (y * (weight.float() + offset if offset else weight.float())).to(out_dtype)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """The torch form of `rope` (diffusers' apply_rotary_emb, use_real, pairs interleaved)."""
    shape = (1, -1, 1, x.shape[-1]) if sequence_dim == 1 else (1, 1, -1, x.shape[-1])
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos.reshape(shape) + rotated.float() * sin.reshape(shape)).to(x.dtype)
