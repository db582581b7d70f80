"""hadanorm's group row sums: computed once per layer (a non-exported buffer), not from a dequantized weight on every
forward, and never stale: a LoRA bake, a state-dict load or a dtype cast keeps them equal to the weight's."""

from __future__ import annotations

import pytest
import torch

from lowbit_pipe.formats import FormatSpec, QuantizedWeight
from lowbit_pipe.kernels import rotation
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.bake import bake_layer
from lowbit_pipe.quant.nn import QuantLinear


def _layer(fmt: str, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear.from_linear(torch.nn.Linear(256, 64), FormatSpec(fmt, rotation="hadanorm"))


def _bare(layer: QuantLinear) -> QuantizedWeight:
    q = layer.qweight
    return QuantizedWeight(q.format, q.shape, q.tensors, q.record)  # no runtime tensors: row sums from the weight


@pytest.mark.parametrize("fmt", ["int8", "fp8", "nvfp4", "mxfp8"])
def test_forward_uses_the_row_sums_computed_once(fmt, monkeypatch):
    layer = _layer(fmt)
    x = torch.randn(3, 256) + 2.0  # a non-zero mean per group, so the correction matters
    expected = layer.format.linear(x, _bare(layer), layer.bias)
    assert torch.equal(layer.hadanorm_rowsums, rotation.group_rowsums(layer.dequantize(), 128))
    assert "hadanorm_rowsums" not in layer.state_dict()  # derived: never exported
    calls = []
    original = type(layer.format).dequantize
    monkeypatch.setattr(type(layer.format), "dequantize", lambda self, q: calls.append(1) or original(self, q))
    assert torch.equal(layer(x), expected)
    assert not calls, "the forward dequantized the whole weight"


def test_row_sums_follow_a_bake_a_load_and_a_cast():
    layer = _layer("int8")
    ledger = Ledger()
    bake_layer(layer, torch.randn(64, 256) * 0.05, mode="standard", seed=0, where="layer", ledger=ledger)
    assert torch.equal(layer.hadanorm_rowsums, rotation.group_rowsums(layer.dequantize(), 128))
    ledger.undo_all()  # the undo puts the pre-bake row sums back with the pre-bake tensors
    assert torch.equal(layer.hadanorm_rowsums, rotation.group_rowsums(layer.dequantize(), 128))

    other = _layer("int8", seed=1)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.hadanorm_rowsums, layer.hadanorm_rowsums)
    other.to(torch.bfloat16)
    assert other.hadanorm_rowsums.dtype == torch.float32
