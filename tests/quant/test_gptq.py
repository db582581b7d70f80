"""GPTQ: error feedback on the round-to-nearest grid. Judged against an independent float64 oracle on
layers with the outlier structure of trained transformers (heavy rows, outlier input channels, correlated
inputs), on held-out inputs; the files it writes are RTN's layout with other codes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.kernels import rotation
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.quant.gptq import GPTQSettings, HessianAccumulator, gptq_quantize

SPECS = [FormatSpec("int8"), FormatSpec("int8", rotation="quarot"), FormatSpec("fp8"), FormatSpec("mxfp8"),
         FormatSpec("nvfp4"),
         FormatSpec("nvfp4", rotation="hadanorm", rotation_group=64), FormatSpec("convrot_w4a4"),
         FormatSpec("w4a8"), FormatSpec("w6a8"), FormatSpec("awq_w4a16"), FormatSpec("svdquant_w4a4")]


def outlier_layer(n: int = 128, k: int = 256, tokens: int = 2048, seed: int = 0):
    """A weight with heavy rows and inputs with 4 outlier channels (x20) and correlated features:
    (weight, calibration inputs, held-out inputs of the same distribution)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k ** 0.5
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=g)[:4]] = 20.0

    def inputs(count: int) -> torch.Tensor:
        return (torch.randn(count, k, generator=g) @ mix) * scale
    w = torch.randn(n, k, generator=g) * 0.02
    w[:8] *= 5.0
    return w, inputs(tokens), inputs(tokens)


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    """Relative output MSE in float64: ||X W^T - X Wq^T||^2 / ||X W^T||^2."""
    y, yq = x.double() @ w.double().t(), x.double() @ wq.double().t()
    return float(((y - yq) ** 2).sum() / (y ** 2).sum())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.rotation}")
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_held_out_inputs(spec, act_order):
    w, x_cal, x_test = outlier_layer()
    fmt = get_format(spec.format)
    kind, group = fmt.input_rotation(spec, w.shape[1])
    acc = HessianAccumulator(w.shape[1], kind, group or None, "cpu")
    for chunk in x_cal.split(500):  # the running mean over uneven chunks is the mean over all rows
        acc.add(chunk)
    result = gptq_quantize(w, spec, acc.hessian, GPTQSettings(block_size=64, act_order=act_order))
    rtn = fmt.quantize(w, spec)
    grid = fmt.calibrated_grid(w, spec, acc.hessian)  # RTN's grid; awq_w4a16's clipping search picks its own

    # The reported losses are the oracle's output error on the calibration inputs.
    grid_cal, gptq_cal = output_error(x_cal, w, fmt.dequantize(grid)), output_error(x_cal, w, fmt.dequantize(result.qweight))
    assert result.rtn_loss == pytest.approx(grid_cal, rel=1e-3)
    assert result.gptq_loss == pytest.approx(gptq_cal, rel=1e-3)
    # On inputs it never saw, GPTQ's weight error costs the output less than RTN's: a quarter with a rotation
    # (it spreads the outlier channels, leaving error GPTQ can move), 0.8 without (measured 0.11-0.16, 0.63-0.71).
    rtn_test, gptq_test = output_error(x_test, w, fmt.dequantize(rtn)), output_error(x_test, w, fmt.dequantize(result.qweight))
    assert gptq_test < (0.8 if kind == "none" else 0.25) * rtn_test, (rtn_test, gptq_test)
    # Same layout as the grid's: same tensors, shapes, dtypes, the same scales; only the codes differ.
    assert result.qweight.record == grid.record and set(result.qweight.tensors) == set(grid.tensors)
    for name, t in grid.tensors.items():
        got = result.qweight.tensors[name]
        assert got.shape == t.shape and got.dtype == t.dtype, name
        if name != "weight":
            assert torch.equal(got, t), name
    assert not torch.equal(result.qweight.tensors["weight"], rtn.tensors["weight"])


