"""q, k, v to e4m3 with one scale per tensor, for cuDNN's FP8 attention (lowbit_pipe.kernels.cudnn_fp8_attention).

cuDNN's `sdpa_fp8` takes one descale per tensor ([1, 1, 1, 1] fp32) and, on Hopper, writes its output in fp8 too.
What this module computes, per call:

- K smoothing: k - mean over the attended keys (per batch, head, channel). q·(k - m) = q·k - q·m, a constant per
  query row, which the softmax cancels exactly; the e4m3 grid then spans k's spread, not its channel offsets.
- V smoothing: v - mean (same means): the attention of v - m is the attention of v minus m (each row of weights
  sums to one), so `+ m` after the kernel gives it back exactly. The output's e4m3 grid then spans O - m, which is
  small where attention is diffuse (O near m): the output rounding, the largest error term on Hopper, shrinks with it.
- One scale per tensor: amax / 448 of q, of k - m_k and of v - m_v (over all batches and heads, attended keys
  only). |O - m_v| <= amax |v - m_v| (a weighted mean), so O's scale is v's: no output overflow, known before the
  kernel runs. A per-tensor scale only has to bound the values: e4m3 is a float format, so a looser bound costs
  precision only for values below amax / 2^15 (its subnormals).
- A key-padding mask ([B, N] booleans, True = attend): the attended keys of each batch are written first, in
  order, then the masked ones as zeros (`key_order`); cuDNN's padding mask then leaves out keys past each batch's
  count (`seq_len_kv`). Softmax over keys does not depend on their order, so this is exact. Masked keys are out
  of the means and scales. A batch with no attended key gets NaN rows (torch's SDPA gives NaN there).

Passes over q, k, v (Triton): `qkv_stats` (reads q, k, v once: per-(batch, head) amaxes and per-channel sums,
minima, maxima; then a small finishing kernel), `quantize_qkv_fp8` (reads them again, writes e4m3 in [B, N, H, D]
and the scales cuDNN reads), and after the kernel `finish_output` (e4m3 O * descale + m_v, in q's dtype and
layout). The statistics pass reads each tensor once, one tensor per program, its running values [BLOCK, D] tiles
reduced once at the end (reducing a tile's rows crosses warps: the first version did it seven times a step and
took 3x the quantize pass's time). A producer can fold q and k away entirely: lowbit_pipe.kernels.norm_rope's
rope_e4m3 writes them as e4m3 codes with a scale known in advance (an RMSNorm output's bound), and
`quantize_folded` then computes v's statistics and codes alone (`v_stats`); lowbit_pipe.attention.fold wires it.
`quantize_qkv_fp8(..., stats=)` still takes statistics a producer computed.

Each kernel has its torch form here (`reference_qkv_fp8`, `reference_finish_output`): the oracle of the CPU
interpreter tests and of the GPU checks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
# P (softmax numerators, in [0, 1] after the running max is subtracted) is stored by cuDNN in e4m3 as p * S_SCALE:
# a power of two under 448, so p = 1 is exact and never saturates.
S_SCALE = 256.0
# Rows of the scales buffer (one fp32 scalar per row, rows 16 bytes apart: each is a [1, 1, 1, 1] tensor of cuDNN)
DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O, DESCALE_O, AMAX_S, AMAX_O = range(9)
SCALE_ROWS = 9
SCALE_STRIDE = 4  # floats between rows

STATS_CHUNK = 256  # tokens per statistics program
STATS_BLOCK = 16  # rows per step inside it (the running [BLOCK, D] tiles stay in registers)
QUANT_BLOCK = 64  # tokens per quantize / output program


@dataclass(frozen=True)
class QKVStats:
    """What the quantization needs to know before it writes a code: per (batch, head), over the attended keys.

    k_mean / v_mean: [B*H, D] fp32; amax: [3, B*H] fp32, the amax of q, of k - k_mean and of v - v_mean."""

    k_mean: torch.Tensor
    v_mean: torch.Tensor
    amax: torch.Tensor


@dataclass(frozen=True)
class QKVFP8:
    """cuDNN's operands: q8, k8, v8 [B, N, H, D] e4m3, contiguous (the keys of a masked call in `key_order`);
    scales [SCALE_ROWS, SCALE_STRIDE] fp32 (row DESCALE_Q ... AMAX_O, column 0); v_mean [B*H, D] fp32 (added back
    to the output); seq_len_kv [B, 1, 1, 1] int32, the attended keys per batch (None without a mask)."""

    q8: torch.Tensor
    k8: torch.Tensor
    v8: torch.Tensor
    scales: torch.Tensor
    v_mean: torch.Tensor
    seq_len_kv: torch.Tensor | None

    def scale(self, row: int) -> torch.Tensor:
        """Row `row` of the scales as a 1-element tensor."""
        return self.scales[row, :1]


# ---------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _stats_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, part_ptr, qpart_ptr, H, N, BH, CHUNKS,
                  sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                  D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MASK: tl.constexpr,
                  FIRST: tl.constexpr):
    # Program (token chunk, batch*head, tensor FIRST + program_id(2): 0 q, 1 k, 2 v): q's amax per channel, or k's /
    # v's sum, min and max per channel over the attended keys of the chunk, into part [6, CHUNKS, BH, D] (k sum,
    # k min, k max, v sum, v min, v max) / qpart [CHUNKS, BH, D]. The running values are [BLOCK, D] tiles, reduced
    # over their rows once at the end: a reduction across a tile's rows crosses warps (shared memory and a barrier),
    # which the first version paid seven times per step, three tensors per program -- 3x the quantize pass's time
    # for the same bytes read (bench/results/attention_route_h100.md).
    c = tl.program_id(0)
    bh = tl.program_id(1)
    which = tl.program_id(2) + FIRST
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    base = (c * BH + bh) * D + cols
    if which == 0:
        amax = tl.zeros([BLOCK, D], dtype=tl.float32)
        for i in tl.range(0, CHUNK, BLOCK):
            rows = c * CHUNK + i + tl.arange(0, BLOCK)
            x = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :] * sqd,
                        mask=(rows < N)[:, None], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        tl.store(qpart_ptr + base, tl.max(amax, axis=0))
    else:
        if which == 1:
            x_ptr = k_ptr + b * skb + h * skh
            sn = skn
            sd = skd
        else:
            x_ptr = v_ptr + b * svb + h * svh
            sn = svn
            sd = svd
        acc_sum = tl.zeros([BLOCK, D], dtype=tl.float32)
        acc_min = tl.full([BLOCK, D], float("inf"), dtype=tl.float32)
        acc_max = tl.full([BLOCK, D], float("-inf"), dtype=tl.float32)
        for i in tl.range(0, CHUNK, BLOCK):
            rows = c * CHUNK + i + tl.arange(0, BLOCK)
            ok = rows < N
            if MASK:
                ok = ok & (tl.load(valid_ptr + b * N + rows, mask=ok, other=0) != 0)
            x = tl.load(x_ptr + rows[:, None] * sn + cols[None, :] * sd, mask=ok[:, None], other=0.0).to(tl.float32)
            acc_sum += x
            acc_min = tl.minimum(acc_min, tl.where(ok[:, None], x, float("inf")))
            acc_max = tl.maximum(acc_max, tl.where(ok[:, None], x, float("-inf")))
        field = CHUNKS * BH * D
        first = (which - 1) * 3 * field
        tl.store(part_ptr + first + base, tl.sum(acc_sum, axis=0))
        tl.store(part_ptr + first + field + base, tl.min(acc_min, axis=0))
        tl.store(part_ptr + first + 2 * field + base, tl.max(acc_max, axis=0))


@triton.jit
def _stats_finish_kernel(part_ptr, qpart_ptr, count_ptr, k_mean_ptr, v_mean_ptr, amax_ptr, H, N, BH, CHUNKS,
                         D: tl.constexpr, HAS_COUNT: tl.constexpr, FIRST: tl.constexpr):
    # Program (batch*head): the chunks' partials -> means, and the amaxes of q, k - k_mean, v - v_mean (those of
    # tensor FIRST on). Over a channel, x - m ranges over [min - m, max - m]: the smoothed amax is exact without
    # another pass over x.
    bh = tl.program_id(0)
    cols = tl.arange(0, D)
    field = CHUNKS * BH * D
    if HAS_COUNT:
        count = tl.load(count_ptr + bh // H).to(tl.float32)
    else:
        count = N * 1.0
    inv = 1.0 / tl.maximum(count, 1.0)
    if FIRST == 0:
        q_amax = tl.zeros([D], dtype=tl.float32)
        for c in range(CHUNKS):
            q_amax = tl.maximum(q_amax, tl.load(qpart_ptr + (c * BH + bh) * D + cols))
        tl.store(amax_ptr + bh, tl.max(q_amax, axis=0))
    for which in tl.static_range(max(FIRST, 1), 3):
        first = (which - 1) * 3 * field
        x_sum = tl.zeros([D], dtype=tl.float32)
        x_min = tl.full([D], float("inf"), dtype=tl.float32)
        x_max = tl.full([D], float("-inf"), dtype=tl.float32)
        for c in range(CHUNKS):
            base = first + (c * BH + bh) * D + cols
            x_sum += tl.load(part_ptr + base)
            x_min = tl.minimum(x_min, tl.load(part_ptr + field + base))
            x_max = tl.maximum(x_max, tl.load(part_ptr + 2 * field + base))
        mean = x_sum * inv
        # no attended key: min / max are +-inf; amax 0 (the batch's rows come out NaN in finish_output)
        amax = tl.where(count > 0, tl.max(tl.maximum(x_max - mean, mean - x_min), axis=0), 0.0)
        if which == 1:
            tl.store(k_mean_ptr + bh * D + cols, mean)
        else:
            tl.store(v_mean_ptr + bh * D + cols, mean)
        tl.store(amax_ptr + which * BH + bh, amax)


@triton.jit
def _scale_of(amax_ptr, which, BH, BH_P2: tl.constexpr):
    """448 / (amax over every batch and head) of tensor `which` (1 where that amax is 0)."""
    idx = tl.arange(0, BH_P2)
    amax = tl.max(tl.load(amax_ptr + which * BH + idx, mask=idx < BH, other=0.0), axis=0)
    return tl.where(amax > 0, 448.0 / amax, 1.0)


@triton.jit
def _quantize_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, pos_ptr, k_mean_ptr, v_mean_ptr, amax_ptr, qk_scale_ptr,
                     scales_ptr, q8_ptr, k8_ptr, v8_ptr, H, N, BH,
                     sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                     D: tl.constexpr, BLOCK: tl.constexpr, BH_P2: tl.constexpr, MASK: tl.constexpr,
                     S_SCALE_C: tl.constexpr, ROW: tl.constexpr, QK: tl.constexpr):
    # Program (token block, batch*head): q, k - k_mean, v - v_mean of the block times their tensor's scale, cast to
    # e4m3 (saturating at +-448) into [B, N, H, D]; keys of a masked call go to their slot in key_order, masked ones
    # as zeros. QK False: q and k are e4m3 already (a producer wrote them, lowbit_pipe.kernels.norm_rope's
    # rope_e4m3), their scales at qk_scale_ptr [2]; only v is written. Program (0, 0) also writes the scales cuDNN
    # reads.
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    if QK:
        sq = _scale_of(amax_ptr, 0, BH, BH_P2)
        sk = _scale_of(amax_ptr, 1, BH, BH_P2)
    else:
        sq = tl.load(qk_scale_ptr)
        sk = tl.load(qk_scale_ptr + 1)
    sv = _scale_of(amax_ptr, 2, BH, BH_P2)
    cols = tl.arange(0, D)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    inside = rows < N
    dst = rows
    ok = inside
    if MASK:
        ok = ok & (tl.load(valid_ptr + b * N + rows, mask=inside, other=0) != 0)
        dst = tl.load(pos_ptr + b * N + rows, mask=inside, other=0)
    out = ((b * N + dst[:, None]).to(tl.int64) * H + h) * D + cols[None, :]
    if QK:
        x = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqn + cols[None, :] * sqd, mask=inside[:, None],
                    other=0.0).to(tl.float32)
        q_out = ((b * N + rows[:, None]).to(tl.int64) * H + h) * D + cols[None, :]
        tl.store(q8_ptr + q_out, tl.minimum(tl.maximum(x * sq, -448.0), 448.0).to(tl.float8e4nv),
                 mask=inside[:, None])
        x = tl.load(k_ptr + b * skb + h * skh + rows[:, None] * skn + cols[None, :] * skd, mask=ok[:, None],
                    other=0.0).to(tl.float32)
        x = tl.where(ok[:, None], (x - tl.load(k_mean_ptr + bh * D + cols)[None, :]) * sk, 0.0)
        tl.store(k8_ptr + out, tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv), mask=inside[:, None])
    x = tl.load(v_ptr + b * svb + h * svh + rows[:, None] * svn + cols[None, :] * svd, mask=ok[:, None],
                other=0.0).to(tl.float32)
    x = tl.where(ok[:, None], (x - tl.load(v_mean_ptr + bh * D + cols)[None, :]) * sv, 0.0)
    tl.store(v8_ptr + out, tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv), mask=inside[:, None])
    if (blk == 0) & (bh == 0):
        tl.store(scales_ptr + 0 * ROW, 1.0 / sq)
        tl.store(scales_ptr + 1 * ROW, 1.0 / sk)
        tl.store(scales_ptr + 2 * ROW, 1.0 / sv)
        tl.store(scales_ptr + 3 * ROW, 1.0 / S_SCALE_C)
        tl.store(scales_ptr + 4 * ROW, S_SCALE_C)
        tl.store(scales_ptr + 5 * ROW, sv)  # O's scale is v's: |O - m_v| <= amax |v - m_v|
        tl.store(scales_ptr + 6 * ROW, 1.0 / sv)


@triton.jit
def _finish_kernel(o8_ptr, v_mean_ptr, scales_ptr, count_ptr, out_ptr, H, N, sob, soh, son, sod,
                   D: tl.constexpr, BLOCK: tl.constexpr, HAS_COUNT: tl.constexpr, DESCALE_ROW: tl.constexpr):
    # Program (token block, batch*head): out = o8 * descale_o + v_mean, in out's dtype and strides; NaN for a batch
    # without an attended key.
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    cols = tl.arange(0, D)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    inside = rows < N
    src = ((b * N + rows[:, None]).to(tl.int64) * H + h) * D + cols[None, :]
    y = tl.load(o8_ptr + src, mask=inside[:, None], other=0.0).to(tl.float32) * tl.load(scales_ptr + DESCALE_ROW)
    y = y + tl.load(v_mean_ptr + bh * D + cols)[None, :]
    if HAS_COUNT:
        y = tl.where(tl.load(count_ptr + b) > 0, y, float("nan"))
    tl.store(out_ptr + b * sob + h * soh + rows[:, None] * son + cols[None, :] * sod, y.to(out_ptr.dtype.element_ty),
             mask=inside[:, None])


# ---------------------------------------------------------------------------------------------------------------
# launchers


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"qkv_fp8: q, k, v must be [B, H, N, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"qkv_fp8: head_dim must be a power of two >= 16, got {d}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"qkv_fp8: key_mask must be [B, N] = {[q.shape[0], q.shape[2]]} booleans (True = attend), "
                         f"got {list(key_mask.shape)} {key_mask.dtype}")


def key_order(key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos [B, N] int32, count [B] int32): key n of batch b goes to slot pos[b, n] -- the attended keys first, in
    order, then the masked ones -- and count[b] keys attend."""
    n = key_mask.shape[1]
    seen = key_mask.cumsum(1, dtype=torch.int32)  # attended keys up to and including n
    count = seen[:, -1]
    idx = torch.arange(1, n + 1, dtype=torch.int32, device=key_mask.device)
    pos = torch.where(key_mask, seen - 1, count[:, None] + (idx - seen) - 1)
    return pos.to(torch.int32).contiguous(), count.contiguous()


