"""Chroma: FLUX.1-schnell derivative with a distilled modulation approximator (`ChromaTransformer2DModel`).

Native names follow diffusers' `convert_chroma_transformer_checkpoint_to_diffusers`: FLUX.1 blocks without
per-block modulation linears, plus `distilled_guidance_layer.{in_proj,layers.N.{in,out}_layer,norms.N,out_proj}`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks
from lowbit_pipe.arch.flux1 import (
    double_block_rules,
    dual_stream_config,
    dual_stream_config_from_keys,
    flux_inputs,
    single_block_rules,
    to_device,
)
from lowbit_pipe.arch.keymap import KeyMap, Rename
from lowbit_pipe.arch.registry import register

G = "distilled_guidance_layer"
KEYMAP = KeyMap([
    Rename(f"{G}.layers.{{i}}.linear_1", f"{G}.layers.{{i}}.in_layer"),
    Rename(f"{G}.layers.{{i}}.linear_2", f"{G}.layers.{{i}}.out_layer"),
    Rename(f"{G}.norms.{{i}}", f"{G}.norms.{{i}}", norm=True),
    Rename("context_embedder", "txt_in"), Rename("x_embedder", "img_in"),
    *double_block_rules(mod=False), *single_block_rules(mod=False),
    Rename("proj_out", "final_layer.linear"),
])


@register
class Chroma(Arch):
    id = "chroma"
    diffusers_class = "ChromaTransformer2DModel"
    keymap = KEYMAP
    native_markers = ("distilled_guidance_layer.in_proj.weight",)
    policy = LayerPolicy(
        keep_float=("x_embedder", "context_embedder", "distilled_guidance_layer*", "norm_out*", "proj_out"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.net.2",
                   "single_transformer_blocks.*.proj_out"),
        block_paths=("transformer_blocks", "single_transformer_blocks"),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "distilled_guidance_layer.in_proj.weight" in shapes and "x_embedder.weight" in shapes \
            and "single_transformer_blocks.0.proj_mlp.weight" in shapes

    def detect_native_keys(self, shapes: dict[str, Any]) -> bool:
        return "distilled_guidance_layer.in_proj.weight" in shapes and "img_in.weight" in shapes

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        hidden = c["attention_head_dim"] * c["num_attention_heads"]
        return dual_stream_config(self.id, c, hidden * 4, approximator_layers=c["approximator_layers"])

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        return dual_stream_config_from_keys(
            self.id, shapes, approximator_layers=count_blocks(shapes, "distilled_guidance_layer.layers"))

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        return to_device(flux_inputs(model_config, batch, image_tokens, text_tokens, generator), device, dtype)
