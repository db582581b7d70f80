"""The calibration checks itself (issue 44): a held-out part of the calibration inputs judges every calibrated layer
(GPTQ, AWQ's clipping, SVDQuant's smoothing, static input scales) against plain rounding; a layer worse there is
rounded (or kept, on_harm: keep), the whole model likewise, and the report and summary give the gain on the
calibration inputs and on the held-out ones side by side. Oracles: the float model's outputs on inputs that neither
the calibration nor the check saw, against a plainly rounded twin's."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.plan.calibration_inputs import _sample_units
from lowbit_pipe.plan.held_out import CalibrationUnits, Split, capture_outputs, output_error, split_units
from lowbit_pipe.plan.policy import LayerPlan
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.recipe import CalibrationConfig, GPTQConfig
from lowbit_pipe.stages.quantize import quantize_module
from lowbit_pipe.summary import format_summary


def _units(n: int) -> CalibrationUnits:
    return CalibrationUnits(tuple((lambda: None) for _ in range(n)), tuple(f"u{i}" for i in range(n)))


def test_split_holds_out_a_seeded_share_or_a_named_set():
    a, b = split_units(_units(8), 0.25, 7), split_units(_units(8), 0.25, 7)
    assert a.held.labels == b.held.labels and len(a.held) == 2 and len(a.fit) == 6
    assert set(a.held.labels).isdisjoint(a.fit.labels) and set(a.held.labels) | set(a.fit.labels) == \
        {f"u{i}" for i in range(8)}
    assert any(split_units(_units(8), 0.25, s).held.labels != a.held.labels for s in range(8, 12))
    thin = split_units(_units(2), 0.25, 7)  # round(0.5) = 0 sets: nothing held out, and the reason given
    assert len(thin.held) == 0 and len(thin.fit) == 2 and thin.how == "none: 2 input sets cannot spare 0.25 of them"
    assert len(split_units(_units(4), 0.9, 7).fit) == 1  # at least one set is calibrated on
    named = split_units(_units(3), 0.25, 7, held=_units(2))
    assert len(named.fit) == 3 and named.held.labels == ("u0", "u1") and "of its own" in named.how


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64))


def _misled(fmt: str, gptq: bool, calibration: CalibrationConfig = CalibrationConfig(), static: bool = False):
    """An MLP quantized with a calibration built to mislead: one 8-token 'sentence' repeated (its Hessians have rank
    8 of 64-128), checked on two held-out sets of varied inputs; then its output error against the float MLP's on
    four evaluation sets neither saw. (result, evaluation error, warnings)."""
    g = torch.Generator().manual_seed(1)
    sentence = 0.05 * torch.randn(8, 64, generator=g) if static else torch.randn(8, 64, generator=g)
    held = [torch.randn(32, 64, generator=g) for _ in range(2)]
    evals = [torch.randn(32, 64, generator=g) for _ in range(4)]
    model = _mlp()
    with torch.no_grad():
        reference = [model(x) for x in evals]
    split = Split(CalibrationUnits(tuple((lambda: model(sentence)) for _ in range(4)), ("sentence",) * 4),
                  CalibrationUnits(tuple((lambda x=x: model(x)) for x in held), ("h0", "h1")), "named")
    spec = FormatSpec(fmt, activations="static" if static else "dynamic")
    plans = [LayerPlan(n, (m.out_features, m.in_features), spec, "test") for n, m in model.named_children()
             if isinstance(m, nn.Linear)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = quantize_module(model, plans, Ledger(), gptq=GPTQConfig(enabled=gptq), run_examples=split,
                                 calibration=calibration)
    with torch.no_grad():
        error = output_error(reference, [model(x) for x in evals])
    return result, error, model, [str(w.message) for w in caught if str(w.message).startswith("calibration:")]


@pytest.mark.parametrize("fmt", ["nvfp4", "int8"])
def test_a_calibration_built_to_mislead_gptq_falls_back_and_ends_no_worse_than_rounding(fmt):
    _, rounded, _, _ = _misled(fmt, gptq=False)
    result, error, _, messages = _misled(fmt, gptq=True)
    check = result["calibration_check"]
    row = check["by_format"][fmt]
    # GPTQ fitted the sentence (its gain there) and was worse than rounding on the held-out inputs...
    assert row["fit_gain"] < 0.9 and row["held_out_gain"] > 1.0 and row["harmed"] >= 1
    assert row["result"].get("rounded", 0) >= 1 or check["model"]["result"] == "rounded"
    # ... so it fell back: on inputs neither the calibration nor the check saw, no worse than plain rounding.
    assert error <= rounded * 1.01, (error, rounded)
    harmed = [v for v in check["layers"].values() if v["calibration"]["harmed"]]
    assert all(v["calibration"]["result"] == "rounded" and v["calibration"]["held_out_gain"] > 1 for v in harmed)
    assert any(m.startswith(f"calibration: calibrated layers were worse than rounding on held-out inputs: "
                            f"{row['harmed']} of 3, kept rounded (e.g. ") for m in messages), messages


def test_on_harm_keep_keeps_the_calibrated_layers_and_says_so():
    _, rounded, _, _ = _misled("nvfp4", gptq=False)
    result, error, _, messages = _misled("nvfp4", gptq=True, calibration=CalibrationConfig(on_harm="keep"))
    check = result["calibration_check"]
    assert check["on_harm"] == "keep" and check["by_format"]["nvfp4"]["harmed"] >= 1
    assert all(v["calibration"]["result"] in ("calibrated", "kept") for v in check["layers"].values())
    assert error > rounded  # what the fallback saves: kept, the misled layers are worse than rounding
    assert any("kept calibrated (quantize.calibration.on_harm: keep)" in m for m in messages), messages


def test_thin_static_scales_are_caught_on_held_out_inputs_and_computed_dynamic():
    """fp8 static scales calibrated on 8 quiet tokens clip every louder held-out input: harm, said in words, and those
    layers compute per-token activations instead (what the format does uncalibrated)."""
    _, dynamic, _, _ = _misled("fp8", gptq=False, calibration=CalibrationConfig(static_tolerance=1e9), static=False)
    result, error, model, messages = _misled("fp8", gptq=False, static=True)
    check = result["calibration_check"]
    row = check["by_format"]["fp8 static scales"]
    assert row["harmed"] == row["layers"] == 3 and row["result"] == {"dynamic": 3}
    assert row["held_out_gain"] > 2 * row["fit_gain"]
    modes = {n: m.format.activation_mode(m.qweight) for n, m in model.named_children() if isinstance(m, QuantLinear)}
    assert set(modes.values()) == {"dynamic"}
    assert error == pytest.approx(dynamic, rel=1e-6)
    assert any(m.startswith("calibration: static input scales were worse on held-out inputs than on the calibration "
                            "inputs: 3 of 3, computed with dynamic activations instead") for m in messages), messages
    # kept static on request: the scales stay, and the warning says they were kept
    result, _, model, messages = _misled("fp8", gptq=False, calibration=CalibrationConfig(on_harm="keep"), static=True)
    assert {m.format.activation_mode(m.qweight) for m in model.modules() if isinstance(m, QuantLinear)} == {"static"}
    assert any("kept calibrated (quantize.calibration.on_harm: keep)" in m for m in messages)


def test_the_thread_cap_covers_the_calibration_forwards_and_hessians():
    """quantize.gptq.threads caps torch's threads for the whole calibration: the forwards (and the Hessian hooks run
    inside them) see it, not only GPTQ's matrix work; torch's count is back after."""
    model = _mlp()
    seen: list[int] = []
    x = torch.randn(64, 64)

    def unit() -> None:
        seen.append(torch.get_num_threads())
        model(x)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plans = [LayerPlan("2", (128, 128), FormatSpec("int8"), "test")]
        quantize_module(model, plans, Ledger(), gptq=GPTQConfig(enabled=True, threads=1),
                        run_examples=split_units(CalibrationUnits((unit,) * 4, ("a", "b", "c", "d")), 0.25, 0))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_calibration_settings_are_validated_naming_the_key(tmp_path):
    for override, path in (("quantize.calibration.on_harm=drop", "quantize.calibration.on_harm"),
                           ("quantize.calibration.held_out_fraction=1.0", "quantize.calibration.held_out_fraction"),
                           ("quantize.calibration.kinds=[{image_scale: 0}]", "quantize.calibration.kinds[0]")):
        with pytest.raises(RecipeError) as info:
            lowbit_pipe.run("default", [override], run_dir=tmp_path / "r")
        assert info.value.path == path


def _eval_error(result, seed: int) -> float:
    """The run's model against the float model on 8 fresh samples of the calibration's kinds (seeds from `seed`),
    each denoised by its own Euler trajectory: what the held-out check estimates, on a separate set."""
    ctx = result.context
    q = ctx.recipe.quantize
    ctx.recipe = dataclasses.replace(ctx.recipe, quantize=dataclasses.replace(q, calibration_seed=seed))
    units = _sample_units(ctx, 0, 8)
    got = capture_outputs(ctx.transformer, units)
    originals = {n: ctx.ledger.original(n) for n, m in ctx.transformer.named_modules() if isinstance(m, QuantLinear)}
    from lowbit_pipe.plan.held_out import swapped

    with swapped(ctx.transformer, originals):
        reference = capture_outputs(ctx.transformer, units)
    ctx.recipe = dataclasses.replace(ctx.recipe, quantize=q)
    return output_error(reference, got)


def _run(tmp_path, name: str, overrides: list[str], recipe: str = "default"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = lowbit_pipe.run(recipe, ["pipeline=[load,detect,quantize]", *overrides], run_dir=tmp_path / name)
    return result, [str(w.message) for w in caught if str(w.message).startswith("calibration:")]


@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("w4a8", marks=pytest.mark.slow),
                                 pytest.param("svdquant_w4a4", marks=pytest.mark.slow),
                                 pytest.param("awq_w4a16", marks=pytest.mark.slow),
                                 pytest.param("int8", marks=pytest.mark.slow)])
def test_tiny_dit_held_out_gain_matches_a_separate_evaluation_set(tmp_path, fmt):
    """The default calibration (8 samples of 4 kinds, 2 held out) on the tiny Krea 2: the calibrated model is never
    worse than rounding by more than 1 % on held-out inputs, the report's held-out gain is within 0.05 of the gain
    on a separate evaluation set of the same kinds, and nothing is warned about."""
    fmt_args = [f"quantize.default.format={fmt}"]
    rtn, _ = _run(tmp_path, "rtn", fmt_args)
    gptq, messages = _run(tmp_path, "gptq", fmt_args + ["quantize.gptq.enabled=true"])
    check = gptq.report["quantize"]["calibration_check"]
    assert messages == [] and len(check["split"]["held_out"]) == 2 and len(check["split"]["calibration"]) == 6
    model = check["model"]
    assert model["checked"] and model["held_out_gain"] <= 1.01
    separate = _eval_error(gptq, 40_000) / _eval_error(rtn, 40_000)
    assert separate <= 1.01
    assert abs(model["held_out_gain"] - separate) <= 0.05, (model["held_out_gain"], separate)
    # the report's per-format row and the summary's side-by-side columns
    row = check["by_format"][fmt]
    assert row["layers"] == gptq.report["stages"]["quantize"]["quantized_layers"] == row["judged"]
    assert row["fit_gain"] is not None and row["held_out_gain"] is not None
    summary = format_summary(gptq.report)
    assert "calibration check: held out 2 of 8 input sets" in summary
    assert "gain calibration  gain held-out" in summary and f"{row['held_out_gain']:.3f}" in summary


@pytest.mark.parametrize("recipe", ["krea2_nvfp4_gptq", pytest.param("krea2_svdquant", marks=pytest.mark.slow),
                                    pytest.param("flux1_fp8", marks=pytest.mark.slow)])
def test_shipped_recipes_default_calibration_is_judged_and_not_warned_about(tmp_path, recipe):
    result, messages = _run(tmp_path, "run", [], recipe)
    check = result.report["quantize"]["calibration_check"]
    assert len(check["split"]["held_out"]) == 2
    assert check["by_format"] and all(r["judged"] == r["layers"] for r in check["by_format"].values())
    harmed = sum(r["harmed"] for r in check["by_format"].values()) or check["model"].get("harmed")
    assert messages == [] or harmed, messages