def qkv_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
              count: torch.Tensor | None = None) -> QKVStats:
    """The statistics pass (Triton; CPU tensors only under TRITON_INTERPRET). `count`: key_mask's attended keys per
    batch ([B] int32, as key_order gives it), computed here when None."""
    check(q, k, v, key_mask)
    return _stats(q, k, v, key_mask, count, first=0)


def v_stats(v: torch.Tensor, key_mask: torch.Tensor | None = None, count: torch.Tensor | None = None) -> QKVStats:
    """The statistics of v alone (a folded call: q and k came in e4m3 from their producer): v_mean and amax row 2
    as `qkv_stats` computes them; k_mean zeros and amax rows 0 and 1 unset."""
    check(v, v, v, key_mask)
    return _stats(v, v, v, key_mask, count, first=2)


def _stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
           count: torch.Tensor | None, first: int) -> QKVStats:
    b, h, n, d = v.shape
    chunks = triton.cdiv(n, STATS_CHUNK)
    dev = v.device
    part = torch.empty(6, chunks, b * h, d, dtype=torch.float32, device=dev)
    qpart = torch.empty(chunks, b * h, d, dtype=torch.float32, device=dev) if first == 0 else part
    v_mean = torch.empty(b * h, d, dtype=torch.float32, device=dev)
    k_mean = (torch.empty if first <= 1 else torch.zeros)(b * h, d, dtype=torch.float32, device=dev)
    amax = torch.empty(3, b * h, dtype=torch.float32, device=dev)
    if key_mask is not None and count is None:
        count = key_mask.sum(dim=1, dtype=torch.int32)
    valid = key_mask.view(torch.uint8) if key_mask is not None else part
    _stats_kernel[(chunks, b * h, 3 - first)](q, k, v, valid, part, qpart, h, n, b * h, chunks, *q.stride(),
                                              *k.stride(), *v.stride(), D=d, CHUNK=STATS_CHUNK, BLOCK=STATS_BLOCK,
                                              MASK=key_mask is not None, FIRST=first, num_warps=4)
    _stats_finish_kernel[(b * h,)](part, qpart, count if count is not None else part, k_mean, v_mean, amax, h, n,
                                   b * h, chunks, D=d, HAS_COUNT=count is not None, FIRST=first, num_warps=4)
    return QKVStats(k_mean, v_mean, amax)


