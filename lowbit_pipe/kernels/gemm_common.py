"""What the scaled Triton GEMMs share (int8_gemm, fp8_gemm with its 16-bit twin float_gemm, nvfp4_gemm): the
launcher, the grouped tile order, the epilogue (scales, bias, low-rank term) as Triton helpers, its argument
checks, and its torch oracle.

    y[m, n] = acc[m, n] * a_scale[m] * w_scale[n or scalar] (+ bias[n]) (+ (xa @ up_t)[m, n])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def launch_gemm(tuned, kernel, args: tuple, flags: dict, m: int, n: int, config: dict | None, on_cuda: bool) -> None:
    """Launch a tiled GEMM kernel: autotuned on CUDA, or with one fixed config (given, or the
    interpreter's: CPU tensors only reach a Triton kernel under TRITON_INTERPRET in tests, and the
    autotuner needs a GPU driver to time configs)."""
    if config is None and not on_cuda:
        config = INTERPRETER_CONFIG
    if config is None:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        tuned[grid](*args, **flags)
        return
    cfg = dict(config)
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    cfg.setdefault("GROUP_M", 8)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    kernel[grid](*args, **flags, **cfg, num_warps=warps, num_stages=stages)


def m_bucket(m: int) -> int:
    """Autotune key for M: powers of 4 from 64 up, so nearby token counts share a tuning."""
    b = 64
    while b < m and b < 16384:
        b *= 4
    return b


INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row-tiles share each
    column-tile while it is in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + ((pid % group) % size_m), (pid % group) // size_m


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile of the TMA GEMMs (grouped order): (first row, first column, its row offsets, its
    column offsets, which rows are in range, which columns are in range)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    return off_m, off_n, offs_m, offs_n, offs_m < M, offs_n < N


def tma_launch_config(m: int, itemsize: int = 1) -> dict:
    """Tiles of the TMA GEMMs (fp8, and int8 with int8 weights: their wgmma shapes are the same). 128x256x128,
    8 warps, 3 stages: fastest of the tiles swept on the H200 at M=4608, with and without the branch, at all
    four Krea 2 shapes (bench/results/fp8_lora_gemm_h200.md). Fewer rows take smaller tiles so the grid still
    covers the SMs: 128x128 (one warpgroup) up to M=1024, 64x128 up to M=64 (the time embedding, a batch of one).
    Wider operands (`itemsize` bytes: 2 for bf16 / fp16) take a K tile as many times shorter, so a pipeline
    stage holds the same bytes (128x256x128 in bf16 would not fit in shared memory)."""
    bk = 128 // itemsize
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4}
    if m <= 1024:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": bk, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": bk, "num_warps": 8, "num_stages": 3}


def launch_tma_gemm(kernel, a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, config: dict | None,
                    args: tuple, flags: dict) -> None:
    """Launch a TMA GEMM kernel(a_desc, b_desc, c, *args, **flags, tiles) over c [M, N] = a [M, K] x w [N, K]^T,
    on `config`'s tiles or `tma_launch_config`'s."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = a.shape, w.shape[0]
    cfg = dict(config or tma_launch_config(m, a.element_size()))
    warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    cfg.setdefault("GROUP_M", 8)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    kernel[grid](a_desc, b_desc, c, *args, **flags, **cfg, num_warps=warps, num_stages=stages)


