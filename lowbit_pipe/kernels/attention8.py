"""8-bit attention (Triton, Hopper): Q·Kᵀ in FP8 or INT8 with per-block scales, P·V in FP8, fp32 online softmax.

    out = softmax(q kᵀ / sqrt(d) + bias) v   q, k, v: [B, H, N, D], D in (64, 128); bias: 0 or -inf per key
                                              (an optional key-padding mask, as Krea 2 pads its text tokens)

Quantization, before the attention kernel (`quantize_qkv`: one statistics pass over k and v, then the code
kernels):
- K smoothing: k - mean over tokens (per batch, head, channel). q·(k - m) = q·k - q·m, a constant per query row,
  which the softmax cancels exactly; what is left for the 8-bit grid is k's spread without its channel offset
  (DiT keys carry large per-channel means after RoPE and norms).
- q and the smoothed k: one scale per block of BLOCK_M query rows / BLOCK_N key rows (amax / 448 for e4m3,
  amax / 127 for int8). q's scale also carries the softmax scale and log2(e), so the kernel uses exp2.
- V smoothing: v - mean over tokens (per batch, head, channel) is what gets quantized; the mean comes back
  exactly as `+ mean` after the normalization (each row of softmax weights sums to one). Its e4m3 grid then
  spans v's spread, not its offset.
- v (smoothed): one e4m3 scale per (batch, head, channel), over all tokens; it factors out of the sum over
  keys, so the kernel applies it once at the end. v is stored transposed ([D, tokens]): the fp8 wgmma takes its second
  operand K-major only.
- P (in [0, 1] after the running max is subtracted) is rounded to e4m3 as p * 448 (the whole grid, subnormals
  down to 448 p = 2^-9), its 1/448 folded into the final normalization with v's scale; the row sums l use the
  unrounded p. Each key block's P·V is its own fp8 dot, added to the fp32 accumulator.

All token counts work: the quantized tensors are padded to whole blocks with zeros, and keys past N are masked
to -inf. A key-padding mask ([B, N] booleans, True = attend) becomes a per-key bias row [B, n_pad] of 0 / -inf
that the kernel adds to each key block's scores (one load of BLOCK_N floats per block); the padding past N is
-inf in it too. Masked keys are left out of the quantization as well: k's and v's means and v's scale are taken
over the attended keys, and masked rows of k and v are stored as zeros, so a padded token's values (however
large) widen no scale. Smoothing stays exact under a mask: a constant per query row still cancels, and each
row of weights still sums to one over the keys it attends. A query whose keys are all masked gets NaN, as torch's
SDPA gives. The torch reference (`reference_attention8`) runs the same arithmetic block by block (the kernel's
oracle, and the path on the CPU); `exact_attention` is the float64 oracle of what 8-bit attention approximates.

Layout: quantize kernels -> attention kernel -> launcher `attention8` (checks, padding, config) -> custom op
`lowbit_pipe::attention8` (fake impl: shapes only, so torch.compile keeps it one node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

QK_FORMATS = ("fp8", "int8")
FP8_MAX = 448.0
INT8_MAX = 127.0
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Attention8Config:
    """Tiles of the attention kernel (and the quantization blocks, which must match them)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    warp_specialize: bool = False


# Fixed configs, no autotuner in the call path: the fastest of bench/attention8_bench.py --sweep's 24 on an H100 at
# 1 x 48 x 4608 x 128, both QK formats (bench/results/attention8_h100_sweep.md); head dim 64 takes the same tiles
# until a sweep of its own. The interpreter (CPU tests) takes small tiles.
GPU_CONFIGS = {64: Attention8Config(64, 128, 4, 2), 128: Attention8Config(64, 128, 4, 2)}
INTERPRETER_CONFIG = Attention8Config(32, 32, 4, 1)


@dataclass(frozen=True)
class QuantizedQKV:
    """q, k (smoothed), v quantized for the attention kernel, padded to `n_pad` tokens (whole blocks).

    q8 / k8: [B*H, n_pad, D] e4m3 or int8; q_scale [B*H, n_pad / block_m] (softmax scale and log2 e included),
    k_scale [B*H, n_pad / block_n]; v8_t: [B*H, D, n_pad] e4m3 of v - v_mean; v_scale, v_mean [B*H, D] (fp32)."""
    q8: torch.Tensor
    q_scale: torch.Tensor
    k8: torch.Tensor
    k_scale: torch.Tensor
    v8_t: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor
    key_bias: torch.Tensor | None  # [B, n_pad] fp32, 0 (attend) or -inf; None: every key attends
    n: int
    n_pad: int
    qk_format: str
    config: Attention8Config


