"""evaluate: model output of the quantized model against the float model on seeded inputs."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from lowbit_pipe.context import Context
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage


@contextlib.contextmanager
def float_reference(ctx: Context) -> Iterator[None]:
    """Temporarily put the float originals of every swapped layer back (exact reference, no copy)."""
    root = ctx.transformer
    swapped = []
    try:
        for name in ctx.ledger.swapped():
            original = ctx.ledger.original(name)
            if original is None:
                raise RuntimeError(f"no float original of '{name}' (quantize.originals=drop): cannot evaluate")
            parent, attr = (root.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) if "." in name else (root, name)
            quantized = getattr(parent, attr)
            device = next(quantized.buffers()).device
            original_device = next(original.parameters()).device
            setattr(parent, attr, original.to(device))
            swapped.append((parent, attr, quantized, original, original_device))
        yield
    finally:
        for parent, attr, quantized, original, original_device in reversed(swapped):
            original.to(original_device)
            setattr(parent, attr, quantized)


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    ref, out = ref.double().flatten(), out.double().flatten()
    err = (out - ref).norm()
    return {
        "rel_error": float(err / ref.norm().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(ref, out, dim=0)),
        "max_abs_error": float((out - ref).abs().max()),
    }


@register
class Evaluate(Stage):
    name = "evaluate"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.evaluate
        if ctx.arch is None:
            result = {"skipped": "no example inputs for an unknown architecture"}
        elif not ctx.ledger.swapped():
            result = {"skipped": "nothing was quantized in this run (no float reference to compare against)"}
        else:
            result = self._measure(ctx)
        ctx.report["evaluate"] = result
        return result

    def _measure(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.evaluate
        model, arch = ctx.transformer, ctx.arch
        refs, outs = [], []
        with torch.inference_mode():
            for i in range(cfg.samples):
                gen = torch.Generator().manual_seed(cfg.seed + i)
                inputs = arch.example_inputs(ctx.model_config, batch=cfg.batch, image_tokens=cfg.image_tokens,
                                             text_tokens=cfg.text_tokens, generator=gen, dtype=ctx.dtype, device=ctx.device)
                outs.append(arch.output_tensor(model(**inputs)).float().cpu())
                with float_reference(ctx):
                    refs.append(arch.output_tensor(model(**inputs)).float().cpu())
        result = compare(torch.cat([r.flatten() for r in refs]), torch.cat([o.flatten() for o in outs]))
        result["samples"] = cfg.samples
        return result