def quantize_qkv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None,
                     stats: QKVStats | None = None) -> QKVFP8:
    """cuDNN's e4m3 operands and scales for [B, H, N, D] q, k, v (any strides); key_mask [B, N] bool or None.
    `stats`: the statistics when a producer already has them (None: the statistics pass runs here)."""
    check(q, k, v, key_mask)
    b, h, n, d = q.shape
    pos = count = None
    if key_mask is not None:
        key_mask = key_mask.contiguous()
        pos, count = key_order(key_mask)
    if stats is None:
        stats = qkv_stats(q, k, v, key_mask, count)
    q8, k8 = (torch.empty(b, n, h, d, dtype=torch.float8_e4m3fn, device=q.device) for _ in range(2))
    return _quantize(q, k, v, q8, k8, None, key_mask, pos, count, stats)


def quantize_folded(q8: torch.Tensor, k8: torch.Tensor, qk_scale: torch.Tensor, v: torch.Tensor,
                    key_mask: torch.Tensor | None = None) -> QKVFP8:
    """cuDNN's operands when a producer wrote q and k in e4m3 (lowbit_pipe.kernels.norm_rope.rope_e4m3): q8, k8
    [B, N, H, D] e4m3 contiguous (k8's keys already in key_order for a masked call), `qk_scale` [2] fp32 the scales
    they were written with (codes = value * scale). Only v's statistics and codes are computed here."""
    b, n, h, d = q8.shape
    for name, t in (("q8", q8), ("k8", k8)):
        if t.dtype != torch.float8_e4m3fn or tuple(t.shape) != (b, n, h, d) or not t.is_contiguous():
            raise ValueError(f"quantize_folded: {name} must be [B, N, H, D] = {[b, n, h, d]} e4m3 contiguous, got "
                             f"{list(t.shape)} {t.dtype}")
    if tuple(v.shape) != (b, h, n, d):
        raise ValueError(f"quantize_folded: v must be [B, H, N, D] = {[b, h, n, d]}, got {list(v.shape)}")
    check(v, v, v, key_mask)
    pos = count = None
    if key_mask is not None:
        key_mask = key_mask.contiguous()
        pos, count = key_order(key_mask)
    stats = v_stats(v, key_mask, count)
    return _quantize(v, v, v, q8, k8, qk_scale, key_mask, pos, count, stats)


