"""Torch reference kernels: exact emulation of the quantized math, run anywhere."""

from __future__ import annotations

import torch


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (per-row) symmetric int8: returns (codes int8, scale fp32 [rows, 1])."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / 127.0
    codes = torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8)
    return codes, scale


def int8_linear(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8: dynamic per-token int8 activations times int8 weight, int32-exact accumulate in fp64-free math.

    Products of int8 codes summed in float32 are exact while |sum| < 2^24, which
    holds for K <= 1040 worst case; beyond that we accumulate in int64 on CPU.
    """
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_rows_int8(x2)
    acc = (xq.to(torch.int64) @ w_codes.to(torch.int64).t()).to(torch.float32)
    y = acc * xs * w_scale.reshape(1, -1) if w_scale.numel() > 1 else acc * xs * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], w_codes.shape[0])
