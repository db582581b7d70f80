"""8-bit attention on a ComfyUI MODEL, through ComfyUI's attention override.

ComfyUI (0.29.0) wraps every attention function of comfy/ldm/modules/attention.py (`wrap_attn`): when the
model's `transformer_options` hold `optimized_attention_override`, the call goes to `override(func, *args,
**kwargs)` instead, `func` being the attention function ComfyUI picked (pytorch, sage, flash, ...). The MODEL's
`model_options["transformer_options"]` reach every attention call of its diffusion model (Krea 2's, FLUX's),
and a clone copies them (dicts and lists deep, other objects shared): set on a clone, the override rides on
that MODEL and every MODEL made from it, never on the MODEL it was cloned from.

`Attention8Override` runs sdpa8 where it serves the call (lowbit_pipe.attention.route) and ComfyUI's own `func`
elsewhere: a mask other than a boolean key-padding one, cross-attention of another length, a layer that asks for
full precision (`low_precision_attention=False`, which ComfyUI's sage attention honours too), a GPU without the kernel,
and (`blocks_only`, the recipe's attention.arch_keep) calls outside the model's repeated blocks: ComfyUI puts
`block_index` in the transformer_options of every block's attention call, and Krea 2's text fusion, which the
diffusers side keeps by module name, calls without it.
Purge drops it: off the MODEL it is given, and marked purged, so any other MODEL still carrying it (ComfyUI's
cache) refuses to sample, naming the node, rather than silently compute in 16 bits; the node re-runs on the
next queue (its purge count moves); cuDNN's runner is closed.

On a CUDA MODEL a call it serves goes through the same per-shape router as the diffusers side
(lowbit_pipe.attention.crossover: cuDNN's FP8 kernel for fp8, the Triton kernel, or ComfyUI's own function
where that is faster, measured once per shape and cached): the Triton kernel alone gained nothing over
ComfyUI's attention at Krea 2's 1024² on an H100 (a whole step, within noise either way) and runs 0.22x of bf16
attention at 512². Eager calls take ComfyUI's own function where the router picks the model's attention;
under torch.compile a routed call is the router's custom op, whose model's attention is torch SDPA.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from lowbit_pipe.attention.crossover import routed_attention_op
from lowbit_pipe.attention.route import STOCK, attend8, count_call, format_problem, route_call, traced_counting
from lowbit_pipe.comfy.node_runs import PURGES, PurgedModelError
from lowbit_pipe.kernels.dispatch import compiling

OVERRIDE_KEY = "optimized_attention_override"


class Attention8Override:
    """ComfyUI's `optimized_attention_override` callable: on a CUDA MODEL the 8-bit path its router picks per call
    shape, elsewhere sdpa8 in `qk_format`; ComfyUI's own function where neither serves or is faster."""

    # ComfyUI's `enable_gqa` keyword is honoured (k / v with fewer heads than q): the fused Krea 2 attention
    # (lowbit_pipe.attention.comfy_fused) hands them over ungrouped only to an override that says so
    takes_enable_gqa = True

    def __init__(self, qk_format: str, made_by: str, node_id: str | None = None, blocks_only: bool = True,
                 device: torch.device | None = None, route: str = "auto", speed_cache: str | None = None,
                 router: Any = None) -> None:
        """`device`: the MODEL's load device; on CUDA the calls are routed (`route`, `speed_cache`: the recipe's
        attention.route and quantize.speed_cache). `router`: one made by the caller instead (tests)."""
        problem = format_problem(qk_format, stock=False)
        if problem is not None:
            raise ValueError(f"{made_by}: 8-bit attention's format {problem}")
        self.qk_format = qk_format
        self.made_by = made_by
        self.node_id = node_id
        self.blocks_only = blocks_only
        self.calls: Counter = Counter()
        self.purged: str | None = None
        self.count_key = traced_counting(self.calls)
        self.notes: list[str] = []
        self.router, self.cudnn = router, None
        if router is None and device is not None and device.type == "cuda":
            from lowbit_pipe.attention.processors import device_router

            if device.index is None:  # compared with the calls' tensors' devices, which carry an index
                device = torch.device("cuda", torch.cuda.current_device())
            self.router, self.cudnn = device_router(qk_format, device, route, speed_cache, path=f"{made_by}: attention",
                                                    notes=self.notes, calls=self.calls)

    def __call__(self, func: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 heads: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.purged is not None:
            raise PurgedModelError(f"this MODEL carries the 8-bit attention of {self.made_by}, {self.purged}. Queue "
                                   "the workflow again: that node re-runs by itself")
        why, qkv, key_mask = self._route(q, k, v, heads, args, kwargs)
        router = self.router if why is None and self.router is not None and qkv[0].device == self.router.device \
            else None
        if router is not None and compiling():  # picked, counted and run when the graph runs
            out = routed_attention_op(*_repeat_kv(*qkv), kwargs.get("scale"), key_mask, router.key)
        else:
            path = self.qk_format
            if router is not None:
                path, why = router.pick(qkv[0], key_mask is not None)
            if why is not None:  # ComfyUI's function, with k / v as given (enable_gqa: ungrouped)
                count_call(self.calls, f"stock: {why}", self.count_key)
                return func(q, k, v, heads, *args, **kwargs)
            count_call(self.calls, path, self.count_key)
            if router is not None:
                out = router.runner(path)(*_repeat_kv(*qkv), kwargs.get("scale"), key_mask)
            else:
                out = attend8(*_repeat_kv(*qkv), self.qk_format, kwargs.get("scale"), key_mask)  # [B, H, N, D]
        if kwargs.get("skip_output_reshape", False):
            return out
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    def _route(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, args: tuple,
               kwargs: dict[str, Any]) -> tuple[str | None, tuple[torch.Tensor, ...], torch.Tensor | None]:
        """(why ComfyUI's own function runs this call, or None; q, k, v as [B, H, N, D]; the key mask sdpa8 takes)."""
        if args:
            return "positional arguments past heads", (), None
        if self.blocks_only and "block_index" not in (kwargs.get("transformer_options") or {}):
            return "outside the model's blocks (attention.arch_keep: Krea 2's text fusion)", (), None
        if kwargs.get("low_precision_attention", True) is False:
            return "the layer asks for full precision", (), None
        if kwargs.get("skip_reshape", False):  # [B, H, N, D]
            if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
                return "q, k, v not [B, H, N, D]", (), None
            if kwargs.get("enable_gqa", False) and 0 < k.shape[1] != q.shape[1] and q.shape[1] % k.shape[1] == 0 \
                    and k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]:
                # grouped k / v heads: routed by their shape as if repeated (the repeat, a copy of k and v at
                # q's head count, is made only for the 8-bit kernels: ComfyUI's function takes them as they are)
                if k.dtype != q.dtype or v.dtype != q.dtype:
                    return "q, k, v of different dtypes", (), None
                why, key_mask = route_call(q, q, q, mask=kwargs.get("mask"))
                return why, (q, k, v), key_mask
        else:  # [B, N, H * D]
            if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape or q.shape[-1] % heads:
                return "q, k, v of different shapes (cross-attention)", (), None
            b, n, width = q.shape
            q, k, v = (t.reshape(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        why, key_mask = route_call(q, k, v, mask=kwargs.get("mask"))
        return why, (q, k, v), key_mask

    def purge(self, when: str) -> None:
        self.purged = f"purged by Purge (lowbit_pipe) at {when}"
        if self.cudnn is not None:  # its graphs, workspaces and handles
            self.cudnn.close()
        PURGES.bump(self.node_id)


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, H, N, D] with k / v's heads repeated to q's where they have fewer (grouped-query attention)."""
    if k.shape[1] == q.shape[1]:
        return q, k, v
    groups = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def override_of(model: Any) -> Attention8Override | None:
    """The 8-bit attention override a MODEL carries (None: none, or another pack's override)."""
    found = getattr(model, "model_options", {}).get("transformer_options", {}).get(OVERRIDE_KEY)
    return found if isinstance(found, Attention8Override) else None


def with_attention8(model: Any, qk_format: str, made_by: str, node_id: str | None = None,
                    blocks_only: bool = True, route: str = "auto", speed_cache: str | None = None) -> Any:
    """A clone of `model` carrying 8-bit attention ("bf16": a plain clone, without ours). The MODEL given is
    untouched; another attention override already on it (a pack's) is refused rather than silently replaced.
    `blocks_only`: calls outside the model's repeated blocks keep ComfyUI's attention; `route`, `speed_cache`: the
    per-shape router's settings on a CUDA MODEL (Attention8Override)."""
    current = getattr(model, "model_options", {}).get("transformer_options", {}).get(OVERRIDE_KEY)
    if current is not None and not isinstance(current, Attention8Override):
        raise ValueError(f"{made_by}: this MODEL already carries an attention override ({current!r}, another node "
                         "pack's): 8-bit attention would replace it. Apply one of the two")
    out = model.clone()
    options = out.model_options.setdefault("transformer_options", {})
    options.pop(OVERRIDE_KEY, None)
    if qk_format != STOCK:
        device = getattr(model, "load_device", None)
        options[OVERRIDE_KEY] = Attention8Override(qk_format, made_by, node_id, blocks_only,
                                                   device if isinstance(device, torch.device) else None, route,
                                                   speed_cache)
    return out


def drop_attention8(model: Any, when: str) -> Attention8Override | None:
    """Purge's part: the override off this MODEL's options, and marked purged (other MODELs still holding it
    refuse to sample). Returns it, or None when the MODEL carried none."""
    found = override_of(model)
    if found is None:
        return None
    model.model_options["transformer_options"].pop(OVERRIDE_KEY, None)
    found.purge(when)
    return found
