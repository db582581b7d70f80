"""Models whose modules carry native (ComfyUI / BFL) names, as a ComfyUI diffusion model does: detected
by their keys, planned by the arch's lists, quantized, given LoRAs and exported exactly as the same model
in diffusers names would be."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import native_module
from safetensors.torch import load_file

import lowbit_pipe
from lowbit_pipe import lora
from lowbit_pipe.arch import detect_module, get_arch
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.quant.nn import QuantLinear


def _native_twin(tmp_path, arch_id: str, fmt: str):
    """(diffusers-path export, the float model as a native tree)."""
    recipe = "flux1_fp8" if arch_id == "flux1" else "default"
    overrides = [f"quantize.default.format={fmt}", "quantize.default.activations=dynamic"]
    floating = lowbit_pipe.run(recipe, ["pipeline=[load,detect,export]", "export.path=" + str(tmp_path / "f.safetensors")],
                               run_dir=tmp_path / "float")
    quant = lowbit_pipe.run(recipe, ["pipeline=[load,detect,quantize,export]", *overrides,
                                     "export.path=" + str(tmp_path / "q.safetensors")], run_dir=tmp_path / "quant")
    return quant, native_module(load_file(floating.export_path)), overrides


@pytest.mark.parametrize("arch_id, fmt", [("krea2", "int8"), ("flux1", "fp8"), ("flux1", "nvfp4")])
def test_a_native_tree_quantizes_and_exports_like_the_diffusers_model(tmp_path, arch_id, fmt):
    quant, tree, overrides = _native_twin(tmp_path, arch_id, fmt)
    found = detect_module(tree)
    assert found is not None and found.arch.id == arch_id and found.native
    out = tmp_path / "native.safetensors"
    run = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export,teardown]", *overrides,
                                      f"export.path={out}"], model=tree, run_dir=tmp_path / "native")
    assert run.report["detect"]["names"] == "native" and "skipped" not in run.report["stages"].get("quantize", {})
    a, b = load_file(quant.export_path), load_file(str(out))
    assert a.keys() == b.keys()  # the same layers quantized, the same native names
    quantized = [k for k in a if k.endswith(".comfy_quant")]
    assert quantized and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                             for k in a if k.rsplit(".", 1)[0] + ".comfy_quant" in a), "quantized tensors differ"
    assert not any(isinstance(m, QuantLinear) for m in tree.modules())  # teardown gave the caller its float tree


def test_loras_on_a_native_tree_match_the_diffusers_model(tmp_path, tiny_model):
    """A diffusers/peft LoRA (separate to_q / to_k / to_v) and a kohya one in native names, on the fused
    native qkv of FLUX: each native layer's LoRA delta is its diffusers parts' deltas, row for row."""
    model = tiny_model("flux1")
    arch = get_arch("flux1")
    from lowbit_pipe.files import layout

    cfg = arch.config_from_model(model)
    tree = native_module(layout.to_native({k: v.detach() for k, v in model.state_dict().items()}, arch, cfg, {}))
    peft_sd, _ = example_lora(model, arch, style="peft", rank=4, seed=1)
    kohya_sd, _ = example_lora(model, arch, style="kohya", rank=8, seed=2)
    ours = copy.deepcopy(model)
    for sd, name in ((peft_sd, "a"), (kohya_sd, "b")):
        lora.attach(ours, sd, strength=0.7, name=name)
        handle = lora.attach(tree, sd, strength=0.7, name=name)
        assert handle.layers
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for native, layer in tree.named_modules():
        if not isinstance(layer, torch.nn.Linear) or "lora" not in layer._modules:
            continue
        x = torch.randn(3, layer.in_features, generator=gen)
        with torch.no_grad():
            got = layer(x) - torch.nn.functional.linear(x, layer.weight, layer.bias)
            parts = []
            for module, rows in arch.from_native_name(native, cfg):
                d = ours.get_submodule(module)
                parts.append(d(x) - torch.nn.functional.linear(x, d.weight, d.bias))
            want = torch.cat(parts, dim=-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        checked += len(parts) > 1
    assert checked > 0  # fused layers were among them


def test_a_target_recipe_on_a_native_tree_is_refused_before_any_weight_changes(tmp_path):
    """quantize.target times and probes the diffusers forward: on a natively named tree (what ComfyUI's Quantize
    node passes) it is refused naming the key and the way that works, and the tree is left as it was."""
    from lowbit_pipe.errors import StageError

    _, tree, _ = _native_twin(tmp_path, "krea2", "int8")
    before = {n: p.detach().clone() for n, p in tree.named_parameters()}
    with pytest.raises(StageError) as info:
        lowbit_pipe.run("krea2_auto_speed_tiny", ["pipeline=[load,detect,quantize]"], model=tree,
                        run_dir=tmp_path / "native")
    message = str(info.value)
    assert "quantize.target" in message and "ComfyUI's native names" in message and "CLI" in message
    assert not any(isinstance(m, QuantLinear) for m in tree.modules())
    assert all(torch.equal(p, before[n]) for n, p in tree.named_parameters())
