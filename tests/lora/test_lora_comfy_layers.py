"""LoRA attach on a model as ComfyUI's "Load Diffusion Model" builds a quantized checkpoint, without ComfyUI.

There every Linear is comfy.ops' mixed-precision Linear: an nn.Module that is NOT an nn.Linear, with
`in_features` / `out_features` and a `weight` that is a comfy-kitchen QuantizedTensor (logical shape,
packed storage) or a plain float tensor, under native (ComfyUI / BFL) names. `MixedLinear` below stands
in for it (real comfy-kitchen QuantizedTensors, F.linear forward), so this runs in CI's default run; the
real ComfyUI loader is checked in test_lora_comfyui.py (slow).

Oracle: the example LoRA written in native style names the ComfyUI module itself, with its full fused
rows (FLUX qkv / linear1), so its delta is alpha / rank * up @ down with no name mapping at all. Every
style of the same seed describes the same LoRA; each must give, per layer, the layer's own output plus
strength * x @ delta^T.
"""

from __future__ import annotations

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor
from torch import nn

from lowbit_pipe import lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.comfy.tree import structural_copy
from lowbit_pipe.lora import LoraError
from lowbit_pipe.lora.make_example import STYLES, example_lora

STRENGTH = 0.8
LAYOUT = "TensorWiseINT8Layout"


class MixedLinear(nn.Module):
    """What comfy.ops.mixed_precision_ops builds for a Linear: no nn.Linear; weight quantized or float."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = QuantizedTensor.from_float(weight, LAYOUT) if quantize else weight.clone()
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def comfy_like(model: nn.Module, arch_id: str) -> nn.Module:
    """The diffusers model's weights in native names, every 2-D weight a MixedLinear (block layers
    quantized), other tensors plain parameters."""
    state = get_arch(arch_id).state_dict_to_native({k: v.detach() for k, v in model.state_dict().items()})
    root = nn.Module()

    def owner(path: str) -> nn.Module:
        mod = root
        for part in path.split(".") if path else []:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        return mod

    linears = {k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dim() == 2}
    for name in sorted(linears):
        parent, _, attr = name.rpartition(".")
        owner(parent).add_module(attr, MixedLinear(state[f"{name}.weight"], state.get(f"{name}.bias"),
                                                   quantize="blocks." in name))
    for key, value in state.items():
        if key.rsplit(".", 1)[0] not in linears:
            parent, _, attr = key.rpartition(".")
            owner(parent).register_parameter(attr, nn.Parameter(value.clone(), requires_grad=False))
    return root.eval()


def native_oracle(model: nn.Module, arch_id: str, **kw) -> dict[str, torch.Tensor]:
    """{native module: fp64 delta W at strength 1} from the native-style file of the same seed."""
    sd, _ = example_lora(model, get_arch(arch_id), style="native", **kw)
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."): -len(".lora_A.weight")]
            down, up = sd[key].double(), sd[key.replace("lora_A", "lora_B")].double()
            alpha = float(sd[key.replace("lora_A.weight", "alpha")])
            out[module] = up @ down * (alpha / down.shape[0])
    return out


@pytest.mark.parametrize("arch_id", ["krea2", "flux1"])
def test_every_file_style_attaches_exactly_to_comfyui_quantized_layers(tiny_model, arch_id):
    model = tiny_model(arch_id)
    tree = comfy_like(model, arch_id)
    kw = {"rank": 4, "seed": 11, "rel": 0.02}
    oracle = native_oracle(model, arch_id, **kw)
    layers = {n: m for n, m in tree.named_modules() if n in oracle}
    assert layers and all(isinstance(m.weight.data, QuantizedTensor) for m in layers.values())
    assert not any(isinstance(m, nn.Linear) for m in layers.values())
    if arch_id == "flux1":
        assert "double_blocks.0.img_attn.qkv" in oracle and "single_blocks.0.linear1" in oracle
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(5, m.in_features, generator=gen) for n, m in layers.items()}
    with torch.no_grad():
        base = {n: layers[n](x) for n, x in inputs.items()}
    for style in STYLES:
        attached = structural_copy(tree)  # what the LoRA node attaches to: new modules, the same tensors
        sd, meta = example_lora(model, get_arch(arch_id), style=style, **kw)
        handle = lora.attach(attached, sd, strength=STRENGTH, name=style)
        assert sorted(handle.layers) == sorted(oracle), style
        for name, x in inputs.items():
            layer = attached.get_submodule(name)
            with torch.no_grad():
                got = layer(x).double()
            want = base[name].double() + STRENGTH * (x.double() @ oracle[name].T)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{style} {name}")
            assert layer.weight is layers[name].weight  # the quantized weight untouched, shared
        handle.remove()
        for name, x in inputs.items():  # off again: the layer's own output bit for bit
            with torch.no_grad():
                assert torch.equal(attached.get_submodule(name)(x), base[name]), f"{style} {name}"


def test_a_fused_native_pair_split_onto_parts_drops_the_columns_a_part_does_not_use(tiny_model):
    """A block-diagonal fused qkv pair (the residual export's) gives each diffusers part only its own rank."""
    model = tiny_model("flux1")
    hidden, r = 256, 3
    downs = [torch.randn(r, hidden) for _ in range(3)]
    ups = [torch.randn(hidden, r) for _ in range(3)]
    up = torch.zeros(3 * hidden, 3 * r)
    for i in range(3):
        up[i * hidden:(i + 1) * hidden, i * r:(i + 1) * r] = ups[i]
    sd = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": torch.cat(downs),
          "diffusion_model.double_blocks.0.img_attn.qkv.lora_B.weight": up}
    data, _ = lora.load(model, sd)
    by = {f.module: f for f in data.layers}
    for i, part in enumerate(["to_q", "to_k", "to_v"]):
        f = by[f"transformer_blocks.0.attn.{part}"]
        assert f.rank == r
        torch.testing.assert_close(f.delta_weight(), ups[i] @ downs[i], rtol=1e-6, atol=1e-6)


