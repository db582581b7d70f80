"""Triton per-token activation quantization, with an optional LoRA down projection from the same read of x.

    row amax -> scale -> codes          (one kernel; two with a LoRA `down`)

Modes:
- "int8": scale = max(amax, 1e-12) / 127, codes = clamp(rne(x / scale), +-127)   (reference.quantize_rows_int8)
- "int4": scale = max(amax, 1e-10) / 7,   codes = clamp(rne(x / scale), +-7)     (reference.quantize_rows_int4)
- "fp8":  scale = amax / 448 (1 where amax == 0), codes = e4m3(clamp(x * (1/scale), +-448))
          (reference.fp8_quantize / positive_scale).
Any mode takes a static per-tensor `static_scale` instead of the row amax: the same code rule with
that one scale for every row (no amax pass at all).

Rotations are not fused here: the dispatch rotates x first with one tensor-core matmul
(rotation.rotate_groups), which the H200 ran five times faster than this kernel's former in-register
Hadamard (bench/results/linear_speed_h200_rotmm.md). Under torch.compile the dispatch does not call this
kernel: the same math as torch ops (`reference_quantize_act`) lets Inductor fuse it into the op before.

LoRA down projection (`down` [R, K], optional): a branch needs x @ down^T, one more read of x
as its own GEMM. Instead `_amax_down_kernel` reads x once for both the row amax (the codes
kernel's first pass) and xa (one tl.dot per chunk, fp32), each program a 64-row block of one
K slice (the dot needs 16+ rows; every row block reads all of `down` from L2, so blocks are
large and the slices widen the grid). Partial results go to per-slice slots, no atomics: the
codes kernel reduces them in slice order (the same bits every run) and makes one pass over x.
A first design put the dot into the codes kernel itself (16-row programs); it was slower than
plain quantize + a cuBLAS x @ down^T, while this one breaks even at K=6144 and wins at K=16384
(bench/results/lora_kernel_tune_h200.md): x comes from HBM twice either way (the plain kernel's
second pass hits L2 because each program re-reads its own few rows at once; here the codes kernel
runs after the whole slice kernel, and 56 MB of x does not stay in the 50 MB L2). The row amax is
max |x|, exact in any chunking, so fused and plain give the same scales and codes bit for bit.

Division is `div_rn` (Triton's `/` on fp32 is an approximate division on the GPU) and
rounding is round-half-even through the 1.5*2^23 trick (torch.round's rule), so codes
match the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODES = {"int8": (0, 127.0, 1e-12), "int4": (0, 7.0, 1e-10), "fp8": (1, 448.0, 0.0)}


@triton.jit
def _amax_down_kernel(
    x_ptr, down_ptr, amax_ptr, xa_ptr,
    M, K, SLICE, stride_xm, R, stride_dk, stride_dr,
    AMAX: tl.constexpr, IEEE: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Program (row block, K slice): the slice's row amax (AMAX=False with a static scale) and its partial
    # x @ down^T (fp32), each written to its own slot [slice, row] -- no atomics, so the codes kernel
    # reduces them in a fixed order and the result is the same every run.
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    r_ok = rows < M
    x_row = x_ptr + rows[:, None] * stride_xm
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    xa = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    for k0 in range(sl * SLICE, tl.minimum(sl * SLICE + SLICE, K), BLOCK_K):
        kk = k0 + cols
        x = tl.load(x_row + kk[None, :], mask=r_ok[:, None] & (kk[None, :] < K), other=0.0)
        d = tl.load(down_ptr + kk[:, None] * stride_dk + offs_r[None, :] * stride_dr,
                    mask=(kk[:, None] < K) & (offs_r[None, :] < R), other=0.0)
        if IEEE:
            xa = tl.dot(x, d, xa, input_precision="ieee")
        else:
            xa = tl.dot(x, d, xa)
        if AMAX:  # max |x|: exact, so the chunking does not matter
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    if AMAX:
        tl.store(amax_ptr + sl * M + rows, amax, mask=r_ok)
    tl.store(xa_ptr + (sl * M + rows)[:, None] * R_PAD + offs_r[None, :], xa, mask=r_ok[:, None])


@triton.jit
def _quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, amax_ptr, xa_part_ptr, xa_ptr,
    M, K, stride_xm, stride_qm, R, stride_xam,
    QMAX: tl.constexpr, EPS: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr, PARTS: tl.constexpr,
    R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # PARTS > 0: `_amax_down_kernel` ran first; its PARTS slices give the amax (no amax pass over x
    # here) and the LoRA xa, summed in slice order.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    r_ok = rows < M
    x_row = x_ptr + rows[:, None] * stride_xm
    if PARTS > 0:
        offs_r = tl.arange(0, R_PAD)
        xa = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for sl in tl.static_range(PARTS):
            xa += tl.load(xa_part_ptr + (sl * M + rows)[:, None] * R_PAD + offs_r[None, :], mask=r_ok[:, None], other=0.0)
        tl.store(xa_ptr + rows[:, None] * stride_xam + offs_r[None, :], xa.to(xa_ptr.dtype.element_ty),
                 mask=r_ok[:, None] & (offs_r[None, :] < R))
    if STATIC:  # one per-tensor scale for every row (fp8, int8, int4 alike); no amax
        scale = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PARTS > 0:
            for sl in tl.static_range(PARTS):
                amax = tl.maximum(amax, tl.load(amax_ptr + sl * M + rows, mask=r_ok, other=0.0))
        else:
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(x_row + (k0 + cols)[None, :], mask=r_ok[:, None] & ((k0 + cols)[None, :] < K), other=0.0)
                amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        if FP8:
            scale = tl.math.div_rn(amax, QMAX)
            scale = tl.where(scale > 0, scale, 1.0)
        else:
            scale = tl.math.div_rn(tl.maximum(amax, EPS), QMAX)
        tl.store(s_ptr + rows, scale, mask=r_ok)
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale)
    for k0 in range(0, K, BLOCK_K):
        oc = k0 + cols
        x = tl.load(x_row + oc[None, :], mask=r_ok[:, None] & (oc[None, :] < K), other=0.0)
        v = x.to(tl.float32)
        if FP8:
            q = tl.clamp(v * inv[:, None], -QMAX, QMAX).to(q_ptr.dtype.element_ty)
        else:
            t = tl.math.div_rn(v, scale[:, None])
            t = (t + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds half to even (|t| < 2**22), like torch.round
            q = tl.clamp(t, -QMAX, QMAX).to(tl.int8)
        tl.store(q_ptr + rows[:, None] * stride_qm + oc[None, :], q, mask=r_ok[:, None] & (oc[None, :] < K))


def launch_config(k: int, override: dict | None = None) -> dict:
    """Launch shapes, from the H200 sweep in bench/results/lora_kernel_tune_h200.md (timings there).

    Codes kernel: 2-row programs over 2048-column chunks, 8 warps: the fastest of the 24 plain shapes
    swept (more rows per program left too few programs per SM at M=4608). LoRA slice kernel (DOWN_*):
    64-row programs over 2048-column slices in 128-column chunks (the dot wants 16+ rows, and every row
    block reads all of `down` from L2 once, so row blocks are large and the slices give the grid its
    width); with the codes kernel after it, it breaks even with plain quantize + a cuBLAS x @ down^T at
    K=6144 and is faster at K=16384 (same file)."""
    cfg = {"BLOCK_M": 2, "BLOCK_K": min(triton.next_power_of_2(k), 2048), "num_warps": 8,
           "DOWN_BLOCK_M": 64, "DOWN_BLOCK_K": 128, "DOWN_SLICE": 2048, "down_warps": 4, "down_stages": 3}
    cfg.update(override or {})
    return cfg


# CPU tensors reach these kernels only under TRITON_INTERPRET (tests), which runs every program in
# Python: 16-row codes programs there unless a config says otherwise (codes do not depend on it).
INTERPRETER_CONFIG = {"BLOCK_M": 16}


def _check_args(x: torch.Tensor, mode: str, static_scale: torch.Tensor | None) -> None:
    """quantize_act's refusals of a mode, shape, dtype or static scale it does not take."""
    if mode not in MODES:
        raise ValueError(f"quantize_act: mode must be one of {list(MODES)}, got '{mode}'")
    if x.dim() != 2:
        raise ValueError(f"quantize_act: expected 2-D x, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_act: x must be fp32/bf16/fp16, got {x.dtype}")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"quantize_act: static_scale must hold one value, got {tuple(static_scale.shape)}")


