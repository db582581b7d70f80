"""Triton weight decode kernels: a packed weight -> the dense operand a tensor-core GEMM reads.

At DiT token counts (M in the hundreds and thousands) decoding the whole weight once per call into a transient
buffer (one layer's, freed after the call) costs a few percent of the GEMM (0.034 ms next to cuBLAS's 0.48 ms
at 4608 x 6144 x 6144 on the H200), while a decode inside the GEMM's main loop is repeated for every row tile
and competes with its MMAs. nvfp4 keeps its register-decode GEMM for calls of few rows (dispatch).

1. `nvfp4_decode`: e2m1 codes (even column in the HIGH nibble) x e4m3 block scales (cuBLAS swizzle) x a
   global scale -> [N, K] in the GEMM's dtype. The product is formed as the reference does,
   e2m1 * (global * block) in fp32, then rounded once to the output dtype: weight-only nvfp4 is what
   stock ComfyUI computes on GPUs without FP4 (dequantize into the activation dtype, matmul). An e4m3
   output (nvfp4's fp8 compute) divides each row by its scale first.
2. `grid_decode_int8`: asym_w4a8_int8 codes (4-bit codebook or uniform 6-bit) x e4m3 group scales ->
   the int8 grid [N, K] the W8A8 GEMM consumes, clamp(rne(level * s_rel), +-127): bit-exact with
   formats.w4a8.decode_int8_grid.
3. `awq_decode`: awq_w4a16's uint4 codes (column 2j in the LOW nibble) with a scale and zero per group of
   64 ([K/64, N], bf16 or fp16) -> (u - 8) * scale + zero, each operation rounded to the scales' dtype as
   torch rounds it (formats.awq_w4a16.decode, comfy-kitchen's arithmetic): bit-exact.
4. `svdquant_decode`: svdquant_w4a4's residual, two's complement int4 codes (column 2j in the LOW nibble)
   times a scale per group of 64 ([K/64, N]), rounded once to the scales' dtype (the eager contract's
   residual): bit-exact. It shares awq_decode's kernel.
5. `mxfp8_decode`: e4m3 codes x 2^(e - 127) per block of 32 (E8M0 exponents in the same swizzle as
   nvfp4's block scales; e = 0 a zero block): exact in fp32, then rounded once to the output dtype
   (formats.mxfp8.dequantize_blocks).
Weight-only layers of awq_w4a16 and mxfp8 on a GPU decode with 3. and 5. into the input's dtype, then
cuBLAS: stock ComfyUI's arithmetic there, without the torch decode's fp32 intermediates.

Each is kernel -> launcher -> custom op with a fake impl (torch.compile keeps it one node).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels import ROUND_EACH_OP
from lowbit_pipe.kernels.nvfp4_gemm import e2m1_half, scale_col_offsets, scale_row_offsets

BLOCK_N = 32
BLOCK_K = 256


@triton.jit
def _nvfp4_decode_kernel(w_ptr, ws_ptr, g_ptr, rs_ptr, out_ptr, N, K, SCALE_COLS, stride_wn, stride_on,
                         FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Whole bytes and whole 16-column scale blocks per program: contiguous loads, each scale read once and
    # broadcast over its 16 columns in registers.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    kb = tl.program_id(1) * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = rows < N
    p = tl.load(w_ptr + rows[:, None] * stride_wn + kh[None, :], mask=r_ok[:, None] & (2 * kh < K)[None, :],
                other=0).to(tl.int16)
    codes = tl.reshape(tl.join(p >> 4, p & 15), (BLOCK_N, BLOCK_K))  # even column = high nibble
    e2m1 = e2m1_half(codes).to(tl.float32) * 16384.0
    s_idx = scale_row_offsets(rows, SCALE_COLS)[:, None] + scale_col_offsets(kb)[None, :]
    block = tl.load(ws_ptr + s_idx, mask=r_ok[:, None] & (16 * kb < K)[None, :], other=0.0).to(tl.float32)
    total = tl.load(g_ptr) * block
    w = tl.reshape(tl.reshape(e2m1, (BLOCK_N, BLOCK_K // 16, 16)) * total[:, :, None], (BLOCK_N, BLOCK_K))
    if FP8:  # reference.fp8_quantize(w, row_scale): times the reciprocal, clamped, rounded to e4m3
        inv = tl.math.div_rn(tl.full((BLOCK_N,), 1.0, tl.float32), tl.load(rs_ptr + rows, mask=r_ok, other=1.0))
        w = tl.clamp(w * inv[:, None], -448.0, 448.0)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols < K)[None, :])


def nvfp4_decode(w_packed: torch.Tensor, w_block: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                 out_dtype: torch.dtype, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """w_packed uint8 [Np, Kp/2], w_block e4m3 swizzled [roundup(Np,128), roundup(Kp/16,4)], global_scale fp32
    (one value) -> out_dtype [n, k] = e2m1 * (global * block) (n <= Np, k <= Kp: padding cropped).
    out_dtype float8_e4m3fn takes `row_scale` fp32 [n]: e4m3(clamp(value * (1 / row_scale), +-448))."""
    fp8 = out_dtype == torch.float8_e4m3fn
    if fp8 != (row_scale is not None) or (fp8 and row_scale.numel() != n):
        raise ValueError(f"nvfp4_decode: an fp8 output takes a row_scale of {n} values, other outputs none")
    if w_packed.dim() != 2 or n > w_packed.shape[0] or k > w_packed.shape[1] * 2:
        raise ValueError(f"nvfp4_decode: [{n}, {k}] does not fit the packed weight {tuple(w_packed.shape)}")
    if global_scale.numel() != 1:
        raise ValueError(f"nvfp4_decode: global_scale must hold one value, got {tuple(global_scale.shape)}")
    w_packed = w_packed.view(torch.uint8).contiguous()
    w_block = w_block.view(torch.float8_e4m3fn).contiguous()
    g = global_scale.float().reshape(1).contiguous()
    rs = row_scale.float().reshape(-1).contiguous() if fp8 else g  # dummy pointer without fp8
    out = torch.empty((n, k), dtype=out_dtype, device=w_packed.device)
    if n and k:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
        _nvfp4_decode_kernel[grid](w_packed, w_block, g, rs, out, n, k, w_block.shape[1], w_packed.stride(0),
                                   out.stride(0), FP8=fp8, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


@triton.jit
def _grid_decode_kernel(w_ptr, srel_ptr, book_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                        BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Whole bytes per program (joined back into column order in registers), each group scale read once.
    tl.static_assert(BLOCK_K % (4 * GROUP) == 0)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    kg = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = rows < N
    w_row = w_ptr + rows[:, None] * stride_wn
    p = tl.load(w_row + kh[None, :], mask=r_ok[:, None] & (2 * kh < K)[None, :], other=0).to(tl.int32)
    code = tl.reshape(tl.join(p & 15, (p >> 4) & 15), (BLOCK_N, BLOCK_K))  # even column = LOW nibble
    if BITS == 6:  # top two bits: plane after the K/2 nibble bytes, column c at bit 2*(c % 4) of byte c // 4
        kq = tl.program_id(1) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)
        t = tl.load(w_row + (K // 2 + kq)[None, :], mask=r_ok[:, None] & (4 * kq < K)[None, :], other=0).to(tl.int32)
        # join puts its new axis last: join(join(b0, b2), join(b1, b3)) flattens to b0, b1, b2, b3
        top = tl.reshape(tl.join(tl.join(t & 3, (t >> 4) & 3), tl.join((t >> 2) & 3, (t >> 6) & 3)),
                         (BLOCK_N, BLOCK_K))
        level = ((code | (top << 4)) - 32).to(tl.float32)
    else:
        level = tl.load(book_ptr + code)  # 16 entries, cache-resident
    s = tl.load(srel_ptr + rows[:, None] * stride_sn + kg[None, :], mask=r_ok[:, None] & (GROUP * kg < K)[None, :],
                other=0.0).to(tl.float32)
    v = tl.reshape(tl.reshape(level, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    v = (v + 12582912.0) - 12582912.0  # round half to even (torch.round), |v| << 2^22
    q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int8)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], q, mask=r_ok[:, None] & (cols < K)[None, :])


def grid_decode_int8(weight: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None, k: int, bits: int,
                     group_size: int = 16) -> torch.Tensor:
    """asym_w4a8_int8 storage -> int8 [N, K]: weight int8 [N, K*bits/8], s_rel e4m3 [N, K/group], codebook fp32
    [16] (bits 4) or None (bits 6: code - 32). Same values as formats.w4a8.decode_int8_grid."""
    if bits not in (4, 6) or (bits == 4) != (codebook is not None):
        raise ValueError(f"grid_decode_int8: bits {bits} with{'out' if codebook is None else ''} a codebook")
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] * 8 != k * bits or tuple(s_rel.shape) != (n, k // group_size):
        raise ValueError(f"grid_decode_int8: weight {tuple(weight.shape)} / s_rel {tuple(s_rel.shape)} do not "
                         f"describe [{n}, {k}] at {bits} bits, groups of {group_size}")
    w = weight.view(torch.uint8).contiguous()
    s = s_rel.view(torch.float8_e4m3fn).contiguous()
    book = codebook.float().contiguous() if codebook is not None else s  # dummy pointer at 6 bits
    out = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
        _grid_decode_kernel[grid](w, s, book, out, n, k, w.stride(0), s.stride(0), out.stride(0),
                                  BITS=bits, GROUP=group_size, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


@triton.jit
def _int4_group_decode_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_wn, stride_sg, stride_on,
                              AWQ: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Whole bytes per program (joined back into column order in registers), each (group, row) scale (and
    # zero) read once and broadcast over its 64 columns. AWQ: uint4 codes minus 8, plus a zero per group;
    # otherwise svdquant_w4a4's two's complement nibbles and no zero.
    tl.static_assert(BLOCK_K % GROUP == 0)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    kg = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = rows < N
    p = tl.load(w_ptr + rows[:, None] * stride_wn + kh[None, :], mask=r_ok[:, None] & (2 * kh < K)[None, :],
                other=0).to(tl.int32)
    u = tl.reshape(tl.join(p & 15, (p >> 4) & 15), (BLOCK_N, BLOCK_K))  # even column = LOW nibble
    code = u - 8 if AWQ else ((u + 8) & 15) - 8
    g_ok = r_ok[:, None] & (GROUP * kg < K)[None, :]
    s_off = kg[None, :] * stride_sg + rows[:, None]  # scales and zeros are [K/64, N]
    s = tl.load(s_ptr + s_off, mask=g_ok, other=0.0).to(tl.float32)
    # code * s is exact in fp32 (a 4-bit integer times an 8/11-bit significand): rounding it (and, AWQ, the sum
    # with the zero) to the scales' dtype is what torch does for each operation in that dtype
    t = tl.reshape(tl.reshape(code.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None],
                   (BLOCK_N, BLOCK_K))
    v = t.to(s_ptr.dtype.element_ty)
    if AWQ:
        z = tl.load(z_ptr + s_off, mask=g_ok, other=0.0).to(tl.float32)
        v = tl.reshape(tl.reshape(v.to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP)) + z[:, :, None],
                       (BLOCK_N, BLOCK_K)).to(s_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols < K)[None, :])


def _int4_group_decode(op: str, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, k: int,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """awq_decode (zero given) or svdquant_decode (none): the checks, naming `op`, and the launch."""
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] * 2 != k or k % 64:
        raise ValueError(f"{op}: weight {tuple(weight.shape)} does not hold [{n}, {k}] (k a multiple of 64)")
    if tuple(scale.shape) != (k // 64, n) or scale.dtype not in (torch.bfloat16, torch.float16) or (
            zero is not None and (zero.shape != scale.shape or zero.dtype != scale.dtype)):
        zeros = "" if zero is None else f" / zero {tuple(zero.shape)} {zero.dtype}"
        raise ValueError(f"{op}: scale {tuple(scale.shape)} {scale.dtype}{zeros} not [{k // 64}, {n}] bf16 or fp16"
                         + (" (both one dtype)" if zero is not None else ""))
    w = weight.view(torch.uint8).contiguous()
    s = scale.contiguous()
    z = zero.contiguous() if zero is not None else s  # a dummy pointer without zeros
    out = torch.empty((n, k), dtype=out_dtype, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
        _int4_group_decode_kernel[grid](w, s, z, out, n, k, w.stride(0), s.stride(0), out.stride(0),
                                        AWQ=zero is not None, GROUP=64, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
                                        **ROUND_EACH_OP)
    return out


def awq_decode(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """awq_w4a16 storage -> out_dtype [N, k]: weight int8 [N, k/2] (uint4, column 2j low), scale and zero
    [k/64, N] in bf16 or fp16. Same values as formats.awq_w4a16.decode, then cast to out_dtype."""
    return _int4_group_decode("awq_decode", weight, scale, zero, k, out_dtype)


def svdquant_decode(weight: torch.Tensor, scale: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """svdquant_w4a4's residual -> out_dtype [N, k]: weight int8 [N, k/2] (two's complement int4, column 2j low),
    scale [k/64, N] bf16 or fp16: codes * scale rounded to the scale's dtype (SVDQuantW4A4._residual's values),
    then cast to out_dtype."""
    return _int4_group_decode("svdquant_decode", weight, scale, None, k, out_dtype)


@triton.jit
def _mxfp8_decode_kernel(w_ptr, e_ptr, out_ptr, N, K, SCALE_COLS, stride_wn, stride_on,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = rows < N
    c = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=r_ok[:, None] & (cols < K)[None, :],
                other=0.0).to(tl.float32)
    e_idx = scale_row_offsets(rows, SCALE_COLS)[:, None] + scale_col_offsets(kb)[None, :]
    e = tl.load(e_ptr + e_idx, mask=r_ok[:, None] & (32 * kb < K)[None, :], other=0).to(tl.int32)
    scale = tl.where(e == 0, 0.0, (e << 23).to(tl.float32, bitcast=True))  # 2^(e - 127); e = 0: a zero block
    v = tl.reshape(tl.reshape(c, (BLOCK_N, BLOCK_K // 32, 32)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
    tl.store(out_ptr + rows[:, None] * stride_on + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (cols < K)[None, :])


def mxfp8_decode(weight: torch.Tensor, exponents: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """mxfp8 storage -> out_dtype [N, K]: weight e4m3 [N, K] (K a multiple of 32), exponents E8M0 (or uint8)
    swizzled [roundup(N,128), roundup(K/32,4)]. Same values as formats.mxfp8.dequantize_blocks, then cast."""
    n, k = weight.shape if weight.dim() == 2 else (0, 1)
    if weight.dim() != 2 or k % 32 or exponents.dim() != 2 or exponents.shape[0] < n or exponents.shape[1] * 32 < k:
        raise ValueError(f"mxfp8_decode: weight {tuple(weight.shape)} / exponents {tuple(exponents.shape)} do not "
                         "describe an mxfp8 layer (K a multiple of 32, swizzled exponents covering it)")
    w = weight.view(torch.float8_e4m3fn).contiguous()
    e = exponents.view(torch.uint8).contiguous()
    out = torch.empty((n, k), dtype=out_dtype, device=weight.device)
    if n and k:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
        _mxfp8_decode_kernel[grid](w, e, out, n, k, e.shape[1], w.stride(0), out.stride(0),
                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out


@torch.library.custom_op("lowbit_pipe::nvfp4_decode", mutates_args=())
def nvfp4_decode_op(w_packed: torch.Tensor, w_block: torch.Tensor, global_scale: torch.Tensor, n: int, k: int,
                    out_dtype: torch.dtype, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    return nvfp4_decode(w_packed, w_block, global_scale, n, k, out_dtype, row_scale)


@nvfp4_decode_op.register_fake
def _(w_packed, w_block, global_scale, n, k, out_dtype, row_scale=None):
    return w_packed.new_empty((n, k), dtype=out_dtype)


@torch.library.custom_op("lowbit_pipe::grid_decode_int8", mutates_args=())
def grid_decode_int8_op(weight: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None, k: int,
                        bits: int, group_size: int) -> torch.Tensor:
    return grid_decode_int8(weight, s_rel, codebook, k, bits, group_size)


@grid_decode_int8_op.register_fake
def _(weight, s_rel, codebook, k, bits, group_size):
    return weight.new_empty((weight.shape[0], k), dtype=torch.int8)


@torch.library.custom_op("lowbit_pipe::awq_decode", mutates_args=())
def awq_decode_op(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    return awq_decode(weight, scale, zero, k, out_dtype)


@awq_decode_op.register_fake
def _(weight, scale, zero, k, out_dtype):
    return weight.new_empty((weight.shape[0], k), dtype=out_dtype)


@torch.library.custom_op("lowbit_pipe::svdquant_decode", mutates_args=())
def svdquant_decode_op(weight: torch.Tensor, scale: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    return svdquant_decode(weight, scale, k, out_dtype)


@svdquant_decode_op.register_fake
def _(weight, scale, k, out_dtype):
    return weight.new_empty((weight.shape[0], k), dtype=out_dtype)


@torch.library.custom_op("lowbit_pipe::mxfp8_decode", mutates_args=())
def mxfp8_decode_op(weight: torch.Tensor, exponents: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return mxfp8_decode(weight, exponents, out_dtype)


@mxfp8_decode_op.register_fake
def _(weight, exponents, out_dtype):
    return weight.new_empty(tuple(weight.shape), dtype=out_dtype)
