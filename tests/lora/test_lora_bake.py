"""Bake modes: standard washes small deltas out of coarse formats; stochastic keeps them on average."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.lora.bake import bake_layer, delta_kept, stochastic_round
from lowbit_pipe.quant.nn import QuantLinear


def _layer(fmt: str, seed: int = 0) -> tuple[QuantLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 256, generator=gen) * 0.05)
    delta = torch.randn(64, 4, generator=gen) @ torch.randn(4, 256, generator=gen)
    delta *= 0.004 * linear.weight.abs().max() / delta.abs().max()  # 0.4% of amax: a realistic LoRA
    return QuantLinear.from_linear(linear, FormatSpec(fmt)), delta


def test_stochastic_round_is_unbiased_on_a_table():
    table = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    x = torch.full((200_000,), 1.1)
    r = stochastic_round(x, table, torch.Generator().manual_seed(0))
    assert set(r.unique().tolist()) == {0.5, 2.0}
    assert abs(float(r.mean()) - 1.1) < 0.01


@pytest.mark.parametrize("fmt, standard_max", [("int8", 0.9), ("fp8", 0.9), ("nvfp4", 0.5)])
def test_stochastic_keeps_the_delta_on_average_standard_loses_it(fmt, standard_max):
    q, delta = _layer(fmt)
    w0 = q.dequantize()
    kept_std = bake_layer(q, delta, mode="standard", seed=0, where="l")
    assert kept_std < standard_max
    kept = []
    for seed in range(8):
        q, _ = _layer(fmt)
        kept.append(bake_layer(q, delta, mode="stochastic", seed=seed, where="l"))
        assert torch.equal(q.dequantize(), _baked(fmt, delta, seed))  # seeded: reproducible
    mean = sum(kept) / len(kept)
    assert abs(mean - 1.0) < 0.15, (fmt, kept)
    assert w0.shape == delta.shape


def _baked(fmt: str, delta: torch.Tensor, seed: int) -> torch.Tensor:
    q, _ = _layer(fmt)
    bake_layer(q, delta, mode="stochastic", seed=seed, where="l")
    return q.dequantize()


def test_bake_keeps_layout_and_static_input_scale():
    q, delta = _layer("fp8")
    q.register_buffer("input_scale", torch.tensor(0.01))
    q._quant_names = q._quant_names + ("input_scale",)
    before = {k: getattr(q, k) for k in q._quant_names}
    bake_layer(q, delta, mode="stochastic", seed=1, where="l")
    for k, t in before.items():
        assert getattr(q, k).dtype == t.dtype and getattr(q, k).shape == t.shape
    assert torch.equal(q.input_scale, before["input_scale"])


def test_delta_kept_measure():
    d = torch.randn(8, 8)
    assert delta_kept(torch.zeros(8, 8), d, d) == pytest.approx(1.0)
    assert delta_kept(torch.zeros(8, 8), torch.zeros(8, 8), d) == 0.0
