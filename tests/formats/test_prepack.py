"""quantize.prepack: w4a8 / w6a8 keep their decoded int8 grid in memory, convrot_w4a4 its codes unpacked to int8.
Same outputs, same exports, the bytes reported, and never stale: a bake or a state-dict load that changes the
stored tensors drops it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe import api
from lowbit_pipe.formats.w4a8 import decode_int8_grid
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.bake import bake_layer
from lowbit_pipe.quant.nn import QuantLinear


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 512), nn.Linear(512, 256))


@pytest.mark.parametrize("fmt", ["w4a8", "w6a8"])
def test_prepacked_grid_gives_the_same_outputs_and_exports(fmt):
    plain, packed = _stack(), _stack()
    config = {"default": {"format": fmt}, "arch_keep_float": False}
    api.quantize(plain, config)
    result = api.quantize(packed, {**config, "prepack": True}, ledger=Ledger())
    layers = [m for m in packed if isinstance(m, QuantLinear)]
    assert len(layers) == 3
    assert result["prepacked_bytes"] == sum(m.in_features * m.out_features for m in layers)  # one int8 per weight
    for m in layers:
        grid = m.prepacked["int8_grid"]
        assert torch.equal(grid, decode_int8_grid(m.qweight.tensors, m.in_features, 4 if fmt == "w4a8" else 6, 16))
    x = torch.randn(3, 512)
    assert torch.equal(plain(x), packed(x))
    sd_plain, sd_packed = plain.state_dict(), packed.state_dict()
    assert sd_plain.keys() == sd_packed.keys()  # nothing extra is exported
    assert all(torch.equal(sd_plain[k], sd_packed[k]) for k in sd_plain)


def test_prepacked_w4a4_codes_give_the_same_outputs_and_exports():
    from lowbit_pipe.formats import get_format

    plain, packed = _stack(), _stack()
    config = {"default": {"format": "convrot_w4a4", "rotation": "convrot"}, "arch_keep_float": False}
    api.quantize(plain, config)
    result = api.quantize(packed, {**config, "prepack": True}, ledger=Ledger())
    layers = [m for m in packed if isinstance(m, QuantLinear)]
    assert len(layers) == 3 and result["prepacked_bytes"] == sum(m.in_features * m.out_features for m in layers)
    for m in layers:
        codes = m.prepacked["int8_codes"]
        assert codes.dtype == torch.int8 and codes.shape == (m.out_features, m.in_features)
        assert int(codes.abs().max()) <= 7
        assert torch.equal(codes, get_format("convrot_w4a4").codes(m.qweight))
    x = torch.randn(3, 512)
    assert torch.equal(plain(x), packed(x))
    sd_plain, sd_packed = plain.state_dict(), packed.state_dict()
    assert sd_plain.keys() == sd_packed.keys() and all(torch.equal(sd_plain[k], sd_packed[k]) for k in sd_plain)


def test_a_bake_or_a_state_dict_load_drops_the_stale_grid():
    model = _stack()
    ledger = Ledger()
    api.quantize(model, {"default": {"format": "w4a8"}, "arch_keep_float": False, "prepack": True}, ledger=ledger)
    layer = model[1]
    before = layer.prepacked["int8_grid"].clone()
    delta = torch.randn(layer.out_features, layer.in_features) * 0.05
    bake_layer(layer, delta, mode="standard", seed=0, where="1", ledger=ledger)
    assert layer.prepacked is None  # the codes changed under it
    x = torch.randn(2, 256)
    fresh = QuantLinear(layer.qweight, layer.bias)
    assert torch.equal(layer(x), fresh(x))  # decoded from the baked codes, not the old grid
    assert not torch.equal(decode_int8_grid(layer.qweight.tensors, 256, 4, 16), before)

    other = _stack(seed=1)
    api.quantize(other, {"default": {"format": "w4a8"}, "arch_keep_float": False, "prepack": True})
    target = other[0]
    assert target.prepacked is not None
    target.load_state_dict(model[0].state_dict())
    assert target.prepacked is None
    x = torch.randn(2, 512)
    assert torch.equal(target(x), model[0](x))  # the loaded codes, not the old grid


def test_teardown_removes_the_prepacked_grid_and_the_recipe_reports_its_bytes(tiny_model, tmp_path):
    model = tiny_model("krea2")
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", "quantize.default.format=w4a8",
                                         "quantize.prepack=true"], model=model, run_dir=tmp_path / "run")
    packed = [m for m in model.modules() if isinstance(m, QuantLinear) and m.prepacked]
    assert packed and result.report["quantize"]["prepacked_bytes"] == sum(
        m.prepacked["int8_grid"].numel() for m in packed)
    lowbit_pipe.teardown(result)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
