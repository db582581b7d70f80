"""Wan 2.1 / 2.2: video DiT with self + cross attention (diffusers `WanTransformer3DModel`).

Native names follow diffusers' `convert_wan_transformer_to_diffusers` (self_attn/cross_attn.{q,k,v,o},
ffn.{0,2}, norm3 <-> norm2, modulation <-> scale_shift_table, head.head <-> proj_out).
Heads: Wan's qk-norm spans all heads, so head_dim is the released models' 128 and heads = hidden / 128.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.keymap import KeyMap, Rename
from lowbit_pipe.arch.registry import register

B = "blocks.{i}"
_ATTN = [("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o"), ("norm_q", "norm_q"), ("norm_k", "norm_k")]
KEYMAP = KeyMap([
    Rename("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    Rename("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    Rename("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    Rename("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    Rename("condition_embedder.time_proj", "time_projection.1"),
    Rename("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    Rename("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    Rename("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    Rename("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    *[Rename(f"{B}.{a}.{d}", f"{B}.{n}.{m}") for a, n in (("attn1", "self_attn"), ("attn2", "cross_attn")) for d, m in _ATTN],
    Rename(f"{B}.attn2.add_k_proj", f"{B}.cross_attn.k_img"), Rename(f"{B}.attn2.add_v_proj", f"{B}.cross_attn.v_img"),
    Rename(f"{B}.attn2.norm_added_k", f"{B}.cross_attn.norm_k_img"),
    Rename(f"{B}.norm2", f"{B}.norm3"),
    Rename(f"{B}.ffn.net.0.proj", f"{B}.ffn.0"), Rename(f"{B}.ffn.net.2", f"{B}.ffn.2"),
    Rename(f"{B}.scale_shift_table", f"{B}.modulation", param=True),
    Rename("scale_shift_table", "head.modulation", param=True), Rename("proj_out", "head.head"),
])
HEAD_DIM = 128


@register
class Wan(Arch):
    id = "wan"
    diffusers_class = "WanTransformer3DModel"
    keymap = KEYMAP
    native_markers = ("head.modulation",)
    policy = LayerPolicy(
        keep_float=("patch_embedding", "condition_embedder*", "proj_out"),
        sensitive=("blocks.*.attn1.to_out.0", "blocks.*.ffn.net.2"),
        block_paths=("blocks",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "condition_embedder.time_proj.weight" in shapes and "blocks.0.attn1.to_q.weight" in shapes

    def lora_template_kwargs(self) -> dict[str, Any]:
        return {"image_dim": 1280, "added_kv_proj_dim": 5120}

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        return ArchConfig(
            arch=self.id, num_layers=c["num_layers"], hidden_size=c["attention_head_dim"] * c["num_attention_heads"],
            num_heads=c["num_attention_heads"], num_kv_heads=c["num_attention_heads"], head_dim=c["attention_head_dim"],
            mlp_hidden=c["ffn_dim"], extra={"text_dim": c["text_dim"], "i2v": c.get("image_dim") is not None},
        )

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        hidden = rows(shapes, "blocks.0.attn1.to_q.weight")
        norm = rows(shapes, "blocks.0.attn1.norm_q.weight", default=hidden)
        head_dim = norm if norm < hidden else HEAD_DIM
        return ArchConfig(
            arch=self.id, num_layers=count_blocks(shapes, "blocks"), hidden_size=hidden, num_heads=hidden // head_dim,
            num_kv_heads=hidden // head_dim, head_dim=head_dim, mlp_hidden=rows(shapes, "blocks.0.ffn.net.0.proj.weight"),
            extra={"text_dim": rows(shapes, "condition_embedder.text_embedder.linear_1.weight", 1),
                   "i2v": "blocks.0.attn2.add_k_proj.weight" in shapes},
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        pt, ph, pw = c["patch_size"]
        side = max(1, int(image_tokens**0.5))
        inputs = {
            "hidden_states": torch.randn(batch, c["in_channels"], pt, side * ph, side * pw, generator=generator),
            "timestep": torch.rand(batch, generator=generator) * 1000,
            "encoder_hidden_states": torch.randn(batch, text_tokens, c["text_dim"], generator=generator),
        }
        return {k: v.to(device, dtype) for k, v in inputs.items()}
