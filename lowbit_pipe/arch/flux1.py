"""FLUX.1: double- then single-stream MMDiT (diffusers `FluxTransformer2DModel`).

Native (BFL / ComfyUI) names follow diffusers' `convert_flux_transformer_checkpoint_to_diffusers`:
`img_attn.qkv` / `txt_attn.qkv` fuse q,k,v and single `linear1` fuses q,k,v,proj_mlp along rows.
Heads: head_dim from the qk-norm width, heads = hidden / head_dim (no GQA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, count_blocks, rows
from lowbit_pipe.arch.keymap import Fused, KeyMap, Rename
from lowbit_pipe.arch.registry import register

D, S, DN, SN = "transformer_blocks.{i}", "single_transformer_blocks.{i}", "double_blocks.{i}", "single_blocks.{i}"


def double_block_rules(mlp: tuple[str, str] = ("net.0.proj", "net.2"), mod: bool = True) -> list:
    """FLUX-style double blocks (FLUX.1, Chroma, FLUX.2 with its ff names)."""
    rules = [
        Fused(f"{DN}.img_attn.qkv", ((f"{D}.attn.to_q", "h"), (f"{D}.attn.to_k", "h"), (f"{D}.attn.to_v", "h"))),
        Fused(f"{DN}.txt_attn.qkv", ((f"{D}.attn.add_q_proj", "h"), (f"{D}.attn.add_k_proj", "h"), (f"{D}.attn.add_v_proj", "h"))),
        Rename(f"{D}.attn.norm_q", f"{DN}.img_attn.norm.query_norm", norm=True),
        Rename(f"{D}.attn.norm_k", f"{DN}.img_attn.norm.key_norm", norm=True),
        Rename(f"{D}.attn.norm_added_q", f"{DN}.txt_attn.norm.query_norm", norm=True),
        Rename(f"{D}.attn.norm_added_k", f"{DN}.txt_attn.norm.key_norm", norm=True),
        Rename(f"{D}.attn.to_out.0", f"{DN}.img_attn.proj"), Rename(f"{D}.attn.to_add_out", f"{DN}.txt_attn.proj"),
        Rename(f"{D}.ff.{mlp[0]}", f"{DN}.img_mlp.0"), Rename(f"{D}.ff.{mlp[1]}", f"{DN}.img_mlp.2"),
        Rename(f"{D}.ff_context.{mlp[0]}", f"{DN}.txt_mlp.0"), Rename(f"{D}.ff_context.{mlp[1]}", f"{DN}.txt_mlp.2"),
    ]
    if mod:
        rules += [Rename(f"{D}.norm1.linear", f"{DN}.img_mod.lin"), Rename(f"{D}.norm1_context.linear", f"{DN}.txt_mod.lin")]
    return rules


def single_block_rules(mod: bool = True) -> list:
    rules = [
        Fused(f"{SN}.linear1", ((f"{S}.attn.to_q", "h"), (f"{S}.attn.to_k", "h"), (f"{S}.attn.to_v", "h"), (f"{S}.proj_mlp", "*"))),
        Rename(f"{S}.attn.norm_q", f"{SN}.norm.query_norm", norm=True),
        Rename(f"{S}.attn.norm_k", f"{SN}.norm.key_norm", norm=True),
        Rename(f"{S}.proj_out", f"{SN}.linear2"),
    ]
    return rules + [Rename(f"{S}.norm.linear", f"{SN}.modulation.lin")] if mod else rules


def mlp_embedder(diff: str, native: str) -> list[Rename]:
    return [Rename(f"{diff}.linear_1", f"{native}.in_layer"), Rename(f"{diff}.linear_2", f"{native}.out_layer")]


KEYMAP = KeyMap([
    *mlp_embedder("time_text_embed.timestep_embedder", "time_in"),
    *mlp_embedder("time_text_embed.text_embedder", "vector_in"),
    *mlp_embedder("time_text_embed.guidance_embedder", "guidance_in"),
    Rename("context_embedder", "txt_in"), Rename("x_embedder", "img_in"),
    *double_block_rules(), *single_block_rules(),
    Rename("proj_out", "final_layer.linear"), Rename("norm_out.linear", "final_layer.adaLN_modulation.1", swap=True),
])


def flux_inputs(c: Mapping[str, Any], batch: int, image_tokens: int, text_tokens: int, generator: torch.Generator,
                axes: int = 3) -> dict[str, torch.Tensor]:
    """Latent tokens, text states, timestep and rope ids shared by the FLUX family."""
    side = max(1, int(image_tokens**0.5))
    hh, ww = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(hh)] * (axes - 2) + [hh, ww], dim=-1).reshape(-1, axes).float()
    return {
        "hidden_states": torch.randn(batch, side * side, c["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch, text_tokens, c["joint_attention_dim"], generator=generator),
        "timestep": torch.rand(batch, generator=generator),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_tokens, axes),
    }


def dual_stream_config(arch_id: str, c: Mapping[str, Any], mlp_hidden: int, **extra: Any) -> ArchConfig:
    """ArchConfig of a FLUX-style model (double- then single-stream blocks) from its diffusers config."""
    return ArchConfig(
        arch=arch_id, num_layers=c["num_layers"] + c["num_single_layers"],
        hidden_size=c["attention_head_dim"] * c["num_attention_heads"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_attention_heads"], head_dim=c["attention_head_dim"], mlp_hidden=mlp_hidden,
        extra={"double_layers": c["num_layers"], "single_layers": c["num_single_layers"], **extra},
    )


def dual_stream_config_from_keys(arch_id: str, shapes: Mapping[str, Any], mlp_hidden: int | None = None,
                                 **extra: Any) -> ArchConfig:
    """The same from diffusers-layout shapes; the MLP width defaults to the single blocks' proj_mlp rows."""
    hidden = rows(shapes, "x_embedder.weight")
    head_dim = rows(shapes, "single_transformer_blocks.0.attn.norm_q.weight")
    double, single = count_blocks(shapes, "transformer_blocks"), count_blocks(shapes, "single_transformer_blocks")
    if mlp_hidden is None:
        mlp_hidden = rows(shapes, "single_transformer_blocks.0.proj_mlp.weight")
    return ArchConfig(
        arch=arch_id, num_layers=double + single, hidden_size=hidden, num_heads=hidden // head_dim,
        num_kv_heads=hidden // head_dim, head_dim=head_dim, mlp_hidden=mlp_hidden,
        extra={"double_layers": double, "single_layers": single, **extra},
    )


