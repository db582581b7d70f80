"""The Plan as an artifact (lowbit_pipe.plan.plan): planning's one value, each layer's format and the attention with
the reason each was chosen; what the quantize stage applies, the report prints and the ComfyUI node reads. And the
swappers that let the solver's probes apply layers and attention without the stage's own code."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.plan.plan import AttentionChoice, Plan, recipe_attention
from lowbit_pipe.plan.policy import LayerPlan
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.quant.swap import LayerSwapper

RULES = ["quantize.rules=[{match: 're:.*ff.*', format: fp8}]", "quantize.keep=['*attn.to_out*']"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """One quantize run of the tiny Krea 2 with a rule, a keep pattern and int8 attention."""
    run_dir = tmp_path_factory.mktemp("plan") / "run"
    return lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", "attention.format=int8", *RULES],
                           run_dir=run_dir)


def test_every_layer_carries_its_format_and_the_reason_it_was_chosen(planned):
    plan = planned.context.plan
    assert isinstance(plan, Plan)
    by = {p.name: p for p in plan.layers}
    linears = {n for n, m in planned.context.transformer.named_modules() if isinstance(m, (nn.Linear, QuantLinear))}
    assert set(by) == linears  # every Linear planned, none twice
    reasons = {p.reason.split(" (")[0] for p in plan.layers}
    assert {"rule 0", "quantize.keep", "arch keep-float", "default"} <= reasons, reasons
    for p in plan.layers:
        if p.reason == "rule 0":
            assert "ff" in p.name and p.spec.format == "fp8"
        elif p.reason == "quantize.keep":
            assert "attn.to_out" in p.name and p.spec is None
        elif p.reason == "default":
            assert p.spec.format == "int8"
    # What the stage applied is what the plan says, layer by layer.
    model = planned.context.transformer
    for p in plan.layers:
        module = model.get_submodule(p.name)
        assert isinstance(module, QuantLinear) == (p.spec is not None), p.name
        if p.spec is not None:
            assert module.format.name == p.spec.format
    assert plan.attention == AttentionChoice("int8", "attention.format int8: the recipe's")
    assert plan.counts() == {k: v for k, v in planned.report["quantize"]["layers"].items()}


def test_report_json_and_summary_show_the_plan(planned):
    report = json.loads((planned.run_dir / "report.json").read_text())
    assert report["plan_attention"] == {"format": "int8", "reason": "attention.format int8: the recipe's",
                                        "chosen_by": "attention.format"}
    rows = {r["name"]: r for r in report["plan"]}
    assert [r["name"] for r in report["plan"]] == [p.name for p in planned.context.plan.layers]
    ff = next(r for n, r in rows.items() if r["reason"] == "rule 0")
    assert ff["format"] == "fp8" and ff["options"]["activations"] == "dynamic" and "rotation" in ff["options"]
    floats = [r for r in rows.values() if r["format"] is None]
    assert floats and all(r["options"] == {} for r in floats)
    summary = (planned.run_dir / "summary.txt").read_text()
    counts = planned.context.plan.counts()
    for fmt, n in counts.items():  # the compact count per format
        assert any(line.split()[:2] == [fmt, str(n)] for line in summary.splitlines()), (fmt, n, summary)
    assert "planned attention: int8 (attention.format int8: the recipe's)" in summary


def test_the_stock_attention_is_planned_with_its_reason(tmp_path):
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], run_dir=tmp_path / "run")
    assert result.context.plan.attention.stock
    assert result.report["plan_attention"]["reason"] == "attention.format bf16: the model's own attention"
    assert result.report["attention"] == {"format": "bf16"}


class _Recorded:
    """Stands in for lowbit_pipe.comfy.attention's override functions: records what the node asked for."""

    def __init__(self):
        self.calls = []

    def with_attention8(self, model, fmt, made_by, node_id=None, blocks_only=True, route="auto", speed_cache=None):
        self.calls.append((fmt, blocks_only, route, speed_cache))
        return {"model": model, "attention": fmt}

    def drop_attention8(self, model, when):
        self.calls.append(("dropped", model["attention"]))


def _result(plan_format: str | None, recipe_format: str):
    attention = types.SimpleNamespace(format=recipe_format, arch_keep=True, layers=["*"], route="cudnn")
    plan = None if plan_format is None else Plan((), AttentionChoice(plan_format, f"picked {plan_format}",
                                                                     "quantize.target"))
    return types.SimpleNamespace(context=types.SimpleNamespace(plan=plan, recipe=types.SimpleNamespace(
        attention=attention, quantize=types.SimpleNamespace(speed_cache="/tmp/speed"))))


