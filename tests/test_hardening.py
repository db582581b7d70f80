"""Defects found by a review and a new user, each pinned by a test that failed before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowbit_pipe
import lowbit_pipe.errors
from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.stages.evaluate import Evaluate

ROOT = Path(__file__).resolve().parents[1]


def test_a_files_own_arch_wins_over_the_default_model_group(tmp_path):
    """A FLUX.1 export reloads through the default recipe (whose model group is tiny Krea 2)."""
    flux = lowbit_pipe.run("flux1_fp8", ["pipeline=[load,detect,quantize,export]"], run_dir=tmp_path / "flux")
    again = lowbit_pipe.run("default", [f"model.path={flux.export_path}", "pipeline=[load,detect]"],
                            run_dir=tmp_path / "reload")
    assert again.report["detect"]["arch"] == "flux1"
    assert type(again.model).__name__ == "FluxTransformer2DModel"
    # model.arch on the command line still forces it (here: as a plain module).
    forced = lowbit_pipe.run("default", [f"model.path={flux.export_path}", "model.arch=generic",
                                         "pipeline=[load,detect]"], run_dir=tmp_path / "forced")
    assert forced.report["detect"]["arch"] == "generic"


def test_a_passed_in_model_keeps_its_device_and_dtype(tiny_model, tmp_path):
    """Unless model.device / model.dtype are set, load leaves a caller's model where it is (a model on the
    meta device would fail on any move) and computes in its own dtype."""
    meta = torch.nn.Sequential(torch.nn.Linear(32, 32)).to("meta")
    result = lowbit_pipe.run("default", ["pipeline=[load]"], model=meta, run_dir=tmp_path / "meta")
    assert result.report["stages"]["load"]["device"] == "meta"
    assert next(meta.parameters()).device.type == "meta"

    model = tiny_model("krea2", torch.bfloat16)
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate,teardown]", "evaluate.samples=1",
                                         "evaluate.trajectory_seeds=0"], model=model, run_dir=tmp_path / "bf16")
    assert result.report["stages"]["load"]["dtype"] == "torch.bfloat16" and result.report["evaluate"]["cosine"] > 0.99
    with pytest.raises(Exception, match="model.dtype=float32, but the model passed in is bfloat16"):
        lowbit_pipe.run("default", ["pipeline=[load]", "model.dtype=float32"], model=model, run_dir=tmp_path / "x")


@pytest.mark.parametrize("group", [2, 4, 8])
def test_rotation_groups_below_16_are_refused(group):
    with pytest.raises(RecipeError) as info:
        compose_recipe("default", ["quantize.default.rotation=quarot", f"quantize.default.rotation_group={group}"])
    assert info.value.path == "quantize.default.rotation_group" and "16" in str(info.value)
    assert compose_recipe("default", ["quantize.default.rotation=quarot", "quantize.default.rotation_group=16"])


def test_ctrl_c_tears_down_then_stops(tiny_model, tmp_path, monkeypatch):
    model = tiny_model("krea2")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def interrupted(self, ctx):
        raise KeyboardInterrupt

    monkeypatch.setattr(Evaluate, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lowbit_pipe.run("default", model=model, run_dir=tmp_path / "run")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "interrupted" and "teardown" in report["stages"]
    assert report["stages"]["teardown"]["retained_bytes"] == 0
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # the caller's model is float again
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_suite_collects_without_the_sweep_plugins(tmp_path):
    """With no Hydra plugin installed at all (`hydra_plugins` missing), collection must not crash."""
    script = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'hydra_plugins' or name.startswith('hydra_plugins.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import pytest\n"
        f"sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', {str(ROOT / 'tests' / 'running' / 'test_report.py')!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "test_pareto_front" in proc.stdout


def test_the_project_stands_alone():
    """No file of the project refers to the team's notebook; its facts live in docs/ and docstrings."""
    notebook = "DESIGN" + ".md"
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    files = tracked or [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    offenders = [f for f in files if (ROOT / f).is_file() and f.endswith((".py", ".md", ".yaml", ".toml", ".sh"))
                 and notebook in (ROOT / f).read_text(errors="ignore")]
    assert offenders == []


def test_run_files_summary_and_units(tmp_path):
    old = os.umask(0o027)
    try:
        result = lowbit_pipe.run("krea2_nvfp4_lora", ["evaluate.samples=1", "evaluate.trajectory_seeds=0"],
                                 run_dir=tmp_path / "run")
    finally:
        os.umask(old)
    export = result.report["export"]
    assert export["layout"] == "comfy" == result.report["recipe"]["export"]["layout"]
    assert export["files"] == 2 and Path(export["lora_path"]).is_file()  # the model and its LoRA file
    for f in (export["path"], export["lora_path"], result.run_dir / "report.json"):
        assert Path(f).stat().st_mode & 0o777 == 0o640, f  # the umask, as for every run file
    summary = (result.run_dir / "summary.txt").read_text()
    assert "{" not in summary and "[" not in summary  # tables, not Python dicts or lists
    assert " MB" not in summary and " GB" not in summary and "MiB" in summary  # one unit style
    assert "LoRA residual branches" in summary


def test_fail_fast_in_the_api(tmp_path):
    """Refused before the run dir exists, naming the key and the path."""
    cases = [
        (["model.path=/nonexistent/w.safetensors"], "model.path"),
        ([f"model.path={tmp_path}"], "model.path"),  # a folder without config.json
        (["pipeline=[load,quantize,lora]", "lora.files=[{path: /nonexistent/style.safetensors}]"], "lora.files[0].path"),
    ]
    if not torch.cuda.is_available():
        cases.append((["model.device=cuda:0"], "model.device"))
    for overrides, key in cases:
        with pytest.raises(RecipeError) as info:
            lowbit_pipe.run("default", overrides, run_dir=tmp_path / "run")
        assert info.value.path == key, (overrides, str(info.value))
    assert not (tmp_path / "run").exists()


def test_packaged_configs_are_found_from_any_directory(tmp_path):
    """conf/ and recipes/ at the top of the source tree, found without depending on the working directory."""
    from lowbit_pipe.paths import config_dir, packaged_recipes

    assert (config_dir() / "config.yaml").is_file() and (config_dir() / "model" / "tiny_krea2.yaml").is_file()
    assert {"default", "krea2_nvfp4", "krea2_nvfp4_lora", "flux1_fp8"} <= set(packaged_recipes())
    team = tmp_path / "team" / "recipe"
    team.mkdir(parents=True)
    (team / "ours.yaml").write_text("# @package _global_\nname: ours\nquantize:\n  default:\n    format: fp8\n")
    r = compose_recipe("ours", [f"hydra.searchpath=[file://{tmp_path / 'team'}]"])
    assert (r.name, r.quantize.default.format) == ("ours", "fp8")


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log():
    import io

    from lowbit_pipe.progress import Console

    log = io.StringIO()
    console = Console(prefix="[job 2] ", err=log, interval=0.0)
    assert list(console.progress(range(5), "evaluate: output samples")) == list(range(5))
    lines = log.getvalue().splitlines()
    assert lines[0] == "[job 2] evaluate: output samples: 1/5" and lines[-1] == "[job 2] evaluate: output samples: 5/5"
    quiet = io.StringIO()
    assert list(Console(err=quiet).progress(range(5), "fast")) == list(range(5))  # done in a blink: no line
    assert quiet.getvalue() == ""
    console.warn("a\n  two-line   warning")
    console.warn("a two-line warning")  # the same text once per run
    assert log.getvalue().splitlines()[-1] == "[job 2] warning: a two-line warning"
    assert log.getvalue().count("warning:") == 1


def test_every_subpackage_is_installed():
    """pyproject lists packages explicitly (conf/ and recipes/ are mapped into the package): a new
    subpackage missing from the list would be left out of `pip install .` without a word."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "lowbit_pipe").rglob("__init__.py")}
    assert found <= listed, found - listed
    assert {"lowbit_pipe.conf", "lowbit_pipe.recipes"} <= listed


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_stage_failing_mid_forward_is_torn_down_to_zero(tmp_path, error):
    """A failure deep inside evaluate's forward passes: the live traceback would keep the model alive
    (frames hold the closures that hold it); the report keeps its text, teardown frees everything."""
    calls = {"n": 0}

    def fail_on_the_200th_call(module, args):
        calls["n"] += 1
        if calls["n"] == 200:
            raise error

    hook = torch.nn.modules.module.register_module_forward_pre_hook(fail_on_the_200th_call)
    try:
        with pytest.raises(type(error) if isinstance(error, KeyboardInterrupt) else lowbit_pipe.errors.StageError):
            lowbit_pipe.run("default", ["evaluate.samples=20", "evaluate.trajectory_seeds=0"], run_dir=tmp_path / "run")
    finally:
        hook.remove()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == ("interrupted" if isinstance(error, KeyboardInterrupt) else "failed")
    teardown = report["stages"]["teardown"]
    assert teardown["unfreed"] == [] and teardown["retained_bytes"] == 0
    assert "fail_on_the_200th_call" in report["traceback"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_move_of_a_passed_in_model_is_undone_by_teardown(tiny_model, tmp_path):
    model = tiny_model("krea2").cuda()
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", "model.device=cpu"], model=model,
                             run_dir=tmp_path / "run")
    assert next(model.parameters()).device.type == "cpu"
    report = lowbit_pipe.teardown(result)
    assert report["undone"].get("device_move") == 1 and report["unfreed"] == []
    assert all(p.device.type == "cuda" for p in model.parameters())
