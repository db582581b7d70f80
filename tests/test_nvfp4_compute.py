"""quantize.nvfp4_compute: how nvfp4 layers compute at run time (weight-only, NVFP4 activations, or auto: weight-only
on a GPU without FP4), reported, never written into the export, refused when misspelled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe import api
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.nn import QuantLinear


def _pair() -> tuple[nn.Sequential, nn.Sequential]:
    """Two copies of one float two-layer stack."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128))
    copy = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 128))
    copy.load_state_dict(base.state_dict())
    return base, copy


@pytest.mark.parametrize("compute,record,like", [("weight_only", "dynamic", "none"), ("nvfp4", "none", "dynamic"),
                                                 ("auto", "dynamic", "dynamic"), ("auto", "none", "none")])
def test_compute_setting_gives_the_numerics_it_names(compute, record, like):
    """On the CPU, "auto" keeps the file's numerics; the two explicit settings override them either way."""
    model, oracle = _pair()
    result = api.quantize(model, {"default": {"format": "nvfp4", "activations": record}, "arch_keep_float": False,
                                  "nvfp4_compute": compute}, ledger=Ledger())
    api.quantize(oracle, {"default": {"format": "nvfp4", "activations": like}, "arch_keep_float": False})
    x = torch.randn(5, 256)
    assert torch.equal(model(x), oracle(x))
    report = result["nvfp4_compute"]
    assert report["setting"] == compute and report["gpu_without_fp4"] is False
    assert report["weight_only_layers"] == (2 if like == "none" else 0)
    # the file is what the recipe asked for: the run-time setting is not in the records
    assert all(("full_precision_matrix_mult" in m.record) == (record == "none") for m in model
               if isinstance(m, QuantLinear))


def test_the_setting_is_undone_by_teardown_and_refused_when_unknown(tiny_model, tmp_path):
    model = tiny_model("krea2")
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", "quantize.default.format=nvfp4",
                                         "quantize.nvfp4_compute=weight_only"], model=model, run_dir=tmp_path / "a")
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.compute == "weight_only" for m in layers)
    assert result.report["quantize"]["nvfp4_compute"]["weight_only_layers"] == len(layers)
    lowbit_pipe.teardown(result)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(RecipeError, match="quantize.nvfp4_compute"):
        lowbit_pipe.run("default", ["quantize.nvfp4_compute=fp4"], run_dir=tmp_path / "b")
