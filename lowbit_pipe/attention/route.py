"""Which attention calls 8-bit attention serves, and the call itself in [B, H, N, D].

sdpa8 computes softmax(q kᵀ * scale) v with no dropout, queries and keys of one length and one head count, and
at most a key-padding mask: a boolean mask that leaves out whole keys, the same for every head and query
([B, 1, 1, N], [B, 1, N] or [B, N]; diffusers' Krea 2 always passes one for its padded text tokens). A call
outside that (another mask, cross-attention of another length, dropout) runs the model's own attention instead,
and says why (`route_call`): nothing is approximated that sdpa8 does not compute. On a CUDA device where the
Triton kernel does not run (before Hopper, a head dim other than 64 / 128) the call runs the model's own
attention too: sdpa8's torch reference there is the kernel's oracle, not a fast path. On the CPU sdpa8's
reference runs (what the error measurements and the tests use). On a GPU, which 8-bit kernel serves a call
`call_form` admits -- cuDNN's FP8 attention, the Triton kernel, or neither where the model's own attention is
faster at the call's shape -- is lowbit_pipe.attention.crossover's choice.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch

from lowbit_pipe.recipe import ATTENTION_FORMATS
from lowbit_pipe.recipe import STOCK_ATTENTION as STOCK

NO_KERNEL = "no 8-bit attention kernel for this GPU / head dim (Hopper, head dim 64 or 128)"


def format_problem(attention_format: object, stock: bool = True) -> str | None:
    """What is wrong with an attention format (attention.format, quantize.target.attention[i], the 8-bit attention
    node's input; `stock`: whether the model's own attention is one), or None: the one check of every such key."""
    known = ATTENTION_FORMATS if stock else tuple(f for f in ATTENTION_FORMATS if f != STOCK)
    if attention_format not in known:
        return f"must be one of {', '.join(known)}, got {attention_format!r}"
    return None


def kernel_head_dims(device: torch.device) -> tuple[int, ...]:
    """The head dims the Triton kernel serves on `device` (none before Hopper, or off CUDA)."""
    if device.type != "cuda":
        return ()
    from lowbit_pipe.kernels.attention8 import GPU_CONFIGS

    return tuple(GPU_CONFIGS) if torch.cuda.get_device_capability(device) >= (9, 0) else ()


def key_padding(mask: Any, batch: int, keys: int) -> torch.Tensor | None:
    """`mask` as a [batch, keys] boolean key mask (True = attend), or None when it is not a key-padding mask."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or not 2 <= mask.dim() <= 4:
        return None
    if mask.shape[-1] != keys or mask.shape[0] not in (1, batch) or any(s != 1 for s in mask.shape[1:-1]):
        return None
    return mask.reshape(mask.shape[0], keys).expand(batch, keys)


def route_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, head_dims: tuple[int, ...] | None = None
               ) -> tuple[str | None, torch.Tensor | None]:
    """(why this [B, H, N, D] call runs the model's own attention, None when sdpa8 serves it; `mask` as the
    [B, N] key mask sdpa8 takes, or None). `head_dims`: what `kernel_head_dims` says for q's device, looked up
    once by a caller that torch.compile traces (None: here)."""
    why, key_mask = call_form(q, k, v, mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    if why is None and q.is_cuda and q.shape[-1] not in (head_dims if head_dims is not None
                                                         else kernel_head_dims(q.device)):
        return NO_KERNEL, None
    return why, key_mask


def call_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False) -> tuple[str | None, torch.Tensor | None]:
    """`route_call` without the kernel's device and head-dim check: (why no 8-bit attention computes this call,
    None when one can; the [B, N] key mask). Which 8-bit kernel, if any, serves it on a GPU is the router's
    choice (lowbit_pipe.attention.crossover)."""
    key_mask = None
    if mask is not None:
        key_mask = key_padding(mask, q.shape[0], k.shape[-2]) if q.dim() == 4 else None
        if key_mask is None:
            return "attention mask other than a boolean key-padding mask", None
    if dropout_p:
        return "dropout", None
    if is_causal:
        return "causal mask", None
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        return "q, k, v of different shapes (cross-attention or grouped heads)", None
    if q.dtype != k.dtype or q.dtype != v.dtype or not q.is_floating_point():
        return "q, k, v of different dtypes", None
    return None, key_mask



# Counters a traced call counts into, by key: dynamo's constant results (assume_constant_result) take constant
# arguments only, which an int and a str are and a Counter is not (torch 2.11 refuses it while tracing). Weak
# values: a counter goes when its dispatch or override does.
_TRACED_COUNTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _count_traced(key: int, path: str) -> bool:
    calls = _TRACED_COUNTERS.get(key)  # runs once, when dynamo traces the call: the graph holds the constant True
    if calls is not None:
        calls[path] += 1
    return True


def traced_counting(calls: Counter) -> int:
    """Mark `_count_traced` for dynamo (torch._dynamo.assume_constant_result: called at trace time, its result a
    constant) and register `calls`; returns the key `count_call` takes. Called by whatever will count calls (the
    8-bit dispatch, ComfyUI's override), not at import: importing torch._dynamo costs ~1 s, which a run without
    8-bit attention should not pay."""
    import torch._dynamo

    torch._dynamo.assume_constant_result(_count_traced)
    _TRACED_COUNTERS[id(calls)] = calls
    return id(calls)


def count_call(calls: Counter, path: str, key: int) -> None:
    """Count one attention call on `path` ("int8", "stock: <why>", ...). Under torch.compile it is counted once,
    when the graph is traced, as "<path> (traced)": a count the graph updated on every call would make dynamo
    guard on its value and recompile each time, until its limit sent the model back to eager. `key`: what
    `traced_counting(calls)` returned."""
    if torch.compiler.is_compiling():
        _count_traced(key, f"{path} (traced)")
    else:
        calls[path] += 1


def attend8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str, scale: float | None,
            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """sdpa8 on [B, H, N, D] tensors (any strides), `key_mask` [B, N] as `route_call` gives it: [B, H, N, D] in
    q's dtype."""
    from lowbit_pipe.kernels.attention8 import sdpa8

    return sdpa8(q, k, v, qk_format=qk_format, sm_scale=scale, key_mask=key_mask)
