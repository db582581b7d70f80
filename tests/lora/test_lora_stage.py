"""The lora stage in a recipe: residual and bake modes, report figures, evaluate like with like, teardown."""

from __future__ import annotations

import pytest

import lowbit_pipe
from lowbit_pipe.lora.make_example import example_lora

PIPE = "pipeline=[load,detect,quantize,lora,evaluate,teardown]"
FAST = "evaluate.samples=1"
NO_EVAL = "pipeline=[load,detect,quantize,lora,teardown]"


def test_residual_stage_reports_and_evaluates_like_with_like(tmp_path):
    plain = lowbit_pipe.run("krea2_nvfp4", ["pipeline=[load,detect,quantize,evaluate,teardown]", FAST],
                            run_dir=tmp_path / "a")
    # A LoRA big enough (50% of amax) that a float reference WITHOUT it shows in rel_error (measured, 1 sample:
    # 0.0096 without the float-original mirrors, 0.0042 with them, 0.0041 with no LoRA at all).
    result = lowbit_pipe.run("krea2_nvfp4_lora", [PIPE, FAST, "lora.files=[{path: 'example:native:seed=3:rel=0.5', name: x}]"],
                             run_dir=tmp_path / "b")
    report = result.report
    stage = report["stages"]["lora"]
    assert stage["mode"] == "residual" and stage["files"] == 1 and stage["layers_per_file"] == [16]
    assert stage["ranks"] == [8]
    assert report["lora"]["files"][0]["alphas"] == [4.0]
    base_err, lora_err = plain.report["evaluate"]["rel_error"], report["evaluate"]["rel_error"]
    assert abs(lora_err - base_err) < 0.25 * base_err, (base_err, lora_err)
    td = report["teardown"]
    assert td["retained_bytes"] == 0 and td["unfreed"] == [] and not td["errors"], td


def test_packaged_recipe_runs_two_loras_and_exports(tmp_path):
    result = lowbit_pipe.run("krea2_nvfp4_lora", ["pipeline=[load,detect,quantize,lora,export]"], run_dir=tmp_path / "r")
    files = result.report["lora"]["files"]
    assert [f["name"] for f in files] == ["style", "detail"] and [f["strength"] for f in files] == [0.8, 0.5]
    from lowbit_pipe import lora

    assert lora.has_residual_lora(result.model)
    export = result.report["export"]
    # the residual branches are written beside the model, as a LoRA file that reloads onto it
    assert export["lora_path"].endswith("model.lora.safetensors") and export["lora_bytes"] > 0
    from safetensors import safe_open

    with safe_open(export["lora_path"], "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    lowbit_pipe.teardown(result)


def test_residual_branches_never_dropped_silently(tmp_path):
    from lowbit_pipe.errors import StageError

    with pytest.raises(StageError, match="residual branches"):
        lowbit_pipe.run("krea2_nvfp4_lora", ["pipeline=[load,detect,quantize,lora,export,teardown]",
                                             "export.residual_lora=error"], run_dir=tmp_path / "r")
    assert not (tmp_path / "r" / "model.lora.safetensors").exists()


def test_stochastic_bake_stage(tmp_path):
    result = lowbit_pipe.run("krea2_nvfp4_lora", [PIPE, FAST, "lora.mode=stochastic", "lora.seed=3"], run_dir=tmp_path / "s")
    lo = result.report["lora"]
    assert lo["mode"] == "stochastic" and lo["baked_layers"] == 16 and lo["quantized_layers_baked"] == 16
    assert 0.3 < lo["delta_kept_mean"] < 3.0
    assert result.report["teardown"]["unfreed"] == [] and not result.report["teardown"]["errors"]


def test_unmatched_keys_fail_the_stage_naming_them(tmp_path, tiny_model):
    import pytest
    import torch
    from safetensors.torch import save_file

    from lowbit_pipe.errors import StageError

    sd, _ = example_lora(tiny_model("krea2"), None, style="peft", rank=2)
    sd["transformer.nowhere.lora_A.weight"] = torch.zeros(2, 4)
    sd["transformer.nowhere.lora_B.weight"] = torch.zeros(4, 2)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(StageError, match=r"stage 'lora'.*bad\.safetensors.*transformer\.nowhere\.lora_A\.weight"):
        lowbit_pipe.run("krea2_nvfp4_lora", [NO_EVAL, f"lora.files=[{{path: '{path}'}}]"], run_dir=tmp_path / "f")
    ok = lowbit_pipe.run("krea2_nvfp4_lora", [NO_EVAL, f"lora.files=[{{path: '{path}'}}]", "lora.strict=false"],
                         run_dir=tmp_path / "g")
    assert ok.report["lora"]["files"][0]["skipped"]


@pytest.mark.parametrize("mode", ["standard", "stochastic"])
def test_flux_bake_keeps_fused_layers_exportable(tmp_path, mode):
    """Baking into FLUX's fused qkv / linear1 parts requantizes each fused weight jointly, so the native
    export stays exact and reloads bit for bit."""
    import torch

    result = lowbit_pipe.run("krea2_nvfp4_lora", ["model=tiny_flux1", f"lora.mode={mode}",
                                                  "pipeline=[load,detect,quantize,lora,export]"], run_dir=tmp_path / "a")
    lo = result.report["lora"]
    assert lo["baked_layers"] >= lo["quantized_layers_baked"] > 0
    again = lowbit_pipe.run("flux1_fp8", [f"model.path={result.export_path}", "pipeline=[load,detect]"],
                            run_dir=tmp_path / "b")
    a, b = result.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
