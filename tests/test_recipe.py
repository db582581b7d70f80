"""Recipe composition and validation: bad input is refused before any work, in one line naming the path."""

from __future__ import annotations

import pytest
from conftest import cli

from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.errors import RecipeError


def test_default_recipe_composes():
    r = compose_recipe("default")
    assert r.name == "default"
    assert r.quantize.default.format == "int8"
    assert r.model.tiny_arch == "krea2" and r.model.arch is None
    assert r.pipeline[0] == "load" and r.pipeline[-1] == "teardown"


def test_packaged_recipes_pick_their_model():
    assert compose_recipe("krea2_nvfp4").model.tiny_arch == "krea2"
    r = compose_recipe("krea2_nvfp4")
    assert (r.quantize.default.format, r.quantize.default.rotation, r.quantize.default.rotation_group) == ("nvfp4", "convrot", 256)
    assert r.quantize.sensitive.format == "int8"
    assert compose_recipe("flux1_fp8").model.tiny_arch == "flux1"


def test_override_and_model_group():
    r = compose_recipe("default", ["quantize.default.format=fp8", "model=tiny_flux1", "evaluate.samples=3"])
    assert (r.quantize.default.format, r.model.tiny_arch, r.evaluate.samples) == ("fp8", "flux1", 3)


@pytest.mark.parametrize("override, path", [
    ("quantize.defualt.format=int8", "quantize.defualt"),
    ("quantize.default.format=int9", "quantize.default.format"),
    ("quantize.default.rotation=spin", "quantize.default.rotation"),
    ("evaluate.samples=many", "evaluate.samples"),
    ("model.dtype=float64", "model.dtype"),
    ("pipeline=[load,quantise]", "pipeline[1]"),
    ("nonsense=1", "nonsense"),
])
def test_bad_overrides_name_the_path(override, path):
    with pytest.raises(RecipeError) as info:
        compose_recipe("default", [override])
    assert info.value.path == path
    assert "\n" not in str(info.value)


def test_unknown_recipe_name():
    with pytest.raises(RecipeError) as info:
        compose_recipe("no_such_recipe")
    assert "no_such_recipe" in str(info.value)


def test_recipe_file_and_dict(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("defaults:\n  - override /model: tiny_flux1\nname: mine\nquantize:\n  default:\n    format: fp8\n")
    r = compose_recipe(f, ["evaluate.samples=1"])
    assert (r.name, r.model.tiny_arch, r.quantize.default.format, r.evaluate.samples) == ("mine", "flux1", "fp8", 1)
    # the command line wins over the file
    assert compose_recipe(f, ["quantize.default.format=int8"]).quantize.default.format == "int8"
    r = compose_recipe({"name": "d", "quantize": {"rules": [{"match": "re:transformer_blocks\\.0\\..*", "keep": True}]}})
    assert r.quantize.rules[0].keep is True
    with pytest.raises(RecipeError) as info:
        compose_recipe({"quantize": {"rules": [{"match": "re:(", "keep": True}]}})
    assert info.value.path == "quantize.rules[0].match"
    bad = tmp_path / "typo.yaml"
    bad.write_text("quantize:\n  defualt:\n    format: int8\n")
    with pytest.raises(RecipeError) as info:
        compose_recipe(bad)
    assert "defualt" in info.value.path


def test_cli_typo_is_one_line_and_creates_nothing(tmp_path):
    proc = cli(["quantize.defualt.format=int8"], tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line]
    assert len(lines) == 1, proc.stderr
    assert "quantize.defualt" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_cli_sweep_values_are_each_checked(tmp_path):
    proc = cli(["-m", "quantize.default.format=int8,int9"], tmp_path)
    assert proc.returncode != 0
    assert "int9" in proc.stderr and "quantize.default.format" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_api_reruns_a_run_dir_recipe_of_another_model(tmp_path):
    """A run dir's recipe.yaml holds the whole model: rerun it through the API, nothing of the default merged in."""
    import lowbit_pipe

    first = lowbit_pipe.run("flux1_fp8", ["pipeline=[load,detect,quantize,evaluate]", "evaluate.trajectory_seeds=1"],
                            run_dir=tmp_path / "a")
    again = lowbit_pipe.run(first.run_dir / "recipe.yaml", run_dir=tmp_path / "b")
    assert again.report["detect"]["arch"] == "flux1"
    assert again.report["evaluate"]["rel_error"] == first.report["evaluate"]["rel_error"]


@pytest.mark.parametrize("override, path", [("compile.mode=partial", "compile.mode"),
                                            ("compile.backend=warp_drive", "compile.backend"),
                                            ("lora.mode=melt", "lora.mode"),
                                            ("export.layout=onnx", "export.layout")])
def test_stage_options_are_refused_before_any_work(override, path):
    with pytest.raises(RecipeError) as info:
        compose_recipe("default", ["pipeline=[load,detect,quantize,compile,lora,export]", override])
    assert info.value.path == path


def test_a_packaged_recipe_edited_in_a_running_process_is_composed_anew(tmp_path, monkeypatch):
    """register_schema keeps what Hydra's store holds (the schema costs ~40 ms a compose), but a recipe file that
    changed since it was stored is stored again: a long-lived process (a ComfyUI server) sees the edit."""
    import os

    from lowbit_pipe.config import compose

    path = tmp_path / "zz_edited.yaml"
    path.write_text("# @package _global_\nquantize:\n  default:\n    format: int8\n")
    packaged = dict(compose.packaged_recipes())
    monkeypatch.setattr(compose, "packaged_recipes", lambda: {**packaged, "zz_edited": path})
    assert compose.compose_recipe("zz_edited").quantize.default.format == "int8"
    assert compose.compose_recipe("zz_edited").quantize.default.format == "int8"
    path.write_text("# @package _global_\nquantize:\n  default:\n    format: fp8\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))  # a coarse clock: still newer
    assert compose.compose_recipe("zz_edited").quantize.default.format == "fp8"
