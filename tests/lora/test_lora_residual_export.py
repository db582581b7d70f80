"""The residual LoRA file is named as the exported checkpoint is, and loads back to the same branches.

export.layout=comfy (the default): `diffusion_model.<native module>` keys, the modules of the model file,
FLUX's fused qkv / linear1 as one exact pair (shared downs once, other parts block-diagonal);
export.layout=diffusers: peft keys. Both reload (lowbit_pipe.lora.attach at strength 1) to the branches
they were written from, on the lowbit_pipe model and on a natively named (ComfyUI-style) one. What stock
ComfyUI makes of the same files is checked against ComfyUI itself in test_lora_comfyui.py (slow).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_lora_comfy_layers import comfy_like

import lowbit_pipe
from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.comfy.tree import structural_copy
from lowbit_pipe.lora.make_example import example_lora


def distinct_peft(model, arch, seed: int) -> dict[str, torch.Tensor]:
    """The example peft LoRA with a down of its own per diffusers module (the example shares one per fused
    native module)."""
    sd, _ = example_lora(model, arch, style="peft", rank=3, seed=seed, rel=0.02)
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=gen) / v.shape[1] ** 0.5 if k.endswith("lora_A.weight") else v)
            for k, v in sd.items()}


def with_two_loras(model, arch, source=None):
    """Two adapters on `model`, drawn for the diffusers model `source` (default: `model` itself)."""
    source = source if source is not None else model
    lora.attach(model, example_lora(source, arch, style="kohya", rank=4, seed=1, rel=0.02)[0], name="k", strength=0.7)
    lora.attach(model, distinct_peft(source, arch, 2), name="p", strength=0.4)
    return model


def branch_deltas(model) -> dict[str, torch.Tensor]:
    return {name: s.up.double() @ s.down.double() for name, s in lora.export.residual_stacks(model).items()}


def layer_outputs(model, names, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    with torch.no_grad():
        for name in names:
            layer = model.get_submodule(name)
            out[name] = layer(torch.randn(4, layer.in_features, generator=gen))
    return out


def file_pairs(path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict]:
    sd = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lowbit_pipe_lora"])
    pairs = {k[: -len(".lora_A.weight")]: (sd[k], sd[k.replace("lora_A", "lora_B")]) for k in sd
             if k.endswith(".lora_A.weight")}
    assert len(sd) == 2 * len(pairs) and not any(k.endswith(".alpha") for k in sd)
    return pairs, meta


@pytest.mark.parametrize("arch_id", ["krea2", "flux1"])
def test_the_comfy_layout_export_writes_native_keys_that_reload_to_the_branches(tiny_model, tmp_path, arch_id):
    model = tiny_model(arch_id)
    arch = get_arch(arch_id)
    config = arch.config_from_model(model)
    api.quantize(model, {"default": {"format": "int8"}})
    pristine = copy.deepcopy(model)
    with_two_loras(model, arch)
    figures = lowbit_pipe.export(model, tmp_path / "model.safetensors")
    pairs, meta = file_pairs(figures["lora_path"])
    assert meta["key_style"] == "native" and meta["scale_folded"] and sorted(meta["adapters"]) == ["k", "p"]
    with safe_open(figures["path"], "pt") as f:
        model_keys = set(f.keys())
    assert all(k.startswith("diffusion_model.") and k[len("diffusion_model."):] + ".weight" in model_keys
               for k in pairs), sorted(pairs)

    # Oracle: each native pair's up @ down is the branches' deltas at their rows (zero elsewhere).
    deltas = branch_deltas(model)
    for key, (down, up) in pairs.items():
        native = key[len("diffusion_model."):]
        want = torch.zeros(up.shape[0], down.shape[1], dtype=torch.float64)
        for name, delta in deltas.items():
            target, rows = arch.to_native(name, config)
            if target == native:
                want[rows if rows is not None else slice(None)] += delta
        torch.testing.assert_close(up.double() @ down.double(), want, rtol=1e-6, atol=1e-9, msg=native)
    if arch_id == "flux1":
        down, up = pairs["diffusion_model.double_blocks.0.img_attn.qkv"]
        # kohya: one down (rank 4) shared by q, k, v; the distinct peft parts: rank 3 each, block-diagonal
        assert tuple(down.shape) == (13, 256) and tuple(up.shape) == (768, 13)
        assert not up[:256, 7:].any() and not up[256:512, 4:7].any() and not up[512:, 4:10].any()
        assert tuple(pairs["diffusion_model.single_blocks.0.linear1"][1].shape) == (1792, 16)

    names = sorted(deltas)
    want = layer_outputs(model, names)
    handle = lora.attach(pristine, figures["lora_path"], name="file")
    assert sorted(handle.layers) == names
    if arch_id == "flux1":  # a part keeps only the rank columns its rows use
        assert pristine.get_submodule("transformer_blocks.0.attn.to_k").lora.rank == 7
    got = layer_outputs(pristine, names)
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch_id", ["krea2", "flux1"])
def test_the_diffusers_layout_export_keeps_peft_keys(tiny_model, tmp_path, arch_id):
    model = tiny_model(arch_id)
    arch = get_arch(arch_id)
    api.quantize(model, {"default": {"format": "int8"}})
    pristine = copy.deepcopy(model)
    with_two_loras(model, arch)
    figures = lowbit_pipe.export(model, tmp_path / "model.safetensors", layout="diffusers")
    pairs, meta = file_pairs(figures["lora_path"])
    deltas = branch_deltas(model)
    assert meta["key_style"] == "diffusers" and sorted(pairs) == sorted(f"transformer.{n}" for n in deltas)
    for name, delta in deltas.items():
        down, up = pairs[f"transformer.{name}"]
        torch.testing.assert_close(up.double() @ down.double(), delta, rtol=1e-6, atol=1e-9, msg=name)
    want = layer_outputs(model, sorted(deltas))
    lora.attach(pristine, figures["lora_path"])
    got = layer_outputs(pristine, sorted(deltas))
    for name in deltas:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch_id", ["krea2", "flux1"])
def test_a_natively_named_model_writes_both_layouts_exactly(tiny_model, tmp_path, arch_id):
    """A ComfyUI model's branches sit on native (fused) layers: the native file keeps them, the diffusers one
    cuts a fused pair into its parts; both reload to the same layer outputs, on either naming."""
    model = tiny_model(arch_id)
    arch = get_arch(arch_id)
    tree = comfy_like(model, arch_id)
    pristine_tree = structural_copy(tree)
    with_two_loras(tree, arch, source=model)
    deltas = branch_deltas(tree)  # native module names
    want = layer_outputs(tree, sorted(deltas))
    if arch_id == "flux1":
        assert "double_blocks.0.img_attn.qkv" in deltas
    for layout, prefix in (("native", "diffusion_model."), ("diffusers", "transformer.")):
        path = tmp_path / f"{layout}.safetensors"
        assert lora.save_residual_lora(tree, path, layout) == path.stat().st_size
        pairs, meta = file_pairs(path)
        assert meta["key_style"] == layout and all(k.startswith(prefix) for k in pairs)
        if layout == "native":
            assert sorted(pairs) == sorted(prefix + n for n in deltas)
        else:
            assert "transformer.transformer_blocks.0.attn.to_q" in pairs
            assert not any(".qkv" in k or "linear1" in k or k.startswith("transformer.blocks.") for k in pairs)
        again = structural_copy(pristine_tree)
        lora.attach(again, path)
        got = layer_outputs(again, sorted(deltas))
        for name in deltas:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=f"{layout} {name}")
        on_diffusers = copy.deepcopy(model)  # the same file on the diffusers-named float model
        lora.attach(on_diffusers, path)
        for name, delta in branch_deltas(on_diffusers).items():
            target, rows = arch.to_native(name, arch.config_from_model(model))
            torch.testing.assert_close(delta, deltas[target][rows if rows is not None else slice(None)],
                                       rtol=1e-6, atol=1e-9, msg=f"{layout} {name}")


def test_an_unknown_layout_is_refused(tiny_model, tmp_path):
    model = tiny_model("krea2")
    lora.attach(model, example_lora(model, get_arch("krea2"), style="peft", rank=2)[0])
    with pytest.raises(ValueError, match="residual LoRA layout 'comfy'"):
        lora.save_residual_lora(model, tmp_path / "x.safetensors", "comfy")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_branch_on_a_swapped_modulation_round_trips_in_both_namings(tiny_model, tmp_path):
    """FLUX `norm_out.linear` is native `final_layer.adaLN_modulation.1` with its (scale, shift) halves
    swapped: the native file's lora_B rows are swapped too, and every reader swaps them back."""
    model = tiny_model("flux1")
    tree = comfy_like(model, "flux1")
    gen = torch.Generator().manual_seed(4)
    sd = {"transformer.norm_out.linear.lora_A.weight": torch.randn(3, 256, generator=gen) * 0.1,
          "transformer.norm_out.linear.lora_B.weight": torch.randn(512, 3, generator=gen) * 0.1}
    x = torch.randn(2, 256, generator=gen)

    def swapped(t):
        return torch.cat([t[..., 256:], t[..., :256]], dim=-1)

    with torch.no_grad():  # the oracle of the naming itself: native rows = diffusers rows, halves swapped
        native = tree.get_submodule("final_layer.adaLN_modulation.1")
        torch.testing.assert_close(native(x), swapped(model.norm_out.linear(x)))
    lora.attach(model, sd, name="mod")
    with torch.no_grad():
        want = model.norm_out.linear(x)
    path = tmp_path / "native.safetensors"
    lora.save_residual_lora(model, path, "native")
    pairs, _ = file_pairs(path)
    down, up = pairs["diffusion_model.final_layer.adaLN_modulation.1"]
    branch = lora.export.residual_stacks(model)["norm_out.linear"]
    torch.testing.assert_close(up, torch.cat([branch.up[256:], branch.up[:256]]), rtol=0, atol=0)
    again = tiny_model("flux1")
    lora.attach(again, path)
    on_tree = structural_copy(tree)
    lora.attach(on_tree, path)
    with torch.no_grad():
        torch.testing.assert_close(again.norm_out.linear(x), want, rtol=1e-5, atol=1e-6)
        native = on_tree.get_submodule("final_layer.adaLN_modulation.1")
        torch.testing.assert_close(native(x), swapped(want), rtol=1e-5, atol=1e-6)
    lora.save_residual_lora(on_tree, tmp_path / "back.safetensors", "diffusers")  # native model -> peft keys
    back, _ = file_pairs(tmp_path / "back.safetensors")
    torch.testing.assert_close(back["transformer.norm_out.linear"][1], branch.up, rtol=1e-6, atol=0)
