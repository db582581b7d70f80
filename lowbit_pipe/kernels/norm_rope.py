"""RMSNorm and rotary embedding as one memory pass each, for the uncompiled (eager) path.

diffusers' DiT blocks run these as chains of torch ops: Krea 2's RMSNorm upcasts to fp32 (a copy), norms, and
casts back (another); `apply_rotary_emb` builds the rotated copy (negate, stack), upcasts both, and runs three
fp32 elementwise ops before the cast back. Uncompiled, each op is a kernel reading and writing the whole tensor:
on the full-size Krea 2 they are most of the 90 ms of eager elementwise time per forward
(bench/results/forward_profile_eager_h200.md). Under torch.compile Inductor fuses the same chains by itself, so
the callers use these kernels in eager only. ComfyUI's own model code (lowbit_pipe.attention.comfy_fused) uses the same
norm, reading its strided q / k views directly, and `rope_pairs` for its RoPE form.

Each computes in fp32 what the torch code computes, and rounds once to the output dtype:

    rms_norm:   y = x * rsqrt(mean(x^2) + eps) * (weight + offset)     (Krea 2: offset 1, zero-centred weight;
                                                                         diffusers' RMSNorm: x̂ rounded first
                                                                         when its weight is 16-bit, as it does)
    rope:       y[2i]   = x[2i]   * cos[2i]   - x[2i+1] * sin[2i]       (interleaved pairs: diffusers' FLUX,
                y[2i+1] = x[2i+1] * cos[2i+1] + x[2i]   * sin[2i+1]      Krea 2)
    rope_pairs: y[2i+r] = F[i,r,0] * x[2i] + F[i,r,1] * x[2i+1]         (ComfyUI: freqs as 2x2 matrices F per
                                                                         pair; 16-bit F computes in F's dtype,
                                                                         as ComfyUI's torch code does)

and, for the modulation and gated residuals around them (ComfyUI's Krea 2 blocks, three and two passes each in
torch), with each op's rounding kept so the result is bit for bit torch's:

    modulated_rms_norm: y = rms_norm(x) * mult + shift                   (mult = 1 + scale, per batch row)
    gated_residual:     y = x + gate * y'                                (gate per batch row)

The fp32 sums may round differently from torch's (order, fused multiply-add, 1 / sqrt against rsqrt): within an
fp32 ulp or a few, so the rounded outputs agree but for a rare bf16 ulp (tests/kernels/test_kernels.py, case norm_rope;
tests/comfy/test_comfy_fused.py against ComfyUI's own modules and functions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels import ROUND_EACH_OP

MAX_DIM = 16384  # one row in registers per program
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, mult_ptr, shift_ptr, M, D, eps, offset, N1, N2, SX0, SX1, SX2, L, SMB, SSB,
                     WEIGHT: tl.constexpr, ROUND_FIRST: tl.constexpr, STRIDED: tl.constexpr, MODULATE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    if STRIDED:  # x's rows as three strided dims (a permuted or sliced view); the output is contiguous
        r = rows.to(tl.int64)
        x_rows = (r // (N1 * N2)) * SX0 + ((r // N2) % N1) * SX1 + (r % N2) * SX2
        x_offs = x_rows[:, None] + cols[None, :]
    else:
        x_offs = offs
    x = tl.load(x_ptr + x_offs, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    if WEIGHT:
        if ROUND_FIRST:  # diffusers' RMSNorm with a 16-bit weight: x̂ in the weight's dtype, then the product
            y = y.to(dt).to(tl.float32)
        y = y * (tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32) + offset)[None, :]
    if MODULATE:  # y * mult + shift per batch row (rows of L tokens), each op rounded to dt as torch's ops round
        b = (rows // L).to(tl.int64)[:, None]
        y = y.to(dt).to(tl.float32) * tl.load(mult_ptr + b * SMB + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y = y.to(dt).to(tl.float32) + tl.load(shift_ptr + b * SSB + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(dt), mask=ok)


@triton.jit
def _gated_residual_kernel(x_ptr, g_ptr, y_ptr, out_ptr, M, D, L, SGB, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    # out = x + gate * y, gate one row per batch (rows of L tokens); the product rounded to dt first, as torch's two
    # ops round
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows < M)[:, None] & (cols < D)[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + (rows // L).to(tl.int64)[:, None] * SGB + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    gy = (g * tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(out_ptr + offs, (tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32) + gy).to(dt), mask=ok)


# The RoPE kernels read a pair's two elements as two stride-2 loads (no gather of a partner, no split / join) and
# take few rows per program (ROPE_ROWS, one warp): on an H100 that reached 1.6-1.9 TB/s where 32-row programs of
# the same code reached 0.2 TB/s and the first kernels (a row per thread group, the partner gathered, 4096
# elements per program) 0.3-0.8 TB/s (bench/results/rope_variants*_h100.md). A row's table entries come from its
# token; L1 serves the rows of one token. `_rope_e4m3_kernel` (attention.fold_qk's) has the same form: 0.167 ->
# 0.097 ms for Krea 2's q at 1024² on an H100, the same codes (bench/results/rope_kernels_h100_s55.md).
ROPE_ROWS = 4


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, HALF, S, ROW_DIV,
                 BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_H)
    ok = (rows < M)[:, None] & (p < HALF)[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * HALF) + 2 * p[None, :]
    x0 = tl.load(x_ptr + base, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + base + 1, mask=ok, other=0.0).to(tl.float32)
    # the row's position in the sequence: [B, S, H, D] (ROW_DIV = H) or [B, H, S, D] (ROW_DIV = 1) rows
    tb = ((rows // ROW_DIV) % S).to(tl.int64)[:, None] * (2 * HALF) + 2 * p[None, :]
    c0 = tl.load(cos_ptr + tb, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + tb + 1, mask=ok, other=0.0)
    s0 = tl.load(sin_ptr + tb, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + tb + 1, mask=ok, other=0.0)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + base, (x0 * c0 - x1 * s0).to(dt), mask=ok)
    tl.store(out_ptr + base + 1, (x1 * c1 + x0 * s1).to(dt), mask=ok)


@triton.jit
def _rope_e4m3_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, scale_ptr, amax_ptr, valid_ptr, pos_ptr, M, HALF, S, H,
                      MASK: tl.constexpr, AMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    # `_rope_kernel` on [B, S, H, D] rows (r = (b S + s) H + h) with an e4m3 epilogue: y * scale saturated at +-448,
    # row (b, s) written to token slot pos[b, s] (MASK: qkv_fp8.key_order, masked tokens as zero codes); AMAX: the
    # largest |y| of the program into amax_ptr (atomic max: the bound's check; one per 4 rows, so it is optional).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_H)
    inside = rows < M
    ok = inside[:, None] & (p < HALF)[None, :]
    r64 = rows.to(tl.int64)
    base = r64[:, None] * (2 * HALF) + 2 * p[None, :]
    x0 = tl.load(x_ptr + base, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + base + 1, mask=ok, other=0.0).to(tl.float32)
    tb = ((rows // H) % S).to(tl.int64)[:, None] * (2 * HALF) + 2 * p[None, :]
    y0 = x0 * tl.load(cos_ptr + tb, mask=ok, other=0.0) - x1 * tl.load(sin_ptr + tb, mask=ok, other=0.0)
    y1 = x1 * tl.load(cos_ptr + tb + 1, mask=ok, other=0.0) + x0 * tl.load(sin_ptr + tb + 1, mask=ok, other=0.0)
    if AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.maximum(tl.abs(y0), tl.abs(y1)), axis=1), axis=0))
    scale = tl.load(scale_ptr)
    code0 = tl.minimum(tl.maximum(y0 * scale, -448.0), 448.0)
    code1 = tl.minimum(tl.maximum(y1 * scale, -448.0), 448.0)
    if MASK:
        bs = r64 // H  # b S + s
        keep = (tl.load(valid_ptr + bs, mask=inside, other=0) != 0)[:, None]
        code0 = tl.where(keep, code0, 0.0)
        code1 = tl.where(keep, code1, 0.0)
        slot = tl.load(pos_ptr + bs, mask=inside, other=0).to(tl.int64)
        base = (((bs // S) * S + slot) * H + r64 % H)[:, None] * (2 * HALF) + 2 * p[None, :]
    tl.store(out_ptr + base, code0.to(tl.float8e4nv), mask=ok)
    tl.store(out_ptr + base + 1, code1.to(tl.float8e4nv), mask=ok)


@triton.jit
def _rope_pairs_kernel(x_ptr, f_ptr, out_ptr, M, HALF, L, ROWS_PER_BATCH, F_BATCH, F_TOKEN,
                       ROUND16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    # rows of x [B, H, L, D]: token l = row % L, batch b = row // (H L); pair p's 2x2 matrix F[p, r, c] sits at
    # freqs[b, 0, l, p, r, c], four floats from element 4 p of the token's block:
    # y[2p + r] = F[p, r, 0] x[2p] + F[p, r, 1] x[2p + 1]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_H)
    ok = (rows < M)[:, None] & (p < HALF)[None, :]
    r64 = rows.to(tl.int64)
    base = r64[:, None] * (2 * HALF) + 2 * p[None, :]
    x0 = tl.load(x_ptr + base, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + base + 1, mask=ok, other=0.0).to(tl.float32)
    fb = ((r64 // ROWS_PER_BATCH) * F_BATCH + (r64 % L) * F_TOKEN)[:, None] + 4 * p[None, :]
    f00 = tl.load(f_ptr + fb, mask=ok, other=0.0).to(tl.float32)
    f01 = tl.load(f_ptr + fb + 1, mask=ok, other=0.0).to(tl.float32)
    f10 = tl.load(f_ptr + fb + 2, mask=ok, other=0.0).to(tl.float32)
    f11 = tl.load(f_ptr + fb + 3, mask=ok, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    if ROUND16:  # 16-bit freqs: the torch code computes in their dtype (x cast to it, the first product rounded)
        cdt = f_ptr.dtype.element_ty
        x0 = x0.to(cdt).to(tl.float32)
        x1 = x1.to(cdt).to(tl.float32)
        y0 = ((f00 * x0).to(cdt).to(tl.float32) + f01 * x1).to(cdt)
        y1 = ((f10 * x0).to(cdt).to(tl.float32) + f11 * x1).to(cdt)
    else:
        y0 = f00 * x0 + f01 * x1
        y1 = f10 * x0 + f11 * x1
    tl.store(out_ptr + base, y0.to(dt), mask=ok)
    tl.store(out_ptr + base + 1, y1.to(dt), mask=ok)


def _blocks(d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps): about 4096 elements per program, whole rows."""
    block_d = triton.next_power_of_2(d)
    block_m = max(1, 4096 // block_d)
    return block_m, block_d, 8 if block_d >= 4096 else 4


def kernel_serves(x: torch.Tensor, d: int) -> bool:
    """The kernels take CUDA tensors of a 16/32-bit float dtype, contiguous, rows up to MAX_DIM."""
    return x.is_cuda and x.dtype in DTYPES and x.is_contiguous() and 0 < d <= MAX_DIM and x.numel() > 0


def row_layout(x: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """x's rows (every dim but the last) as at most three strided dims, for `rms_norm` on a view: (N1, N2, SX0,
    SX1, SX2), row r at element (r // (N1 N2)) SX0 + (r // N2 % N1) SX1 + (r % N2) SX2. None when the last dim
    is not unit-stride or more than three strided dims remain (adjacent dims that step evenly are merged: a
    permuted [B, L, H, D] -> [B, H, L, D] view, or q sliced out of a packed qkv, is three)."""
    if x.dim() == 0 or (x.shape[-1] > 1 and x.stride(-1) != 1):
        return None
    merged: list[tuple[int, int]] = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 3:
        return None
    merged = [(1, 0)] * (3 - len(merged)) + merged
    (_, s0), (n1, s1), (n2, s2) = merged
    return n1, n2, s0, s1, s2


def norm_serves(x: torch.Tensor, d: int) -> bool:
    """`rms_norm` takes x (CUDA, a 16/32-bit float, rows up to MAX_DIM) contiguous or as a view whose rows are
    three strided dims (`row_layout`). Device and autograd are the caller's to check."""
    return (x.dtype in DTYPES and 0 < d <= MAX_DIM and x.numel() > 0 and x.shape[-1] == d
            and (x.is_contiguous() or row_layout(x) is not None))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0, *,
             round_first: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over x's last dim (x CUDA, contiguous or a strided view `row_layout` takes), fp32 math, the result
    contiguous in `out_dtype` (x's by default). `weight` None: no scale; a weight of any float dtype is read as
    fp32, plus `offset`. `round_first`: x̂ rounded to `out_dtype` before the weight multiplies (diffusers' RMSNorm
    with a 16-bit weight)."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    m = x.numel() // d
    strided = not x.is_contiguous()
    n1, n2, s0, s1, s2 = row_layout(x) if strided else (1, 1, 0, 0, 0)
    block_m, block_d, warps = _blocks(d)
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](x, weight if weight is not None else x, out, x, x, m, d, float(eps),
                                                 float(offset), n1, n2, s0, s1, s2, 1, 0, 0, WEIGHT=weight is not None,
                                                 ROUND_FIRST=round_first, STRIDED=strided, MODULATE=False,
                                                 BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out


def batch_rows(t: torch.Tensor, x: torch.Tensor) -> int | None:
    """The batch stride of `t` read as one row of x's last dim per batch of x [B, L, F]: t [B or 1, 1, F] (or [F])
    with unit-stride rows, on x's device, in x's dtype; None when it is not such a tensor."""
    b, f = x.shape[0], x.shape[-1]
    if t.dtype != x.dtype or t.device != x.device or t.shape[-1] != f or (f > 1 and t.stride(-1) != 1):
        return None
    if t.dim() == 1:
        return 0
    if t.dim() != 3 or t.shape[1] != 1 or t.shape[0] not in (1, b):
        return None
    return t.stride(0) if t.shape[0] == b and b > 1 else 0


def modulated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, mult: torch.Tensor,
                       shift: torch.Tensor) -> torch.Tensor:
    """`rms_norm(x, weight, eps, offset) * mult + shift` in one pass, each of the three results rounded to x's dtype as
    torch's three ops round them (ComfyUI's Krea 2 blocks: `(1 + scale) * norm(x) + shift`). x [B, L, F]
    contiguous; mult / shift one row per batch (`batch_rows`)."""
    b, seq, d = x.shape
    out = torch.empty_like(x)
    m = x.numel() // d
    block_m, block_d, warps = _blocks(d)
    _rms_norm_kernel[(triton.cdiv(m, block_m),)](x, weight, out, mult, shift, m, d, float(eps), float(offset), 1, 1,
                                                 0, 0, 0, seq, batch_rows(mult, x), batch_rows(shift, x), WEIGHT=True,
                                                 ROUND_FIRST=False, STRIDED=False, MODULATE=True, BLOCK_M=block_m,
                                                 BLOCK_D=block_d, num_warps=warps, **ROUND_EACH_OP)
    return out


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`x + gate * y` in one pass, the product rounded to x's dtype first as torch's two ops round it (ComfyUI's Krea 2
    blocks). x, y [B, L, F] contiguous, same dtype; gate one row per batch (`batch_rows`)."""
    b, seq, d = x.shape
    out = torch.empty_like(x)
    m = x.numel() // d
    block_m, block_d, warps = _blocks(d)
    _gated_residual_kernel[(triton.cdiv(m, block_m),)](x, gate, y, out, m, d, seq, batch_rows(gate, x),
                                                       BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps,
                                                       **ROUND_EACH_OP)
    return out


def _rope_grid(m: int, d: int) -> tuple[tuple[int], dict[str, int]]:
    """The RoPE kernels' grid over m rows of head dim d, and their block sizes: ROPE_ROWS rows, one warp per 64
    pairs (one for the head dims measured, 64 and 128; more for wider heads, so a thread's share stays put)."""
    block_h = triton.next_power_of_2(d // 2)
    return (triton.cdiv(m, ROPE_ROWS),), {"BLOCK_M": ROPE_ROWS, "BLOCK_H": block_h,
                                          "num_warps": max(1, min(8, block_h // 64))}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """Interleaved-pair rotary embedding of x [B, S, H, D] (sequence_dim 1) or [B, H, S, D] (2), x contiguous;
    cos / sin [S, D] fp32, contiguous. The result in x's dtype."""
    d = x.shape[-1]
    s_len = x.shape[sequence_dim]
    row_div = x.shape[2] if sequence_dim == 1 else 1
    out = torch.empty_like(x)
    m = x.numel() // d
    grid, meta = _rope_grid(m, d)
    _rope_kernel[grid](x, cos, sin, out, m, d // 2, s_len, row_div, **meta)
    return out


def rope_e4m3(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None,
              key_mask: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """`rope` of x [B, S, H, D] (sequence_dim 1, contiguous) written as e4m3 codes y * scale (saturating at +-448):
    [B, S, H, D] e4m3, cuDNN's FP8 attention's layout (lowbit_pipe.kernels.qkv_fp8). `scale` [1] fp32 on x's device
    (448 / a bound of |y|: `norm_bound`); `amax` [1] fp32, raised to the largest |y| seen (a check of the bound;
    zero it first), or None: not tracked (the bound holds by construction; the check costs an atomic per program).
    `key_mask` [B, S] bool with `pos` (qkv_fp8.key_order's): the keys of a masked call, token s of batch b written to
    slot pos[b, s], masked ones as zero codes."""
    b, s_len, h, d = x.shape
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    m = x.numel() // d
    masked = key_mask is not None
    valid = key_mask.contiguous().view(torch.uint8) if masked else scale
    grid, meta = _rope_grid(m, d)
    _rope_e4m3_kernel[grid](x, cos, sin, out, scale, scale if amax is None else amax, valid, pos if masked else scale,
                            m, d // 2, s_len, h, MASK=masked, AMAX=amax is not None, **meta)
    return out


def norm_bound(weight: torch.Tensor | None, offset: float, dim: int, device: torch.device) -> torch.Tensor:
    """A bound of |y| for y = RMSNorm(x) * (weight + offset) over `dim` channels, and for its rotary embedding: each
    |x̂_c| <= sqrt(dim) (the squares sum to dim at most), so each pair's norm is at most sqrt(dim) max|weight +
    offset|, and a rotation keeps pair norms. Times 1 + 1/64: the 16-bit roundings of the norm's output (2^-8 each)
    and fp32's in the rotation. [1] fp32 on `device` (computed there: no host sync); weight None: no scale."""
    if weight is None:
        return torch.full((1,), dim ** 0.5 * (1 + 1 / 64), dtype=torch.float32, device=device)
    w = weight.detach().to(device=device, dtype=torch.float32)
    return ((w + offset).abs().amax() * (dim ** 0.5 * (1 + 1 / 64))).reshape(1)


def rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's RoPE form (comfy.ldm.flux.math apply_rope / apply_rope1: FLUX.1, Krea 2, Qwen-Image) of x [B, H, L,
    D] contiguous, with `freqs` [Bf, 1, Lf, D/2, 2, 2] (Bf 1 or B; Lf >= L, its first L tokens used, or 1) whose last
    three dims are contiguous: y[.., 2i + r] = freqs[b, 0, l, i, r, 0] x[.., 2i] + freqs[b, 0, l, i, r, 1] x[..,
    2i + 1]. In freqs' dtype as the torch code computes it (fp32: one rounding, to x's dtype; 16-bit: x cast to
    it and the first product rounded to it, then the second added and rounded), the result in x's dtype."""
    b, h, l_len, d = x.shape
    out = torch.empty_like(x)
    m = x.numel() // d
    f_batch = freqs.stride(0) if freqs.shape[0] > 1 else 0
    f_token = freqs.stride(2) if freqs.shape[2] > 1 else 0
    grid, meta = _rope_grid(m, d)
    _rope_pairs_kernel[grid](x, freqs, out, m, d // 2, l_len, h * l_len, f_batch, f_token,
                             ROUND16=freqs.dtype != torch.float32, **meta)
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


def reference_modulated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, mult: torch.Tensor,
                                 shift: torch.Tensor) -> torch.Tensor:
    """`modulated_rms_norm` in torch: the norm (`reference_rms_norm`), then torch's own multiply and add."""
    return reference_rms_norm(x, weight, eps, offset) * mult + shift


def reference_gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + gate * y


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """The torch form of `rope` (diffusers' apply_rotary_emb, use_real, pairs interleaved)."""
    shape = (1, -1, 1, x.shape[-1]) if sequence_dim == 1 else (1, 1, -1, x.shape[-1])
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos.reshape(shape) + rotated.float() * sin.reshape(shape)).to(x.dtype)


def reference_rope_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The torch form of `rope_pairs` (ComfyUI's apply_rope1 arithmetic: in freqs' dtype, the first product
    rounded, then a multiply-add; the result in x's dtype)."""
    f = freqs[:, :, : x.shape[2]]
    xc = x.to(freqs.dtype)
    x0, x1 = xc[..., 0::2], xc[..., 1::2]  # [B, H, L, D/2]
    rows = [torch.addcmul(f[..., r, 0] * x0, f[..., r, 1], x1) for r in (0, 1)]
    return torch.stack(rows, dim=-1).flatten(-2).to(x.dtype)


def reference_rope_e4m3(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The torch form of `rope_e4m3` (y in fp32, not rounded to x's dtype first)."""
    from lowbit_pipe.kernels.qkv_fp8 import e4m3, key_order

    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    y = x.float() * cos[None, :, None] + rotated.float() * sin[None, :, None]
    codes = e4m3(y * scale)
    if key_mask is not None:
        codes = torch.where(key_mask[:, :, None, None], codes, 0.0)
        pos, _ = key_order(key_mask)
        placed = torch.empty_like(codes)
        placed.scatter_(1, pos.long()[:, :, None, None].expand_as(codes), codes)
        codes = placed
    return codes.to(torch.float8_e4m3fn)
