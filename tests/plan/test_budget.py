"""Mixed precision by budget: fits under the budget, close to it, sensitive layers get the precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.errors import StageError
from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.plan.budget import plan_budget
from lowbit_pipe.plan.policy import LayerPlan


@pytest.mark.parametrize("ratio", [0.45, pytest.param(0.5, marks=pytest.mark.slow)])
def test_budget_run_lands_within_two_percent_under(tmp_path, ratio):
    r = lowbit_pipe.run("default", [f"quantize.budget_ratio={ratio}", "pipeline=[load,detect,quantize,evaluate]"],
                        run_dir=tmp_path / "run")
    b = r.report["quantize"]["budget"]
    model_bytes = tensor_bytes(r.model)
    assert model_bytes == b["model_bytes"] == b["total_bytes"]  # the plan's arithmetic is the real size
    assert 0.98 * b["budget_bytes"] <= model_bytes <= b["budget_bytes"]
    assert set(b["sensitivity"]) == {p["name"] for p in r.report["plan"] if p["reason"].startswith("budget")}
    assert r.report["evaluate"]["rel_error"] < 0.05


def test_budget_counts_the_memory_of_hadanorm_row_sums(tmp_path):
    """hadanorm layers hold their group row sums in memory (a derived buffer): the plan's bytes include them."""
    r = lowbit_pipe.run("default", ["quantize.budget_ratio=0.45", "pipeline=[load,detect,quantize]",
                                    "quantize.budget_candidates=[{format: nvfp4, rotation: hadanorm}, {format: int8}]"],
                        run_dir=tmp_path / "run")
    b = r.report["quantize"]["budget"]
    assert any("hadanorm_rowsums" in dict(m.named_buffers()) for m in r.model.modules())
    assert tensor_bytes(r.model) == b["model_bytes"] == b["total_bytes"] <= b["budget_bytes"]


def test_budget_below_minimum_is_refused(tmp_path):
    with pytest.raises(StageError, match="below the smallest possible size"):
        lowbit_pipe.run("default", ["quantize.budget_ratio=0.1"], run_dir=tmp_path / "run")


def test_sensitive_layer_gets_the_precision():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    # Layers 0, 1, 3 are +-c (exact in 4 bits); only layer 2 loses precision in weight-only nvfp4.
    with torch.no_grad():
        for i in (0, 1, 3):
            model[i].weight.copy_(torch.sign(torch.randn(256, 256)) * 0.05)
    x = torch.randn(64, 256)
    plans = [LayerPlan(str(i), (256, 256), FormatSpec("int8"), "default") for i in range(4)]
    float_bytes = tensor_bytes(model)
    nvfp4 = FormatSpec("nvfp4", activations="none")
    nvfp4_all = plan_budget(model, plans, [nvfp4, FormatSpec("int8")], float_bytes, lambda: model(x),
                            allow_float=False)
    # Bytes are only spent where they buy accuracy: the exact layers stay 4-bit even with room to spare.
    assert [p.spec.format for p in nvfp4_all.plans] == ["nvfp4", "nvfp4", "int8", "nvfp4"]
    tight = plan_budget(model, plans, [nvfp4, FormatSpec("int8")], int(float_bytes * 0.185),  # room for exactly one int8 upgrade
                        lambda: model(x), allow_float=False)
    chosen = {p.name: p.spec.format for p in tight.plans}
    assert chosen["2"] == "int8" and list(chosen.values()).count("int8") == 1, chosen
    assert tight.sensitivity["2"]["nvfp4"] > 10 * max(tight.sensitivity[n]["nvfp4"] for n in "013")
    assert tight.total_bytes <= tight.budget_bytes