# ---------------------------------------------------------------------------------------------------------------
# quantization kernels


@triton.jit
def _round_codes(y, INT8: tl.constexpr):
    """Codes of y (already scaled into the grid): int8 round-half-even (the 1.5 * 2^23 trick, torch.round's
    rule) or e4m3 (the cast rounds to nearest even)."""
    # one return statement: the compiler refuses returns of different types even under a constexpr branch
    if INT8:
        codes = ((tl.minimum(tl.maximum(y, -127.0), 127.0) + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        codes = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
    return codes


@triton.jit
def _quant_blocks_kernel(
    x_ptr, mean_ptr, kb_ptr, y_ptr, s_ptr,
    H, N, N_PAD, stride_b, stride_h, stride_n, stride_d, scale_mul,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr, INT8: tl.constexpr, KEY_MASK: tl.constexpr,
):
    # Program (token block, batch*head): the block's amax -> one scale -> codes, written to the padded
    # [B*H, N_PAD, D] buffer (rows past N, and masked keys, are zeros).
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows < N
    if KEY_MASK:
        ok = ok & (tl.load(kb_ptr + b * N_PAD + rows) == 0.0)
    x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_n + cols[None, :] * stride_d,
                mask=ok[:, None], other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = tl.where(ok[:, None], x - tl.load(mean_ptr + bh * D + cols)[None, :], 0.0)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    if INT8:
        scale = tl.maximum(amax, 1e-12) / 127.0
    else:
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
    y = _round_codes(tl.div_rn(x, tl.zeros_like(x) + scale), INT8)
    tl.store(y_ptr + (bh * N_PAD + rows)[:, None] * D + cols[None, :], y)
    tl.store(s_ptr + bh * tl.cdiv(N_PAD, BLOCK) + blk, scale * scale_mul)


@triton.jit
def _quant_v_kernel(
    x_ptr, vs_ptr, vm_ptr, kb_ptr, y_ptr,
    H, N, N_PAD, stride_b, stride_h, stride_n, stride_d,
    D: tl.constexpr, BLOCK: tl.constexpr, KEY_MASK: tl.constexpr,
):
    # Program (token block, batch*head): e4m3 codes of (v - v_mean) / v_scale per channel, written transposed
    # [D, N_PAD] (rows past N, and masked keys, are zeros).
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows < N
    if KEY_MASK:
        ok = ok & (tl.load(kb_ptr + b * N_PAD + rows) == 0.0)
    x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_n + cols[None, :] * stride_d,
                mask=ok[:, None], other=0.0).to(tl.float32)
    x = tl.where(ok[:, None], x - tl.load(vm_ptr + bh * D + cols)[None, :], 0.0)
    scale = tl.load(vs_ptr + bh * D + cols)
    y = _round_codes(tl.div_rn(x, tl.zeros_like(x) + scale[None, :]), False)
    # stored as a [D, BLOCK] tile (tokens contiguous), so the compiler coalesces the transposed write
    tl.store(y_ptr + (bh * D + cols)[:, None] * N_PAD + rows[None, :], tl.trans(y))


STATS_CHUNK = 512  # tokens per statistics program: 9 x 48 programs at Krea 2's 1024² shape, enough for every SM
STATS_BLOCK = 64


@triton.jit
def _kv_stats_kernel(
    k_ptr, v_ptr, kb_ptr, part_ptr,
    H, N, N_PAD, BH, N_CHUNKS,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, KEY_MASK: tl.constexpr,
):
    # Program (token chunk, batch*head): per channel, over the chunk's attended keys, sum k, sum v, max v, min v
    # -> part[4, N_CHUNKS, BH, D] (fp32). One read of k and v in place of torch's four reductions.
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    sum_k = tl.zeros([D], dtype=tl.float32)
    sum_v = tl.zeros([D], dtype=tl.float32)
    max_v = tl.full([D], float("-inf"), dtype=tl.float32)
    min_v = tl.full([D], float("inf"), dtype=tl.float32)
    for start in tl.range(0, CHUNK, BLOCK):
        rows = c * CHUNK + start + tl.arange(0, BLOCK)
        ok = rows < N
        if KEY_MASK:
            ok = ok & (tl.load(kb_ptr + b * N_PAD + rows, mask=ok, other=float("-inf")) == 0.0)
        kx = tl.load(k_ptr + b * stride_kb + h * stride_kh + rows[:, None] * stride_kn + cols[None, :] * stride_kd,
                     mask=ok[:, None], other=0.0).to(tl.float32)
        vx = tl.load(v_ptr + b * stride_vb + h * stride_vh + rows[:, None] * stride_vn + cols[None, :] * stride_vd,
                     mask=ok[:, None], other=0.0).to(tl.float32)
        sum_k += tl.sum(kx, axis=0)
        sum_v += tl.sum(vx, axis=0)
        max_v = tl.maximum(max_v, tl.max(tl.where(ok[:, None], vx, float("-inf")), axis=0))
        min_v = tl.minimum(min_v, tl.min(tl.where(ok[:, None], vx, float("inf")), axis=0))
    at = part_ptr + (c * BH + bh) * D + cols
    step = N_CHUNKS * BH * D
    tl.store(at, sum_k)
    tl.store(at + step, sum_v)
    tl.store(at + 2 * step, max_v)
    tl.store(at + 3 * step, min_v)


@triton.jit
def _kv_stats_finish_kernel(
    part_ptr, count_ptr, k_mean_ptr, v_mean_ptr, v_scale_ptr, H, N, BH, N_CHUNKS,
    D: tl.constexpr, HAS_COUNT: tl.constexpr,
):
    # Program (batch*head): the chunks' partials -> k's mean, v's mean, v's e4m3 scale (amax |v - mean| / 448).
    bh = tl.program_id(0)
    cols = tl.arange(0, D)
    sum_k = tl.zeros([D], dtype=tl.float32)
    sum_v = tl.zeros([D], dtype=tl.float32)
    max_v = tl.full([D], float("-inf"), dtype=tl.float32)
    min_v = tl.full([D], float("inf"), dtype=tl.float32)
    step = N_CHUNKS * BH * D
    for c in range(0, N_CHUNKS):
        at = part_ptr + (c * BH + bh) * D + cols
        sum_k += tl.load(at)
        sum_v += tl.load(at + step)
        max_v = tl.maximum(max_v, tl.load(at + 2 * step))
        min_v = tl.minimum(min_v, tl.load(at + 3 * step))
    if HAS_COUNT:  # attended keys per batch row (a key mask)
        count = tl.maximum(tl.load(count_ptr + bh // H), 1.0)
    else:
        count = N * 1.0
    v_mean = sum_v / count
    v_amax = tl.maximum(tl.maximum(max_v - v_mean, v_mean - min_v), 0.0)  # 0 where no key is attended
    tl.store(k_mean_ptr + bh * D + cols, sum_k / count)
    tl.store(v_mean_ptr + bh * D + cols, v_mean)
    tl.store(v_scale_ptr + bh * D + cols, tl.where(v_amax > 0, v_amax / 448.0, 1.0))


# ---------------------------------------------------------------------------------------------------------------
# attention kernel


@triton.jit
def _attention8_kernel(
    q_desc, k_desc, v_desc, qs_ptr, ks_ptr, vs_ptr, vm_ptr, kb_ptr, o_ptr,
    H, N, N_PAD, stride_ob, stride_oh, stride_on, stride_od,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT8: tl.constexpr, MASK_TAIL: tl.constexpr,
    KEY_BIAS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = bh * N_PAD
    q = q_desc.load([row0 + pid_m * BLOCK_M, 0])
    q_scale = tl.load(qs_ptr + bh * tl.cdiv(N_PAD, BLOCK_M) + pid_m)
    ks_row = ks_ptr + bh * tl.cdiv(N_PAD, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for start_n in tl.range(0, N_PAD, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([row0 + start_n, 0])
        if INT8:
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * (q_scale * tl.load(ks_row + start_n // BLOCK_N))
        if KEY_BIAS:  # the padding past N is -inf in it: no tail mask needed
            s = s + tl.load(kb_ptr + (bh // H) * N_PAD + start_n + offs_n)[None, :]
        elif MASK_TAIL:
            s = tl.where((start_n + offs_n)[None, :] < N, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = m_new
        if KEY_BIAS:  # masked keys before any attended one: -inf - -inf would be NaN; against 0, p and alpha are 0
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = v_desc.load([bh * D, start_n])
        pv = tl.dot((p * 448.0).to(tl.float8e4nv), tl.trans(v))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    cols = tl.arange(0, D)
    v_scale = tl.load(vs_ptr + bh * D + cols)
    out = acc * (v_scale[None, :] / 448.0) / l_i[:, None] + tl.load(vm_ptr + bh * D + cols)[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    b = bh // H
    h = bh % H
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=(rows < N)[:, None])


# ---------------------------------------------------------------------------------------------------------------
# launchers


def _check_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str,
                key_mask: torch.Tensor | None) -> None:
    if qk_format not in QK_FORMATS:
        raise ValueError(f"attention8: qk_format must be one of {QK_FORMATS}, got {qk_format!r}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"attention8: q, k, v must be [B, H, N, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"attention8: key_mask must be [B, N] = {[q.shape[0], q.shape[2]]} booleans (True = attend), "
                         f"got {list(key_mask.shape)} {key_mask.dtype}")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str, key_mask: torch.Tensor | None) -> None:
    _check_args(q, k, v, qk_format, key_mask)
    if q.shape[-1] not in (64, 128):
        raise ValueError(f"attention8: head_dim must be 64 or 128, got {q.shape[-1]}")


def key_bias_row(key_mask: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[B, n_pad] fp32: 0 where key_mask ([B, N] bool) attends, -inf where it does not and past N."""
    bias = torch.full((key_mask.shape[0], n_pad), float("-inf"), dtype=torch.float32, device=key_mask.device)
    bias[:, :key_mask.shape[1]].masked_fill_(key_mask, 0.0)
    return bias


def config_for(d: int, on_cuda: bool) -> Attention8Config:
    return GPU_CONFIGS[d] if on_cuda else INTERPRETER_CONFIG


def kv_stats(k: torch.Tensor, v: torch.Tensor, key_bias: torch.Tensor | None,
             key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k's mean, v's mean and v's e4m3 scale (amax |v - v's mean| / 448, 1 where that is 0) per (batch, head,
    channel), [B*H, D] fp32, over the attended keys: two launches (partials per token chunk, then their sum)."""
    b, h, n, d = k.shape
    chunks = triton.cdiv(n, STATS_CHUNK)
    part = torch.empty(4, chunks, b * h, d, dtype=torch.float32, device=k.device)
    k_mean, v_mean, v_scale = (torch.empty(b * h, d, dtype=torch.float32, device=k.device) for _ in range(3))
    count = key_mask.sum(dim=1, dtype=torch.float32) if key_mask is not None else None
    n_pad = key_bias.shape[1] if key_bias is not None else n
    _kv_stats_kernel[(chunks, b * h)](
        k, v, key_bias if key_bias is not None else part, part, h, n, n_pad, b * h, chunks, *k.stride(),
        *v.stride(), D=d, CHUNK=STATS_CHUNK, BLOCK=STATS_BLOCK, KEY_MASK=key_bias is not None, num_warps=4)
    _kv_stats_finish_kernel[(b * h,)](part, count if count is not None else part, k_mean, v_mean, v_scale, h, n,
                                      b * h, chunks, D=d, HAS_COUNT=count is not None, num_warps=4)
    return k_mean, v_mean, v_scale


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str = "fp8",
                 sm_scale: float | None = None, config: Attention8Config | None = None,
                 key_mask: torch.Tensor | None = None) -> QuantizedQKV:
    """The attention kernel's operands (Triton; CPU tensors only under TRITON_INTERPRET)."""
    _check(q, k, v, qk_format, key_mask)
    b, h, n, d = q.shape
    cfg = config or config_for(d, q.is_cuda)
    if cfg.block_m % cfg.block_n and cfg.block_n % cfg.block_m:
        raise ValueError(f"attention8: block_m {cfg.block_m} and block_n {cfg.block_n} must divide one another")
    step = max(cfg.block_m, cfg.block_n)
    n_pad = triton.cdiv(n, step) * step
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    int8 = qk_format == "int8"
    code = torch.int8 if int8 else torch.float8_e4m3fn
    dev = q.device
    key_bias = key_bias_row(key_mask, n_pad) if key_mask is not None else None
    mean, v_mean, v_scale = kv_stats(k, v, key_bias, key_mask)
    q8 = torch.empty(b * h, n_pad, d, dtype=code, device=dev)
    k8 = torch.empty(b * h, n_pad, d, dtype=code, device=dev)
    v8_t = torch.empty(b * h, d, n_pad, dtype=torch.float8_e4m3fn, device=dev)
    q_scale = torch.empty(b * h, n_pad // cfg.block_m, dtype=torch.float32, device=dev)
    k_scale = torch.empty(b * h, n_pad // cfg.block_n, dtype=torch.float32, device=dev)
    for x, y, s, block, mean_arg, mul in ((q, q8, q_scale, cfg.block_m, None, sm * LOG2E),
                                          (k, k8, k_scale, cfg.block_n, mean, 1.0)):
        is_key = mean_arg is not None
        _quant_blocks_kernel[(n_pad // block, b * h)](
            x, mean_arg if is_key else v_scale, key_bias if key_bias is not None else v_scale, y, s, h, n, n_pad,
            *x.stride(), mul, D=d, BLOCK=block, HAS_MEAN=is_key, INT8=int8, KEY_MASK=is_key and key_bias is not None,
            num_warps=4)
    _quant_v_kernel[(n_pad // cfg.block_n, b * h)](v, v_scale, v_mean, key_bias if key_bias is not None else v_scale,
                                                   v8_t, h, n, n_pad, *v.stride(), D=d, BLOCK=cfg.block_n,
                                                   KEY_MASK=key_bias is not None, num_warps=4)
    return QuantizedQKV(q8, q_scale, k8, k_scale, v8_t, v_scale, v_mean, key_bias, n, n_pad, qk_format, cfg)


def attention8_quantized(qkv: QuantizedQKV, out: torch.Tensor) -> torch.Tensor:
    """The attention kernel over already quantized operands, into `out` [B, H, N, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = qkv.config
    bh, n_pad, d = qkv.q8.shape
    q2, k2, v2 = qkv.q8.view(bh * n_pad, d), qkv.k8.view(bh * n_pad, d), qkv.v8_t.view(bh * d, n_pad)
    q_desc = TensorDescriptor(q2, list(q2.shape), [d, 1], [cfg.block_m, d])
    k_desc = TensorDescriptor(k2, list(k2.shape), [d, 1], [cfg.block_n, d])
    v_desc = TensorDescriptor(v2, list(v2.shape), [n_pad, 1], [d, cfg.block_n])
    _attention8_kernel[(n_pad // cfg.block_m, bh)](
        q_desc, k_desc, v_desc, qkv.q_scale, qkv.k_scale, qkv.v_scale, qkv.v_mean,
        qkv.key_bias if qkv.key_bias is not None else qkv.v_mean, out, out.shape[1], qkv.n, n_pad,
        *out.stride(), D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, INT8=qkv.qk_format == "int8",
        MASK_TAIL=qkv.n % cfg.block_n != 0, KEY_BIAS=qkv.key_bias is not None,
        WARP_SPECIALIZE=cfg.warp_specialize, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def attention8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str = "fp8",
               sm_scale: float | None = None, config: Attention8Config | None = None,
               key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ * sm_scale) v with 8-bit operands (Triton): [B, H, N, D] in q's dtype and memory layout (a
    [B, N, H, D] tensor seen as [B, H, N, D] gives its output in that layout, so transposing back is free).
    key_mask: [B, N] booleans, True where a key is attended (None: all)."""
    qkv = quantize_qkv(q, k, v, qk_format, sm_scale, config, key_mask)
    return attention8_quantized(qkv, torch.empty_like(q))


# ---------------------------------------------------------------------------------------------------------------
# torch reference and oracle


def _codes(x: torch.Tensor, scale: torch.Tensor, int8: bool) -> torch.Tensor:
    """Dequantized codes of x / scale (the kernels' rounding rules), as fp32."""
    y = x / scale
    if int8:
        return torch.round(y.clamp(-INT8_MAX, INT8_MAX))
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def reference_attention8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str = "fp8",
                         sm_scale: float | None = None, config: Attention8Config | None = None,
                         key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton path's arithmetic in torch, block by block (same scales, codes, online softmax and P
    rounding): its oracle, and 8-bit attention where the kernel cannot run (CPU, other head dims)."""
    _check_args(q, k, v, qk_format, key_mask)
    b, h, n, d = q.shape
    cfg = config or INTERPRETER_CONFIG
    bm, bn = cfg.block_m, cfg.block_n
    int8 = qk_format == "int8"
    grid = INT8_MAX if int8 else FP8_MAX
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf, kf, vf = q.float(), k.float(), v.float()
    if key_mask is None:
        key_mask = torch.ones(b, n, dtype=torch.bool, device=q.device)
    # masked keys: out of the means and scales, zeros in k and v (the kernel's rule)
    w = key_mask[:, None, :, None]
    count = key_mask.sum(dim=1).clamp(min=1).float()[:, None, None, None]
    k_mean = torch.where(w, kf, 0).sum(dim=2, keepdim=True) / count
    v_mean = torch.where(w, vf, 0).sum(dim=2, keepdim=True) / count
    kf = torch.where(w, kf - k_mean, 0)
    vf = torch.where(w, vf - v_mean, 0)
    v_amax = vf.abs().amax(dim=2, keepdim=True)
    v_scale = torch.where(v_amax > 0, v_amax / FP8_MAX, torch.ones_like(v_amax))
    v8 = _codes(vf, v_scale, False)

    def block_scale(x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=(-2, -1), keepdim=True)
        return torch.clamp(amax, min=1e-12) / grid if int8 else torch.where(amax > 0, amax / grid, torch.ones_like(amax))

    out = torch.empty(b, h, n, d, dtype=torch.float32, device=q.device)
    bias = key_bias_row(key_mask, n)[:, None, None, :]
    k_blocks = []
    for s0 in range(0, n, bn):
        kb = kf[:, :, s0:s0 + bn]
        ks = block_scale(kb)
        k_blocks.append((_codes(kb, ks, int8), ks, v8[:, :, s0:s0 + bn], bias[..., s0:s0 + bn]))
    for r0 in range(0, n, bm):
        qb = qf[:, :, r0:r0 + bm]
        qs = block_scale(qb)
        q8 = _codes(qb, qs, int8)
        qmul = qs * (sm * LOG2E)
        m_i = torch.full(qb.shape[:-1], float("-inf"), device=q.device)
        l_i = torch.zeros_like(m_i)
        acc = torch.zeros_like(qb)
        for k8, ks, vb, kbias in k_blocks:
            s = (q8 @ k8.transpose(-1, -2)) * (qmul * ks) + kbias
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            m_sub = torch.where(m_new == float("-inf"), 0.0, m_new)  # masked keys before any attended one (the kernel's)
            p = torch.exp2(s - m_sub[..., None])
            alpha = torch.exp2(m_i - m_sub)
            l_i = l_i * alpha + p.sum(dim=-1)
            p8 = (p * FP8_MAX).to(torch.float8_e4m3fn).float()
            acc = acc * alpha[..., None] + p8 @ vb
            m_i = m_new
        out[:, :, r0:r0 + bm] = acc * (v_scale / FP8_MAX) / l_i[..., None] + v_mean
    return out.to(q.dtype)


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                    key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ * sm_scale) v in float64 (keys where key_mask [B, N] is False left out): what the 8-bit
    attention approximates."""
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q.double() @ k.double().transpose(-1, -2)) * sm
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


# ---------------------------------------------------------------------------------------------------------------
# entry point: the kernel where it runs, the reference elsewhere; one custom op so torch.compile keeps it one node


def kernel_runs(q: torch.Tensor) -> bool:
    """Whether the Triton kernel serves q's device and shape (Hopper or newer, head_dim 64 or 128)."""
    return (q.is_cuda and q.dim() == 4 and q.shape[-1] in GPU_CONFIGS
            and torch.cuda.get_device_capability(q.device) >= (9, 0))


@torch.library.custom_op("lowbit_pipe::attention8", mutates_args=())
def _attention8_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str, sm_scale: float,
                   key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    if kernel_runs(q):
        return attention8(q, k, v, qk_format, sm_scale, key_mask=key_mask)
    return torch.empty_like(q).copy_(reference_attention8(q, k, v, qk_format, sm_scale, key_mask=key_mask))


@_attention8_op.register_fake
def _(q, k, v, qk_format, sm_scale, key_mask):
    return torch.empty_like(q)  # q's layout, as both paths return


def sdpa8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str = "int8",
          sm_scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """8-bit softmax(q kᵀ * sm_scale) v for [B, H, N, D] q, k, v, keys where key_mask ([B, N] bool) is False
    left out: the Triton kernel on Hopper for head dims 64 / 128, the torch reference (same arithmetic)
    elsewhere. Output in q's dtype and memory layout."""
    _check_args(q, k, v, qk_format, key_mask)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _attention8_op(q, k, v, qk_format, float(sm), key_mask)
