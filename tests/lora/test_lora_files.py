"""LoRA files: every key style maps to the same branches; fused splits; errors name file, key and layer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from safetensors.torch import save_file

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.lora import LoraError
from lowbit_pipe.lora.make_example import STYLES, example_lora


def _deltas(model, sd, **kw) -> dict[str, torch.Tensor]:
    data, _ = lora.load(model, sd, **kw)
    out: dict[str, torch.Tensor] = {}
    for f in data.layers:
        out[f.module] = out.get(f.module, 0) + f.delta_weight()
    return out


@pytest.mark.parametrize("arch_id", ["krea2", "flux1", "z_image"])
def test_every_key_style_gives_the_same_deltas(tiny_model, arch_id):
    """Same seed, same factors, four key styles (fused native qkv / linear1 for FLUX and Z-Image)."""
    model = tiny_model(arch_id)
    arch = get_arch(arch_id)
    ref = None
    for style in STYLES:
        sd, _ = example_lora(model, arch, style=style, rank=4, seed=7, alpha=4.0)
        deltas = _deltas(model, sd)
        assert deltas, style
        if ref is None:
            ref = deltas
            continue
        assert deltas.keys() == ref.keys(), style
        for name in ref:
            torch.testing.assert_close(deltas[name], ref[name], msg=f"{style} {name}")


def test_flux_linear1_splits_rows_exactly(tiny_model):
    model = tiny_model("flux1")
    hidden = 256
    down = torch.randn(4, hidden)
    up = torch.randn(3 * hidden + 1024, 4)
    sd = {"lora_unet_single_blocks_1_linear1.lora_down.weight": down,
          "lora_unet_single_blocks_1_linear1.lora_up.weight": up,
          "lora_unet_single_blocks_1_linear1.alpha": torch.tensor(2.0)}
    deltas = _deltas(model, sd)
    full = (up @ down) * 0.5
    b = "single_transformer_blocks.1."
    torch.testing.assert_close(deltas[b + "attn.to_k"], full[hidden:2 * hidden])
    torch.testing.assert_close(deltas[b + "proj_mlp"], full[3 * hidden:])


def test_unmatched_keys_error_lists_them_or_warn(tiny_model, tmp_path):
    model = tiny_model("krea2")
    sd, _ = example_lora(model, get_arch("krea2"), style="native", rank=4)
    sd["diffusion_model.blocks.9.attn.wq.lora_A.weight"] = torch.zeros(4, 256)  # block 9 of a 2-block model
    sd["diffusion_model.blocks.9.attn.wq.lora_B.weight"] = torch.zeros(256, 4)
    path = tmp_path / "extra.safetensors"
    save_file(sd, str(path))
    with pytest.raises(LoraError, match=r"extra\.safetensors.*blocks\.9\.attn\.wq\.lora_A\.weight.*strict=false"):
        lora.attach(copy.deepcopy(model), path)
    with pytest.warns(UserWarning, match=r"blocks\.9\.attn\.wq"):
        handle = lora.attach(model, path, strict=False)
    assert len(handle.layers) == 16 and handle.skipped


def test_shape_mismatch_names_file_key_and_layer(tiny_model):
    model = tiny_model("krea2")
    sd = {"diffusion_model.blocks.0.attn.wq.lora_A.weight": torch.zeros(4, 100),
          "diffusion_model.blocks.0.attn.wq.lora_B.weight": torch.zeros(256, 4)}
    with pytest.raises(LoraError, match=r"<state dict> \[diffusion_model\.blocks\.0\.attn\.wq\.lora_B\.weight\].*"
                                        r"transformer_blocks\.0\.attn\.to_q"):
        lora.attach(model, sd)


def test_unsupported_adapter_types_are_named(tiny_model):
    model = tiny_model("krea2")
    sd = {"lora_unet_blocks_0_attn_wq.lokr_w1": torch.zeros(4, 4), "lora_unet_blocks_0_attn_wq.lokr_w2": torch.zeros(64, 64)}
    with pytest.raises(LoraError, match="lokr_w1"):
        lora.attach(model, sd)


def test_dora_is_baked_with_a_warning_naming_the_layer(tiny_model):
    model = tiny_model("krea2")
    api.quantize(model, {"default": {"format": "int8"}})
    q = model.get_submodule("transformer_blocks.0.attn.to_q")
    before = {k: getattr(q, k).clone() for k in q._quant_names}
    w = q.dequantize()
    sd = {"diffusion_model.blocks.0.attn.wq.lora_A.weight": torch.randn(4, 256) * 0.3,
          "diffusion_model.blocks.0.attn.wq.lora_B.weight": torch.randn(256, 4) * 0.3,
          "diffusion_model.blocks.0.attn.wq.dora_scale": w.norm(dim=1, keepdim=True) * 1.1}
    with pytest.warns(UserWarning, match=r"transformer_blocks\.0\.attn\.to_q.*DORA"):
        handle = lora.attach(model, sd, name="d")
    assert handle.baked == ["transformer_blocks.0.attn.to_q"] and not handle.layers
    assert not torch.equal(q.weight, before["weight"])
    lora.remove(model, "d")  # exact: the pre-bake tensors come back
    assert all(torch.equal(getattr(q, k), t) for k, t in before.items())


def test_peft_alpha_from_diffusers_metadata(tiny_model, tmp_path):
    model = tiny_model("krea2")
    sd, meta = example_lora(model, get_arch("krea2"), style="peft", rank=4, alpha=2.0)
    path = tmp_path / "p.safetensors"
    save_file(sd, str(path), metadata=meta)
    data, _ = lora.load(model, path)
    assert data.alphas == [2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lora.load(model, path, alpha=8.0)[0].alphas == [8.0]


def test_names_without_an_arch_map_match_as_written_or_by_kohya_underscores():
    from torch import nn

    from lowbit_pipe.lora.files import _generic_targets

    linears = {"blocks.0.attn.to_q": nn.Linear(2, 2), "proj_out": nn.Linear(2, 2)}
    assert _generic_targets("transformer.blocks.0.attn.to_q", linears) == [("blocks.0.attn.to_q", None)]
    assert _generic_targets("base_model.model.blocks.0.attn.to_q", linears) == [("blocks.0.attn.to_q", None)]
    assert _generic_targets("lora_unet_blocks_0_attn_to_q", linears) == [("blocks.0.attn.to_q", None)]
    assert _generic_targets("proj_out", linears) == [("proj_out", None)]
    assert _generic_targets("unet.blocks.0.attn.to_k", linears) == []
