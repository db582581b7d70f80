"""evaluate: the metrics against hand-computed values, the sampler, per-layer SQNR hooks, trajectory
divergence on a broken model, decoded images on a tiny offline pipeline, the report.json schema."""

from __future__ import annotations

import math

import pytest
import torch

import lowbit_pipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.measure import metrics, sampler
from lowbit_pipe.measure.images import spatial_latent
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.stages.evaluate import Evaluate, layer_probes


# ---- metrics -----------------------------------------------------------------------------------
def test_sqnr_hand_computed():
    ref = torch.tensor([3.0, 4.0])  # signal power 25
    out = torch.tensor([3.0, 4.5])  # noise power 0.25
    assert metrics.sqnr_db(ref, out) == pytest.approx(20.0)  # 10*log10(100)
    assert metrics.sqnr_db(25.0, 0.25) == pytest.approx(20.0)
    assert metrics.sqnr_db(ref, ref) == math.inf and metrics.finite(math.inf) is None


def test_psnr_of_known_perturbation():
    ref = torch.zeros(4, 8, 8)
    ref[0, 0, 0] = 1.0
    out = ref + 0.01  # MSE 1e-4 -> PSNR 40 dB at peak 1
    assert metrics.psnr_db(ref, out, peak=1.0) == pytest.approx(40.0)
    assert metrics.psnr_db(ref * 2, out * 2) == pytest.approx(40.0)  # default peak max|ref|: scale-invariant
    assert metrics.psnr_db(ref, ref) == math.inf


def test_rel_error_and_cosine():
    ref = torch.tensor([1.0, 0.0])
    out = torch.tensor([1.0, 1.0])
    assert metrics.rel_error(ref, out) == pytest.approx(1.0)
    assert metrics.cosine(ref, out) == pytest.approx(1 / math.sqrt(2))
    with pytest.raises(ValueError):
        metrics.cosine(ref, out[:1])


def test_ssim_constant_images_and_identity():
    a, b = 0.2, 0.6  # constant images: SSIM reduces to the luminance term (2ab + C1) / (a^2 + b^2 + C1)
    c1 = 0.01**2
    got = metrics.ssim(torch.full((3, 16, 16), a, dtype=torch.float64), torch.full((3, 16, 16), b, dtype=torch.float64))
    assert got == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), rel=1e-9)
    x = torch.rand(3, 20, 20, generator=torch.Generator().manual_seed(0))
    assert metrics.ssim(x, x) == pytest.approx(1.0)
    noisy = (x + 0.2 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert 0 < metrics.ssim(x, noisy) < 0.9


# ---- sampler -----------------------------------------------------------------------------------
def test_euler_sampler_integrates_a_known_field():
    # v(x, s) = x  =>  each step x <- x * (1 + ds); from sigma 1 to 0 in S steps: x * (1 - 1/S)^S.
    x0 = torch.ones(1, 4, 2)
    inputs = {"hidden_states": x0, "timestep": torch.zeros(1)}
    seen = []

    def forward(kw):
        seen.append(float(kw["timestep"][0]))
        return kw["hidden_states"]

    out = sampler.euler_sample(forward, inputs, steps=4, time_scale=1000.0)
    assert torch.allclose(out, x0 * (1 - 1 / 4) ** 4)
    assert seen == [1000.0, 750.0, 500.0, 250.0]
    assert inputs["hidden_states"] is x0  # the caller's inputs are not modified


def test_spatial_latent_inverts_krea2_packing():
    # Krea2Pipeline._pack_latents (diffusers 0.42), inlined: importing the pipeline imports transformers (slow).
    b, c, h, w, p = 2, 4, 6, 6, 2
    z = torch.randn(b, c, h, w)
    packed = z.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)
    assert torch.equal(spatial_latent(packed, p), z)
    assert spatial_latent(torch.randn(2, 4, 1, 6, 6), p).shape == (2, 4, 6, 6)  # video latent: frame 0


# ---- the stage ---------------------------------------------------------------------------------
def test_report_schema_and_layers(tmp_path):
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]", "evaluate.steps=2"],
                             run_dir=tmp_path / "run")
    ev = result.report["evaluate"]
    for key in ("rel_error", "cosine", "max_abs_error", "samples", "psnr_db", "layers", "trajectory",
                "weight_bytes", "float_weight_bytes", "latency_ms", "peak_device_bytes", "objective"):
        assert key in ev, key
    assert ev["latency_ms"] is None and ev["peak_device_bytes"] is None  # CPU: no latency figures
    assert set(ev["trajectory"]) >= {"seeds", "steps", "mean_cosine", "min_cosine", "diverged"}
    assert ev["trajectory"]["diverged"] == 0 and ev["trajectory"]["min_cosine"] > 0.999
    assert len(ev["layers"]) == 16 and all(v["format"] == "int8" and 25 < v["sqnr_db"] < 60 for v in ev["layers"].values())
    assert ev["sqnr_min_db"] == min(v["sqnr_db"] for v in ev["layers"].values())
    assert ev["weight_bytes"] < ev["float_weight_bytes"]
    assert ev["psnr_db"] > 40 and ev["objective"] == ev["psnr_db"]


