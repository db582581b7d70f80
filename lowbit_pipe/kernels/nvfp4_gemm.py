"""NVFP4 on Hopper (no FP4 tensor cores): decode the 4-bit weight in registers, bf16 tl.dot.

Two kernels, each laid out kernel -> launcher -> custom op (fake impl for torch.compile):

1. `nvfp4_act_quant`: NVFP4 activation emulation (what the format's GPU reference does:
   per-16 e4m3 block scales under a global scale g, one per row [M] (dynamic, the default)
   or one scalar (static input_scale, or the per-tensor opt-in), e2m1 codes). It writes
   a' = e2m1 * block (no g) in bf16/fp16/fp32: a product of a 2-bit and a 4-bit
   significand, so EXACT in bf16; g goes into the GEMM epilogue.
2. `nvfp4_gemm`: y = (a' @ W'^T) * (g_x * g_w) + bias (g_x per row with `row_scale`), where W' = e2m1 * block_w is built
   per tile in registers from the packed uint8 codes (even column in the HIGH nibble,
   comfy-kitchen hi_first) and the swizzled e4m3 block scales, also exact in bf16.
   With plain bf16 activations (a_scale 1) the same kernel is a W4A16 GEMM.

The weight never exists in memory at more than 4.5 bits per value: no cached dequantized copy.
e2m1 -> fp16 bits is a shift (`e2m1_half`); the 2^14 folds into the block scale. The decode pieces are
shared with kernels.decode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels.gemm_common import grouped_tile, launch_gemm, m_bucket

E2M1_MAX = tl.constexpr(6.0)  # constexpr: read inside the kernels
FP8_MAX = tl.constexpr(448.0)


# ---------------------------------------------------------------------------
# activation fake-quant (reference.nvfp4_quantize_blocks, minus the global scale)
# ---------------------------------------------------------------------------

@triton.jit
def _nvfp4_act_kernel(x_ptr, g_ptr, out_ptr, M, K, KP, stride_xm, stride_om,
                      PER_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = rows < M
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None] & (cols[None, :] < K), other=0.0)
    if PER_ROW:  # one global scale per row (token): [BLOCK_M, 1] against the [BLOCK_M, BLOCK_K // 16] block scales
        g = tl.load(g_ptr + rows, mask=r_ok, other=1.0)[:, None]
    else:
        g = tl.load(g_ptr)
    blocks = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // 16, 16))
    bscale = tl.math.div_rn(tl.max(tl.abs(blocks), axis=2), E2M1_MAX)
    s8 = tl.minimum(tl.math.div_rn(bscale, g), FP8_MAX).to(tl.float8e4nv).to(tl.float32)
    total = g * s8
    zero = total == 0.0
    data = tl.math.div_rn(blocks, tl.where(zero, 1.0, total)[:, :, None])
    data = tl.where(zero[:, :, None], 0.0, data)
    a = tl.minimum(tl.abs(data), E2M1_MAX)
    # e2m1 magnitude index, ties to the even code (reference._E2M1_EDGES)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    magf = mag.to(tl.float32)
    val = tl.where(mag < 4, magf * 0.5, tl.where(mag < 6, magf - 2.0, (magf - 5.0) * 2.0 + 2.0))
    val = tl.where(data < 0, -val, val) * s8[:, :, None]
    out = tl.reshape(val, (BLOCK_M, BLOCK_K))
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols[None, :] < KP))


def nvfp4_act_quant(x: torch.Tensor, global_scale: torch.Tensor, k_padded: int | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] -> a' [M, Kp] (e2m1 * e4m3 block scale, zero beyond K); Kp = k_padded or K. `global_scale`: one
    fp32 value for every row, or [M] (or [M, 1]), one per row."""
    if x.dim() != 2:
        raise ValueError(f"nvfp4_act_quant: expected 2-D x, got {tuple(x.shape)}")
    m, k = x.shape
    kp = k_padded or k
    if kp % 16 or kp < k:
        raise ValueError(f"nvfp4_act_quant: padded K {kp} must be a multiple of 16 and >= K {k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, kp), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    per_row = global_scale.numel() != 1
    if per_row and global_scale.numel() != m:
        raise ValueError(f"nvfp4_act_quant: {global_scale.numel()} global scales for {m} rows (one, or one per row)")
    g = global_scale.float().reshape(-1).contiguous()
    block_k = min(triton.next_power_of_2(kp), 256)
    block_m = 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(kp, block_k))
    _nvfp4_act_kernel[grid](x, g, out, m, k, kp, x.stride(0), out.stride(0), PER_ROW=per_row, BLOCK_M=block_m,
                            BLOCK_K=block_k, num_warps=4)
    return out