def _quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor,
              qk_scale: torch.Tensor | None, key_mask: torch.Tensor | None, pos: torch.Tensor | None,
              count: torch.Tensor | None, stats: QKVStats) -> QKVFP8:
    """The quantize kernel: q, k and v into q8, k8 and a new v8 (qk_scale None), or v alone (q8 / k8 given)."""
    b, h, n, d = v.shape
    v8 = torch.empty(b, n, h, d, dtype=torch.float8_e4m3fn, device=v.device)
    # rows DESCALE_Q..DESCALE_O written by the kernel, AMAX_S / AMAX_O by cuDNN; the other columns are padding
    scales = torch.empty(SCALE_ROWS, SCALE_STRIDE, dtype=torch.float32, device=v.device)
    valid = key_mask.view(torch.uint8) if key_mask is not None else scales
    _quantize_kernel[(triton.cdiv(n, QUANT_BLOCK), b * h)](
        q, k, v, valid, pos if pos is not None else scales, stats.k_mean, stats.v_mean, stats.amax,
        qk_scale if qk_scale is not None else scales, scales, q8, k8, v8, h, n, b * h, *q.stride(), *k.stride(),
        *v.stride(), D=d, BLOCK=QUANT_BLOCK, BH_P2=triton.next_power_of_2(b * h), MASK=key_mask is not None,
        S_SCALE_C=S_SCALE, ROW=SCALE_STRIDE, QK=qk_scale is None, num_warps=4)
    seq_len_kv = count.view(b, 1, 1, 1) if count is not None else None
    return QKVFP8(q8, k8, v8, scales, stats.v_mean, seq_len_kv)


