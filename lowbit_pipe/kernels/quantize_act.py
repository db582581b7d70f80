"""Triton per-token activation quantization, optionally fused with a block-diagonal Hadamard.

    (rotate x @ H per group) -> row amax -> scale -> codes          (one kernel; two with a LoRA `down`)

Modes:
- "int8": scale = max(amax, 1e-12) / 127, codes = clamp(rne(x / scale), +-127)   (reference.quantize_rows_int8)
- "int4": scale = max(amax, 1e-10) / 7,   codes = clamp(rne(x / scale), +-7)     (reference.quantize_rows_int4)
- "fp8":  scale = amax / 448 (1 where amax == 0), codes = e4m3(clamp(x * (1/scale), +-448))
          (reference.fp8_quantize / positive_scale).
Any mode takes a static per-tensor `static_scale` instead of the row amax: the same code rule with
that one scale for every row (no amax pass at all).

Rotation (`rot` = "convrot" / "quarot", group G): each program owns ROT_ROWS (16) rows and
walks the row G columns at a time. Both kinds are Kronecker powers, so a group of
G >= 256 rotates as H_16 kron H_{G/16} (two small dots on the [16, G/16] view of each
row: 16x16 factors, ~18 KB of shared memory); smaller groups (quarot 128) use one dot
with the whole +-1 matrix in 64-column slices. The +-1 factors are exact in bf16/fp16
and the 1/sqrt(G) goes on in fp32. The row amax needs the whole rotated row before any
code can be written, so the kernel rotates twice (pass 1: amax, pass 2: codes) instead
of spilling the fp32 rotated row to memory.
hadanorm (per-group mean removal, plus a correction term) is not fused: rotate with
`rotation.rotate_activation` first and quantize with rot="none".

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
runs after the whole slice kernel, and 56 MB of x does not stay in the 50 MB L2).

Fused and plain give the same scales and codes bit for bit, by construction: the rotation is a
dot whose fp32 sums depend on the tile's shape (the MMA instruction the compiler picks from the
shape and warp count on the GPU, the BLAS kernel under the interpreter), so the row amax is
computed by ONE function (`_row_amax`) on tiles of ROT_ROWS rows, with the same warp count, in
both kernels: the slice kernel takes each 16-row sub-tile of its 64-row block out of registers
(exactly: the sub-tile plus zeros) for the amax, and keeps the whole block for the xa dot, so x
is still read once. Without rotation the amax is max |x|, exact in any chunking. The codes pass
is the same kernel with the same tile in both paths. (Loading the sub-tiles again from memory
instead needed more shared memory than the H200 has for fp32 x at the default 64-row block, and a
separate amax loop after the xa loop ran slower for quarot.)

Division is `div_rn` (Triton's `/` on fp32 is an approximate division on the GPU) and
rounding is round-half-even through the 1.5*2^23 trick (torch.round's rule), so codes
match the torch reference except where the fp32 rotation sums differ in the last bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowbit_pipe.kernels import rotation

MODES = {"int8": (0, 127.0, 1e-12), "int4": (0, 7.0, 1e-10), "fp8": (1, 448.0, 0.0)}
_RNE_MAGIC = 12582912.0  # 1.5 * 2**23: (v + M) - M rounds half-to-even for |v| < 2**22


@triton.jit
def _rot_chunk(x, h_ptr, j, H_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_K: tl.constexpr, HC: tl.constexpr):
    """Columns [j*HC, (j+1)*HC) of x @ H for the tile x [BLOCK_M, BLOCK_K], fp32.

    H is read in [BLOCK_K, HC] slices (L2-resident) so shared memory holds 32 KB of it
    instead of the whole 128 KB 256x256 matrix."""
    hr = tl.arange(0, BLOCK_K)
    hc = j * HC + tl.arange(0, HC)
    h = tl.load(h_ptr + hr[:, None] * BLOCK_K + hc[None, :])
    if IEEE:  # fp32 input: true fp32 products (the GPU default would be tf32)
        acc = tl.dot(x, h, input_precision="ieee")
    else:
        acc = tl.dot(x, h)
    return acc * H_SCALE


@triton.jit
def _rot_kron(x, ha_ptr, hb_ptr, H_SCALE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
              A: tl.constexpr, B: tl.constexpr):
    """x [BLOCK_M, A*B] @ (H_A kron H_B) without the G x G matrix: per row, X [A, B] -> H_A X H_B.

    Step 1 (X @ H_B) multiplies the input dtype by +-1 (exact) into fp32; step 2 (H_A on the
    other index) multiplies fp32 values, so it runs as an fp32 dot (ieee). Both factors are
    tiny (16 x 16 for G=256), so shared memory stays small and many programs fit per SM."""
    ib = tl.arange(0, B)
    ia = tl.arange(0, A)
    hb = tl.load(hb_ptr + ib[:, None] * B + ib[None, :])
    ha = tl.load(ha_ptr + ia[:, None] * A + ia[None, :]).to(tl.float32)
    if IEEE:
        z = tl.dot(tl.reshape(x, (BLOCK_M * A, B)), hb, input_precision="ieee")
    else:
        z = tl.dot(tl.reshape(x, (BLOCK_M * A, B)), hb)
    z = tl.reshape(tl.permute(tl.reshape(z, (BLOCK_M, A, B)), (0, 2, 1)), (BLOCK_M * B, A))
    y = tl.dot(z, ha, input_precision="ieee")
    y = tl.reshape(tl.permute(tl.reshape(y, (BLOCK_M, B, A)), (0, 2, 1)), (BLOCK_M, A * B))
    return y * H_SCALE


@triton.jit
def _rotated_chunk(x, h_ptr, hb_ptr, j, ROT: tl.constexpr, KRON_A: tl.constexpr, H_SCALE: tl.constexpr,
                   IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HC: tl.constexpr):
    """Output columns [j*HC, (j+1)*HC) of the tile after the rotation (Kronecker form: HC == BLOCK_K), fp32."""
    if ROT and KRON_A > 0:
        v = _rot_kron(x, h_ptr, hb_ptr, H_SCALE, IEEE, BLOCK_M, KRON_A, BLOCK_K // KRON_A)
    elif ROT:
        v = _rot_chunk(x, h_ptr, j, H_SCALE, IEEE, BLOCK_K, HC)
    else:
        v = x.to(tl.float32)
    return v


@triton.jit
def _row_amax(x, h_ptr, hb_ptr, amax, ROT: tl.constexpr, KRON_A: tl.constexpr, H_SCALE: tl.constexpr,
              IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HC: tl.constexpr):
    """amax updated with the row-wise |max| of the rotated tile x [BLOCK_M, BLOCK_K]: the ONE place a
    row amax is computed. Rotating, both kernels call it on [ROT_ROWS, G] tiles with the same
    warps (the codes kernel's amax pass on its own rows, the slice kernel on each ROT_ROWS-row
    sub-tile of its block), so a row's rotated values -- and its amax -- are the same bits in both."""
    for j in tl.static_range(BLOCK_K // HC):
        v = _rotated_chunk(x, h_ptr, hb_ptr, j, ROT, KRON_A, H_SCALE, IEEE, BLOCK_M, BLOCK_K, HC)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    return amax


@triton.jit
def _amax_down_kernel(
    x_ptr, h_ptr, hb_ptr, down_ptr, amax_ptr, xa_ptr,
    M, K, SLICE, stride_xm, R, stride_dk, stride_dr,
    AMAX: tl.constexpr, ROT: tl.constexpr, H_SCALE: tl.constexpr, IEEE: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HC: tl.constexpr, KRON_A: tl.constexpr, ROT_ROWS: tl.constexpr,
):
    # Program (row block, K slice): the slice's row amax (rotated x; AMAX=False with a static scale)
    # and its partial x @ down^T (unrotated x, fp32), each written to its own slot [slice, row] -- no
    # atomics, so the codes kernel reduces them in a fixed order and the result is the same every run.
    # Rotating, the amax comes from `_row_amax` on each ROT_ROWS-row sub-tile of the loaded block (taken
    # out of registers exactly: a sum of the sub-tile and zeros), the same call on the same tile shape
    # as the codes kernel's amax pass: the rotation dot's fp32 sums depend on its shape, so equal
    # shapes give equal bits. The xa dot keeps the whole block.
    tl.static_assert(BLOCK_M % ROT_ROWS == 0)
    pid = tl.program_id(0)
    sl = tl.program_id(1)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R_PAD)
    r_ok = rows < M
    x_row = x_ptr + rows[:, None] * stride_xm
    sub = tl.arange(0, BLOCK_M // ROT_ROWS)
    amax = tl.zeros((BLOCK_M // ROT_ROWS, ROT_ROWS), dtype=tl.float32)  # [sub-tile, row in it]
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
        if AMAX:
            if ROT:  # sub-tile t of the block, exactly (the other terms of the sum are zeros)
                x3 = tl.reshape(x, (BLOCK_M // ROT_ROWS, ROT_ROWS, BLOCK_K))
                for t in tl.static_range(BLOCK_M // ROT_ROWS):
                    xt = tl.sum(tl.where(sub[:, None, None] == t, x3, 0.0), axis=0).to(x.dtype)
                    a = _row_amax(xt, h_ptr, hb_ptr, tl.zeros((ROT_ROWS,), dtype=tl.float32), ROT, KRON_A,
                                  H_SCALE, IEEE, ROT_ROWS, BLOCK_K, HC)
                    amax = tl.maximum(amax, tl.where(sub[:, None] == t, a[None, :], 0.0))
            else:  # max |x|: exact, so the chunking does not matter
                amax = tl.maximum(amax, tl.reshape(tl.max(tl.abs(x.to(tl.float32)), axis=1),
                                                   (BLOCK_M // ROT_ROWS, ROT_ROWS)))
    if AMAX:
        tl.store(amax_ptr + sl * M + rows, tl.reshape(amax, (BLOCK_M,)), mask=r_ok)
    tl.store(xa_ptr + (sl * M + rows)[:, None] * R_PAD + offs_r[None, :], xa, mask=r_ok[:, None])


@triton.jit
def _quant_rows_kernel(
    x_ptr, h_ptr, hb_ptr, q_ptr, s_ptr, static_ptr, amax_ptr, xa_part_ptr, xa_ptr,
    M, K, stride_xm, stride_qm, R, stride_xam,
    QMAX: tl.constexpr, EPS: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr,
    ROT: tl.constexpr, H_SCALE: tl.constexpr, IEEE: tl.constexpr, PARTS: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HC: tl.constexpr, KRON_A: tl.constexpr, ROT_ROWS: tl.constexpr,
):
    # BLOCK_K: the rotation group (ROT) or the column chunk; HC: output columns per step
    # (HC == BLOCK_K without rotation or with the Kronecker form). KRON_A > 0: rotate as
    # H_A kron H_B (h_ptr = H_A, hb_ptr = H_B, A * B = BLOCK_K); 0: one dot with H (h_ptr).
    # Rotating, programs are ROT_ROWS rows (the amax pass is `_row_amax` on exactly the slice
    # kernel's sub-tile shape). PARTS > 0: `_amax_down_kernel` ran first; its PARTS slices give the
    # amax (no amax pass over x here) and the LoRA xa, summed in slice order.
    tl.static_assert(not ROT or BLOCK_M == ROT_ROWS)
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
                amax = _row_amax(x, h_ptr, hb_ptr, amax, ROT, KRON_A, H_SCALE, IEEE, BLOCK_M, BLOCK_K, HC)
        if FP8:
            scale = tl.math.div_rn(amax, QMAX)
            scale = tl.where(scale > 0, scale, 1.0)
        else:
            scale = tl.math.div_rn(tl.maximum(amax, EPS), QMAX)
        tl.store(s_ptr + rows, scale, mask=r_ok)
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32), scale)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + (k0 + cols)[None, :], mask=r_ok[:, None] & ((k0 + cols)[None, :] < K), other=0.0)
        for j in tl.static_range(BLOCK_K // HC):
            v = _rotated_chunk(x, h_ptr, hb_ptr, j, ROT, KRON_A, H_SCALE, IEEE, BLOCK_M, BLOCK_K, HC)
            if FP8:
                q = tl.clamp(v * inv[:, None], -QMAX, QMAX).to(q_ptr.dtype.element_ty)
            else:
                t = tl.math.div_rn(v, scale[:, None])
                t = (t + 12582912.0) - 12582912.0  # round half to even, like torch.round
                q = tl.clamp(t, -QMAX, QMAX).to(tl.int8)
            oc = k0 + j * HC + tl.arange(0, HC)
            tl.store(q_ptr + rows[:, None] * stride_qm + oc[None, :], q, mask=r_ok[:, None] & (oc[None, :] < K))


KRON_OUTER = 16  # groups >= 256 rotate as H_16 kron H_{G/16} (both kinds are Kronecker powers)
ROT_ROWS = 16  # rows of every rotated tile (the Hadamard dot needs 16): one shape for every kernel


@functools.lru_cache(maxsize=32)
def _unnormalized_hadamard(kind: str, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """+-1 Hadamard (rotation.hadamard(...) * sqrt(group)), exact in every float dtype, on `device`.

    Cached per device so a forward does no host-to-device copy (CUDA-graph capturable once
    warm); a few KB each. `clear_cache()` empties it."""
    return torch.sign(rotation.hadamard(kind, group)).to(device=device, dtype=dtype).contiguous()


def clear_cache() -> None:
    """Drop the cached device Hadamard factors."""
    _unnormalized_hadamard.cache_clear()


def launch_config(k: int, rot: str, override: dict | None = None) -> dict:
    """Launch shapes, from the H200 sweep in bench/results/lora_kernel_tune_h200.md (timings there).

    Codes kernel: 2-row programs over 2048-column chunks, 8 warps: the fastest of the 24 plain shapes
    swept (more rows per program left too few programs per SM at M=4608). Rotating, programs are
    ROT_ROWS (16) rows whatever `BLOCK_M` says, and the slice kernel runs with the codes kernel's
    `num_warps` (its `down_warps` is for unrotated calls): the Hadamard dot needs 16 rows, and one
    tile shape and warp count for every rotation dot -- the compiler picks the MMA instruction from
    those -- keep the amax bit-equal with the LoRA slice kernel's. LoRA slice kernel
    (DOWN_*): 64-row programs over 2048-column slices in 128-column chunks (the dot wants 16+ rows,
    and every row block reads all of `down` from L2 once, so row blocks are large and the slices give
    the grid its width); with the codes kernel after it, it breaks even with plain quantize + a cuBLAS
    x @ down^T at K=6144 and is faster at K=16384 (same file)."""
    cfg = {"BLOCK_M": ROT_ROWS if rot != "none" else 2, "BLOCK_K": min(triton.next_power_of_2(k), 2048),
           "num_warps": 4 if rot != "none" else 8,
           "DOWN_BLOCK_M": 64, "DOWN_BLOCK_K": 128, "DOWN_SLICE": 2048, "down_warps": 4, "down_stages": 3}
    cfg.update(override or {})
    return cfg


# CPU tensors reach these kernels only under TRITON_INTERPRET (tests), which runs every program in
# Python: 16-row codes programs there unless a config says otherwise (codes do not depend on it).
INTERPRETER_CONFIG = {"BLOCK_M": 16}


def quantize_act(x: torch.Tensor, mode: str = "int8", rot: str = "none", group: int | None = None,
                 static_scale: torch.Tensor | None = None, down: torch.Tensor | None = None,
                 config: dict | None = None) -> tuple[torch.Tensor, ...]:
    """x [M, K] (fp32/bf16/fp16) -> (codes [M, K] int8 or float8_e4m3fn, scale fp32 [M, 1]),
    plus xa = x @ down^T [M, R] in x's dtype when `down` [R, K] (R <= 128) is given.

    `rot` rotates first (x @ H per group of `group`). `static_scale` (one positive value, any mode)
    uses one per-tensor scale s instead of the per-token amax: codes = clamp(rne(x_rot / s), +-qmax)
    (int8 / int4) or e4m3(clamp(x_rot * (1/s), +-448)) (fp8); the returned scale is [M, 1] of it.
    With `down` (any strides; a transposed [K, R] copy reads in whole rows), a first kernel
    reads x once for both the row amax and the LoRA down projection, per K slice; the codes
    kernel then needs one pass over x instead of two. Codes and scales equal the plain call's
    bit for bit: a row's amax comes from the same function on the same tile shape in both paths.
    `config` overrides `launch_config` (tests under the interpreter, the tuning bench).
    """
    if mode not in MODES:
        raise ValueError(f"quantize_act: mode must be one of {list(MODES)}, got '{mode}'")
    if x.dim() != 2:
        raise ValueError(f"quantize_act: expected 2-D x, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_act: x must be fp32/bf16/fp16, got {x.dtype}")
    if static_scale is not None and static_scale.numel() != 1:
        raise ValueError(f"quantize_act: static_scale must hold one value, got {tuple(static_scale.shape)}")
    if rot not in ("none", "convrot", "quarot"):
        raise ValueError(f"quantize_act: rot must be none/convrot/quarot (hadanorm: rotate first), got '{rot}'")
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
    cfg = launch_config(k, rot, {**INTERPRETER_CONFIG, **(config or {})} if not x.is_cuda else config)
    if rot != "none":
        g = rotation.resolve_group(rot, group)
        if k % g:
            raise ValueError(f"quantize_act: K={k} is not a multiple of the {rot} group {g}")
        block_k = down_block_k = g
        h_scale = float(1.0 / g**0.5)
        if g >= KRON_OUTER * KRON_OUTER:
            kron_a, hc = KRON_OUTER, g
            h = _unnormalized_hadamard(rot, KRON_OUTER, x.dtype, x.device)
            hb = _unnormalized_hadamard(rot, g // KRON_OUTER, x.dtype, x.device)
        else:  # small group (quarot 128: 32 KB in bf16): one dot, in 64-column slices
            kron_a, hc = 0, min(g, 64)
            h = hb = _unnormalized_hadamard(rot, g, x.dtype, x.device)
        bm = ROT_ROWS  # every rotated tile has ROT_ROWS rows (see _row_amax)
    else:
        h = hb = scale  # dummy pointers when ROT=False
        block_k, down_block_k, h_scale, kron_a = cfg["BLOCK_K"], cfg["DOWN_BLOCK_K"], 1.0, 0
        hc = block_k
        bm = cfg["BLOCK_M"]
    flags = {"ROT": rot != "none", "H_SCALE": h_scale, "IEEE": x.dtype == torch.float32, "KRON_A": kron_a,
             "R_PAD": max(16, triton.next_power_of_2(r)), "ROT_ROWS": ROT_ROWS}
    parts, amax_part, xa_part = 0, scale, scale  # dummy pointers without down
    if down is not None:
        dbm = cfg["DOWN_BLOCK_M"]
        if dbm % ROT_ROWS or dbm & (dbm - 1):
            raise ValueError(f"quantize_act: DOWN_BLOCK_M must be a power of two >= {ROT_ROWS}, got {dbm}")
        slice_k = triton.cdiv(cfg["DOWN_SLICE"], down_block_k) * down_block_k
        parts = triton.cdiv(k, slice_k)
        if static_scale is None:
            amax_part = torch.empty((parts, m), dtype=torch.float32, device=x.device)
        xa_part = torch.empty((parts, m, flags["R_PAD"]), dtype=torch.float32, device=x.device)
        _amax_down_kernel[(triton.cdiv(m, dbm), parts)](
            x, h, hb, down, amax_part, xa_part, m, k, slice_k, x.stride(0), r, down.stride(1), down.stride(0),
            AMAX=static_scale is None, BLOCK_M=dbm, BLOCK_K=down_block_k, HC=hc if rot != "none" else down_block_k,
            **flags, num_warps=cfg["num_warps"] if rot != "none" else cfg["down_warps"], num_stages=cfg["down_stages"])
    _quant_rows_kernel[(triton.cdiv(m, bm),)](
        x, h, hb, q, scale, static, amax_part, xa_part, xa if down is not None else scale,
        m, k, x.stride(0), q.stride(0), r, r,
        QMAX=qmax, EPS=eps, FP8=bool(is_fp8), STATIC=static_scale is not None, PARTS=parts,
        BLOCK_M=bm, BLOCK_K=block_k, HC=hc, **flags, num_warps=cfg["num_warps"], num_stages=2,
    )
    return (q, scale) if down is None else (q, scale, xa)


# ---------------------------------------------------------------------------
# custom op (fake impl: shapes only) so torch.compile keeps the kernel as one node
# ---------------------------------------------------------------------------

@torch.library.custom_op("lowbit_pipe::quantize_act", mutates_args=())
def quantize_act_op(x: torch.Tensor, mode: str, rot: str, group: int,
                    static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_act(x, mode, rot, group or None, static_scale)


@quantize_act_op.register_fake
def _(x, mode, rot, group, static_scale):
    dtype = torch.float8_e4m3fn if mode == "fp8" else torch.int8
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@torch.library.custom_op("lowbit_pipe::quantize_act_down", mutates_args=())
def quantize_act_down_op(x: torch.Tensor, mode: str, rot: str, group: int, static_scale: torch.Tensor | None,
                         down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_act_op plus the LoRA down projection xa = x @ down^T [M, R] (x's dtype) from the same read of x."""
    return quantize_act(x, mode, rot, group or None, static_scale, down=down)


@quantize_act_down_op.register_fake
def _(x, mode, rot, group, static_scale, down):
    dtype = torch.float8_e4m3fn if mode == "fp8" else torch.int8
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32),
            x.new_empty((x.shape[0], down.shape[0])))


def reference_quantize_act(x: torch.Tensor, mode: str = "int8", rot: str = "none", group: int | None = None,
                           static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch oracle of `quantize_act` (the formats' own reference functions; a static scale: one
    scale s for every row, codes clamp(round(x_rot / s), +-qmax) for int8 / int4, fp8_quantize for fp8)."""
    from lowbit_pipe.kernels import reference

    v, _ = rotation.rotate_activation(x, rot, group)
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
