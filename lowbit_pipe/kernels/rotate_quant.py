"""Rotation and per-token quantization without a rotated copy of x in memory.

    pass 1: x @ H per group on tensor cores -> row amax per group     (`_rotated_amax_kernel`)
    pass 2: x @ H again -> codes under the row scale                   (`_rotated_codes_kernel`)

The unfused path (rotation.rotate_groups, then quantize_act) writes the rotated x and reads it twice:
at M=4608, K=6144 (bf16) about 250 MB of traffic, which cost as much as a 6144 x 1536 INT8 GEMM on the
H200 (bench/results/linear_speed_h200_rotmm.md). Here x is read twice and only the codes are written
(~140 MB); the Hadamard products are recomputed in pass 2 instead of stored (for a 256 group: 2 x 14.5
GFLOP at M=4608, K=6144, tens of microseconds on tensor cores).

Numerics are the unfused path's up to the order of the fp32 sums (a code moves by one where a value sits
on a rounding edge): each rotated value is the fp32 sum of the group's products, rounded once to x's
dtype (what rotate_groups' matmul stores) before its amax and code; the codes and scales
follow quantize_act's rules (`scale_of`, `codes_of`). Groups up to `MAX_GROUP` wide: a group's x tile
and a column slice of H sit in shared memory; wider rotations (QuaRot over a whole large K) keep the
unfused path.

Programs are (64-row block, group): K/group times more programs than row blocks alone, so M=256 still
fills the GPU. Pass 1 writes each group's partial amax to its own slot [group, row] (no atomics); pass
2 reduces the slots of its rows in group order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels import rotation
from lowbit_pipe.kernels.quantize_act import MODES, codes_of, scale_of

MAX_GROUP = 256
LAUNCH = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}
# CPU tensors reach this only under TRITON_INTERPRET (tests): 16-row blocks there (it runs every program in
# Python), and fp32 dot operands (FP32_DOT: its bf16 tl.dot returns garbage).
INTERPRETER = {"BLOCK_M": 16}


def fits(group: int, x: torch.Tensor) -> bool:
    """Whether a call takes this path: a power-of-two group from 16 to MAX_GROUP, and on a GPU a bf16 / fp16 x
    (an fp32 x needs an fp32 FMA dot of these tiles: its GPU test did not finish within minutes on the H200)."""
    return 16 <= group <= MAX_GROUP and group & (group - 1) == 0 and (x.dtype != torch.float32 or not x.is_cuda)


@triton.jit
def _rotated_slice(x, h_ptr, j, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    """Columns [j * BLOCK_N, (j + 1) * BLOCK_N) of (x tile) @ H, fp32 sums rounded once to x's dtype."""
    offs_g = tl.arange(0, GROUP)
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.load(h_ptr + offs_g[:, None] * GROUP + offs_n[None, :])
    if FP32_DOT:
        r = tl.dot(x.to(tl.float32), h.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(x, h)
    return r.to(x.dtype).to(tl.float32)


@triton.jit
def _rotated_amax_kernel(x_ptr, h_ptr, amax_ptr, M, stride_xm,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < M
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None], other=0.0)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in tl.static_range(GROUP // BLOCK_N):
        r = _rotated_slice(x, h_ptr, j, GROUP, BLOCK_N, FP32_DOT)
        amax = tl.maximum(amax, tl.max(tl.abs(r), axis=1))
    tl.store(amax_ptr + g * M + rows, amax, mask=r_ok)


@triton.jit
def _rotated_codes_kernel(x_ptr, h_ptr, amax_ptr, static_ptr, q_ptr, s_ptr, M, GROUPS, stride_xm, stride_qm,
                          QMAX: tl.constexpr, EPS: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < M
    if STATIC:
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for s in range(0, GROUPS):  # max: exact, and the same order every run
            amax = tl.maximum(amax, tl.load(amax_ptr + s * M + rows, mask=r_ok, other=0.0))
        scale = scale_of(amax, QMAX, EPS, FP8)
        if g == 0:
            tl.store(s_ptr + rows, scale, mask=r_ok)
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=r_ok[:, None], other=0.0)
    for j in tl.static_range(GROUP // BLOCK_N):
        r = _rotated_slice(x, h_ptr, j, GROUP, BLOCK_N, FP32_DOT)
        q = codes_of(r, scale, inv, QMAX, FP8, q_ptr.dtype.element_ty)
        out_cols = g * GROUP + j * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(q_ptr + rows[:, None] * stride_qm + out_cols[None, :], q, mask=r_ok[:, None])


def rotate_quantize(x: torch.Tensor, mode: str, kind: str, group: int, static_scale: torch.Tensor | None = None,
                    config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K], scale fp32 [M, 1]) of rotate_groups(x, kind, group) under quantize_act's
    rules for `mode` (int8 / int4 / fp8), per token or with one `static_scale`; `config` overrides LAUNCH."""
    if mode not in MODES:
        raise ValueError(f"rotate_quantize: mode must be one of {list(MODES)}, got '{mode}'")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rotate_quantize: expected 2-D fp32/bf16/fp16 x, got {tuple(x.shape)} {x.dtype}")
    if not 16 <= group <= MAX_GROUP or group & (group - 1):
        raise ValueError(f"rotate_quantize: group {group} is not a power of two from 16 to {MAX_GROUP}")
    if x.is_cuda and x.dtype == torch.float32:
        raise ValueError("rotate_quantize: an fp32 x on a GPU takes rotate_groups + quantize_act (see fits)")
    m, k = x.shape
    if k % group:
        raise ValueError(f"rotate_quantize: K={k} is not a multiple of the rotation group {group}")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"rotate_quantize: static_scale must hold one value, got {tuple(static_scale.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    is_fp8, qmax, eps = MODES[mode]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    static = scale  # dummy pointer without a static scale
    if static_scale is not None:
        static = static_scale.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
        scale.copy_(static.expand(m, 1))
    if m == 0:
        return q, scale
    cfg = {**LAUNCH, **({} if x.is_cuda else INTERPRETER), **(config or {})}
    bm, bn = cfg["BLOCK_M"], min(cfg["BLOCK_N"], group)
    h = rotation.device_hadamard(kind, group, x.dtype, x.device)
    fp32_dot = x.dtype == torch.float32 or not x.is_cuda
    groups = k // group
    grid = (triton.cdiv(m, bm), groups)
    amax = scale  # dummy pointer with a static scale
    if static_scale is None:
        amax = torch.empty((groups, m), dtype=torch.float32, device=x.device)
        _rotated_amax_kernel[grid](x, h, amax, m, x.stride(0), GROUP=group, BLOCK_M=bm, BLOCK_N=bn,
                                   FP32_DOT=fp32_dot, num_warps=cfg["num_warps"])
    _rotated_codes_kernel[grid](x, h, amax, static, q, scale, m, groups, x.stride(0), q.stride(0),
                                QMAX=qmax, EPS=eps, FP8=bool(is_fp8), STATIC=static_scale is not None,
                                GROUP=group, BLOCK_M=bm, BLOCK_N=bn, FP32_DOT=fp32_dot, num_warps=cfg["num_warps"])
    return q, scale
