"""Z-Image: single-stream DiT with noise / context refiners (diffusers `ZImageTransformer2DModel`).

Native names follow diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`: fused `attention.qkv`,
`attention.out`, `q_norm` / `k_norm`, `x_embedder` / `final_layer` for patch size 2x1 (`2-1`).
Heads: head_dim from the qk-norm width; kv heads from to_k rows (native qkv assumes no GQA: equal thirds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.keymap import Fused, KeyMap, Rename
from lowbit_pipe.arch.registry import register

_BLOCKS = ("layers", "noise_refiner", "context_refiner")
KEYMAP = KeyMap([
    Rename("all_x_embedder.2-1", "x_embedder"), Rename("all_final_layer.2-1.linear", "final_layer.linear"),
    Rename("all_final_layer.2-1.adaLN_modulation.1", "final_layer.adaLN_modulation.1"),
    *[r for b in _BLOCKS for r in (
        Fused(f"{b}.{{i}}.attention.qkv", tuple((f"{b}.{{i}}.attention.to_{x}", "h") for x in "qkv")),
        Rename(f"{b}.{{i}}.attention.to_out.0", f"{b}.{{i}}.attention.out"),
        Rename(f"{b}.{{i}}.attention.norm_q", f"{b}.{{i}}.attention.q_norm"),
        Rename(f"{b}.{{i}}.attention.norm_k", f"{b}.{{i}}.attention.k_norm"))],
])


@register
class ZImage(Arch):
    id = "z_image"
    diffusers_class = "ZImageTransformer2DModel"
    keymap = KEYMAP
    policy = LayerPolicy(
        keep_float=("all_x_embedder*", "all_final_layer*", "t_embedder*", "cap_embedder*", "noise_refiner*",
                    "context_refiner*", "*adaLN_modulation*", "siglip_embedder*"),
        sensitive=("layers.*.attention.to_out.0", "layers.*.feed_forward.w2"),
        block_paths=("layers",),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "layers.0.attention.to_q.weight" in shapes and any(k.startswith("all_x_embedder.") for k in shapes)

    def detect_native_keys(self, shapes: dict[str, Any]) -> bool:
        # Lumina 2 (same family) has no pad tokens.
        return "layers.0.attention.qkv.weight" in shapes and ("cap_pad_token" in shapes or "x_pad_token" in shapes)

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        dim, heads = c["dim"], c["n_heads"]
        return ArchConfig(
            arch=self.id, num_layers=c["n_layers"], hidden_size=dim, num_heads=heads, num_kv_heads=c["n_kv_heads"],
            head_dim=dim // heads, mlp_hidden=int(dim / 3 * 8),
            extra={"refiner_layers": c["n_refiner_layers"], "cap_feat_dim": c["cap_feat_dim"]},
        )

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        a = "layers.0.attention."
        head_dim = rows(shapes, a + "norm_q.weight")
        return ArchConfig(
            arch=self.id, num_layers=count_blocks(shapes, "layers"), hidden_size=rows(shapes, a + "to_q.weight", 1),
            num_heads=rows(shapes, a + "to_q.weight") // head_dim, num_kv_heads=rows(shapes, a + "to_k.weight") // head_dim,
            head_dim=head_dim, mlp_hidden=rows(shapes, "layers.0.feed_forward.w1.weight"),
            extra={"refiner_layers": count_blocks(shapes, "noise_refiner"),
                   "cap_feat_dim": rows(shapes, "cap_embedder.1.weight", 1)},
        )

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        p = tuple(c.get("all_patch_size", (2,)))[0]
        side = max(1, int(image_tokens**0.5)) * p
        x = [torch.randn(c["in_channels"], 1, side, side, generator=generator).to(device, dtype) for _ in range(batch)]
        cap = [torch.randn(text_tokens, c["cap_feat_dim"], generator=generator).to(device, dtype) for _ in range(batch)]
        return {"x": x, "t": torch.rand(batch, generator=generator).to(device, dtype), "cap_feats": cap}

    def output_tensor(self, output: Any) -> torch.Tensor:
        out = output[0] if isinstance(output, (tuple, list)) and not isinstance(output[0], torch.Tensor) else output
        out = out if isinstance(out, (list, tuple, torch.Tensor)) else out.sample
        return torch.stack(list(out)) if isinstance(out, (list, tuple)) else out