def finish_output(o8: torch.Tensor, qkv: QKVFP8, out: torch.Tensor) -> torch.Tensor:
    """out [B, H, N, D] (any strides, any float dtype) = o8 [B, N, H, D] e4m3 * O's descale + v's mean."""
    b, n, h, d = o8.shape
    count = qkv.seq_len_kv
    _finish_kernel[(triton.cdiv(n, QUANT_BLOCK), b * h)](
        o8, qkv.v_mean, qkv.scales[DESCALE_O], count if count is not None else qkv.scales, out, h, n, *out.stride(),
        D=d, BLOCK=QUANT_BLOCK, HAS_COUNT=count is not None, DESCALE_ROW=0, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# torch forms


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 (saturating at +-448), as fp32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def reference_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_mask: torch.Tensor | None = None) -> QKVStats:
    """`qkv_stats` in torch."""
    check(q, k, v, key_mask)
    b, h, n, d = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    if key_mask is None:
        key_mask = torch.ones(b, n, dtype=torch.bool, device=q.device)
    w = key_mask[:, None, :, None]
    count = key_mask.sum(dim=1).float()[:, None, None, None]
    k_mean = torch.where(w, kf, 0).sum(dim=2, keepdim=True) / count.clamp(min=1)
    v_mean = torch.where(w, vf, 0).sum(dim=2, keepdim=True) / count.clamp(min=1)
    k_amax = torch.where(w, kf - k_mean, 0).abs().amax(dim=(2, 3))
    v_amax = torch.where(w, vf - v_mean, 0).abs().amax(dim=(2, 3))
    amax = torch.stack([qf.abs().amax(dim=(2, 3)), k_amax, v_amax]).reshape(3, b * h)
    return QKVStats(k_mean.reshape(b * h, d), v_mean.reshape(b * h, d), amax)