@pytest.mark.parametrize("spec", SPECS[:7], ids=lambda s: f"{s.format}-{s.rotation}")
def test_grid_rounding_of_the_weight_itself_reproduces_round_to_nearest(spec):
    """On the RTN grid, rounding the (rotated) weight gives RTN's own codes back."""
    w, _, _ = outlier_layer(seed=1)
    fmt = get_format(spec.format)
    q = fmt.quantize(w, spec)
    kind, group = fmt.input_rotation(spec, w.shape[1])
    w_rot = rotation.rotate_weight(w, kind, group or None)
    grid = fmt.grid_rounder(q)(w_rot, torch.arange(w.shape[1]))
    again = fmt.encode_on_grid(q, grid)
    assert torch.equal(again.tensors["weight"], q.tensors["weight"])


def test_pipeline_gptq_on_the_tiny_dit_held_out_and_reloaded(tmp_path):
    base = ["quantize.default.format=nvfp4", "evaluate.samples=2", "evaluate.trajectory_seeds=0",
            "pipeline=[load,detect,quantize,evaluate,export]"]
    rtn = lowbit_pipe.run("default", base, run_dir=tmp_path / "rtn").report
    gptq = lowbit_pipe.run("default", base + ["quantize.gptq.enabled=true", "quantize.gptq.hessian_bytes=600000"],
                           run_dir=tmp_path / "gptq")
    rep = gptq.report["quantize"]["gptq"]
    quantized = gptq.report["stages"]["quantize"]["quantized_layers"]
    assert rep["passes"] > 1 and rep["rtn_fallback"] == {} and len(rep["layers"]) == quantized
    assert all(v["gptq_loss"] < v["rtn_loss"] for v in rep["layers"].values())
    # Evaluate's seeds are not the calibration's: the gain holds on held-out inputs.
    assert gptq.report["evaluate"]["rel_error"] < rtn["evaluate"]["rel_error"]
    # The export is an ordinary nvfp4 file: it reloads to the same outputs.
    again = lowbit_pipe.run("default", [f"model.path={gptq.export_path}", "pipeline=[load,detect]"],
                            run_dir=tmp_path / "again")
    inputs = gptq.context.arch.example_inputs(gptq.context.model_config, batch=1, image_tokens=16, text_tokens=4,
                                              generator=torch.Generator().manual_seed(3), dtype=torch.float32,
                                              device="cpu")
    with torch.no_grad():
        assert torch.equal(gptq.model(**inputs).sample, again.model(**inputs).sample)


def test_passes_keep_fused_groups_together_and_respect_the_hessian_budget():
    from lowbit_pipe.plan.policy import LayerPlan
    from lowbit_pipe.stages.quantize import gptq_passes

    spec = FormatSpec("int8")
    plans = [LayerPlan(n, (64, k), spec, "default") for n, k in [("q", 64), ("k", 64), ("v", 64), ("o", 64), ("up", 128)]]
    fused = [[("q", 0, 64), ("k", 64, 128), ("v", 128, 192)]]
    one = 4 * 64 * 64
    assert gptq_passes(plans, fused, one) == [[["q", "k", "v"]], [["o"]], [["up"]]]
    assert gptq_passes(plans, fused, 2 * one) == [[["q", "k", "v"], ["o"]], [["up"]]]
    assert gptq_passes(plans, fused, 1 << 30) == [[["q", "k", "v"], ["o"], ["up"]]]


def test_layers_without_grid_rounding_fall_back_to_nearest_and_are_named():
    """A layer GPTQ cannot round (nvfp4 padded to 16 x 16: the policy never plans one, a caller's plan may)
    is rounded to nearest, warned about once and listed; the others still get GPTQ."""
    from lowbit_pipe.plan.policy import LayerPlan
    from lowbit_pipe.recipe import GPTQConfig
    from lowbit_pipe.stages.quantize import quantize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48), nn.Linear(48, 24))
    x = torch.randn(256, 64)
    plans = [LayerPlan(n, (m.out_features, m.in_features), FormatSpec("nvfp4"), "test")
             for n, m in model.named_children()]
    ledger = Ledger()
    with pytest.warns(UserWarning, match=r"GPTQ: 1 layers rounded to nearest instead \(e.g. 2: .*padded layer"):
        result = quantize_module(model, plans, ledger, gptq=GPTQConfig(enabled=True), run_examples=lambda: model(x))
    assert set(result["gptq"]["layers"]) == {"0", "1"} and set(result["gptq"]["rtn_fallback"]) == {"2"}
    assert result["layers"] == {"nvfp4": 3}
    ledger.unwind()


