"""Swap on a loaded quantized model: add, remove, re-weight; exact removal; dtype / device; ledger; export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.branches import stack_of
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.quant.nn import QuantLinear


def _setup(tiny_model, fmt="nvfp4", ledger=None):
    model = tiny_model("krea2")
    api.quantize(model, {"default": {"format": fmt}}, ledger=ledger)
    arch = get_arch("krea2")
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(1), dtype=torch.float32, device="cpu")
    return model, arch, inputs


def _out(arch, model, inputs):
    with torch.no_grad():
        return arch.output_tensor(model(**inputs))


def test_add_reweight_remove_is_exact(tiny_model):
    model, arch, inputs = _setup(tiny_model)
    base = _out(arch, model, inputs)
    a, _ = example_lora(model, arch, style="kohya", rank=4, seed=1, rel=0.01)
    b, _ = example_lora(model, arch, style="peft", rank=8, seed=2, rel=0.01)
    lora.attach(model, a, name="a", strength=1.0)
    only_a = _out(arch, model, inputs)
    lora.attach(model, b, name="b", strength=0.5)
    q = model.get_submodule("transformer_blocks.0.attn.to_q")
    assert isinstance(q, QuantLinear) and stack_of(q).rank == 12 and stack_of(q).names() == ["a", "b"]
    both = _out(arch, model, inputs)
    assert not torch.allclose(both, only_a)
    lora.set_strength(model, "b", 0.0)
    torch.testing.assert_close(_out(arch, model, inputs), only_a, rtol=1e-5, atol=1e-6)
    lora.set_strength(model, "b", 0.5)
    torch.testing.assert_close(_out(arch, model, inputs), both, rtol=1e-5, atol=1e-6)
    lora.remove(model, "b")
    assert torch.equal(_out(arch, model, inputs), only_a)  # one branch left: same pair as attaching it alone
    lora.remove(model, "a")
    assert torch.equal(_out(arch, model, inputs), base)  # bit-exact
    with pytest.raises(KeyError, match="no LoRA named 'a'"):
        lora.remove(model, "a")


def test_branches_follow_dtype_quantized_buffers_do_not(tiny_model):
    model, arch, inputs = _setup(tiny_model, fmt="int8")
    sd, _ = example_lora(model, arch, style="native", rank=4)
    lora.attach(model, sd, name="a")
    q = model.get_submodule("transformer_blocks.0.ff.up")
    model.to(torch.bfloat16)
    stack = stack_of(q)
    assert q.weight.dtype == torch.int8 and q.weight_scale.dtype == torch.float32
    assert stack.down.dtype == stack.up.dtype == torch.bfloat16 and stack.branches[0].down.dtype == torch.bfloat16
    x = torch.randn(3, q.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        assert q(x).dtype == torch.bfloat16
    assert "transformer_blocks.0.ff.up.lora.down" not in model.state_dict()  # non-persistent: export unaffected


def test_ledger_teardown_takes_everything_off(tiny_model):
    ledger = Ledger()
    keys = set(tiny_model("krea2").state_dict())
    model, arch, inputs = _setup(tiny_model, ledger=ledger)
    base = _out(arch, model, inputs)
    sd, _ = example_lora(model, arch, style="native", rank=4, rel=0.01)
    lora.attach(model, sd, name="a", ledger=ledger)
    lora.set_strength(model, "a", 2.0)
    assert not torch.equal(_out(arch, model, inputs), base)
    report = ledger.unwind()
    assert not report.errors and report.retained_bytes == 0, report.as_dict()
    assert not any(isinstance(m, lora.LoraStack) for m in model.modules())
    assert not hasattr(model, "_lowbit_lora") and set(model.state_dict()) == keys  # float again
    assert not any(m._forward_hooks for m in model.modules())


def test_residual_export_round_trip(tiny_model, tmp_path):
    model, arch, inputs = _setup(tiny_model)
    base = _out(arch, model, inputs)
    lora.attach(model, example_lora(model, arch, style="kohya", rank=4, seed=1, rel=0.01)[0], name="a", strength=0.8)
    lora.attach(model, example_lora(model, arch, style="peft", rank=6, seed=2, rel=0.01)[0], name="b", strength=0.3)
    want = _out(arch, model, inputs)
    assert lora.has_residual_lora(model)
    path = tmp_path / "model.lora.safetensors"
    assert lora.save_residual_lora(model, path) == path.stat().st_size
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["lowbit_pipe_lora"])
        assert f.get_tensor("transformer.transformer_blocks.0.attn.to_q.lora_A.weight").shape == (10, 256)
    assert meta["adapters"]["b"]["strength"] == 0.3 and meta["adapters"]["a"]["ranks"] == [4]
    lora.remove(model, "a")
    lora.remove(model, "b")
    assert not lora.has_residual_lora(model) and lora.save_residual_lora(model, tmp_path / "none.safetensors") == 0
    torch.testing.assert_close(_out(arch, model, inputs), base, rtol=0, atol=0)
    lora.attach(model, path, name="merged")  # the exported file alone, strength 1, reproduces the stack
    torch.testing.assert_close(_out(arch, model, inputs), want, rtol=1e-5, atol=1e-6)


def test_float_layers_get_exact_residual_too(tiny_model):
    """Keep-float layers (plain nn.Linear) carry the branch through a forward hook; weights untouched."""
    model, arch, inputs = _setup(tiny_model)
    layer = model.get_submodule("img_in")
    assert type(layer) is torch.nn.Linear
    weight = layer.weight.clone()
    sd = {"diffusion_model.first.lora_A.weight": torch.randn(2, 16), "diffusion_model.first.lora_B.weight": torch.randn(256, 2)}
    lora.attach(model, sd, name="f", strength=0.5)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, layer.bias) + 0.5 * (x @ sd[
            "diffusion_model.first.lora_A.weight"].t()) @ sd["diffusion_model.first.lora_B.weight"].t())
    assert torch.equal(layer.weight, weight)
    lora.remove(model, "f")
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, weight, layer.bias))
