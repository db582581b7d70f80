"""bench/headline.py's byte count: what its weight-GB column reports for each variant."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_model_bytes_counts_wrapper_subclasses_by_their_inner_tensors():
    """torchao's quantized weights are wrapper subclasses whose nominal dtype is the float one: counted by numel x
    element_size they look unquantized. TwoTensor (torch's own test subclass, two inner tensors) shows the rule."""
    from torch.testing._internal.two_tensor import TwoTensor

    from headline import model_bytes

    layer = nn.Linear(8, 4, bias=True)
    plain = model_bytes(layer)
    assert plain == (4 * 8 + 4) * 4
    inner = torch.zeros(4, 8, dtype=torch.float16)
    layer.weight = nn.Parameter(TwoTensor(inner, inner.clone()), requires_grad=False)
    assert layer.weight.element_size() == 2  # nominal: one fp16 tensor's worth
    assert model_bytes(layer) == 2 * (4 * 8 * 2) + 4 * 4  # both inner tensors, and the fp32 bias
