"""Krea 2: single-stream DiT (diffusers `Krea2Transformer2DModel`).

Native (ComfyUI / Krea) names mirror diffusers' `convert_krea2_transformer_checkpoint_to_diffusers`.
Heads come from the qk-norm width (head_dim) and the q / k row counts (GQA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.keymap import KeyMap, Rename, block_renames
from lowbit_pipe.arch.registry import register

_BLOCK = [("attn.to_q", "attn.wq", False), ("attn.to_k", "attn.wk", False), ("attn.to_v", "attn.wv", False),
          ("attn.to_out.0", "attn.wo", False), ("attn.to_gate", "attn.gate", False),
          ("attn.norm_q", "attn.qknorm.qnorm", True), ("attn.norm_k", "attn.qknorm.knorm", True),
          ("ff.gate", "mlp.gate", False), ("ff.up", "mlp.up", False), ("ff.down", "mlp.down", False),
          ("norm1", "prenorm", True), ("norm2", "postnorm", True)]

KEYMAP = KeyMap([
    Rename("img_in", "first"), Rename("time_embed.linear_1", "tmlp.0"), Rename("time_embed.linear_2", "tmlp.2"),
    Rename("time_mod_proj", "tproj.1"), Rename("txt_in.norm", "txtmlp.0", norm=True),
    Rename("txt_in.linear_1", "txtmlp.1"), Rename("txt_in.linear_2", "txtmlp.3"),
    Rename("text_fusion.projector", "txtfusion.projector"),
    Rename("final_layer.linear", "last.linear"), Rename("final_layer.norm", "last.norm", norm=True),
    Rename("final_layer.scale_shift_table", "last.modulation.lin", param=True),
    Rename("transformer_blocks.{i}.scale_shift_table", "blocks.{i}.mod.lin", param=True, flat=True),
    *block_renames(("transformer_blocks.{i}", "text_fusion.layerwise_blocks.{i}", "text_fusion.refiner_blocks.{i}"),
                   _BLOCK, ("blocks.{i}", "txtfusion.layerwise_blocks.{i}", "txtfusion.refiner_blocks.{i}")),
], flat_rows={"transformer_blocks.{i}.scale_shift_table": 6})


@register
class Krea2(Arch):
    id = "krea2"
    diffusers_class = "Krea2Transformer2DModel"
    keymap = KEYMAP
    native_markers = ("txtfusion.projector.weight",)
    text_mask_key = "encoder_attention_mask"  # Krea2Pipeline pads prompts to 512 tokens and always passes it
    # ComfyUI names first/last/tmlp/tproj/txtfusion/txtmlp are diffusers'
    # img_in/final_layer/time_embed/time_mod_proj/text_fusion/txt_in.
    policy = LayerPolicy(
        keep_float=("img_in", "final_layer*", "time_embed*", "time_mod_proj", "text_fusion*", "txt_in*"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.down"),
        block_paths=("transformer_blocks",),
        # The text fusion attends over 512 prompt tokens (refiner) or the 12 tapped layers (layerwise): no time to
        # gain, and on the full-size model fp8 Q·Kᵀ there fell to cosine 0.99872 against float64 (the joint blocks:
        # 0.99985; bench/results/attention8_error_h100.md).
        attention_keep=("text_fusion.*",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "text_fusion.projector.weight" in shapes and "time_mod_proj.weight" in shapes

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        return ArchConfig(
            arch=self.id,
            num_layers=c["num_layers"],
            hidden_size=c["attention_head_dim"] * c["num_attention_heads"],
            num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_key_value_heads"],
            head_dim=c["attention_head_dim"],
            mlp_hidden=c["intermediate_size"],
            text_layers=c["num_text_layers"],
            extra={"text_hidden": c["text_hidden_dim"]},
        )

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        b = "transformer_blocks.0."
        head_dim = rows(shapes, b + "attn.norm_q.weight")
        return ArchConfig(
            arch=self.id,
            num_layers=count_blocks(shapes, "transformer_blocks"),
            hidden_size=rows(shapes, "img_in.weight"),
            num_heads=rows(shapes, b + "attn.to_q.weight") // head_dim,
            num_kv_heads=rows(shapes, b + "attn.to_k.weight") // head_dim,
            head_dim=head_dim,
            mlp_hidden=rows(shapes, b + "ff.gate.weight"),
            # Logical in_features: a packed projector reads 6 (or padded 8) for 12 layers.
            text_layers=rows(shapes, "text_fusion.projector.weight", 1),
            extra={"text_hidden": rows(shapes, "txt_in.linear_1.weight", 1)},
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        side = max(1, int(image_tokens**0.5))
        image_tokens = side * side
        hidden = torch.randn(batch, image_tokens, c["in_channels"], generator=generator)
        text = torch.randn(batch, text_tokens, c["num_text_layers"], c["text_hidden_dim"], generator=generator)
        timestep = torch.rand(batch, generator=generator)
        hh, ww = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(hh), hh, ww], dim=-1).reshape(-1, 3)
        position_ids = torch.cat([torch.zeros(text_tokens, 3, dtype=img_ids.dtype), img_ids])
        return {
            "hidden_states": hidden.to(device, dtype),
            "encoder_hidden_states": text.to(device, dtype),
            "timestep": timestep.to(device, dtype),
            "position_ids": position_ids.to(device),
        }
