"""Triton W4A4 GEMM with a scale per group of 64 on both operands (svdquant_w4a4's main path), its low-rank
branch in the epilogue:

    y[m, n] = sum_g (sum_{k in g} a[m, k] * w[n, k]) * a_scale[m, g] * w_scale[g, n] (+ bias[n]) (+ (xa @ up_t)[m, n])

a: int4 activation codes in [-7, 7] held in int8 [M, K]; w: the residual's int4 codes, packed two per byte
[N, K/2] (column 2i in the LOW nibble, svdquant_w4a4's layout: unpacked to int8 in registers) or, prepacked,
int8 [N, K]. Each K step is one group of 64: its exact int32 dot on the INT8 tensor cores, scaled by the two
groups' scales into an fp32 accumulator (the scales change per group, so no step can share an int32 sum).
xa = x @ proj_down (the unsmoothed input), up_t = proj_up^T: the SVD branch, with any LoRA on the layer
concatenated to it, added as the accumulator of one more dot before the single output rounding.

The format's own forward (formats.svdquant_w4a4, comfy-kitchen's eager contract) rounds the dequantized
operands to the layer's dtype and multiplies them there; this kernel keeps the integer sums exact and the
scaling in fp32, so it differs from that contract by the contract's own roundings (~1e-3 relative).

Layout: kernel -> launcher (`svdquant_gemm`: checks, allocation, grid) -> custom op `lowbit_pipe::svdquant_gemm`
(with a fake impl, so torch.compile traces through it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.gemm_common import (
    bias_operand,
    check_out_dtype,
    grouped_tile,
    launch_gemm,
    low_rank_args,
    low_rank_tile,
    m_bucket,
)

GROUP = 64  # inputs per scale, on both operands: one K step of the kernel


def _cfg(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": GROUP, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages)


# int8_gemm's tile shapes at BLOCK_K = 64 (the group): large tiles for thousands of rows, small ones for few.
CONFIGS = {
    "128x256_w8_s3": _cfg(128, 256, 8, 3),
    "256x128_w8_s3": _cfg(256, 128, 8, 3),
    "128x128_w8_s4": _cfg(128, 128, 8, 4),
    "128x128_w4_s5": _cfg(128, 128, 4, 5),
    "64x128_w4_s4": _cfg(64, 128, 4, 4),
}


@triton.jit
def _svdquant_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, xa_ptr, up_ptr,
    M, N, K, M_BUCKET, R,
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_asg, stride_bsg, stride_bsn,
    stride_cm, stride_cn, stride_xam, stride_xar, stride_ur, stride_un,
    PACKED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
    LORA_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if PACKED:
        offs_kh = tl.arange(0, BLOCK_K // 2)
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_kh[None, :] * stride_bk
    else:  # [BLOCK_K, BLOCK_N] view of the row-major [N, K] codes
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + offs_n * stride_bsn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // BLOCK_K):  # K is a multiple of the group (the launcher checks): no K masks
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0)
        if PACKED:
            p = tl.load(b_ptrs, mask=n_ok[:, None], other=0)
            lo = (p << 4).to(tl.int8) >> 4  # sign-extend the low nibble (even column)
            hi = p >> 4  # arithmetic shift: the high nibble, sign-extended (odd column)
            b = tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)))
            b_ptrs += (BLOCK_K // 2) * stride_bk
        else:
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0)
            b_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        part = tl.dot(a, b, out_dtype=tl.int32)
        sa = tl.load(as_ptrs + g * stride_asg, mask=m_ok, other=0.0).to(tl.float32)
        sb = tl.load(bs_ptrs + g * stride_bsg, mask=n_ok, other=0.0).to(tl.float32)
        acc += part.to(tl.float32) * sa[:, None] * sb[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        acc = low_rank_tile(acc, xa_ptr, up_ptr, offs_m, offs_n, m_ok, n_ok, R, stride_xam, stride_xar, stride_ur,
                            stride_un, R_PAD, LORA_IEEE)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_svdquant_gemm_tuned = triton.autotune(configs=list(CONFIGS.values()),
                                       key=["N", "K", "M_BUCKET", "PACKED", "HAS_LORA", "R_PAD"])(_svdquant_gemm_kernel)


def svdquant_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, packed: bool = True,
                  xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """a int8 [M, K] (codes in [-7, 7]), a_scale [M, K/64], w packed int4 [N, K/2] (`packed`) or int8 codes
    [N, K], w_scale [K/64, N] (scales in any float dtype, read as fp32; any strides) -> out_dtype [M, N].

    `xa` [M, R] and `up_t` [R, N] (one float dtype, R <= 128): the low-rank epilogue, both or neither.
    `config`: explicit meta-parameters (BLOCK_M/N, GROUP_M, num_warps, num_stages; BLOCK_K is the group) instead
    of autotuning; used by the interpreter tests.
    """
    op = "svdquant_gemm"
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{op}: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != torch.int8 or w.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{op}: expected int8 activation codes and int8 weight codes, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    n = w.shape[0]
    wk = w.shape[1] * (2 if packed else 1)
    if wk != k:
        raise ValueError(f"{op}: K mismatch, a has {k}, w holds {wk} ({'packed int4' if packed else 'int8 codes'})")
    if k % GROUP:
        raise ValueError(f"{op}: K={k} is not a multiple of the scale group {GROUP}")
    groups = k // GROUP
    if tuple(a_scale.shape) != (m, groups) or tuple(w_scale.shape) != (groups, n):
        raise ValueError(f"{op}: scales want a_scale [{m}, {groups}] and w_scale [{groups}, {n}], "
                         f"got {tuple(a_scale.shape)} and {tuple(w_scale.shape)}")
    if config is not None and config.get("BLOCK_K", GROUP) != GROUP:
        raise ValueError(f"{op}: BLOCK_K is the scale group, {GROUP}; got {config['BLOCK_K']}")
    check_out_dtype(op, out_dtype)
    bias_arg = bias_operand(op, n, bias, a_scale)
    lr = low_rank_args(op, m, n, xa, up_t, a_scale)
    w = w.view(torch.int8)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    args = (a, w, c, a_scale, w_scale, bias_arg, *lr.pointers, m, n, k, m_bucket(m), lr.r,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), a_scale.stride(0), a_scale.stride(1),
            w_scale.stride(0), w_scale.stride(1), c.stride(0), c.stride(1), *lr.strides)
    flags = {"PACKED": packed, "HAS_BIAS": bias is not None, **lr.flags}
    cfg = {**config, "BLOCK_K": GROUP} if config is not None else None
    launch_gemm(_svdquant_gemm_tuned, _svdquant_gemm_kernel, args, flags, m, n, cfg, a.is_cuda)
    return c


# ---------------------------------------------------------------------------
# custom op: opaque to torch.compile (no graph break), with a shape-only fake impl
# ---------------------------------------------------------------------------

@torch.library.custom_op("lowbit_pipe::svdquant_gemm", mutates_args=())
def svdquant_gemm_op(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, packed: bool,
                     xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    return svdquant_gemm(a, a_scale, w, w_scale, bias, out_dtype, packed, xa, up_t)


@svdquant_gemm_op.register_fake
def _(a, a_scale, w, w_scale, bias, out_dtype, packed, xa=None, up_t=None):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def reference_svdquant_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            bias: torch.Tensor | None = None, packed: bool = True, xa: torch.Tensor | None = None,
                            up_t: torch.Tensor | None = None) -> torch.Tensor:
    """Float64 oracle of `svdquant_gemm`: each group's exact integer sum times its two scales, summed over groups,
    plus bias and xa @ up_t."""
    if packed:
        p = w.view(torch.uint8).to(torch.int32)
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(w.shape[0], -1)
        w = torch.where(codes >= 8, codes - 16, codes)
    m, k = a.shape
    n, groups = w.shape[0], k // GROUP
    sums = torch.einsum("mgk,ngk->mgn", a.double().reshape(m, groups, GROUP), w.double().reshape(n, groups, GROUP))
    y = (sums * a_scale.double().unsqueeze(-1) * w_scale.double().unsqueeze(0)).sum(dim=1)
    if bias is not None:
        y = y + bias.double()
    if xa is not None:
        y = y + xa.double() @ up_t.double()
    return y
