"""The handle API: `handle = lora.attach(model, path, strength=0.8)`, `handle.set_strength(0.5)`, `handle.remove()`;
a handle whose adapter is off the model raises LoraRemovedError from both methods."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora import LoraError, LoraRemovedError
from lowbit_pipe.lora.make_example import example_lora


def _setup(tiny_model, tmp_path, ledger=None):
    model = tiny_model("krea2")
    api.quantize(model, {"default": {"format": "int8"}}, ledger=ledger)
    arch = get_arch("krea2")
    sd, meta = example_lora(model, arch, style="peft", rank=4, seed=3, rel=0.05)
    path = tmp_path / "style.safetensors"
    save_file(sd, str(path), metadata=meta)
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(1), dtype=torch.float32, device="cpu")
    return model, path, inputs


def _out(model, inputs):
    with torch.no_grad():
        return get_arch("krea2").output_tensor(model(**inputs))


def test_handle_set_strength_and_remove(tiny_model, tmp_path):
    model, path, inputs = _setup(tiny_model, tmp_path)
    base = _out(model, inputs)
    oracle = copy.deepcopy(model)
    lora.attach(oracle, path, strength=0.5)  # a fresh attach at the strength the handle is set to
    want = _out(oracle, inputs)

    handle = lora.attach(model, path, strength=0.8)
    assert handle.name == "style" and handle.attached and handle.strength == 0.8
    at_08 = _out(model, inputs)
    assert not torch.allclose(at_08, base)
    handle.set_strength(0.5)
    assert handle.strength == 0.5
    assert torch.equal(_out(model, inputs), want)  # same branches, same folded pair: bit for bit
    handle.set_strength(0.8)
    assert torch.equal(_out(model, inputs), at_08)

    handle.remove()
    assert not handle.attached and "style" not in lora.attached(model)
    assert torch.equal(_out(model, inputs), base)
    with pytest.raises(LoraRemovedError, match=r"LoRA 'style' \(.*style\.safetensors\) was removed"):
        handle.set_strength(0.3)
    with pytest.raises(LoraRemovedError, match="was removed"):
        handle.remove()
    assert isinstance(LoraRemovedError("x"), LoraError)
    assert torch.equal(_out(model, inputs), base)  # the failed calls changed nothing


def test_handle_removed_through_the_module_function_or_replaced_by_a_new_attach(tiny_model, tmp_path):
    model, path, inputs = _setup(tiny_model, tmp_path)
    old = lora.attach(model, path, strength=0.8)
    lora.remove(model, "style")  # the module function still works, and kills the handle
    with pytest.raises(LoraRemovedError, match="was removed"):
        old.set_strength(0.5)
    new = lora.attach(model, path, strength=0.8)  # same name again: the old handle must not reach the new adapter
    with pytest.raises(LoraRemovedError):
        old.remove()
    assert lora.attached(model) == {"style": new} and new.attached
    lora.set_strength(model, "style", 0.25)
    assert new.strength == 0.25
    new.remove()
    with pytest.raises(KeyError, match="no LoRA named 'style'"):
        lora.remove(model, "style")


def test_handle_after_ledger_teardown_raises(tiny_model, tmp_path):
    ledger = Ledger()
    model, path, _ = _setup(tiny_model, tmp_path, ledger)
    handle = lora.attach(model, path, strength=0.8, ledger=ledger)
    handle.set_strength(0.5)
    ledger.undo_all()
    assert not handle.attached
    with pytest.raises(LoraRemovedError, match="no longer attached"):
        handle.set_strength(0.1)
    with pytest.raises(LoraRemovedError, match="no longer attached"):
        handle.remove()
