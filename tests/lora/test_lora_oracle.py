"""LoRA residual branches against the real library: peft (through diffusers' loader) on the float model.

The oracle converts our generated file with diffusers' own converter (kohya FLUX with fused qkv /
linear1 and alpha; Krea 2 native names), loads it with peft and gives the float LoRA delta.
Residual mode on the quantized model must reproduce that delta.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.quant.nn import QuantLinear

STRENGTH = 0.7
# diffusers' kohya FLUX converter hard-codes the real model's linear1 split (3072 x 3 + 12288), so the
# oracle covers the double blocks (fused img / txt qkv); linear1 splits are checked in test_lora_files.
PATTERN = {"flux1": r"^transformer_blocks\.\d+\.", "krea2": None}


def _oracle_state(arch_id: str, sd: dict) -> dict:
    from diffusers.loaders import lora_conversion_utils as conv

    if arch_id == "flux1":
        return conv._convert_kohya_flux_lora_to_diffusers(dict(sd))
    return conv._convert_non_diffusers_krea2_lora_to_diffusers({k: v for k, v in sd.items() if not k.endswith(".alpha")})


def _peft_model(model: nn.Module, state: dict) -> nn.Module:
    peft_model = copy.deepcopy(model)
    peft_model.load_lora_adapter(state, prefix="transformer", adapter_name="oracle")
    peft_model.set_adapters(["oracle"], [STRENGTH])
    return peft_model


def _base(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own output without its LoRA stack."""
    if isinstance(layer, QuantLinear):
        return layer.format.linear(x, layer.qweight, layer.bias)
    return nn.functional.linear(x, layer.weight, layer.bias)


def _inputs(arch_id: str, model: nn.Module, seed: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    return get_arch(arch_id).example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                            generator=torch.Generator().manual_seed(seed), dtype=dtype, device="cpu")


def _out(arch_id: str, model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return get_arch(arch_id).output_tensor(model(**inputs)).double()


# svdquant_w4a4: the LoRA branch beside the format's own low-rank branch, both exact.
CASES = [("flux1", "kohya", "int8"), ("krea2", "native", "fp8"), ("krea2", "native", "svdquant_w4a4")]


@pytest.mark.parametrize("arch_id, style, fmt", CASES)
def test_residual_matches_peft_at_module_level(tiny_model, arch_id, style, fmt):
    model = tiny_model(arch_id)
    alpha = None if arch_id == "flux1" else 8.0  # krea2 converter drops alpha keys: use alpha = rank there
    sd, _ = example_lora(model, get_arch(arch_id), style=style, rank=8, seed=1, alpha=alpha, pattern=PATTERN[arch_id])
    peft_model = _peft_model(model, _oracle_state(arch_id, sd))
    quant = copy.deepcopy(model)
    api.quantize(quant, {"default": {"format": fmt}})
    handle = lora.attach(quant, sd, strength=STRENGTH, name="a")
    assert handle.layers and (handle.alphas == [4.0] if arch_id == "flux1" else True)
    checked = 0
    gen = torch.Generator().manual_seed(0)
    for name in handle.layers:
        q = quant.get_submodule(name)
        p = peft_model.get_submodule(name)
        x = torch.randn(5, q.in_features, generator=gen)
        with torch.no_grad():
            ours = q(x) - _base(q, x)
            theirs = p(x) - p.base_layer(x)
        assert theirs.abs().max() > 0
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=f"{name}")
        checked += isinstance(q, QuantLinear)
    assert checked > 0


@pytest.mark.parametrize("arch_id, style", [("flux1", "kohya"), ("krea2", "native")])
def test_residual_on_float_model_equals_peft_at_model_level(tiny_model, arch_id, style):
    """No quantization: our branches (forward hooks on float Linears) vs peft, whole-model output (fp64, so
    the comparison is not drowned in fp32 rounding of the base output)."""
    model = tiny_model(arch_id).double()
    alpha = None if arch_id == "flux1" else 8.0
    sd, _ = example_lora(model, get_arch(arch_id), style=style, rank=8, seed=2, alpha=alpha, pattern=PATTERN[arch_id],
                         rel=0.02)  # large enough to stand out of fp32 noise at the output
    peft_model = _peft_model(model, _oracle_state(arch_id, sd))
    ours = copy.deepcopy(model)
    lora.attach(ours, sd, strength=STRENGTH, name="a")
    inputs = _inputs(arch_id, model, dtype=torch.float64)
    base = _out(arch_id, model, inputs)
    d_peft = _out(arch_id, peft_model, inputs) - base
    d_ours = _out(arch_id, ours, inputs) - base
    assert d_peft.norm() > 1e-4 * base.norm()
    # peft keeps its LoRA layers in fp32 (and the converter rescales factors in fp32): that is the floor.
    assert float((d_ours - d_peft).norm() / d_peft.norm()) < 5e-5


