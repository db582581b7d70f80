"""Triton INT8 GEMM: int8 activations x int8 (or packed int4) weight -> int32, scaled epilogue.

    y[m, n] = (acc[m, n] * a_scale[m]) * b_scale[n or scalar] (+ bias[n]) (+ sum_r xa[m, r] * up_t[r, n]),
    acc = sum_k a[m, k] * w[n, k]

Optional low-rank epilogue (a LoRA residual y += (x @ down^T) @ up^T on the quantized linear): `xa`
[M, R] = x @ down^T (activation dtype, the UNROTATED input; quantize_act computes it from its own read
of x) and `up_t` [R, N]; the tile's fp32 result is the accumulator of one more
tl.dot (R padded to a power of two >= 16, masked), so the branch costs no extra pass over y and
the output is rounded once (the unfused path rounds y and the delta, then their sum).

Layout: kernel -> launcher (`int8_gemm`: checks, allocation, grid) -> custom op
`lowbit_pipe::int8_gemm` (with a fake impl, so torch.compile traces through it).

Weight modes (`w_mode`):
- 0: int8 codes [N, K] (int8_tensorwise, w4a8/w6a8 after their int8-grid decode).
- 1: signed int4 codes packed two per byte [N, K/2], column 2i in the LOW nibble
     (convrot_w4a4). Unpacked to int8 in registers, so the tensor cores see int8.

The epilogue multiplies in the same order as the torch reference
(`acc * xs * ws`, then `+ bias`, then the output cast), and the int32 accumulation
is exact, so outputs match the reference to fp32 rounding of the scale products.

Two kernels: on Hopper, for int8 weights at M >= 1024 when the operands allow it (`use_tma`),
`_int8_tma_kernel` reads them through TMA descriptors (no masks in the K loop) with fp8_gemm's tiles,
chosen by M, no autotuning; elsewhere the masked-load kernel, autotuned. Its tiles: 256x128x128 /
128x256x128, 8 warps, 3 stages for M in the thousands (large tiles reuse each loaded operand tile across
many outputs; the stage count from the H200 tile sweep in
bench/results/lora_kernel_tune_h200.md); smaller tiles for M=256-ish calls, where large ones
would leave SMs without a tile. Against bf16 on the H200: the GEMM column of
bench/results/linear_speed_h200.md. Autotune keys on
N, K and a bucketed M (so a new token count does not re-tune).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.gemm_common import (
    epilogue_args,
    grouped_tile,
    launch_gemm,
    launch_tma_gemm,
    low_rank_tile,
    m_bucket,
    reference_epilogue,
    scaled_tile,
    tile_offsets,
)


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps, num_stages=stages)


# Short named list (Hopper): the two large tiles (module doc), two for small M / small N, and
# 128x128x64 / 4 warps / 5 stages, which the H200 sweep found fastest WITH the low-rank epilogue at
# the small-N shape 4608 x 6144 -> 1536 (timings: bench/results/lora_kernel_tune_h200.md, GEMM tiles).
CONFIGS = {
    "256x128x128_w8_s3": _cfg(256, 128, 128, 8, 3),
    "128x256x128_w8_s3": _cfg(128, 256, 128, 8, 3),
    "128x128x128_w8_s4": _cfg(128, 128, 128, 8, 4),
    "64x128x128_w4_s4": _cfg(64, 128, 128, 4, 4),
    "128x128x64_w4_s5": _cfg(128, 128, 64, 4, 5),
}


@triton.jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, xa_ptr, up_ptr,
    M, N, K, M_BUCKET, R,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_xam, stride_xar, stride_ur, stride_un,
    W_MODE: tl.constexpr, B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, LORA_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if W_MODE == 0:
        # [BLOCK_K, BLOCK_N] view of the row-major [N, K] weight (K-major B, what int8 wgmma wants).
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    else:
        offs_kh = tl.arange(0, BLOCK_K // 2)
        b_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_kh[None, :] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_left), other=0)
        if W_MODE == 0:
            b = tl.load(b_ptrs, mask=n_ok[None, :] & (offs_k[:, None] < k_left), other=0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        else:
            p = tl.load(b_ptrs, mask=n_ok[:, None] & (offs_kh[None, :] < k_left // 2), other=0)
            lo = (p << 4).to(tl.int8) >> 4  # sign-extend the low nibble (even column)
            hi = p >> 4  # arithmetic shift: the high nibble, sign-extended (odd column)
            b = tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)))
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += (BLOCK_K // 2) * stride_bk
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)

    y = scaled_tile(acc.to(tl.float32), as_ptr, bs_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, B_SCALAR, HAS_BIAS)
    if HAS_LORA:  # low-rank epilogue: y += xa[tile rows] @ up_t[:, tile cols], fp32 accumulate
        y = low_rank_tile(y, xa_ptr, up_ptr, offs_m, offs_n, m_ok, n_ok, R, stride_xam, stride_xar, stride_ur, stride_un,
                          R_PAD, LORA_IEEE)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_tma_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, bias_ptr, xa_ptr, up_ptr,
    M, N, K, R,
    stride_cm, stride_cn, stride_xam, stride_xar, stride_ur, stride_un,
    B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, LORA_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The int8-weight GEMM with its operands through TMA tensor descriptors (Hopper): out-of-range rows, columns
    and K come back as zeros, so the K loop has no masks (what made the fp8 GEMM fast: fp8_gemm's module doc)."""
    off_m, off_n, offs_m, offs_n, m_ok, n_ok = tile_offsets(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for i in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, i * BLOCK_K])
        b = b_desc.load([off_n, i * BLOCK_K])
        acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)

    y = scaled_tile(acc.to(tl.float32), as_ptr, bs_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, B_SCALAR, HAS_BIAS)
    if HAS_LORA:
        y = low_rank_tile(y, xa_ptr, up_ptr, offs_m, offs_n, m_ok, n_ok, R, stride_xam, stride_xar, stride_ur, stride_un,
                          R_PAD, LORA_IEEE)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def tma_operands(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a [M, K] and w [N, K] can go through TMA descriptors: K-contiguous rows starting on 16-byte
    boundaries (int8: one byte per value)."""
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.shape[1] % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, w))


# The TMA kernel was measured at M=4608 only; fewer rows keep the autotuned kernel and its measured figures.
TMA_MIN_ROWS = 1024


def use_tma(a: torch.Tensor, w: torch.Tensor, w_mode: int) -> bool:
    """The TMA kernel on Hopper (sm90) for int8 weights from TMA_MIN_ROWS rows when the operands allow it;
    otherwise the masked-load kernel, autotuned. H200 at M=4608 (bench/results/linear_speed_h200_tma.md against
    linear_speed_h200_rotmm.md): int8 weights 0.299 ms through TMA against 0.347 masked at 6144 x 6144; packed
    int4 unpacked from a TMA tile took 0.842 ms against 0.627 masked (the nibble shuffle, not the loads, bounds
    that kernel), so int4 stays masked."""
    return (w_mode == 0 and a.shape[0] >= TMA_MIN_ROWS and a.is_cuda
            and torch.cuda.get_device_properties(a.device).major == 9 and tma_operands(a, w))


_int8_gemm_tuned = triton.autotune(configs=list(CONFIGS.values()), key=["N", "K", "M_BUCKET", "W_MODE", "HAS_LORA", "R_PAD"])(_int8_gemm_kernel)

def int8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, w_mode: int = 0,
              config: dict | None = None, xa: torch.Tensor | None = None,
              up_t: torch.Tensor | None = None, tma: bool | None = None) -> torch.Tensor:
    """a int8 [M, K], w int8 [N, K] (w_mode 0) or packed int4 [N, K/2] (w_mode 1),
    a_scale fp32 [M] / [M, 1], w_scale fp32 [N] / [N, 1] / scalar -> out_dtype [M, N].

    `xa` [M, R] and `up_t` [R, N] (same float dtype, any strides; R <= 128): the low-rank
    epilogue, out += xa @ up_t in fp32 before the output cast. Both or neither.

    `config`: explicit meta-parameters (BLOCK_M/N/K, GROUP_M, num_warps, num_stages) instead of
    autotuning (the masked-load kernel) or gemm_common.tma_launch_config (TMA); used by the interpreter tests.
    `tma`: the TMA-descriptor kernel, int8 weights only (None: `use_tma`: on Hopper from TMA_MIN_ROWS rows when
    the operands allow it).
    """
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"int8_gemm: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != torch.int8 or w.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"int8_gemm: expected int8 a and int8 w, got {a.dtype} and {w.dtype}")
    if w_mode not in (0, 1):
        raise ValueError(f"int8_gemm: w_mode must be 0 (int8) or 1 (packed int4), got {w_mode}")
    m, k = a.shape
    n = w.shape[0]
    wk = w.shape[1] * (2 if w_mode == 1 else 1)
    if wk != k:
        raise ValueError(f"int8_gemm: K mismatch, a has {k}, w holds {wk} (w_mode {w_mode})")
    if w_mode == 1 and k % 2:
        raise ValueError("int8_gemm: packed int4 needs an even K")
    ep = epilogue_args("int8_gemm", m, n, a_scale, w_scale, bias, out_dtype, xa, up_t)
    w = w.view(torch.int8)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if tma is None:
        tma = use_tma(a, w, w_mode)
    if tma:
        if w_mode != 0 or not tma_operands(a, w):
            raise ValueError(f"int8_gemm: TMA needs int8 weights (w_mode 0) and K-contiguous operands with 16-byte "
                             f"aligned rows, got w_mode {w_mode}, K={k}")
        launch_tma_gemm(_int8_tma_kernel, a, w, c, config,
                        (*ep.pointers, m, n, k, ep.r, c.stride(0), c.stride(1), *ep.lora_strides), ep.flags)
        return c
    args = (a, w, c, *ep.pointers, m, n, k, m_bucket(m), ep.r,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), c.stride(0), c.stride(1), *ep.lora_strides)
    launch_gemm(_int8_gemm_tuned, _int8_gemm_kernel, args, {"W_MODE": w_mode, **ep.flags}, m, n, config, a.is_cuda)
    return c


# ---------------------------------------------------------------------------
# custom op: opaque to torch.compile (no graph break), with a shape-only fake impl
# ---------------------------------------------------------------------------

@torch.library.custom_op("lowbit_pipe::int8_gemm", mutates_args=())
def int8_gemm_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, w_mode: int,
                 xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    return int8_gemm(a, w, a_scale, w_scale, bias, out_dtype, w_mode, None, xa, up_t)


@int8_gemm_op.register_fake
def _(a, w, a_scale, w_scale, bias, out_dtype, w_mode, xa=None, up_t=None):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def reference_int8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                        w_mode: int = 0, xa: torch.Tensor | None = None,
                        up_t: torch.Tensor | None = None) -> torch.Tensor:
    """Torch oracle of `int8_gemm` (exact int64 accumulate, same scale order; fp32 low-rank term)."""
    if w_mode == 1:
        p = w.view(torch.uint8).to(torch.int32)
        codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(w.shape[0], -1)
        w = torch.where(codes >= 8, codes - 16, codes)
    acc = (a.to(torch.int64) @ w.to(torch.int64).t()).to(torch.float32)
    return reference_epilogue(acc, a_scale, w_scale, bias, out_dtype, xa, up_t)