def test_the_quantize_node_sets_the_plans_attention_not_the_recipes(monkeypatch):
    """The node reads the Plan: an attention format quantize.target chose (the recipe's attention.format left bf16)
    becomes ComfyUI's override, routed with the recipe's attention.route and speed cache; a stock plan or no plan
    (no quantize stage) sets none."""
    from lowbit_pipe.comfy import attention as comfy_attention
    from lowbit_pipe.comfy.node_runs import NodeRun
    from lowbit_pipe.comfy.nodes import _planned_attention

    recorded = _Recorded()
    monkeypatch.setattr(comfy_attention, "with_attention8", recorded.with_attention8)
    monkeypatch.setattr(comfy_attention, "drop_attention8", recorded.drop_attention8)
    run = NodeRun(Ledger(), "Quantize (lowbit_pipe) node 3", "3")
    out, summary = _planned_attention("MODEL", _result("int8", "bf16"), run, run.made_by, "3", "summary")
    assert out == {"model": "MODEL", "attention": "int8"} and recorded.calls == [("int8", True, "cudnn", "/tmp/speed")]
    assert "8-bit attention (int8 Q·Kᵀ" in summary and "(picked int8)" in summary
    run.ledger.unwind()  # Purge's undo drops the override it set
    assert recorded.calls[-1] == ("dropped", "int8")
    for plan_format in ("bf16", None):
        recorded.calls.clear()
        out, summary = _planned_attention("MODEL", _result(plan_format, "int8"), run, run.made_by, "3", "s")
        assert (out, summary, recorded.calls) == ("MODEL", "s", [])


def test_the_layer_swapper_builds_what_the_plan_says_and_undoes(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(4, 64)
    before = model(x)
    ledger = Ledger()
    swapper = LayerSwapper(originals="drop", prepack=True)
    assert swapper.for_probes() == LayerSwapper(originals="keep", prepack=True)
    swapper.for_probes().swap(model, {"0": FormatSpec("int8"), "2": FormatSpec("fp8")}, ledger, {})
    assert [type(m).__name__ for m in model] == ["QuantLinear", "GELU", "QuantLinear"]
    assert model[0].format.name == "int8" and model[2].format.name == "fp8"
    assert torch.allclose(model(x), before, rtol=0.1, atol=0.05) and not torch.equal(model(x), before)
    with pytest.raises(ValueError, match="layer '0' is already quantized"):
        swapper.swap(model, {"0": FormatSpec("int8")}, ledger, {})
    ledger.undo_all()
    assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Linear"]
    assert torch.equal(model(x), before)


def test_plan_counts_rows_and_line():
    plan = Plan((LayerPlan("a", (8, 16), FormatSpec("int8"), "default"),
                 LayerPlan("b", (8, 16), None, "quantize.keep"),
                 LayerPlan("c", (8, 16), FormatSpec("int8", activations="static"), "rule 0")),
                recipe_attention("fp8"))
    assert plan.counts() == {"int8": 2} and plan.float_reasons() == {"quantize.keep": 1}
    assert [r["options"].get("activations") for r in plan.rows()] == ["dynamic", None, "static"]
    assert plan.line() == "plan: int8 2, float 1 layers; attention fp8 (attention.format fp8: the recipe's)"


def test_stage_names_and_modes_are_the_schemas():
    """validate checks pipeline names and stage modes against recipe's constants, without importing the stages:
    the registry holds exactly those names and refuses another."""
    from lowbit_pipe.recipe import COMPILE_MODES, LORA_MODES, PIPELINE_STAGES
    from lowbit_pipe.stages import STAGES
    from lowbit_pipe.stages import compile as compile_stage
    from lowbit_pipe.stages import lora as lora_stage
    from lowbit_pipe.stages.base import Stage
    from lowbit_pipe.stages.registry import register

    assert set(STAGES) == set(PIPELINE_STAGES)
    assert compile_stage.MODES == COMPILE_MODES and lora_stage.MODES == LORA_MODES

    class Odd(Stage):
        name = "odd"

    with pytest.raises(ValueError, match="'odd', not one of recipe.PIPELINE_STAGES"):
        register(Odd)
    assert "odd" not in STAGES


@pytest.mark.parametrize("overrides, path", [
    (["attention.format=int4"], "attention.format"),
    (["quantize.target.speedup=1.1", "quantize.target.attention=[bf16,int4]"], "quantize.target.attention[1]"),
])
def test_one_attention_format_check_names_each_key(overrides, path):
    from lowbit_pipe.attention.route import format_problem
    from lowbit_pipe.config.compose import compose_recipe

    with pytest.raises(RecipeError) as err:
        compose_recipe("default", overrides)
    assert err.value.path == path and err.value.problem == format_problem("int4")
    assert format_problem("int4") == "must be one of bf16, int8, fp8, got 'int4'"
    assert format_problem("bf16") is None and format_problem("bf16", stock=False) is not None


def test_the_solvers_attention_probe_applies_what_the_attention_step_applies(monkeypatch):
    """The probe that times an attention format for quantize.target gets the recipe's route, speed cache, keep list
    and fold_qk, as the attention step's `apply` does (it once took the default route and no cache: a recipe with
    route=triton was timed on another kernel than the one it ran)."""
    from lowbit_pipe.attention import swapper as swapper_module
    from lowbit_pipe.attention.swapper import AttentionSwapper

    seen = []
    monkeypatch.setattr(swapper_module, "apply_attention", lambda *args, **kwargs: seen.append((args[1:], kwargs)))
    swapper = AttentionSwapper(layers=("blocks.*",), keep=("blocks.0.attn",), route="triton", fold_qk=True,
                               speed_cache="/tmp/speed.json")
    model, ledger = nn.Linear(2, 2), Ledger()
    assert swapper.probe(model, "fp8", ledger) == {}
    swapper.apply(model, "fp8", ledger)
    assert len(seen) == 2 and seen[0] == seen[1]
    assert seen[0][1] == {"keep": ("blocks.0.attn",), "route": "triton", "speed_cache": "/tmp/speed.json",
                          "fold_qk": True}
