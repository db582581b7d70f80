"""End to end: the runner, the run dir, export -> reload, failures, sweeps, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cli
from safetensors import safe_open
from safetensors.torch import save_file

import lowbit_pipe
from lowbit_pipe.errors import RecipeError, StageError
from lowbit_pipe.quant.nn import QuantLinear


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def test_default_run_writes_everything(tmp_path):
    result = lowbit_pipe.run("default", run_dir=tmp_path / "run")
    assert result.status == "ok"
    report = _report(result.run_dir)
    assert report["status"] == "ok"
    assert report["detect"]["arch"] == "krea2"
    assert report["recipe"]["quantize"]["default"]["format"] == "int8"
    for stage in ("load", "detect", "quantize", "evaluate", "export", "teardown"):
        assert report["stages"][stage]["seconds"] >= 0
        assert report["stages"][stage]["peak_host_bytes"] > 0
    ev = report["evaluate"]
    assert 0 < ev["rel_error"] < 0.05 and ev["cosine"] > 0.99
    assert Path(report["export"]["path"]).is_file() and report["export"]["bytes"] > 0
    assert report["teardown"]["retained_bytes"] == 0 and report["teardown"]["unfreed"] == []
    env = json.loads((result.run_dir / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["seed"] == 0
    assert "int8" in (result.run_dir / "recipe.yaml").read_text()
    assert "rel_error" in (result.run_dir / "summary.txt").read_text()


def test_export_header_and_layout(tmp_path):
    result = lowbit_pipe.run("default", run_dir=tmp_path / "run")
    path = result.report["export"]["path"]
    with safe_open(path, "pt") as f:
        meta = json.loads(f.metadata()["lowbit_pipe"])
        keys = set(f.keys())
        # ComfyUI's native Krea 2 names: blocks.N.attn.wq is diffusers' transformer_blocks.N.attn.to_q
        record = bytes(f.get_tensor("blocks.0.attn.wq.comfy_quant").tolist()).decode()
        assert f.get_tensor("blocks.0.attn.wq.weight").dtype == torch.int8
        assert f.get_tensor("first.weight").dtype == torch.float32  # kept float (img_in), compute dtype
    assert json.loads(record) == {"format": "int8_tensorwise"}
    assert meta["arch"] == "krea2" and meta["layout"] == "native" and meta["transformer_config"]["num_layers"] == 2
    assert meta["recipe"]["name"] == "default"
    assert meta["layers"]["transformer_blocks.0.attn.to_q"] == {"format": "int8", "shape": [256, 256], "activations": "dynamic"}
    assert "blocks.0.attn.wq.weight_scale" in keys and not any(k.startswith("transformer_blocks") for k in keys)


@pytest.mark.parametrize("extra", [["export.layout=diffusers"], ["export.shard_bytes=1048576"]])
def test_other_layouts_reload_exactly(tmp_path, extra):
    first = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]", *extra], run_dir=tmp_path / "a")
    path = first.export_path
    if "export.shard_bytes=1048576" in extra:
        assert path.endswith(".index.json") and first.report["export"]["files"] > 1
    else:
        with safe_open(path, "pt") as f:
            assert "transformer_blocks.0.attn.to_q.comfy_quant" in set(f.keys())
    second = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load,detect]"], run_dir=tmp_path / "b")
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_reload_gives_identical_outputs(tmp_path):
    first = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "a")
    model = first.model
    path = first.export_path
    second = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load,detect]"], run_dir=tmp_path / "b")
    reloaded = second.model
    assert second.report["detect"]["arch"] == "krea2"
    quant = [n for n, m in reloaded.named_modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 16
    arch = first.context.arch
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(5), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, reloaded(**inputs).sample)


def test_export_refuses_to_overwrite_its_input(tmp_path):
    first = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "a")
    path = first.export_path
    before = Path(path).read_bytes()
    with pytest.raises(RecipeError) as info:  # refused before any work: no run dir, no weight read
        lowbit_pipe.run("default", [f"model.path={path}", f"export.path={path}", "pipeline=[load,export,teardown]"],
                        run_dir=tmp_path / "b")
    assert "overwrite" in str(info.value) and info.value.path == "export.path"
    assert not (tmp_path / "b").exists()
    assert Path(path).read_bytes() == before
    assert not list(Path(path).parent.glob(".*tmp*"))


def _unknown_arch_file(tmp_path: Path) -> Path:
    path = tmp_path / "unknown.safetensors"
    save_file({"encoder.layer.weight": torch.zeros(4, 4)}, str(path))
    return path


def test_failing_stage_is_recorded_and_torn_down(tmp_path):
    path = _unknown_arch_file(tmp_path)
    with pytest.raises(StageError) as info:
        lowbit_pipe.run("default", [f"model.path={path}"], run_dir=tmp_path / "run")
    assert info.value.stage == "load" and str(path) in str(info.value)
    report = _report(tmp_path / "run")
    assert report["status"] == "failed"
    assert "load" in report["error"]
    assert "teardown" in report["stages"]


def test_corrupt_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(RecipeError) as info:
        lowbit_pipe.run("default", [f"model.path={bad}"], run_dir=tmp_path / "run")
    assert str(bad) in str(info.value) and "JSON" in str(info.value) and info.value.path == "model.path"
    assert not (tmp_path / "run").exists()


def test_api_model_is_restored_not_dropped(tiny_model, tmp_path):
    model = tiny_model("krea2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    result = lowbit_pipe.run("default", model=model, run_dir=tmp_path / "run")
    assert result.status == "ok"
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(dict(model.named_modules())[n] is m for n, m in modules.items())


def test_cli_default_run(tmp_path):
    proc = cli([], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rel_error" in proc.stdout and "export:" in proc.stdout
    reports = list((tmp_path / "runs").rglob("report.json"))
    assert len(reports) == 1 and json.loads(reports[0].read_text())["status"] == "ok"


@pytest.mark.slow
def test_cli_sweep(tmp_path):
    proc = cli(["-m", "quantize.default.format=int8,fp8,nvfp4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    sweep = [json.loads(p.read_text()) for p in (tmp_path / "runs" / "multirun").rglob("report.json")]
    assert sorted(r["recipe"]["quantize"]["default"]["format"] for r in sweep) == ["fp8", "int8", "nvfp4"]
    assert all(r["status"] == "ok" and Path(r["export"]["path"]).is_file() for r in sweep)


def test_cli_failure_exit_code(tmp_path):
    proc = cli([f"model.path={_unknown_arch_file(tmp_path)}"], tmp_path)
    assert proc.returncode == 1
    assert "stage 'load' failed" in proc.stderr and "unknown.safetensors" in proc.stderr
    report = json.loads(next((tmp_path / "runs").rglob("report.json")).read_text())
    assert report["status"] == "failed"
