"""`activations: dynamic | static | none` is real for every format: each computes its own math (checked
against a float64 oracle written here), static scales are calibrated on the layer's rotated input and
survive export and reload, weight-only is stored the way stock ComfyUI reads it, and layers a format
cannot take are planned, counted, warned about and can fall back to another format."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open
from torch import nn

import lowbit_pipe
from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.formats import FormatSpec, common, get_format
from lowbit_pipe.formats.base import WEIGHT_ONLY_KEY
from lowbit_pipe.kernels import reference, rotation
from lowbit_pipe.quant.nn import QuantLinear

FORMATS = [("int8", "none"), ("int8", "convrot"), ("int8", "hadanorm"), ("fp8", "none"), ("fp8", "quarot"),
           ("nvfp4", "none"), ("nvfp4", "convrot"), ("convrot_w4a4", "convrot"), ("w4a8", "convrot"),
           ("w6a8", "convrot")]
QMAX = {"int8": 127, "w4a8": 127, "w6a8": 127, "convrot_w4a4": 7}


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 512, generator=gen) * 0.05
    x = torch.randn(2, 5, 512, generator=gen)
    x[..., 7] *= 20  # an outlier channel: per-token and static scales then differ clearly
    return w, x


def _oracle(fmt_name: str, q, x: torch.Tensor, mode: str) -> torch.Tensor:
    """float64 oracle of the layer's math, built from the stored weight and the activation rule."""
    fmt = get_format(fmt_name)
    w = fmt.dequantize(q).double()
    if mode == "none":
        return x.double() @ w.t()
    if fmt_name in ("convrot_w4a4", "w4a8", "w6a8"):  # ConvRot 256 is part of these formats
        kind, group = "convrot", 256
    else:  # the stored record says which rotation the weight carries
        kind, group = common.record_rotation(q.record, fmt_name)
    # The rotation in fp32 as the layer runs it (tests/kernels/test_rotation.py checks it against the Hadamard
    # definition), so rounding boundaries match; everything after it in float64.
    xr, mu = rotation.rotate_activation(x.float(), kind, group or None)
    xr = xr.double()
    w_rot = rotation.rotate_weight(w, kind, group or None).double() if kind != "none" else w
    if fmt_name == "fp8":
        s = q.tensors["input_scale"].double() if mode == "static" else \
            xr.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448
        xq = reference.fp8_quantize(xr.float(), s.float()).double() * s
    elif fmt_name == "nvfp4":
        xq = reference.nvfp4_fake_quant(xr.float(), q.tensors.get("input_scale")).double()
    else:
        qmax = QMAX[fmt_name]  # codes = round_half_even(x / s) in fp32, the formats' defined rule
        xf = xr.float()
        s = q.tensors["input_scale"].float() if mode == "static" else \
            xf.abs().amax(-1, keepdim=True).clamp_min(1e-12 if qmax == 127 else 1e-10) / qmax
        xq = torch.clamp(torch.round(xf / s), -qmax, qmax).double() * s.double()
    y = xq @ w_rot.t()
    if mu is not None:
        y = y + mu.double() @ w.reshape(w.shape[0], -1, group).sum(-1).t()
    return y


@pytest.mark.parametrize("name,rot", FORMATS)
def test_each_mode_computes_its_own_math(name, rot):
    fmt = get_format(name)
    w, x = _data()
    outs = {}
    for mode in ("dynamic", "static", "none"):
        spec = FormatSpec(name, rotation=rot, activations=mode)
        kind, group = fmt.input_rotation(spec, 512)
        # Calibrated on other data than x: its amax is not x's (for nvfp4, whose dynamic scale is per
        # tensor, the same amax would make static and dynamic the same numbers).
        amax = 1.5 * float(rotation.rotate_activation(x, kind, group or None)[0].abs().amax())
        q = fmt.with_activations(fmt.quantize(w, spec), mode, amax if mode == "static" else None)
        assert fmt.activation_mode(q) == mode
        y = fmt.linear(x, q, None)
        ref = _oracle(name, q, x, mode)
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 1e-5, (mode, err)
        outs[mode] = y
    # The three modes are three different computations (the defect: static and none equalled dynamic).
    assert not torch.equal(outs["dynamic"], outs["static"])
    assert not torch.equal(outs["dynamic"], outs["none"])
    assert not torch.equal(outs["static"], outs["none"])