def reference_qkv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_mask: torch.Tensor | None = None) -> QKVFP8:
    """`quantize_qkv_fp8` in torch: the same statistics, codes, key order and scales."""
    b, h, n, d = q.shape
    stats = reference_stats(q, k, v, key_mask)
    amax = stats.amax.amax(dim=1)
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    k_mean, v_mean = stats.k_mean.view(b, h, 1, d), stats.v_mean.view(b, h, 1, d)
    keep = key_mask[:, None, :, None] if key_mask is not None else torch.ones(1, 1, n, 1, dtype=torch.bool,
                                                                             device=q.device)
    codes = [e4m3(q.float() * scale[0]),
             e4m3(torch.where(keep, (k.float() - k_mean) * scale[1], 0)),
             e4m3(torch.where(keep, (v.float() - v_mean) * scale[2], 0))]
    seq_len_kv = None
    if key_mask is not None:
        pos, count = key_order(key_mask)
        for i in (1, 2):
            placed = torch.empty_like(codes[i])
            placed.scatter_(2, pos.long()[:, None, :, None].expand_as(codes[i]), codes[i])
            codes[i] = placed
        seq_len_kv = count.view(b, 1, 1, 1)
    q8, k8, v8 = (c.transpose(1, 2).contiguous().to(torch.float8_e4m3fn) for c in codes)
    scales = torch.zeros(SCALE_ROWS, SCALE_STRIDE, dtype=torch.float32, device=q.device)
    scales[DESCALE_Q:DESCALE_V + 1, 0] = 1.0 / scale
    scales[DESCALE_S, 0], scales[SCALE_S, 0] = 1.0 / S_SCALE, S_SCALE
    scales[SCALE_O, 0], scales[DESCALE_O, 0] = scale[2], 1.0 / scale[2]
    return QKVFP8(q8, k8, v8, scales, stats.v_mean, seq_len_kv)


def reference_finish_output(o8: torch.Tensor, qkv: QKVFP8, dtype: torch.dtype) -> torch.Tensor:
    """`finish_output` in torch: [B, H, N, D] in `dtype`."""
    b, n, h, d = o8.shape
    y = o8.float().transpose(1, 2) * qkv.scales[DESCALE_O, 0] + qkv.v_mean.view(b, h, 1, d)
    if qkv.seq_len_kv is not None:
        y = torch.where(qkv.seq_len_kv.view(b, 1, 1, 1) > 0, y, float("nan"))
    return y.to(dtype)
