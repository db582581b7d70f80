"""Krea 2: single-stream DiT (diffusers `Krea2Transformer2DModel`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit_pipe.arch import register
from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy


@register
class Krea2(Arch):
    id = "krea2"
    diffusers_class = "Krea2Transformer2DModel"
    # ComfyUI names first/last/tmlp/tproj/txtfusion/txtmlp are diffusers'
    # img_in/final_layer/time_embed/time_mod_proj/text_fusion/txt_in.
    policy = LayerPolicy(
        keep_float=("img_in", "final_layer*", "time_embed*", "time_mod_proj", "text_fusion*", "txt_in*"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.down"),
        block_paths=("transformer_blocks",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "text_fusion.projector.weight" in shapes and "time_mod_proj.weight" in shapes

    def config_from_model(self, model: nn.Module) -> ArchConfig:
        c = model.config
        return ArchConfig(
            arch=self.id,
            num_layers=c.num_layers,
            hidden_size=c.attention_head_dim * c.num_attention_heads,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.attention_head_dim,
            mlp_hidden=c.intermediate_size,
            text_layers=c.num_text_layers,
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