def test_weight_only_is_the_dequantized_matmul_in_the_input_dtype():
    fmt = get_format("nvfp4")
    w, x = _data()
    q = fmt.with_activations(fmt.quantize(w, FormatSpec("nvfp4", activations="none")), "none")
    assert q.record[WEIGHT_ONLY_KEY] is True  # stock ComfyUI's weight-only switch
    xb = x.bfloat16()
    y = fmt.linear(xb, q, None)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, xb @ fmt.dequantize(q).bfloat16().t())


def _input_amax(model: nn.Module, layer: str, kind: str, group: int, recipe) -> float:
    """Independent re-run of the calibration: amax of the layer's rotated input over the seeded examples the
    calibration fits on (all but the held-out share, drawn with the calibration seed), each of its kind's token
    counts and text padding, denoised by `calibration_steps` Euler steps (sigma 1 -> 0 linearly,
    x += (sigma' - sigma) * v)."""
    from lowbit_pipe.arch import detect_model

    arch = detect_model(model)
    seen = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda m, a, o: seen.append(rotation.rotate_activation(a[0], kind, group or None)[0].abs().amax()))
    q, ev = recipe.quantize, recipe.evaluate
    n, kinds = q.calibration_samples, q.calibration.kinds
    held = set(torch.randperm(n, generator=torch.Generator().manual_seed(q.calibration_seed))
               [:round(n * q.calibration.held_out_fraction)].tolist())
    fit = [i for i in range(n) if i not in held]
    with torch.no_grad():
        for i in fit:
            k = kinds[i % len(kinds)]
            text = round(ev.text_tokens * k.text_scale)
            inputs = arch.example_inputs(dict(model.config), batch=ev.batch,
                                         image_tokens=round(ev.image_tokens * k.image_scale), text_tokens=text,
                                         dtype=torch.float32, device="cpu",
                                         generator=torch.Generator().manual_seed(q.calibration_seed + i))
            if k.text_valid is not None:
                inputs = arch.padded_text_inputs(inputs, round(text * k.text_valid))
            steps = q.calibration_steps
            for s in range(steps):
                inputs["timestep"] = torch.full_like(inputs["timestep"], 1.0 - s / steps)
                v = arch.output_tensor(model(**inputs))
                inputs["hidden_states"] = inputs["hidden_states"] - v.reshape(inputs["hidden_states"].shape) / steps
    assert len(seen) == len(fit) * q.calibration_steps > 0 and 0 < len(held) < n
    handle.remove()
    return float(max(seen))


@pytest.mark.parametrize("fmt,rot", [("int8", "convrot"), ("fp8", "none"), ("nvfp4", "quarot")])
def test_static_scales_are_calibrated_exported_and_reloaded(tiny_model, tmp_path, fmt, rot):
    model = tiny_model("krea2")
    overrides = [f"quantize.default.format={fmt}", f"quantize.default.rotation={rot}",
                 "quantize.default.activations=static", "pipeline=[load,detect,quantize,evaluate,export,teardown]",
                 "evaluate.samples=1", "evaluate.trajectory_seeds=0"]
    recipe = compose_recipe("default", overrides)
    layer = "transformer_blocks.0.attn.to_q"
    spec = FormatSpec(fmt, rotation=rot)
    kind, group = get_format(fmt).input_rotation(spec, model.get_submodule(layer).in_features)
    expected = _input_amax(model, layer, kind, group, recipe) / get_format(fmt).act_qmax

    result = lowbit_pipe.run("default", overrides, run_dir=tmp_path / "run")
    assert result.report["quantize"]["activations"] == {"static": result.report["stages"]["quantize"]["quantized_layers"]}
    path = result.export_path
    with safe_open(path, "pt") as f:
        scales = [k for k in f.keys() if k.endswith(".input_scale")]
        assert len(scales) == result.report["stages"]["quantize"]["quantized_layers"]
        assert torch.isclose(f.get_tensor("blocks.0.attn.wq.input_scale"), torch.tensor(expected), rtol=1e-6)
        meta = json.loads(f.metadata()["lowbit_pipe"])
    assert meta["layers"][layer]["activations"] == "static"

    # Reload: same layers, same math, bit for bit.
    a = lowbit_pipe.run("default", overrides[:3] + ["pipeline=[load,detect,quantize]"], run_dir=tmp_path / "a")
    b = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]"], run_dir=tmp_path / "b")
    qa, qb = a.model.get_submodule(layer), b.model.get_submodule(layer)
    assert qb.format.activation_mode(qb.qweight) == "static"
    x = torch.randn(3, qa.in_features, generator=torch.Generator().manual_seed(1))
    assert torch.equal(qa(x), qb(x))


