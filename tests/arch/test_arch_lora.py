"""LoRA module names (diffusers / peft, kohya, ComfyUI native, AI-toolkit) -> diffusers modules."""

from __future__ import annotations

import pytest

import lowbit_pipe.arch as A
from lowbit_pipe.arch.base import ArchConfig
from lowbit_pipe.arch.lora import lora_module_name

H = 3072  # FLUX.1 width: rows of the fused natives default to the class-default config


@pytest.mark.parametrize("name, expected", [
    ("transformer.transformer_blocks.0.attn.to_q.lora_A.weight", [("transformer_blocks.0.attn.to_q", None)]),
    ("base_model.model.single_transformer_blocks.2.proj_out.lora_B.weight", [("single_transformer_blocks.2.proj_out", None)]),
    ("lora_transformer_single_transformer_blocks_0_attn_to_q.lora_down.weight", [("single_transformer_blocks.0.attn.to_q", None)]),
    ("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight",
     [("transformer_blocks.0.attn.to_q", slice(0, H)), ("transformer_blocks.0.attn.to_k", slice(H, 2 * H)),
      ("transformer_blocks.0.attn.to_v", slice(2 * H, 3 * H))]),
    ("diffusion_model.double_blocks.3.txt_attn.qkv.lora_B.weight",
     [("transformer_blocks.3.attn.add_q_proj", slice(0, H)), ("transformer_blocks.3.attn.add_k_proj", slice(H, 2 * H)),
      ("transformer_blocks.3.attn.add_v_proj", slice(2 * H, 3 * H))]),
    ("diffusion_model.single_blocks.7.linear1",
     [("single_transformer_blocks.7.attn.to_q", slice(0, H)), ("single_transformer_blocks.7.attn.to_k", slice(H, 2 * H)),
      ("single_transformer_blocks.7.attn.to_v", slice(2 * H, 3 * H)), ("single_transformer_blocks.7.proj_mlp", slice(3 * H, None))]),
    ("lora_unet_single_blocks_7_linear2.alpha", [("single_transformer_blocks.7.proj_out", None)]),
    ("lora_unet_double_blocks_0_txt_mlp_0", [("transformer_blocks.0.ff_context.net.0.proj", None)]),
    ("lora_unet_double_blocks_12_img_mod_lin", [("transformer_blocks.12.norm1.linear", None)]),
    ("diffusion_model.double_blocks.1.img_attn.proj.lora_A.weight", [("transformer_blocks.1.attn.to_out.0", None)]),
    ("lora_unet_guidance_in_in_layer", [("time_text_embed.guidance_embedder.linear_1", None)]),
    ("lora_te1_text_model_encoder_layers_0_mlp_fc1", []),
    ("transformer.not_a_module.lora_A.weight", []),
])
def test_flux1_lora_names(name, expected):
    assert A.get_arch("flux1").lora_targets(name) == expected


def test_flux1_fused_rows_follow_the_config():
    arch = A.get_arch("flux1")
    tiny = ArchConfig("flux1", 3, 256, 4, 4, 64, 1024)
    targets = arch.lora_targets("diffusion_model.single_blocks.0.linear1.lora_B.weight", tiny)
    assert [t[1] for t in targets] == [slice(0, 256), slice(256, 512), slice(512, 768), slice(768, None)]
    assert arch.lora_target("diffusion_model.single_blocks.0.linear1") is None  # fused: use lora_targets
    assert arch.lora_target("lora_unet_single_blocks_0_linear2") == "single_transformer_blocks.0.proj_out"


@pytest.mark.parametrize("name, expected", [
    ("diffusion_model.blocks.3.attn.wq.lora_A.weight", "transformer_blocks.3.attn.to_q"),
    ("diffusion_model.blocks.3.attn.wo.lora_B.weight", "transformer_blocks.3.attn.to_out.0"),
    ("diffusion_model.blocks.0.attn.gate.lora_A.weight", "transformer_blocks.0.attn.to_gate"),
    ("diffusion_model.blocks.0.mlp.gate.lora_A.weight", "transformer_blocks.0.ff.gate"),
    ("lora_unet_blocks_3_mlp_down.lora_down.weight", "transformer_blocks.3.ff.down"),
    ("base_model.model.txtfusion.refiner_blocks.1.attn.gate.lora_B.weight", "text_fusion.refiner_blocks.1.attn.to_gate"),
    ("lora_unet_txtfusion_layerwise_blocks_0_mlp_up", "text_fusion.layerwise_blocks.0.ff.up"),
    ("transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight", "transformer_blocks.0.attn.to_out.0"),
    ("diffusion_model.tproj.1.lora_A.weight", "time_mod_proj"),
    ("diffusion_model.tmlp.2.lora_A.weight", "time_embed.linear_2"),
    ("diffusion_model.txtmlp.3.lora_A.weight", "txt_in.linear_2"),
    ("diffusion_model.first.lora_A.weight", "img_in"),
    ("diffusion_model.last.linear.lora_A.weight", "final_layer.linear"),
    ("diffusion_model.blocks.0.attn.qknorm.lora_A.weight", None),
])
def test_krea2_lora_names(name, expected):
    assert A.get_arch("krea2").lora_target(name) == expected


