"""The detect stage on every embedded tiny model: `model=tiny_<arch>` (or a variant, `tiny_<arch>_comfy`) reports
exactly `<arch>`."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import cli

import lowbit_pipe
from lowbit_pipe.paths import tiny_models

TINY = sorted(name[len("tiny_"):] for name in tiny_models())


def test_every_listed_arch_has_a_tiny_model():
    assert {"krea2", "flux1", "flux2", "qwen_image", "z_image", "sd3", "chroma", "wan"} <= set(TINY)


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_is_detected_as_its_id(tmp_path, name, capsys):
    arch = yaml.safe_load(tiny_models()[f"tiny_{name}"].read_text())["tiny_arch"]
    result = lowbit_pipe.run("default", [f"model=tiny_{name}", "pipeline=[load,detect]"], run_dir=tmp_path / "run")
    det = result.report["detect"]
    assert det["arch"] == arch
    assert det["config"]["arch"] == arch and det["config"]["hidden_size"] > 0
    plan = det["plan"]
    assert plan["layers"].get("int8", 0) > 0 and plan["layers"].get("float", 0) > 0  # keep-float list applied
    assert plan["linear_bytes_after"] < plan["linear_bytes_before"]
    printed = capsys.readouterr().out
    assert f"detect: {arch}" in printed and "linear weights" in printed


def test_cli_reports_arch(tmp_path):
    proc = cli(["model=tiny_flux2", "pipeline=[load,detect,teardown]"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "detect: flux2" in proc.stdout


def test_unknown_model_falls_back_to_generic(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 64))
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]"], model=model,
                             run_dir=tmp_path / "run")
    assert any("Sequential" in w["message"] for w in result.report["warnings"])
    assert result.report["detect"]["arch"] == "generic"
    assert [p["format"] for p in result.report["plan"]] == [None, "int8", None]
    assert "skipped" in result.report["evaluate"]
