"""svdquant_w4a4: comfy-kitchen's SVDQuant layout and eager forward, bit for bit on the tensors we write;
smoothing + low-rank branch + 4-bit residual beat plain 4-bit at the same residual bits; LoRA branches
compose with its own branch exactly."""

from __future__ import annotations

import pytest
import torch
from test_gptq import outlier_layer, output_error

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.quant.gptq import GPTQSettings, HessianAccumulator, gptq_quantize

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

FMT = get_format("svdquant_w4a4")


@pytest.mark.parametrize("n,k,rank,seed", [(192, 256, 32, 0), (64, 512, 16, 1), (130, 128, 8, 2)])
def test_forward_is_comfy_kitchens_eager_forward_bit_for_bit(n, k, rank, seed):
    w, _, _ = outlier_layer(n, k, 64, seed)
    q = FMT.quantize(w, FormatSpec("svdquant_w4a4", rank=rank))
    t = q.tensors
    assert t["weight"].shape == (n, k // 2) and t["weight_scale"].shape == (k // 64, n)
    assert t["weight_proj_down"].shape == (k, rank) and t["weight_proj_up"].shape == (n, rank)
    x = (torch.randn(37, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    with ck.registry.use_backend("eager"):
        qx, ascales, branch = ck.quantize_svdquant_w4a4(x, smooth=t["weight_smooth_factor"],
                                                        lora_down=t["weight_proj_down"])
        theirs = ck.scaled_mm_svdquant_w4a4(act=qx, wgt=t["weight"], ascales=ascales, wscales=t["weight_scale"],
                                            lora_act_in=branch, lora_up=t["weight_proj_up"], bias=bias)[:37]
        # The same tensors through comfy-kitchen's layout, as a loader builds it from a state dict.
        from comfy_kitchen.tensor.svdquant_w4a4 import TensorCoreSVDQuantW4A4Layout as Layout
        qt = QuantizedTensor(t["weight"], "TensorCoreSVDQuantW4A4Layout", Layout.Params(
            scale=t["weight_scale"], orig_dtype=torch.bfloat16, orig_shape=(n, k), proj_down=t["weight_proj_down"],
            proj_up=t["weight_proj_up"], smooth_factor=t["weight_smooth_factor"]))
        via_layout = torch.nn.functional.linear(x, qt, bias)
    ours = FMT.linear(x, q, bias)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, theirs) and torch.equal(ours, via_layout)


def test_branch_and_smoothing_beat_plain_int4_on_outlier_layers():
    """Held-out output error: svdquant RTN < convrot_w4a4 RTN (same 4-bit residual, plus the rank-32
    branch); with calibration (smoothing from the Hessian, GPTQ on the smoothed residual) lower still."""
    w, x_cal, x_test = outlier_layer(256, 512, 4096, seed=3)
    convrot = get_format("convrot_w4a4")
    e_convrot = output_error(x_test, w, convrot.dequantize(convrot.quantize(w, FormatSpec("convrot_w4a4"))))
    spec = FormatSpec("svdquant_w4a4")
    e_rtn = output_error(x_test, w, FMT.dequantize(FMT.quantize(w, spec)))
    acc = HessianAccumulator(512, "none", None, "cpu")
    acc.add(x_cal)
    calibrated = gptq_quantize(w, spec, acc.hessian, GPTQSettings())
    e_cal = output_error(x_test, w, FMT.dequantize(calibrated.qweight))
    assert e_rtn < 0.7 * e_convrot and e_cal < 0.5 * e_rtn, (e_convrot, e_rtn, e_cal)
    smooth = calibrated.qweight.tensors["weight_smooth_factor"].float()
    assert not torch.allclose(smooth, torch.ones_like(smooth))  # the calibration did smooth


def test_weight_only_mode_is_the_effective_weight():
    w, _, _ = outlier_layer(64, 256, 16, seed=4)
    q = FMT.with_activations(FMT.quantize(w, FormatSpec("svdquant_w4a4")), "none")
    x = torch.randn(5, 256)
    torch.testing.assert_close(FMT.linear(x, q, None), x @ FMT.dequantize(q).t())


def test_bad_tensors_are_named():
    w, _, _ = outlier_layer(64, 256, 16, seed=5)
    t = dict(FMT.quantize(w, FormatSpec("svdquant_w4a4")).tensors)
    where = "f.safetensors [blocks.0.attn.wq]"
    with pytest.raises(FormatError, match=r"attn\.wq\]\.weight: expected 2-D.*tile-packed"):
        FMT.from_tensors({**t, "weight": t["weight"].reshape(1, 2, 32, 128)}, {"format": "svdquant_w4a4"}, where)
    with pytest.raises(FormatError, match=r"weight_proj_up: torch.float16, but weight_scale is torch.bfloat16"):
        FMT.from_tensors({**t, "weight_proj_up": t["weight_proj_up"].half()}, {"format": "svdquant_w4a4"}, where)
    with pytest.raises(FormatError, match=r"weight_smooth_factor: zero entries"):
        FMT.from_tensors({**t, "weight_smooth_factor": torch.zeros_like(t["weight_smooth_factor"])},
                         {"format": "svdquant_w4a4"}, where)
    with pytest.raises(ValueError, match="no static input_scale"):
        FMT.check_spec(FormatSpec("svdquant_w4a4", activations="static"))


def test_packaged_svdquant_recipe_beats_plain_w4a4_on_held_out_seeds(tmp_path):
    import lowbit_pipe

    fast = ["evaluate.samples=2", "evaluate.trajectory_seeds=0", "pipeline=[load,detect,quantize,evaluate,export]"]
    plain = lowbit_pipe.run("krea2_nvfp4", fast + ["quantize.default.format=convrot_w4a4"], run_dir=tmp_path / "a")
    svd = lowbit_pipe.run("krea2_svdquant", fast, run_dir=tmp_path / "b")
    layers = svd.report["quantize"]["layers"]
    assert layers.get("svdquant_w4a4", 0) > 0 and svd.report["quantize"]["gptq"]["rtn_fallback"] == {}
    assert svd.report["evaluate"]["rel_error"] < plain.report["evaluate"]["rel_error"]
    assert svd.report["export"]["not_stock_comfy"]  # the node pack's kind