def test_layer_sqnr_matches_a_direct_computation_and_hooks_are_removed(tmp_path):
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], run_dir=tmp_path / "run")
    ctx = result.context
    name = "transformer_blocks.0.attn.to_q"
    original, quantized = ctx.ledger.original(name), ctx.transformer.get_submodule(name)
    x = torch.randn(5, original.in_features, generator=torch.Generator().manual_seed(0))
    sums: dict = {}
    with torch.inference_mode(), layer_probes(ctx, sums):
        assert len(original._forward_hooks) == 1
        original(x)
    assert not original._forward_hooks  # removed on exit
    with torch.inference_mode():
        expected = metrics.sqnr_db(original(x), quantized(x))
    assert metrics.sqnr_db(*sums[name]) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(RuntimeError), layer_probes(ctx, sums):  # removed on error too
        raise RuntimeError("boom")
    assert not original._forward_hooks


def test_broken_model_diverges(tmp_path):
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", "evaluate.trajectory_seeds=2",
                                         "evaluate.layers=false", "evaluate.samples=1", "evaluate.steps=2"],
                             run_dir=tmp_path / "run")
    ctx = result.context
    assert Evaluate().run(ctx)["trajectory"]["diverged"] == 0
    # Break it: every quantized layer's weights x20 (scales); the tiny model's float paths keep the
    # final cosines near 0.75, under the 0.9 default threshold, over a 0.5 one.
    for module in ctx.transformer.modules():
        if isinstance(module, QuantLinear):
            module.weight_scale.mul_(20)
    ev = Evaluate().run(ctx)
    assert ev["trajectory"]["diverged"] == 2 and ev["trajectory"]["min_cosine"] < 0.9
    assert ev["cosine"] < 0.5
    ctx.recipe.evaluate.diverge_cosine = 0.5
    assert Evaluate().run(ctx)["trajectory"]["diverged"] == 0


def test_images_on_a_tiny_offline_pipeline(tiny_model, tmp_path):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[0.1] * 4, latents_std=[1.5] * 4).eval()
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                         transformer=tiny_model("krea2"))
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate,teardown]", "evaluate.images=true",
                                         "evaluate.samples=1", "evaluate.steps=2"], model=pipe, run_dir=tmp_path / "p")
    images = result.report["evaluate"]["images"]
    assert images["vae"] == "pipeline" and 30 < images["psnr_db"] < 200 and 0.99 < images["ssim"] <= 1
    from PIL import Image

    grid = Image.open(tmp_path / "p" / "images.png")
    from lowbit_pipe.measure.images import LABEL_HEIGHT

    # 2 seeds x (float | quantized | diff) square tiles, under a title line, a column header and a label per seed
    assert grid.size[0] == 3 * (grid.size[1] - 4 * LABEL_HEIGHT) // 2


def test_images_substitute_vae_and_recipe_checks(tmp_path):
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]", "evaluate.images=true",
                                         "evaluate.samples=1", "evaluate.steps=2", "evaluate.trajectory_seeds=1"],
                             run_dir=tmp_path / "run")
    images = result.report["evaluate"]["images"]
    assert images["vae"].startswith("tiny AutoencoderKL") and images["psnr_db"] > 30
    assert (tmp_path / "run" / "images.png").is_file()
    with pytest.raises(RecipeError, match="evaluate.steps"):
        lowbit_pipe.run("default", ["evaluate.steps=0"], run_dir=tmp_path / "bad")
    with pytest.raises(RecipeError, match="evaluate.images"):
        lowbit_pipe.run("default", ["evaluate.images=true", "evaluate.trajectory_seeds=0"], run_dir=tmp_path / "bad")


def test_objective_budget_penalty(tmp_path):
    over = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]", "evaluate.budget_bytes=1000",
                                       "evaluate.trajectory_seeds=0", "evaluate.layers=false"], run_dir=tmp_path / "r")
    ev = over.report["evaluate"]
    assert ev["objective"] == pytest.approx(-1000.0 * ev["weight_bytes"] / 1000)
