"""export: one safetensors file in the layout ComfyUI reads, with the recipe and config in its header."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lowbit_pipe import __version__
from lowbit_pipe.checkpoint import atomic_save
from lowbit_pipe.context import Context
from lowbit_pipe.nn import QuantLinear
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.load import METADATA_KEY


def export_state_dict(model: torch.nn.Module, float_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Quantized layers' tensors as they are; float tensors in `float_dtype`. Returns (tensors, format counts)."""
    quant_keys = set()
    counts: Counter[str] = Counter()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            counts[module.format.name] += 1
            quant_keys.update(f"{name}.{k}" for k in module._quant_names + ("comfy_quant",))
    state = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if key not in quant_keys and tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        state[key] = tensor.cpu()
    return state, dict(counts)


@register
class Export(Stage):
    name = "export"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.export
        path = Path(cfg.path) if cfg.path else ctx.run_dir / "model.safetensors"
        dtype = ctx.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        state, counts = export_state_dict(ctx.transformer, dtype)
        header = {
            "version": __version__,
            "arch": ctx.arch.id if ctx.arch else None,
            "transformer_config": ctx.model_config,
            "recipe": OmegaConf.to_container(OmegaConf.structured(ctx.recipe), resolve=True),
            "layers": counts,
        }
        metadata = {METADATA_KEY: json.dumps(header, default=str)}
        nbytes = atomic_save(state, path, metadata, inputs=(ctx.recipe.model.path,))
        result = {"path": str(path), "bytes": nbytes, "tensors": len(state), "quantized_layers": sum(counts.values())}
        ctx.report["export"] = result
        return result