def test_gptq_refusals_name_the_setting(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(ValueError, match="GPTQ .* needs calibration inputs: pass calibrate="):
        lowbit_pipe.quantize(model, {"gptq": {"enabled": True}})
    with pytest.raises(RecipeError, match="quantize.gptq.damp"):
        lowbit_pipe.quantize(model, {"gptq": {"damp": 0.0}})
    with pytest.raises(RecipeError, match="quantize.gptq.enabled.*model.stream"):
        lowbit_pipe.run("default", ["model.stream=true", f"model.path={tmp_path / 'x.safetensors'}",
                                    "pipeline=[load,detect,quantize,export]", "quantize.gptq.enabled=true"],
                        run_dir=tmp_path / "run")


def test_packaged_gptq_recipe_beats_its_rtn_twin_on_held_out_seeds(tmp_path):
    fast = ["evaluate.samples=2", "evaluate.trajectory_seeds=1", "evaluate.steps=4",
            "pipeline=[load,detect,quantize,evaluate,export]"]
    rtn = lowbit_pipe.run("krea2_nvfp4", fast, run_dir=tmp_path / "rtn").report
    gptq = lowbit_pipe.run("krea2_nvfp4_gptq", fast, run_dir=tmp_path / "gptq").report
    assert gptq["quantize"]["layers"] == rtn["quantize"]["layers"]
    assert len(gptq["quantize"]["gptq"]["layers"]) == sum(gptq["quantize"]["layers"].values())
    assert gptq["evaluate"]["rel_error"] < rtn["evaluate"]["rel_error"]
    assert gptq["evaluate"]["trajectory"]["min_cosine"] > rtn["evaluate"]["trajectory"]["min_cosine"]
    # The same kinds of layer in the file: what stock ComfyUI loads of one it loads of the other.
    assert gptq["export"]["not_stock_comfy"] == rtn["export"]["not_stock_comfy"]


def _one_layer_gptq(x: torch.Tensor, width: int = 64, **cfg):
    """GPTQ (int8) of one Linear(width, 32) calibrated on `x`: (quantize result, warnings' messages)."""
    import warnings

    from lowbit_pipe.plan.policy import LayerPlan
    from lowbit_pipe.recipe import GPTQConfig
    from lowbit_pipe.stages.quantize import quantize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 32))
    plans = [LayerPlan("0", (32, width), FormatSpec("int8"), "test")]
    ledger = Ledger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = quantize_module(model, plans, ledger, gptq=GPTQConfig(enabled=True, **cfg), run_examples=lambda: model(x))
    ledger.unwind()
    return result, [str(w.message) for w in caught if str(w.message).startswith(("GPTQ", "calibration:"))]


def test_report_gives_tokens_width_rank_and_damping_share_per_layer():
    x = torch.randn(3, 200, 64)  # 600 tokens of full-rank inputs
    result, messages = _one_layer_gptq(x)
    layer = result["gptq"]["layers"]["0"]
    assert layer["tokens"] == 600 and layer["width"] == 64 and layer["rank"] == 64
    assert layer["damp_measure"] == "eigenvalues" and layer["damp_share"] == 0.0
    assert [m for m in messages if m.startswith("GPTQ")] == []
    # Wider than spectrum_max_width: no eigenvalues, the Cholesky pivots' estimate instead.
    layer = _one_layer_gptq(x, spectrum_max_width=32)[0]["gptq"]["layers"]["0"]
    assert layer["rank"] is None and layer["damp_measure"] == "cholesky pivots" and layer["damp_share"] == 0.0


