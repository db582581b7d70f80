"""Triton FP8 GEMM: e4m3 activations x e4m3 weight -> fp32, scaled epilogue with an optional
low-rank term (the LoRA residual), for the fp8 format on Hopper.

    y[m, n] = acc[m, n] * a_scale[m] * w_scale[n or scalar] (+ bias[n]) (+ sum_r xa[m, r] * up_t[r, n]),
    acc = sum_k a[m, k] * w[n, k]

Why not only cuBLAS (`torch._scaled_mm`): it has no epilogue hook, so a LoRA branch would cost
one more pass over y (`addmm_`, 8-27 % of the linear at Krea 2 shapes on the H200). Here the
branch is one more tl.dot on the fp32 tile before the output cast, as in int8_gemm.

Operands are read through TMA tensor descriptors (out-of-range rows / columns / K come back as
zeros, so the K loop needs no masks; masked pointer loads of fp8 ran 1.45x slower on the H200).

Accumulation (`PROMOTE`): Hopper's fp8 tensor cores keep a reduced-precision accumulator.
- 0: the whole K in it (Triton's sm90 default; cuBLAS's "fast accumulation").
- 1: each K tile's partial sum promoted to the fp32 accumulator (max_num_imprecise_acc).
- P > 1: a second register accumulator, added into the fp32 one every P K tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lowbit_pipe.kernels.int8_gemm import OUT_DTYPES, grouped_tile


@triton.jit
def _fp8_gemm_kernel(
    a_desc, b_desc, c_ptr, as_ptr, bs_ptr, bias_ptr, xa_ptr, up_ptr,
    M, N, K, R,
    stride_cm, stride_cn, stride_xam, stride_xar, stride_ur, stride_un,
    B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
    LORA_IEEE: tl.constexpr, LORA_INIT: tl.constexpr, PROMOTE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA and LORA_INIT:  # the branch in the accumulator's units: acc0 = (xa @ up_t) / (a_scale w_scale)
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        xa = tl.load(xa_ptr + offs_m[:, None] * stride_xam + offs_r[None, :] * stride_xar,
                     mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        up = tl.load(up_ptr + offs_r[:, None] * stride_ur + offs_n[None, :] * stride_un,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if LORA_IEEE:
            acc = tl.dot(xa, up, input_precision="ieee")
        else:
            acc = tl.dot(xa, up)
        acc = acc * (1.0 / tl.load(as_ptr + offs_m, mask=m_ok, other=1.0))[:, None]
        if B_SCALAR:
            acc = acc * (1.0 / tl.load(bs_ptr))
        else:
            acc = acc * (1.0 / tl.load(bs_ptr + offs_n, mask=n_ok, other=1.0))[None, :]
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_k = tl.cdiv(K, BLOCK_K)
    for i in range(0, n_k):
        a = a_desc.load([off_m, i * BLOCK_K])
        b = b_desc.load([off_n, i * BLOCK_K])
        if PROMOTE == 0:
            acc = tl.dot(a, b.T, acc)
        elif PROMOTE == 1:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            part = tl.dot(a, b.T, part)
            if i % PROMOTE == PROMOTE - 1:
                acc += part
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PROMOTE > 1:
        acc += part

    y = acc * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
    if B_SCALAR:
        y = y * tl.load(bs_ptr)
    else:
        y = y * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA and not LORA_INIT:  # low-rank epilogue: y += xa[tile rows] @ up_t[:, tile cols], fp32 accumulate
        offs_r = tl.arange(0, R_PAD)
        r_ok = offs_r < R
        xa = tl.load(xa_ptr + offs_m[:, None] * stride_xam + offs_r[None, :] * stride_xar,
                     mask=m_ok[:, None] & r_ok[None, :], other=0.0)
        up = tl.load(up_ptr + offs_r[:, None] * stride_ur + offs_n[None, :] * stride_un,
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        if LORA_IEEE:
            y = tl.dot(xa, up, y, input_precision="ieee")
        else:
            y = tl.dot(xa, up, y)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
             xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None,
             config: dict | None = None, promote: int = 0, lora_init: bool = False) -> torch.Tensor:
    """a e4m3 [M, K], w e4m3 [N, K] (both K-contiguous, K % 16 == 0), a_scale fp32 [M] / [M, 1],
    w_scale fp32 [N] / [N, 1] / scalar -> out_dtype [M, N]; `xa` [M, R] and `up_t` [R, N] (one float
    dtype, R <= 128): out += xa @ up_t in fp32 before the output cast."""
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(f"fp8_gemm: expected 2-D a and w, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: expected float8_e4m3fn a and w, got {a.dtype} and {w.dtype}")
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"fp8_gemm: K mismatch, a has {k}, w has {w.shape[1]}")
    if k % 16 or a.stride(1) != 1 or w.stride(1) != 1 or a.stride(0) % 16 or w.stride(0) % 16:
        raise ValueError(f"fp8_gemm: TMA needs K-contiguous operands with 16-byte aligned rows, got K={k}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"fp8_gemm: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    a_scale = a_scale.reshape(-1).float().contiguous()
    if a_scale.numel() != m:
        raise ValueError(f"fp8_gemm: a_scale has {a_scale.numel()} values for {m} rows")
    b_scalar = w_scale.numel() == 1
    w_scale = w_scale.reshape(-1).float().contiguous()
    if not b_scalar and w_scale.numel() != n:
        raise ValueError(f"fp8_gemm: w_scale has {w_scale.numel()} values for {n} columns")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"fp8_gemm: bias has {bias.numel()} values for {n} columns")
    if (xa is None) != (up_t is None):
        raise ValueError("fp8_gemm: the low-rank epilogue needs both xa and up_t")
    r = 0
    if xa is not None:
        r = xa.shape[1] if xa.dim() == 2 else -1
        if xa.dim() != 2 or up_t.dim() != 2 or xa.shape[0] != m or tuple(up_t.shape) != (r, n):
            raise ValueError(f"fp8_gemm: low-rank epilogue wants xa [{m}, R] and up_t [R, {n}], "
                             f"got {tuple(xa.shape)} and {tuple(up_t.shape)}")
        if xa.dtype not in OUT_DTYPES or up_t.dtype != xa.dtype:
            raise ValueError(f"fp8_gemm: xa and up_t must share one float dtype, got {xa.dtype} and {up_t.dtype}")
        if r > 128:
            raise ValueError(f"fp8_gemm: low-rank epilogue takes R <= 128, got {r}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    cfg = dict(config or DEFAULT_CONFIG)
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.setdefault("GROUP_M", 8)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [bn, bk])
    bias_arg = bias.contiguous() if bias is not None else a_scale  # dummy pointer when HAS_BIAS=False
    has_lora = xa is not None and r > 0
    xa_arg, up_arg = (xa, up_t) if has_lora else (a_scale, a_scale)
    lora_strides = (xa.stride(0), xa.stride(1), up_t.stride(0), up_t.stride(1)) if has_lora else (0, 0, 0, 0)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](
        a_desc, b_desc, c, a_scale, w_scale, bias_arg, xa_arg, up_arg, m, n, k, r,
        c.stride(0), c.stride(1), *lora_strides,
        B_SCALAR=b_scalar, HAS_BIAS=bias is not None, HAS_LORA=has_lora,
        R_PAD=max(16, triton.next_power_of_2(r)) if has_lora else 16,
        LORA_IEEE=has_lora and xa.dtype == torch.float32, LORA_INIT=lora_init, PROMOTE=promote,
        **cfg, num_warps=warps, num_stages=stages)
    return c


DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


def reference_fp8_gemm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                       xa: torch.Tensor | None = None, up_t: torch.Tensor | None = None) -> torch.Tensor:
    """Torch oracle of `fp8_gemm`: e4m3 products are exact in fp32; the sum runs in float64."""
    acc = (a.double() @ w.double().t()).float()
    ws = w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(1, -1)
    y = acc * a_scale.float().reshape(-1, 1) * ws
    if bias is not None:
        y = y + bias.float()
    if xa is not None:
        y = y + xa.float() @ up_t.float()
    return y.to(out_dtype)