def _amax_down(x: torch.Tensor, down: torch.Tensor, cfg: dict, scale: torch.Tensor, *, amax: bool, ieee: bool,
               r_pad: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The first kernel with `down`: per K slice, the rows' partial amax (when `amax`: no static scale) and the
    partial x @ down^T. Returns (slices, amax partials [slices, M] (`scale`, a dummy pointer, without `amax`),
    xa partials [slices, M, r_pad])."""
    m, k = x.shape
    r = down.shape[0]
    dbm, dbk = cfg["DOWN_BLOCK_M"], cfg["DOWN_BLOCK_K"]
    if dbm < 16 or dbm & (dbm - 1):
        raise ValueError(f"quantize_act: DOWN_BLOCK_M must be a power of two >= 16, got {dbm}")
    slice_k = triton.cdiv(cfg["DOWN_SLICE"], dbk) * dbk
    parts = triton.cdiv(k, slice_k)
    amax_part = torch.empty((parts, m), dtype=torch.float32, device=x.device) if amax else scale
    xa_part = torch.empty((parts, m, r_pad), dtype=torch.float32, device=x.device)
    _amax_down_kernel[(triton.cdiv(m, dbm), parts)](
        x, down, amax_part, xa_part, m, k, slice_k, x.stride(0), r, down.stride(1),
        down.stride(0), AMAX=amax, IEEE=ieee, R_PAD=r_pad, BLOCK_M=dbm, BLOCK_K=dbk,
        num_warps=cfg["down_warps"], num_stages=cfg["down_stages"])
    return parts, amax_part, xa_part


def quantize_act(x: torch.Tensor, mode: str = "int8", static_scale: torch.Tensor | None = None,
                 down: torch.Tensor | None = None, config: dict | None = None) -> tuple[torch.Tensor, ...]:
    """x [M, K] (fp32/bf16/fp16) -> (codes [M, K] int8 or float8_e4m3fn, scale fp32 [M, 1]),
    plus xa = x @ down^T [M, R] in x's dtype when `down` [R, K] (R <= 128) is given.

    `static_scale` (one positive value, any mode) uses one per-tensor scale s instead of the per-token
    amax: codes = clamp(rne(x / s), +-qmax) (int8 / int4) or e4m3(clamp(x * (1/s), +-448)) (fp8); the
    returned scale is [M, 1] of it. With `down` (any strides; a transposed [K, R] copy reads in whole
    rows), a first kernel reads x once for both the row amax and the LoRA down projection, per K slice;
    the codes kernel then needs one pass over x instead of two. Codes and scales equal the plain call's
    bit for bit. `config` overrides `launch_config` (tests under the interpreter, the tuning bench).
    """
    _check_args(x, mode, static_scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    r = 0
    if down is not None:
        if down.dim() != 2 or down.shape[1] != k or not 0 < down.shape[0] <= 128:
            raise ValueError(f"quantize_act: down must be [R <= 128, {k}], got {tuple(down.shape)}")
        down = down.to(x.dtype)
        r = down.shape[0]
    xa = torch.empty((m, r), dtype=x.dtype, device=x.device) if down is not None else None
    is_fp8, qmax, eps = MODES[mode]
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn if is_fp8 else torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if static_scale is not None:
        static = static_scale.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
        scale.copy_(static.expand(m, 1))
    else:
        static = scale  # dummy pointer when STATIC=False
    if m == 0:
        return (q, scale) if down is None else (q, scale, xa)
    cfg = launch_config(k, {**INTERPRETER_CONFIG, **(config or {})} if not x.is_cuda else config)
    ieee = x.dtype == torch.float32
    r_pad = max(16, triton.next_power_of_2(r))
    parts, amax_part, xa_part = 0, scale, scale  # dummy pointers without down
    if down is not None:
        parts, amax_part, xa_part = _amax_down(x, down, cfg, scale, amax=static_scale is None, ieee=ieee,
                                               r_pad=r_pad)
    bm = cfg["BLOCK_M"]
    _quant_rows_kernel[(triton.cdiv(m, bm),)](
        x, q, scale, static, amax_part, xa_part, xa if down is not None else scale,
        m, k, x.stride(0), q.stride(0), r, r,
        QMAX=qmax, EPS=eps, FP8=bool(is_fp8), STATIC=static_scale is not None, PARTS=parts, R_PAD=r_pad,
        BLOCK_M=bm, BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=2,
    )
    return (q, scale) if down is None else (q, scale, xa)


def reference_quantize_act(x: torch.Tensor, mode: str = "int8",
                           static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of `quantize_act` (the formats' own reference functions; a static scale: one scale s
    for every row, codes clamp(round(x / s), +-qmax) for int8 / int4, fp8_quantize for fp8). Also the
    dispatch's quantization under torch.compile, where Inductor fuses these ops into the op before."""
    from lowbit_pipe.kernels import reference

    v = x.float()
    if static_scale is not None:
        s = static_scale.float().reshape(())
        scale = s.expand(v.shape[0], 1).clone()
        if mode == "fp8":
            return reference.fp8_quantize(v, s), scale
        qmax = MODES[mode][1]
        return torch.clamp(torch.round(v / s), -qmax, qmax).to(torch.int8), scale
    if mode == "int8":
        return reference.quantize_rows_int8(v)
    if mode == "int4":
        return reference.quantize_rows_int4(v)
    s = reference.positive_scale(v.abs().amax(dim=-1, keepdim=True), reference.FP8_E4M3_MAX)
    return reference.fp8_quantize(v, s), s