def test_too_thin_to_judge_says_so_naming_the_layer_and_its_tokens():
    """One calibrate function cannot be split: nothing is held out, so the check cannot judge the layer, and the
    warning says so together with the calibration's own thinness (24 tokens for 64 inputs: rank-deficient)."""
    result, _ = _one_layer_gptq(torch.randn(24, 64), warn_damp_share=0.5)
    layer = result["gptq"]["layers"]["0"]
    assert layer["tokens"] == 24 and layer["rank"] == 24
    assert result["gptq"]["hessians"]["few_tokens"] == ["0"]
    # 40 of 64 directions hold no data at all: the damping is all there is in them (in the report, not a warning).
    assert layer["damp_share"] == pytest.approx(40 / 64) and result["gptq"]["hessians"]["damp"] == ["0"]
    check = result["calibration_check"]
    assert check["split"]["held_out"] == [] and check["layers"]["0"]["calibration"]["judged"] is False
    messages = _one_layer_gptq(torch.randn(24, 64))[1]
    assert len(messages) == 1 and messages[0].startswith(
        "calibration: too little held-out data to judge 1 of 1 calibrated layers (none: the calibration was given "
        "as one set)"), messages
    assert "e.g. 0: 24 tokens for 64 inputs" in messages[0] and "worse than rounding" in messages[0]


def test_enough_tokens_in_a_subspace_are_reported_not_warned_about():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 64, generator=g)  # 512 tokens in an 8-dim subspace
    result, messages = _one_layer_gptq(x)
    layer = result["gptq"]["layers"]["0"]
    assert layer["tokens"] == 512 and layer["rank"] == 8
    assert result["gptq"]["hessians"] == {"few_tokens": [], "low_rank": ["0"], "damp": []}
    assert [m for m in messages if "rank" in m or "damping" in m] == []
    # The damping share's threshold is the recipe's: at its default 0.9 the 56 of 64 empty directions (88%) are not
    # listed, at 0.5 they are.
    assert _one_layer_gptq(x, warn_damp_share=0.5)[0]["gptq"]["hessians"]["damp"] == ["0"]


def test_gptq_threads_follow_the_free_cores_and_torch_is_restored(monkeypatch):
    from lowbit_pipe.quant import gptq as gptq_mod

    before = torch.get_num_threads()
    monkeypatch.setattr(gptq_mod.os, "getloadavg", lambda: (50.0, 50.0, 50.0))  # every core busy elsewhere
    assert gptq_mod.gptq_threads() == 1
    monkeypatch.setattr(gptq_mod.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # idle: torch's own count, capped
    assert gptq_mod.gptq_threads() == min(before, len(gptq_mod.os.sched_getaffinity(0)))
    assert gptq_mod.gptq_threads(3) == 3  # quantize.gptq.threads wins
    w, x_cal, _ = outlier_layer()
    acc = HessianAccumulator(w.shape[1], "none", None, "cpu")
    acc.add(x_cal)
    seen = []
    real_round_block = gptq_mod._round_block

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real_round_block(*args)
    monkeypatch.setattr(gptq_mod, "_round_block", spy)
    out = gptq_quantize(w, FormatSpec("int8"), acc.hessian, GPTQSettings(threads=2))
    assert out.threads == 2 and set(seen) == {1}  # the column loop on one thread
    assert torch.get_num_threads() == before


def test_gptq_thread_and_report_settings_are_validated():
    model = nn.Sequential(nn.Linear(64, 64))
    for key, value in (("threads", 0), ("spectrum_max_width", -1), ("warn_damp_share", 0.0)):
        with pytest.raises(RecipeError, match=f"quantize.gptq.{key}"):
            lowbit_pipe.quantize(model, {"gptq": {key: value}})


def test_gptq_codes_do_not_depend_on_the_thread_count():
    """The policy's count follows the machine's load: the codes it gives must not (a rerun is the same file)."""
    w, x_cal, _ = outlier_layer(n=96, k=320)
    acc = HessianAccumulator(w.shape[1], "none", None, "cpu")
    acc.add(x_cal)
    one, two = (gptq_quantize(w, FormatSpec("nvfp4"), acc.hessian, GPTQSettings(threads=t, act_order=True))
                for t in (1, 2))
    assert torch.equal(one.qweight.tensors["weight"], two.qweight.tensors["weight"])
    assert one.gptq_loss == two.gptq_loss