def test_weight_only_is_stored_as_stock_comfyui_reads_it(tmp_path):
    result = lowbit_pipe.run("default", ["quantize.default.activations=none", "pipeline=[load,detect,quantize,export]"],
                             run_dir=tmp_path / "run")
    with safe_open(result.export_path, "pt") as f:
        record = json.loads(bytes(f.get_tensor("blocks.0.attn.wq.comfy_quant").tolist()))
    assert record == {"format": "int8_tensorwise", WEIGHT_ONLY_KEY: True}
    again = lowbit_pipe.run("default", [f"model.path={result.export_path}", "pipeline=[load]"], run_dir=tmp_path / "b")
    layer = again.model.get_submodule("transformer_blocks.0.attn.to_q")
    assert layer.format.activation_mode(layer.qweight) == "none"


def test_static_without_calibration_is_refused_naming_the_layer():
    cfg = {"default": {"format": "int8", "activations": "static"}, "arch_keep_float": False}
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.raises(ValueError, match=r"static.*calibrate="):
        lowbit_pipe.quantize(model, cfg)
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match=r"never reach \['1'\]"):  # the examples only run layer 0
        lowbit_pipe.quantize(model, cfg, calibrate=lambda: model[0](x))
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # refused before any swap
    stats = lowbit_pipe.quantize(model, cfg, calibrate=lambda: model(x))
    assert stats["layers"] == {"int8": 2}
    assert torch.isclose(model[0].input_scale, x.abs().amax() / 127)


# ------------------------------------------------------------- layers a format cannot take


def _odd_widths() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 384), nn.Linear(384, 256), nn.Linear(256, 384), nn.Linear(384, 512))


def test_unfit_layers_get_a_reason_a_count_a_warning_and_a_fallback():
    model = _odd_widths()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = lowbit_pipe.quantize(model, {"default": {"format": "w4a8"}, "arch_keep_float": False})
    assert stats["layers"] == {"w4a8": 2}  # in_features 512 and 256; the two 384-wide ones cannot
    text = [str(w.message) for w in caught]
    assert any("2 of 4 layers stay float" in t and "384" in t and "quantize.fallback" in t for t in text), text

    model = _odd_widths()
    stats = lowbit_pipe.quantize(model, {"default": {"format": "w4a8"}, "fallback": {"format": "int8"},
                                         "arch_keep_float": False})
    assert stats["layers"] == {"w4a8": 2, "int8": 2}
    assert model[1].format.name == "int8" and model[0].format.name == "w4a8"


def test_unfit_layers_in_the_run_report_and_summary(tmp_path):
    # Tiny Krea 2: the text path is 64 wide, so w4a8 (ConvRot 256) cannot take those layers.
    result = lowbit_pipe.run("default", ["quantize.default.format=w4a8", "quantize.arch_keep_float=false",
                                         "pipeline=[load,detect,quantize]"], run_dir=tmp_path / "run")
    plan = {p["name"]: p for p in result.report["plan"]}
    unfit = [p for p in plan.values() if p["format"] is None and "cannot store" in p["reason"]]
    assert unfit and all("not a multiple of the ConvRot group 256" in p["reason"] for p in unfit)
    q = result.report["quantize"]
    assert q["unfit"]["float"] == len(unfit)
    assert sum(q["float_layers"].values()) == len(unfit)
    assert any("stay float" in w["message"] for w in result.report["warnings"])
    summary = (result.run_dir / "summary.txt").read_text()
    assert any(line.split()[:2] == ["float", str(len(unfit))] and line.endswith("w4a8 cannot store it")
               for line in summary.splitlines()), summary

    # Rotated int8 on the same widths: quantized, but stored unrotated, and the plan says so.
    result = lowbit_pipe.run("default", ["quantize.default.rotation=convrot", "quantize.arch_keep_float=false",
                                         "pipeline=[load,detect,quantize]"], run_dir=tmp_path / "rot")
    reasons = [p["reason"] for p in result.report["plan"] if p["format"] == "int8"]
    assert any("convrot skipped: in_features 64" in r for r in reasons)
    assert result.report["quantize"]["unfit"]["unrotated"] > 0