# ---------------------------------------------------------------------------
# weight decode pieces (this GEMM and kernels.decode)
# ---------------------------------------------------------------------------

@triton.jit
def e2m1_half(codes):
    """4-bit e2m1 codes (int16) -> fp16 e2m1(code) * 2^-14, exact: a shift puts sign, exponent and mantissa in
    place (normals and the 0.5 subnormal alike); the caller folds the 2^14 into a scale."""
    return (((codes & 8) << 12) | ((codes & 7) << 9)).to(tl.float16, bitcast=True)


@triton.jit
def scale_row_offsets(rows, SCALE_COLS):
    """Offset of each weight row's block-scale line in the cuBLAS 128x4-tile swizzle (reference.swizzle_block_scales)."""
    r = rows % 128
    return (rows // 128) * (SCALE_COLS // 4) * 512 + (r % 32) * 16 + (r // 32) * 4


@triton.jit
def scale_col_offsets(kb):
    """Offset of block column `kb` (16 inputs each) within a row's line of the same swizzle."""
    return (kb // 4) * 512 + kb % 4


# ---------------------------------------------------------------------------
# GEMM with the NVFP4 weight decoded in registers
# ---------------------------------------------------------------------------

def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages)


CONFIGS = {
    "128x128x128_w8_s3": _cfg(128, 128, 128, 8, 3),
    "256x128x64_w8_s3": _cfg(256, 128, 64, 8, 3),
    "128x256x64_w8_s3": _cfg(128, 256, 64, 8, 3),
    "64x128x128_w4_s4": _cfg(64, 128, 128, 4, 4),
}

@triton.jit
def _nvfp4_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, scale_ptr, row_scale_ptr, bias_ptr, c_ptr,
    M, N, K, M_BUCKET, SCALE_COLS,
    stride_am, stride_wn, stride_cm,
    HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kh = tl.arange(0, BLOCK_K // 2)
    offs_kb = tl.arange(0, BLOCK_K // 16)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_kh[None, :]
    s_row = scale_row_offsets(offs_n, SCALE_COLS)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None] & ((k0 + offs_k)[None, :] < K), other=0.0)
        p = tl.load(w_ptrs, mask=n_ok[:, None] & ((k0 + 2 * offs_kh)[None, :] < K), other=0).to(tl.int16)
        codes = tl.reshape(tl.join(p >> 4, p & 15), (BLOCK_N, BLOCK_K))  # even column = high nibble
        half = e2m1_half(codes)
        kb = k0 // 16 + offs_kb
        s_idx = s_row[:, None] + scale_col_offsets(kb)[None, :]
        bs = tl.load(ws_ptr + s_idx, mask=n_ok[:, None] & ((kb * 16)[None, :] < K), other=0.0).to(tl.float32) * 16384.0
        w = tl.reshape(tl.reshape(half.to(tl.float32), (BLOCK_N, BLOCK_K // 16, 16)) * bs[:, :, None], (BLOCK_N, BLOCK_K))
        w = tl.trans(w.to(a_ptr.dtype.element_ty))
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2

    if ROW_SCALE:  # the activations' per-row global scale times the weight's, in fp32, then the accumulator
        y = acc * (tl.load(row_scale_ptr + offs_m, mask=m_ok, other=0.0) * tl.load(scale_ptr))[:, None]
    else:
        y = acc * tl.load(scale_ptr)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], y.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_nvfp4_gemm_tuned = triton.autotune(configs=list(CONFIGS.values()), key=["N", "K", "M_BUCKET"])(_nvfp4_gemm_kernel)


def nvfp4_gemm(a: torch.Tensor, w_packed: torch.Tensor, w_block: torch.Tensor, scale: torch.Tensor, n: int,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               config: dict | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, Kp] (bf16/fp16/fp32; fp32 computes an fp32 dot), w_packed uint8 [Np, Kp/2],
    w_block e4m3 swizzled [roundup(Np,128), roundup(Kp/16,4)], scale fp32 scalar (g_x * g_w, or g_w alone with
    `row_scale`: fp32 [M], the activations' global scale per row, y = acc * (row_scale * scale))
    -> out_dtype [M, n] (n <= Np: the logical out_features)."""

    if a.dim() != 2 or w_packed.dim() != 2:
        raise ValueError(f"nvfp4_gemm: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w_packed.shape)}")
    m, kp = a.shape
    if w_packed.shape[1] * 2 != kp:
        raise ValueError(f"nvfp4_gemm: a has K={kp}, the packed weight holds {w_packed.shape[1] * 2}")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"nvfp4_gemm: a must be bf16/fp16/fp32, got {a.dtype}")
    if n > w_packed.shape[0]:
        raise ValueError(f"nvfp4_gemm: n={n} exceeds the {w_packed.shape[0]} stored rows")
    if a.stride(-1) != 1:
        a = a.contiguous()
    w_packed = w_packed.view(torch.uint8).contiguous()
    w_block = w_block.view(torch.float8_e4m3fn).contiguous()
    scale = scale.float().reshape(1).contiguous()
    if row_scale is not None and row_scale.numel() != m:
        raise ValueError(f"nvfp4_gemm: {row_scale.numel()} row scales for {m} rows")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    bias_arg = bias.contiguous() if bias is not None else scale
    row_arg = row_scale.float().reshape(-1).contiguous() if row_scale is not None else scale
    args = (a, w_packed, w_block, scale, row_arg, bias_arg, c, m, n, kp, m_bucket(m), w_block.shape[1],
            a.stride(0), w_packed.stride(0), c.stride(0))
    flags = {"HAS_BIAS": bias is not None, "ROW_SCALE": row_scale is not None, "IEEE": a.dtype == torch.float32}
    launch_gemm(_nvfp4_gemm_tuned, _nvfp4_gemm_kernel, args, flags, m, n, config, a.is_cuda)
    return c


# ---------------------------------------------------------------------------
# custom ops (fake impls: shapes only)
# ---------------------------------------------------------------------------

@torch.library.custom_op("lowbit_pipe::nvfp4_act_quant", mutates_args=())
def nvfp4_act_quant_op(x: torch.Tensor, global_scale: torch.Tensor, k_padded: int, out_dtype: torch.dtype) -> torch.Tensor:
    return nvfp4_act_quant(x, global_scale, k_padded, out_dtype)


@nvfp4_act_quant_op.register_fake
def _(x, global_scale, k_padded, out_dtype):
    return x.new_empty((x.shape[0], k_padded), dtype=out_dtype)


@torch.library.custom_op("lowbit_pipe::nvfp4_gemm", mutates_args=())
def nvfp4_gemm_op(a: torch.Tensor, w_packed: torch.Tensor, w_block: torch.Tensor, scale: torch.Tensor, n: int,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    return nvfp4_gemm(a, w_packed, w_block, scale, n, bias, out_dtype, row_scale=row_scale)


@nvfp4_gemm_op.register_fake
def _(a, w_packed, w_block, scale, n, bias, out_dtype, row_scale=None):
    return a.new_empty((a.shape[0], n), dtype=out_dtype)
