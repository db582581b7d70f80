"""The attention step: the Plan's attention format (and the recipe's attention.fused_norm_rope) on the live model,
every swap through the ledger: report.json's `attention`.

A step of the quantize stage rather than a stage of the pipeline: it runs right after the Plan's layers are in
place and before quantize.target's whole-forward check, whose predicted time and error include the attention, and
a recipe's `pipeline:` stays as it was. What it applies depends on the model: a diffusers model gets 8-bit
attention processors (lowbit_pipe.attention.swapper) and the fused norm / RoPE kernels of lowbit_pipe.attention.fused;
a natively named model (ComfyUI's) gets ComfyUI's own norms / RoPE fused (lowbit_pipe.attention.comfy_fused), its
8-bit attention being ComfyUI's attention override, which the node pack sets on the MODEL from the same Plan; a
streamed run has no model in memory and applies nothing.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from lowbit_pipe.attention.swapper import AttentionSwapper
from lowbit_pipe.plan.plan import AttentionChoice
from lowbit_pipe.stages.context import Context

STREAMED_NOTE = "a streamed run has no model in memory; the attention format is run time only (exports never carry it)"
NATIVE_NOTE = "natively named model (ComfyUI's): the node pack sets ComfyUI's attention override on the MODEL"


def fused_norm_rope_idle(model: nn.Module) -> str | None:
    """Why attention.fused_norm_rope changes nothing a forward computes on this model (its kernels serve CUDA tensors
    only: lowbit_pipe.kernels.norm_rope.kernel_serves), or None when it can."""
    p = next(model.parameters(), None)
    if p is None or p.device.type == "cuda":
        return None
    return (f"its kernels run on CUDA only and the model is on {p.device.type}, so the norms and RoPE run torch's "
            "code, as without it (model.device=cuda uses them)")


def _native(ctx: Context, choice: AttentionChoice, by: dict[str, str]) -> dict[str, Any]:
    """A natively named model: ComfyUI's own norms / RoPE fused when the recipe asks; its 8-bit attention is the
    node pack's override."""
    out = {"format": choice.format, **by} if choice.stock else {"format": choice.format, "applied": False,
                                                                  "note": NATIVE_NOTE}
    if ctx.recipe.attention.fused_norm_rope:
        from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope

        fused = apply_comfy_fused_norm_rope(ctx.transformer, ctx.ledger)
        out["fused_norm_rope"] = fused.as_dict()
        if not fused.norms and not fused.ropes:
            warnings.warn("attention.fused_norm_rope: no ComfyUI norm or attention module of a known class "
                          "(Krea 2, FLUX.1, Qwen-Image, comfy.ops RMSNorm) in this natively named model", stacklevel=3)
    return out


def _fused(ctx: Context) -> dict[str, Any]:
    """attention.fused_norm_rope on a diffusers model (before the 8-bit processors, which then build on these:
    processors.rebound_class); {} when the recipe does not ask."""
    if not ctx.recipe.attention.fused_norm_rope:
        return {}
    from lowbit_pipe.attention.fused import apply_fused_norm_rope

    fused = {"fused_norm_rope": apply_fused_norm_rope(ctx.transformer, ctx.ledger).as_dict()}
    idle = fused_norm_rope_idle(ctx.transformer)
    if idle is not None:  # applied (and undone by teardown) all the same: a model moved to a GPU later uses it
        fused["fused_norm_rope"]["note"] = idle
        warnings.warn(f"attention.fused_norm_rope=true did nothing in this run: {idle}", stacklevel=3)
    return fused


def apply_planned_attention(ctx: Context, choice: AttentionChoice) -> dict[str, Any]:
    """The Plan's attention (`choice`) on the run's transformer: report.json's `attention` (`chosen_by` named where
    quantize.target chose it). The applied handle goes on ctx.attention until teardown."""
    by = {"chosen_by": choice.chosen_by} if choice.chosen_by != "attention.format" else {}
    if choice.stock and not ctx.recipe.attention.fused_norm_rope:
        return {"format": choice.format, **by}
    if ctx.stream is not None:
        return {"format": choice.format, "applied": False, "note": STREAMED_NOTE}
    if ctx.native:
        return _native(ctx, choice, by)
    fused = _fused(ctx)
    if choice.stock:
        return {"format": choice.format, **by, **fused}
    applied = AttentionSwapper.for_recipe(ctx.recipe, ctx.arch).apply(ctx.transformer, choice.format, ctx.ledger)
    ctx.attention = applied
    ctx.ledger.record("attention8", "the run's 8-bit attention handle", lambda: setattr(ctx, "attention", None),
                      check=lambda: True if ctx.attention is None else "still set")
    if not applied.modules:
        why = next(iter(applied.kept.values()), "no diffusers attention module (a ComfyUI model takes the 8-bit "
                                                "attention node's override instead)")
        warnings.warn(f"attention.format={choice.format}: no attention module got 8-bit attention ({why})",
                      stacklevel=2)
    return {**applied.as_dict(), "applied": bool(applied.modules), **by, **fused}


__all__ = ["apply_planned_attention", "fused_norm_rope_idle"]
