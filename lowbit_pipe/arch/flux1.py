"""FLUX.1: double- then single-stream MMDiT (diffusers `FluxTransformer2DModel`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit_pipe.arch import register
from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy


@register
class Flux1(Arch):
    id = "flux1"
    diffusers_class = "FluxTransformer2DModel"
    # BFL img_in/time_in/guidance_in/txt_in/final_layer and the modulation linears, in diffusers names.
    policy = LayerPolicy(
        keep_float=("x_embedder", "time_text_embed*", "context_embedder", "norm_out*", "proj_out",
                    "*norm1.linear", "*norm1_context.linear", "single_transformer_blocks.*.norm.linear"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.net.2",
                   "single_transformer_blocks.*.proj_out"),
        block_paths=("transformer_blocks", "single_transformer_blocks"),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "single_transformer_blocks.0.proj_mlp.weight" in shapes and "context_embedder.weight" in shapes \
            and "x_embedder.weight" in shapes

    def config_from_model(self, model: nn.Module) -> ArchConfig:
        c = model.config
        hidden = c.attention_head_dim * c.num_attention_heads
        return ArchConfig(
            arch=self.id,
            num_layers=c.num_layers + c.num_single_layers,
            hidden_size=hidden,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_attention_heads,
            head_dim=c.attention_head_dim,
            mlp_hidden=hidden * 4,
            extra={"double_layers": c.num_layers, "single_layers": c.num_single_layers,
                   "guidance_embeds": bool(c.guidance_embeds)},
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        side = max(1, int(image_tokens**0.5))
        hh, ww = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(hh), hh, ww], dim=-1).reshape(-1, 3).float()
        inputs = {
            "hidden_states": torch.randn(batch, side * side, c["in_channels"], generator=generator),
            "encoder_hidden_states": torch.randn(batch, text_tokens, c["joint_attention_dim"], generator=generator),
            "pooled_projections": torch.randn(batch, c["pooled_projection_dim"], generator=generator),
            "timestep": torch.rand(batch, generator=generator),
            "img_ids": img_ids,
            "txt_ids": torch.zeros(text_tokens, 3),
        }
        if c.get("guidance_embeds"):
            inputs["guidance"] = torch.full((batch,), 3.5)
        return {k: v.to(device, dtype) if k not in ("img_ids", "txt_ids") else v.to(device) for k, v in inputs.items()}