@triton.jit
def scaled_tile(acc, as_ptr, bs_ptr, bias_ptr, offs_m, offs_n, m_ok, n_ok, B_SCALAR: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """acc (fp32) * a_scale[rows] * w_scale[cols or scalar] (+ bias[cols]): the torch reference's order."""
    y = acc * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    if B_SCALAR:
        y = y * tl.load(bs_ptr)
    else:
        y = y * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def low_rank_tile(acc, xa_ptr, up_ptr, offs_m, offs_n, m_ok, n_ok, R, stride_xam, stride_xar, stride_ur, stride_un,
                  R_PAD: tl.constexpr, LORA_IEEE: tl.constexpr):
    """acc + xa[tile rows, :R] @ up_t[:R, tile cols] (fp32 accumulate; R padded to R_PAD, masked)."""
    offs_r = tl.arange(0, R_PAD)
    r_ok = offs_r < R
    xa = tl.load(xa_ptr + offs_m[:, None] * stride_xam + offs_r[None, :] * stride_xar,
                 mask=m_ok[:, None] & r_ok[None, :], other=0.0)
    up = tl.load(up_ptr + offs_r[:, None] * stride_ur + offs_n[None, :] * stride_un,
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)
    if LORA_IEEE:  # fp32 factors: true fp32 products (the GPU default would be tf32)
        return tl.dot(xa, up, acc, input_precision="ieee")
    return tl.dot(xa, up, acc)


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class EpilogueArgs:
    """The checked operands of a scaled GEMM's epilogue (this GEMM and fp8_gemm), in kernel order:
    `pointers` = (a_scale, w_scale, bias, xa, up_t) with dummies where absent, `lora_strides` =
    (xa rows, xa cols, up_t rows, up_t cols), `flags` = the matching constexprs."""
    pointers: tuple[torch.Tensor, ...]
    r: int
    lora_strides: tuple[int, int, int, int]
    flags: dict


def epilogue_args(op: str, m: int, n: int, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, xa: torch.Tensor | None, up_t: torch.Tensor | None) -> EpilogueArgs:
    """a_scale fp32 [M] / [M, 1], w_scale [N] / [N, 1] / scalar, bias [N], xa [M, R] and up_t [R, N]
    (one float dtype, R <= 128, both or neither): checked, each error naming `op` and the operand."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    a_scale = a_scale.reshape(-1).float().contiguous()
    if a_scale.numel() != m:
        raise ValueError(f"{op}: a_scale has {a_scale.numel()} values for {m} rows")
    b_scalar = w_scale.numel() == 1
    w_scale = w_scale.reshape(-1).float().contiguous()
    if not b_scalar and w_scale.numel() != n:
        raise ValueError(f"{op}: w_scale has {w_scale.numel()} values for {n} columns")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"{op}: bias has {bias.numel()} values for {n} columns")
    if (xa is None) != (up_t is None):
        raise ValueError(f"{op}: the low-rank term needs both xa and up_t")
    r = 0
    if xa is not None:
        r = xa.shape[1] if xa.dim() == 2 else -1
        if xa.dim() != 2 or up_t.dim() != 2 or xa.shape[0] != m or tuple(up_t.shape) != (r, n):
            raise ValueError(f"{op}: low-rank term wants xa [{m}, R] and up_t [R, {n}], "
                             f"got {tuple(xa.shape)} and {tuple(up_t.shape)}")
        if xa.dtype not in OUT_DTYPES or up_t.dtype != xa.dtype:
            raise ValueError(f"{op}: xa and up_t must share one float dtype, got {xa.dtype} and {up_t.dtype}")
        if r > 128:
            raise ValueError(f"{op}: low-rank term takes R <= 128, got {r}")
    has_lora = xa is not None and r > 0
    bias_arg = bias.contiguous() if bias is not None else a_scale  # dummy pointers when absent
    xa_arg, up_arg = (xa, up_t) if has_lora else (a_scale, a_scale)
    strides = (xa.stride(0), xa.stride(1), up_t.stride(0), up_t.stride(1)) if has_lora else (0, 0, 0, 0)
    flags = {"B_SCALAR": b_scalar, "HAS_BIAS": bias is not None, "HAS_LORA": has_lora,
             "R_PAD": max(16, triton.next_power_of_2(r)) if has_lora else 16,
             "LORA_IEEE": has_lora and xa.dtype == torch.float32}
    return EpilogueArgs((a_scale, w_scale, bias_arg, xa_arg, up_arg), r, strides, flags)


def reference_epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, xa: torch.Tensor | None, up_t: torch.Tensor | None) -> torch.Tensor:
    """The scaled GEMMs' epilogue in torch (their oracles): acc * a_scale * w_scale (+ bias) (+ xa @ up_t)."""
    ws = w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(1, -1)
    y = acc * a_scale.float().reshape(-1, 1) * ws
    if bias is not None:
        y = y + bias.float()
    if xa is not None:
        y = y + xa.float() @ up_t.float()
    return y.to(out_dtype)