def test_a_dora_on_a_comfyui_quantized_layer_is_refused_before_anything_changes(tiny_model):
    model = tiny_model("krea2")
    tree = comfy_like(model, "krea2")
    layer = tree.get_submodule("blocks.0.attn.wq")
    sd = {"diffusion_model.blocks.0.attn.wo.lora_A.weight": torch.randn(4, 256),
          "diffusion_model.blocks.0.attn.wo.lora_B.weight": torch.randn(256, 4),
          "diffusion_model.blocks.0.attn.wq.lora_A.weight": torch.randn(4, 256),
          "diffusion_model.blocks.0.attn.wq.lora_B.weight": torch.randn(256, 4),
          "diffusion_model.blocks.0.attn.wq.dora_scale": torch.rand(256, 1) + 1}
    with pytest.raises(LoraError, match=r"cannot bake a LoRA into 'blocks\.0\.attn\.wq'.*QuantizedTensor"):
        lora.attach(tree, sd)
    assert not any(isinstance(m, lora.LoraStack) for m in tree.modules()) and "lora" not in layer._modules


def test_a_shape_error_on_a_natively_named_model_names_the_native_layer(tiny_model):
    tree = comfy_like(tiny_model("krea2"), "krea2")
    sd = {"diffusion_model.blocks.0.attn.wk.lora_A.weight": torch.randn(4, 256),
          "diffusion_model.blocks.0.attn.wk.lora_B.weight": torch.randn(256, 4)}
    with pytest.raises(LoraError, match=r"wk\.lora_B\.weight\].*'blocks\.0\.attn\.wk' \(diffusers "
                                        r"'transformer_blocks\.0\.attn\.to_k'\) \(128x256\)"):
        lora.attach(tree, sd)
