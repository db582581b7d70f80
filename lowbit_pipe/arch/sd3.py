"""SD3 / SD3.5: MMDiT with joint blocks (diffusers `SD3Transformer2DModel`).

Native names follow diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`: `joint_blocks.N.{x,context}_block`
with fused `attn.qkv`; the last block's context half is pre-only (its 2h-row modulation is swapped).
Heads: head_dim from the qk-norm width when present (SD3.5), else 64 (every released SD3 / 3.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.keymap import Fused, KeyMap, Rename
from lowbit_pipe.arch.registry import register

J, D = "joint_blocks.{i}", "transformer_blocks.{i}"
KEYMAP = KeyMap([
    Rename("pos_embed.pos_embed", "pos_embed", param=True), Rename("pos_embed.proj", "x_embedder.proj"),
    Rename("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    Rename("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    Rename("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    Rename("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    Fused(f"{J}.x_block.attn.qkv", ((f"{D}.attn.to_q", "h"), (f"{D}.attn.to_k", "h"), (f"{D}.attn.to_v", "h"))),
    Fused(f"{J}.context_block.attn.qkv", ((f"{D}.attn.add_q_proj", "h"), (f"{D}.attn.add_k_proj", "h"), (f"{D}.attn.add_v_proj", "h"))),
    Fused(f"{J}.x_block.attn2.qkv", ((f"{D}.attn2.to_q", "h"), (f"{D}.attn2.to_k", "h"), (f"{D}.attn2.to_v", "h"))),
    Rename(f"{D}.attn.norm_q", f"{J}.x_block.attn.ln_q"), Rename(f"{D}.attn.norm_k", f"{J}.x_block.attn.ln_k"),
    Rename(f"{D}.attn.norm_added_q", f"{J}.context_block.attn.ln_q"),
    Rename(f"{D}.attn.norm_added_k", f"{J}.context_block.attn.ln_k"),
    Rename(f"{D}.attn2.norm_q", f"{J}.x_block.attn2.ln_q"), Rename(f"{D}.attn2.norm_k", f"{J}.x_block.attn2.ln_k"),
    Rename(f"{D}.attn.to_out.0", f"{J}.x_block.attn.proj"), Rename(f"{D}.attn.to_add_out", f"{J}.context_block.attn.proj"),
    Rename(f"{D}.attn2.to_out.0", f"{J}.x_block.attn2.proj"),
    Rename(f"{D}.norm1.linear", f"{J}.x_block.adaLN_modulation.1"),
    Rename(f"{D}.norm1_context.linear", f"{J}.context_block.adaLN_modulation.1", swap=True),
    Rename(f"{D}.ff.net.0.proj", f"{J}.x_block.mlp.fc1"), Rename(f"{D}.ff.net.2", f"{J}.x_block.mlp.fc2"),
    Rename(f"{D}.ff_context.net.0.proj", f"{J}.context_block.mlp.fc1"),
    Rename(f"{D}.ff_context.net.2", f"{J}.context_block.mlp.fc2"),
    Rename("proj_out", "final_layer.linear"), Rename("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True),
])


@register
class SD3(Arch):
    id = "sd3"
    diffusers_class = "SD3Transformer2DModel"
    keymap = KEYMAP
    native_markers = ("joint_blocks.0.context_block.adaLN_modulation.1.weight",)
    policy = LayerPolicy(
        keep_float=("pos_embed*", "time_text_embed*", "context_embedder", "norm_out*", "proj_out",
                    "*norm1.linear", "*norm1_context.linear"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.net.2"),
        block_paths=("transformer_blocks",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "pos_embed.proj.weight" in shapes and "transformer_blocks.0.norm1_context.linear.weight" in shapes

    def lora_template_kwargs(self) -> dict[str, Any]:
        return {"dual_attention_layers": (0,), "qk_norm": "rms_norm"}

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        hidden = c["attention_head_dim"] * c["num_attention_heads"]
        return ArchConfig(
            arch=self.id, num_layers=c["num_layers"], hidden_size=hidden, num_heads=c["num_attention_heads"],
            num_kv_heads=c["num_attention_heads"], head_dim=c["attention_head_dim"], mlp_hidden=hidden * 4,
            extra={"dual_attention_layers": tuple(c.get("dual_attention_layers") or ()), "qk_norm": c.get("qk_norm")},
        )

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        hidden = rows(shapes, "pos_embed.proj.weight")
        head_dim = rows(shapes, "transformer_blocks.0.attn.norm_q.weight", default=64)
        dual = tuple(sorted({int(k.split(".")[1]) for k in shapes if k.startswith("transformer_blocks.") and ".attn2." in k}))
        return ArchConfig(
            arch=self.id, num_layers=count_blocks(shapes, "transformer_blocks"), hidden_size=hidden,
            num_heads=hidden // head_dim, num_kv_heads=hidden // head_dim, head_dim=head_dim,
            mlp_hidden=rows(shapes, "transformer_blocks.0.ff.net.0.proj.weight"),
            extra={"dual_attention_layers": dual,
                   "qk_norm": "rms_norm" if "transformer_blocks.0.attn.norm_q.weight" in shapes else None},
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        side = max(1, int(image_tokens**0.5)) * c["patch_size"]
        inputs = {
            "hidden_states": torch.randn(batch, c["in_channels"], side, side, generator=generator),
            "encoder_hidden_states": torch.randn(batch, text_tokens, c["joint_attention_dim"], generator=generator),
            "pooled_projections": torch.randn(batch, c["pooled_projection_dim"], generator=generator),
            "timestep": torch.rand(batch, generator=generator) * 1000,
        }
        return {k: v.to(device, dtype) for k, v in inputs.items()}
