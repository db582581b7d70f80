"""8-bit attention on a live model: the recipe's `attention:` section (lowbit_pipe.kernels.attention8's sdpa8, or
on Hopper+ cuDNN's FP8 attention, in place of the model's scaled dot-product attention). `route` decides, call by
call, whether 8-bit attention can serve a call; `crossover` which kernel does on a GPU (or the model's own, where
faster at the call's shape); `processors` applies it to a diffusers model through its attention processors,
recorded in the ledger. ComfyUI's side is lowbit_pipe.comfy.attention (the MODEL's attention override)."""

from __future__ import annotations

from lowbit_pipe.attention.processors import AppliedAttention, apply_attention
from lowbit_pipe.attention.route import ATTENTION_FORMATS, STOCK

__all__ = ["ATTENTION_FORMATS", "STOCK", "AppliedAttention", "apply_attention"]
