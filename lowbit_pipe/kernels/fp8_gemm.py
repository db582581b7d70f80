"""Triton FP8 GEMM for the fp8 format on Hopper: e4m3 activations x e4m3 weight, per-row/column
scales, optional bias and LoRA branch, one kernel.

    y[m, n] = (acc0[m, n] + sum_k a[m, k] w[n, k]) * a_scale[m] * w_scale[n or scalar] (+ bias[n]),
    acc0 = (xa @ up_t)[m, n] / (a_scale[m] w_scale[n])     (0 without a branch)

Why not cuBLAS alone (`torch._scaled_mm`): it has no hook for the branch, so a LoRA cost one more
pass over y (`addmm_`; its share of the linear at Krea 2 shapes: bench/results/lora_overhead_h200.md
and fp8_lora_gemm_h200.md). Why the branch enters as the accumulator's initial value: as a dot after
the K loop (the int8 GEMM's epilogue) it needs its own operand tiles while the whole 128x256 fp32
accumulator is live; as the initial value it is computed before the K loop, into the accumulator the
loop needs anyway, and on the 128x256 tile it cost a small fraction of the epilogue dot's time
(bench/results/fp8_lora_gemm_h200.md). Dividing by the scales first costs two fp32 roundings.

Accumulation: the whole K in the Hopper tensor cores' reduced-precision fp8 accumulator (Triton's
sm90 default; cuBLAS's "fast accumulation", what torchao and vLLM use for fp8 inference): 2.4e-3
relative error at K=6144 and 3.5e-3 at K=16384 against a float64 oracle, where bf16 output
rounding alone is 1.7e-3 and e4m3 quantization of x and w is ~4 %. `promote=P` adds the partial
sum into an fp32 accumulator every P K tiles (P=4: 1.7e-3, but slower: the "promote/4" column of
bench/results/fp8_lora_gemm_h200.md); not used by the linear.

Operands come through TMA tensor descriptors: out-of-range rows, columns and K come back as zeros,
so the K loop has no masks (masked pointer loads of fp8 were much slower on the H200:
bench/results/lora_kernel_tune_h200.md, last section). Needs
K % 16 == 0 (16-byte rows) and sm90; the fp8 linear checks both (dispatch.fp8_linear).

The same kernel on 16-bit operands (`float_gemm`: bf16 / fp16, unit scales; fp32 under the interpreter):
y = a @ w^T (+ bias) (+ xa @ up_t), one rounding to the output dtype, with full fp32 accumulation (16-bit
wgmma). svdquant_w4a4's GPU path runs its dequantized operands through it, its SVD branch as the initial
accumulator (dispatch.svdquant_linear).

Layout: kernel -> launchers (`fp8_gemm`, `float_gemm`: checks, allocation, grid) -> custom ops
`lowbit_pipe::fp8_gemm`, `lowbit_pipe::float_gemm` (fake impls: shapes only, so torch.compile keeps each
one node).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.gemm_common import (
    epilogue_args,
    launch_tma_gemm,
    low_rank_tile,
    reference_epilogue,
    scaled_tile,
    tile_offsets,
)


@triton.jit
def _fp8_gemm_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, bias_ptr, xa_ptr, up_ptr,
    M, N, K, R,
    stride_cm, stride_cn, stride_xam, stride_xar, stride_ur, stride_un,
    B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
    LORA_IEEE: tl.constexpr, PROMOTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    off_m, off_n, offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:  # the branch in the accumulator's units: acc0 = (xa @ up_t) / (a_scale w_scale)
        acc = low_rank_tile(acc, xa_ptr, up_ptr, offs_m, offs_n, m_ok, n_ok, R, stride_xam, stride_xar, stride_ur,
                            stride_un, R_PAD, LORA_IEEE)
        acc = acc * (1.0 / tl.load(as_ptr + offs_m, mask=m_ok, other=1.0))[:, None]
        if B_SCALAR:
            acc = acc * (1.0 / tl.load(bs_ptr))
        else:
            acc = acc * (1.0 / tl.load(bs_ptr + offs_n, mask=n_ok, other=1.0))[None, :]
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_k = tl.cdiv(K, BLOCK_K)
    for i in range(0, n_k):
        a = a_desc.load([off_m, i * BLOCK_K])
        b = b_desc.load([off_n, i * BLOCK_K])
        if PROMOTE == 0:
            acc = tl.dot(a, b.T, acc)
        else:
            part = tl.dot(a, b.T, part)
            if i % PROMOTE == PROMOTE - 1:
                acc += part
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PROMOTE > 1:
        acc += part

    y = scaled_tile(acc, as_ptr, bs_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, B_SCALAR, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None,
             config: dict | None = None, promote: int = 0) -> torch.Tensor:
    """a e4m3 [M, K], w e4m3 [N, K] (both K-contiguous, K % 16 == 0), a_scale fp32 [M] / [M, 1],
    w_scale fp32 [N] / [N, 1] / scalar -> out_dtype [M, N]. With a branch every scale must be nonzero
    (it is divided by them; the fp8 format guarantees it: formats/fp8.py `_nonzero_scales`).

    `xa` [M, R] and `up_t` [R, N] (one float dtype, any strides, R <= 128): the LoRA branch,
    out += xa @ up_t (fp32 products and sum). `config`: BLOCK_M/N/K, num_warps, num_stages
    (default: gemm_common.tma_launch_config(M)); `promote`: 0, or P >= 2 (see the module doc).
    """
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"fp8_gemm: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: expected float8_e4m3fn a and w, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"fp8_gemm: K mismatch, a has {k}, w has {w.shape[1]}")
    if k % 16 or a.stride(1) != 1 or w.stride(1) != 1 or a.stride(0) % 16 or w.stride(0) % 16:
        raise ValueError(f"fp8_gemm: TMA needs K-contiguous operands with 16-byte aligned rows, got K={k}")
    ep = epilogue_args("fp8_gemm", m, n, a_scale, w_scale, bias, out_dtype, xa, up_t)
    if promote != 0 and promote < 2:
        raise ValueError(f"fp8_gemm: promote must be 0 or >= 2, got {promote}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    launch_tma_gemm(_fp8_gemm_kernel, a, w, c, config,
                    (*ep.pointers, m, n, k, ep.r, c.stride(0), c.stride(1), *ep.lora_strides),
                    {**ep.flags, "PROMOTE": promote})
    return c


def float_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.bfloat16, xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """a [M, K] @ w [N, K]^T (+ bias [N]) (+ xa [M, R] @ up_t [R, N]) -> out_dtype [M, N], by fp8_gemm's TMA
    kernel on 16-bit operands (one dtype, bf16 or fp16; fp32 for the interpreter tests), K-contiguous with
    16-byte aligned rows. The branch is the accumulator's initial value (fp32 products and sum); the scales
    are one, so they change nothing."""
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"float_gemm: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != w.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"float_gemm: expected a and w in one of bf16 / fp16 / fp32, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    n = w.shape[0]
    align = 16 // a.element_size()
    if w.shape[1] != k:
        raise ValueError(f"float_gemm: K mismatch, a has {k}, w has {w.shape[1]}")
    if k % align or a.stride(1) != 1 or w.stride(1) != 1 or a.stride(0) % align or w.stride(0) % align:
        raise ValueError(f"float_gemm: TMA needs K-contiguous operands with 16-byte aligned rows, got K={k}")
    ones = torch.ones(m, dtype=torch.float32, device=a.device)
    ep = epilogue_args("float_gemm", m, n, ones, ones[:1], bias, out_dtype, xa, up_t)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    launch_tma_gemm(_fp8_gemm_kernel, a, w, c, config,
                    (*ep.pointers, m, n, k, ep.r, c.stride(0), c.stride(1), *ep.lora_strides), {**ep.flags, "PROMOTE": 0})
    return c


@torch.library.custom_op("lowbit_pipe::float_gemm", mutates_args=())
def float_gemm_op(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    return float_gemm(a, w, bias, out_dtype, xa, up_t)


@float_gemm_op.register_fake
def _(a, w, bias, out_dtype, xa=None, up_t=None):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@torch.library.custom_op("lowbit_pipe::fp8_gemm", mutates_args=())
def fp8_gemm_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype,
                xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    return fp8_gemm(a, w, a_scale, w_scale, bias, out_dtype, xa, up_t)


@fp8_gemm_op.register_fake
def _(a, w, a_scale, w_scale, bias, out_dtype, xa=None, up_t=None):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def reference_fp8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                       xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    """Torch oracle of `fp8_gemm`: e4m3 products are exact in fp32; the sum runs in float64."""
    return reference_epilogue((a.double() @ w.double().t()).float(), a_scale, w_scale, bias, out_dtype, xa, up_t)
