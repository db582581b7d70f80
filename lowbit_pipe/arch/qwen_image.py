"""Qwen-Image: dual-stream MMDiT (diffusers `QwenImageTransformer2DModel`).

ComfyUI's native names are the diffusers names (diffusers' single-file mapping is the identity), so
`keymap` is None. Heads: head_dim from the qk-norm width, no GQA.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.registry import register


@register
class QwenImage(Arch):
    id = "qwen_image"
    diffusers_class = "QwenImageTransformer2DModel"
    policy = LayerPolicy(
        keep_float=("time_text_embed*", "img_in", "txt_in", "norm_out*", "proj_out"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.img_mlp.net.2"),
        block_paths=("transformer_blocks",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "txt_norm.weight" in shapes and "transformer_blocks.0.img_mod.1.weight" in shapes

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        hidden = c["attention_head_dim"] * c["num_attention_heads"]
        return ArchConfig(
            arch=self.id, num_layers=c["num_layers"], hidden_size=hidden, num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_attention_heads"], head_dim=c["attention_head_dim"], mlp_hidden=hidden * 4,
        )

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        hidden = rows(shapes, "img_in.weight")
        head_dim = rows(shapes, "transformer_blocks.0.attn.norm_q.weight")
        return ArchConfig(
            arch=self.id, num_layers=count_blocks(shapes, "transformer_blocks"), hidden_size=hidden,
            num_heads=hidden // head_dim, num_kv_heads=hidden // head_dim, head_dim=head_dim,
            mlp_hidden=rows(shapes, "transformer_blocks.0.img_mlp.net.0.proj.weight"),
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        side = max(1, int(image_tokens**0.5))
        return {
            "hidden_states": torch.randn(batch, side * side, c["in_channels"], generator=generator).to(device, dtype),
            "encoder_hidden_states": torch.randn(batch, text_tokens, c["joint_attention_dim"], generator=generator).to(device, dtype),
            "encoder_hidden_states_mask": torch.ones(batch, text_tokens, dtype=torch.long, device=device),
            "timestep": torch.rand(batch, generator=generator).to(device, dtype),
            "img_shapes": [(1, side, side)] * batch,
        }