def test_quantized_model_output_delta_equals_peft_on_its_dequantized_weights(tiny_model):
    """Model level, exact: on the quantized tiny Krea 2 (NVFP4 weight-only), (Q + LoRA) - Q equals
    peft's (F' + LoRA) - F' where F' is the float model holding the dequantized weights Q computes with."""
    arch_id = "krea2"
    model = tiny_model(arch_id)
    sd, _ = example_lora(model, get_arch(arch_id), style="native", rank=8, seed=4, alpha=8.0, rel=0.02)
    quant = copy.deepcopy(model)
    api.quantize(quant, {"default": {"format": "nvfp4", "activations": "none"}})
    deq = copy.deepcopy(model)
    with torch.no_grad():
        for name, q in quant.named_modules():
            if isinstance(q, QuantLinear):
                deq.get_submodule(name).weight.copy_(q.dequantize())
    inputs = _inputs(arch_id, model)
    d_oracle = _out(arch_id, _peft_model(deq, _oracle_state(arch_id, sd)), inputs) - _out(arch_id, deq, inputs)
    base_q = _out(arch_id, quant, inputs)
    lora.attach(quant, sd, strength=STRENGTH, name="a")
    d_ours = _out(arch_id, quant, inputs) - base_q
    assert float((d_ours - d_oracle).norm() / d_oracle.norm()) < 2e-3  # fp32 rounding of the outputs
    lora.remove(quant, "a")
    assert torch.equal(_out(arch_id, quant, inputs), base_q)


def test_quantized_output_delta_tracks_float_delta_unlike_a_bake(tiny_model):
    """Against the real float model + peft: the residual keeps the delta to first order (a quantized base
    shifts it by ~quant error x delta through the nonlinear network); a standard NVFP4 bake of the same
    LoRA at a realistic scale (0.4% of amax) turns it into requantization noise."""
    arch_id = "krea2"
    model = tiny_model(arch_id)
    sd, _ = example_lora(model, get_arch(arch_id), style="native", rank=8, seed=4, alpha=8.0)
    inputs = _inputs(arch_id, model)
    d_float = _out(arch_id, _peft_model(model, _oracle_state(arch_id, sd)), inputs) - _out(arch_id, model, inputs)
    quant = copy.deepcopy(model)
    api.quantize(quant, {"default": {"format": "nvfp4", "activations": "none"}})
    base_q = _out(arch_id, quant, inputs)
    lora.attach(quant, sd, strength=STRENGTH, name="a")
    err_res = float(((_out(arch_id, quant, inputs) - base_q) - d_float).norm() / d_float.norm())
    lora.remove(quant, "a")
    lora.bake_files(quant, [(sd, STRENGTH)], mode="standard")
    err_bake = float(((_out(arch_id, quant, inputs) - base_q) - d_float).norm() / d_float.norm())
    assert err_res < 0.3 and err_bake > 5 * err_res, (err_res, err_bake)


def test_ledger_mirrors_lora_on_float_originals(tiny_model):
    """Evaluate's float reference swaps the ledger's float originals back: they carry the LoRA too."""
    from lowbit_pipe.lora.branches import stack_of

    model = tiny_model("krea2")
    sd, _ = example_lora(model, get_arch("krea2"), style="peft", rank=4, seed=5)
    ledger = Ledger()
    api.quantize(model, {"default": {"format": "int8"}}, ledger=ledger)
    handle = lora.attach(model, sd, name="a", ledger=ledger)
    name = handle.layers[0]
    original = ledger.original(name)
    q = model.get_submodule(name)
    assert isinstance(q, QuantLinear) and isinstance(original, nn.Linear)
    assert stack_of(original).names() == ["a"]
    x = torch.randn(3, q.in_features)
    with torch.no_grad():
        torch.testing.assert_close(original(x) - _base(original, x), q(x) - _base(q, x), rtol=1e-4, atol=1e-6)
    lora.set_strength(model, "a", 0.25)
    assert stack_of(original).branches[0].strength == 0.25
    del handle  # the test's own reference; teardown proves the stacks die
    report = ledger.unwind()
    assert not report.errors and not any("lora" in u for u in report.unfreed), report.as_dict()
    assert stack_of(original) is None and not original._forward_hooks
