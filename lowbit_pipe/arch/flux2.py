"""FLUX.2: double- then single-stream MMDiT with shared modulations (diffusers `Flux2Transformer2DModel`).

Native names follow diffusers' `convert_flux2_transformer_checkpoint_to_diffusers`: double-block
`img_attn.qkv` / `txt_attn.qkv` fuse q,k,v; single `linear1` == diffusers' fused `attn.to_qkv_mlp_proj`.
SwiGLU MLP: `ff.linear_in` rows = 2 x mlp. Heads: head_dim from the qk-norm width, no GQA.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, rows
from lowbit_pipe.arch.flux1 import (
    SN,
    S,
    double_block_rules,
    dual_stream_config,
    dual_stream_config_from_keys,
    flux_inputs,
    mlp_embedder,
    to_device,
)
from lowbit_pipe.arch.keymap import KeyMap, Rename
from lowbit_pipe.arch.registry import register

KEYMAP = KeyMap([
    Rename("x_embedder", "img_in"), Rename("context_embedder", "txt_in"),
    *mlp_embedder("time_guidance_embed.timestep_embedder", "time_in"),
    *mlp_embedder("time_guidance_embed.guidance_embedder", "guidance_in"),
    Rename("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    Rename("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    Rename("single_stream_modulation.linear", "single_stream_modulation.lin"),
    *double_block_rules(mlp=("linear_in", "linear_out"), mod=False),
    Rename(f"{S}.attn.to_qkv_mlp_proj", f"{SN}.linear1"), Rename(f"{S}.attn.to_out", f"{SN}.linear2"),
    Rename(f"{S}.attn.norm_q", f"{SN}.norm.query_norm", norm=True),
    Rename(f"{S}.attn.norm_k", f"{SN}.norm.key_norm", norm=True),
    Rename("proj_out", "final_layer.linear"), Rename("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True),
])


@register
class Flux2(Arch):
    id = "flux2"
    diffusers_class = "Flux2Transformer2DModel"
    keymap = KEYMAP
    native_markers = ("single_stream_modulation.lin.weight",)
    policy = LayerPolicy(
        keep_float=("x_embedder", "context_embedder", "time_guidance_embed*", "double_stream_modulation*",
                    "single_stream_modulation*", "norm_out*", "proj_out"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.linear_out",
                   "single_transformer_blocks.*.attn.to_out"),
        block_paths=("transformer_blocks", "single_transformer_blocks"),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "single_stream_modulation.linear.weight" in shapes and "x_embedder.weight" in shapes

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        hidden = c["attention_head_dim"] * c["num_attention_heads"]
        return dual_stream_config(self.id, c, int(hidden * c["mlp_ratio"]), guidance_embeds=bool(c["guidance_embeds"]))

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        # Single blocks fuse attention and MLP: linear2's in_features = hidden + mlp.
        mlp = rows(shapes, "single_transformer_blocks.0.attn.to_out.weight", 1) - rows(shapes, "x_embedder.weight")
        return dual_stream_config_from_keys(
            self.id, shapes, mlp,
            guidance_embeds="time_guidance_embed.guidance_embedder.linear_1.weight" in shapes)

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        inputs = flux_inputs(c, batch, image_tokens, text_tokens, generator, axes=len(c["axes_dims_rope"]))
        if c.get("guidance_embeds", True):
            inputs["guidance"] = torch.full((batch,), 3.5)
        return to_device(inputs, device, dtype)