def test_krea2_agrees_with_diffusers_converter():
    """Every name diffusers' Krea 2 LoRA converter maps, we map the same way."""
    import torch
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

    arch = A.get_arch("krea2")
    names = ["blocks.4.attn.wk", "blocks.4.attn.wv", "blocks.27.mlp.up", "txtfusion.layerwise_blocks.1.attn.wo",
             "txtfusion.projector", "tmlp.0", "txtmlp.1", "last.linear"]
    sd = {f"diffusion_model.{n}.lora_A.weight": torch.zeros(1) for n in names}
    theirs = sorted(lora_module_name(k).removeprefix("transformer.") for k in _convert_non_diffusers_krea2_lora_to_diffusers(sd))
    ours = sorted(arch.lora_target(k) for k in sd)
    assert ours == theirs


@pytest.mark.parametrize("aid, name, expected", [
    ("flux2", "diffusion_model.single_blocks.3.linear1.lora_A.weight", [("single_transformer_blocks.3.attn.to_qkv_mlp_proj", None)]),
    ("flux2", "lora_unet_double_blocks_1_img_mlp_2", [("transformer_blocks.1.ff.linear_out", None)]),
    ("qwen_image", "transformer.transformer_blocks.5.img_mlp.net.2.lora_A.weight", [("transformer_blocks.5.img_mlp.net.2", None)]),
    ("qwen_image", "lora_unet_transformer_blocks_5_attn_add_q_proj", [("transformer_blocks.5.attn.add_q_proj", None)]),
    ("wan", "diffusion_model.blocks.2.self_attn.o.lora_A.weight", [("blocks.2.attn1.to_out.0", None)]),
    ("wan", "diffusion_model.blocks.2.cross_attn.k_img.lora_A.weight", [("blocks.2.attn2.add_k_proj", None)]),
    ("wan", "lora_unet_blocks_2_ffn_0", [("blocks.2.ffn.net.0.proj", None)]),
    ("sd3", "lora_unet_joint_blocks_0_context_block_attn_proj", [("transformer_blocks.0.attn.to_add_out", None)]),
    ("z_image", "diffusion_model.layers.4.attention.out.lora_A.weight", [("layers.4.attention.to_out.0", None)]),
    ("z_image", "diffusion_model.layers.4.feed_forward.w2.lora_A.weight", [("layers.4.feed_forward.w2", None)]),
    ("chroma", "lora_unet_single_blocks_0_linear2", [("single_transformer_blocks.0.proj_out", None)]),
])
def test_other_arch_lora_names(aid, name, expected):
    assert A.get_arch(aid).lora_targets(name) == expected


def test_sd3_fused_qkv_lora():
    targets = A.get_arch("sd3").lora_targets("diffusion_model.joint_blocks.2.x_block.attn.qkv.lora_B.weight")
    assert [t[0] for t in targets] == [f"transformer_blocks.2.attn.to_{x}" for x in "qkv"]
    assert targets[1][1] == slice(1152, 2304)


def test_swapped_modulation_lora_takes_its_rows_with_the_halves_exchanged():
    import torch

    from lowbit_pipe.arch.keymap import SWAP_HALVES, take_rows

    targets = A.get_arch("flux1").lora_targets("diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight")
    assert targets == [("norm_out.linear", SWAP_HALVES)]
    up = torch.arange(8.0).reshape(8, 1)
    assert take_rows(up, SWAP_HALVES, 4).flatten().tolist() == [4, 5, 6, 7, 0, 1, 2, 3]  # (shift, scale) -> (scale, shift)
    assert torch.equal(take_rows(up, SWAP_HALVES, 2), up)  # not 2 x in_features rows: as the key map, unswapped
