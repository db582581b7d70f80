"""Reproducibility: the same recipe and seed give identical figures and a byte-identical export, in
one process and across processes; `python -m lowbit_pipe recipe=<run dir>/recipe.yaml` reruns a run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import cli

import lowbit_pipe

# Overrides that make the runs exercise every figure (images too) yet stay quick.
OVERRIDES = ["recipe=default", "evaluate.images=true", "evaluate.samples=1", "evaluate.steps=2"]
TIMING = {"seconds", "peak_host_bytes", "peak_device_bytes", "latency_ms"}


def figures(run_dir: Path) -> dict:
    """Everything a run measured except timing and memory, plus the export's digest."""
    report = json.loads((run_dir / "report.json").read_text())
    out = {k: report[k] for k in ("status", "recipe", "detect", "quantize", "evaluate", "plan") if k in report}
    out["evaluate"] = {k: v for k, v in out["evaluate"].items() if k not in TIMING}
    out["stages"] = {name: {k: v for k, v in s.items() if k not in TIMING and k != "path"}
                     for name, s in report["stages"].items() if name not in ("teardown", "export", "evaluate")}
    export = Path(report["export"]["path"])
    out["export"] = (report["export"]["bytes"], hashlib.sha256(export.read_bytes()).hexdigest())
    if (run_dir / "images.png").is_file():
        out["images"] = hashlib.sha256((run_dir / "images.png").read_bytes()).hexdigest()
    return out


def differing(x: dict, y: dict, prefix: str = "") -> list[str]:
    """Key paths whose values differ (for a readable failure)."""
    if not (isinstance(x, dict) and isinstance(y, dict)):
        return [] if x == y else [prefix or "<root>"]
    return [d for k in sorted(set(x) | set(y)) for d in differing(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)]


@pytest.mark.slow
def test_same_recipe_same_figures_in_process_and_subprocess_and_rerun(tmp_path):
    name, overrides = OVERRIDES[0].split("=")[1], OVERRIDES[1:]
    a = lowbit_pipe.run(name, overrides, run_dir=tmp_path / "a")
    b = lowbit_pipe.run(name, overrides, run_dir=tmp_path / "b")
    fa, fb = figures(a.run_dir), figures(b.run_dir)
    assert fa["evaluate"]["trajectory"]["steps"] == 2 and fa["evaluate"]["images"]["ssim"] > 0
    assert differing(fa, fb) == []

    proc = cli(OVERRIDES + [f"hydra.run.dir={tmp_path / 'c'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert differing(figures(tmp_path / "c"), fa) == []

    # Rerun from the run dir alone (the documented command), from another directory.
    proc = cli([f"recipe={tmp_path / 'c' / 'recipe.yaml'}", f"hydra.run.dir={tmp_path / 'd'}"], tmp_path / "c")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert differing(figures(tmp_path / "d"), fa) == []


def test_rerun_of_a_non_default_model_replaces_the_model_group(tmp_path):
    """A run dir's recipe.yaml is complete: rerunning a FLUX.1 run must not merge in the default
    (Krea 2) model's tiny_config. Checked without running, through the same composition path."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lowbit_pipe.__main__ import recipe_file_args
    from lowbit_pipe.config.compose import compose_recipe, register_schema, to_recipe
    from lowbit_pipe.paths import config_dir

    first = compose_recipe("flux1_fp8", ["evaluate.steps=3"])
    path = tmp_path / "recipe.yaml"
    from omegaconf import OmegaConf

    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(first)))
    args = recipe_file_args([f"recipe={path}"])
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            again = to_recipe(compose(config_name="config", overrides=args))
    finally:
        GlobalHydra.instance().clear()
    assert again == first