def to_device(inputs: dict[str, Any], device, dtype, keep: tuple[str, ...] = ("img_ids", "txt_ids")) -> dict[str, Any]:
    return {k: (v.to(device) if k in keep else v.to(device, dtype)) if isinstance(v, torch.Tensor) else v
            for k, v in inputs.items()}


@register
class Flux1(Arch):
    id = "flux1"
    diffusers_class = "FluxTransformer2DModel"
    keymap = KEYMAP
    native_markers = ("double_blocks.0.img_mod.lin.weight",)
    # BFL img_in/time_in/guidance_in/txt_in/final_layer and the modulation linears, in diffusers names.
    policy = LayerPolicy(
        keep_float=("x_embedder", "time_text_embed*", "context_embedder", "norm_out*", "proj_out",
                    "*norm1.linear", "*norm1_context.linear", "single_transformer_blocks.*.norm.linear"),
        sensitive=("transformer_blocks.*.attn.to_out.0", "transformer_blocks.*.ff.net.2",
                   "single_transformer_blocks.*.proj_out"),
        block_paths=("transformer_blocks", "single_transformer_blocks"),
    )

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return "single_transformer_blocks.0.proj_mlp.weight" in shapes and "x_embedder.weight" in shapes \
            and "time_text_embed.timestep_embedder.linear_1.weight" in shapes

    def lora_template_kwargs(self) -> dict[str, Any]:
        return {"guidance_embeds": True}

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        hidden = c["attention_head_dim"] * c["num_attention_heads"]
        return dual_stream_config(self.id, c, hidden * 4, guidance_embeds=bool(c["guidance_embeds"]))

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        return dual_stream_config_from_keys(
            self.id, shapes, guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in shapes)

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        c = model_config
        inputs = flux_inputs(c, batch, image_tokens, text_tokens, generator)
        inputs["pooled_projections"] = torch.randn(batch, c["pooled_projection_dim"], generator=generator)
        if c.get("guidance_embeds"):
            inputs["guidance"] = torch.full((batch,), 3.5)
        return to_device(inputs, device, dtype)
