"""Hostile input, as someone who can reach a ComfyUI server (or hand over a recipe file) would send it.

Each case asserts the refusal, that nothing outside the allowed folders changed, and that a secret canary (an
environment variable this test sets, and a file's content) appears in no error, UI text, report or run file.
The node functions run "inside ComfyUI" through a stand-in `folder_paths` (ComfyUI's folder registry: models,
loras, output under a scratch base folder); the real server's cases are in test_comfyui_server.py (slow set).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_comfy_nodes import _layer, krea2  # noqa: F401 - krea2 is a fixture used here

from lowbit_pipe.comfy.nodes import LowbitExport, LowbitLoRA, LowbitQuantize, node_recipe
from lowbit_pipe.config import untrusted
from lowbit_pipe.config.compose import compose_recipe, recipe_file_args
from lowbit_pipe.errors import LowbitError, RecipeError, WriteError
from lowbit_pipe.files.tempfiles import publish, temp_path

CANARY = "canary-" + secrets.token_hex(8)


@pytest.fixture
def comfy_folders(tmp_path, monkeypatch):
    """A stand-in for ComfyUI's `folder_paths` over tmp_path/base (models/, output/), a secret file beside it, and
    the canary in the environment."""
    base = tmp_path / "base"
    models = base / "models"
    for kind in ("diffusion_models", "loras", "lowbit_recipes"):
        (models / kind).mkdir(parents=True)
    (base / "output").mkdir()
    fp = types.ModuleType("folder_paths")
    fp.models_dir = str(models)
    fp.get_output_directory = lambda: str(base / "output")
    fp.get_folder_paths = lambda kind: [str(models / kind)]
    fp.get_filename_list = lambda kind: sorted(p.name for p in (models / kind).iterdir() if p.is_file())

    def full_path(kind: str, name: str) -> str:
        if name not in fp.get_filename_list(kind):
            raise FileNotFoundError(name)
        return str(models / kind / name)

    fp.get_full_path_or_raise = full_path
    monkeypatch.setitem(sys.modules, "folder_paths", fp)
    monkeypatch.setenv("LOWBIT_TEST_SECRET", CANARY)
    secret = tmp_path / "secret" / ".env"
    secret.parent.mkdir()
    secret.write_text(f"TOKEN: {CANARY}\nroot:x:0:0:{CANARY}:/root:/bin/bash\n")
    return types.SimpleNamespace(base=base, models=models, secret=secret, tmp=tmp_path)


def _tree_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def _no_canary_under(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and "secret" not in path.parts:
            assert CANARY.encode() not in path.read_bytes(), f"the canary leaked into {path}"


def _refused(fn, *args, match: str, **kwargs) -> str:
    with pytest.raises((LowbitError, ValueError, FileExistsError, FileNotFoundError), match=match) as err:
        fn(*args, **kwargs)
    text = str(err.value)
    assert CANARY not in text, text
    return text


# ------------------------------------------------------------------------------------------ the recipe input
@pytest.mark.parametrize("recipe", ["/etc/passwd", "../../../../../etc/hostname", "/proc/self/maps",
                                    "SECRET", "SECRET.yaml", "../../secret/.env.yaml", "lowbit_recipes/../x.yaml"])
def test_the_recipe_input_reads_no_file_outside_the_recipe_folder(comfy_folders, recipe):
    recipe = recipe.replace("SECRET", str(comfy_folders.secret))
    text = _refused(node_recipe, recipe, "", "krea2", match="recipe")
    assert "root:x" not in text and "TOKEN" not in text


def test_a_link_in_the_recipe_folder_to_a_file_elsewhere_is_refused(comfy_folders):
    link = comfy_folders.models / "lowbit_recipes" / "evil.yaml"
    link.symlink_to(comfy_folders.secret)
    _refused(node_recipe, "evil.yaml", "", "krea2", match="leads outside lowbit_recipes")


def test_a_recipe_file_in_the_recipe_folder_is_read_and_checked(comfy_folders):
    folder = comfy_folders.models / "lowbit_recipes"
    (folder / "team").mkdir()
    (folder / "team" / "fp8.yaml").write_text("defaults: [default]\nquantize:\n  default:\n    format: fp8\n")
    assert node_recipe("team/fp8.yaml", "", "krea2").quantize.default.format == "fp8"
    (folder / "env.yaml").write_text("quantize:\n  default:\n    format: ${oc.env:LOWBIT_TEST_SECRET}\n")
    _refused(node_recipe, "env.yaml", "", "krea2", match="resolver 'oc.env'")
    (folder / "model.yaml").write_text("model:\n  path: /etc/passwd\n")
    _refused(node_recipe, "model.yaml", "", "krea2", match="'model' is not read by the Quantize node")


@pytest.mark.parametrize("text, match", [
    ("quantize:\n  default:\n    format: ${oc.env:LOWBIT_TEST_SECRET}\n", "resolver 'oc.env'"),
    ("quantize:\n  default:\n    format: ${oc.decode:'1'}\n", "resolver 'oc.decode'"),
    ("quantize:\n  default:\n    format: ${${x}.env:LOWBIT_TEST_SECRET}\n", "resolver"),
    ("hydra:\n  searchpath: [file:///]\n", "hydra.searchpath"),
    ("quantize:\n  default:\n    _target_: os.system\n", "_target_"),
    ("export:\n  path: /tmp/x.safetensors\n", "'export' is not read"),
    ("quantize:\n  speed_cache: /etc\n", "quantize.speed_cache names a folder"),
    ("defaults:\n  - override /hydra/callbacks: mlflow\n", "Hydra plugin"),
])
def test_recipe_text_in_the_node_is_data(comfy_folders, text, match):
    _refused(node_recipe, text, "", "krea2", match=match)


@pytest.mark.parametrize("line, match", [
    ("quantize.default.format=${oc.env:LOWBIT_TEST_SECRET}", "resolver 'oc.env'"),
    ("hydra.searchpath=[file:///etc]", "'hydra' is not read"),
    ("recipe=passwd", "the recipe is the node's 'recipe' input"),
    ("+model.path=/etc/passwd", "plain key path"),
    ("model.path=/etc/passwd", "'model' is not read"),
    ("quantize.speed_cache=/tmp/anywhere", "names a folder"),
    ("export.path=/tmp/x.safetensors", "'export' is not read"),
    ("pipeline=[load,detect,quantize,export]", "'pipeline' is not read"),
])
def test_node_overrides_set_only_what_the_node_runs(comfy_folders, line, match):
    _refused(node_recipe, "auto", line, "krea2", match=match)


def test_the_nodes_calibration_honours_the_recipes_sample_and_step_counts(comfy_folders):
    recipe = node_recipe("flux1_fp8", "quantize.calibration_samples=3\nquantize.calibration_steps=1", "flux1")
    assert (recipe.quantize.calibration_samples, recipe.quantize.calibration_steps) == (3, 1)
    from lowbit_pipe.comfy.nodes import _calibration

    runner = _calibration(torch.nn.Linear(2, 2), "flux1", None, None, recipe.quantize)
    assert "3 samples x 1 Euler steps" in runner.description
    assert runner.labels == ("sample 0", "sample 1", "sample 2")  # one input set per sample: some can be held out


def test_billion_laughs_and_oversized_text_are_refused_before_parsing(comfy_folders):
    laughs = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    t0 = time.perf_counter()
    _refused(node_recipe, laughs, "", "krea2", match="anchors and aliases")
    _refused(node_recipe, "quantize: {}\n#" + "x" * (untrusted.MAX_TEXT_BYTES + 1), "", "krea2", match="bytes of recipe")
    _refused(node_recipe, "auto", "quantize.seed=1\n" * 5000, "krea2", match="at most")
    assert time.perf_counter() - t0 < 5  # refused unexpanded (expanded: minutes and gigabytes)


def test_no_canary_reaches_a_run_folder(comfy_folders, krea2):  # noqa: F811
    model, _ = krea2
    for recipe, overrides in (("auto", "quantize.default.format=${oc.env:LOWBIT_TEST_SECRET}"),
                              ("quantize:\n  default:\n    format: ${oc.env:LOWBIT_TEST_SECRET}\n", "")):
        _refused(LowbitQuantize().quantize, model, recipe, overrides, match="resolver")
    assert type(_layer(model)) is torch.nn.Linear  # refused before anything changed
    _no_canary_under(comfy_folders.tmp)


# ------------------------------------------------------------------------------------------ Export
@pytest.mark.parametrize("name", ["../../../escape", "/tmp/escape", "", ".", "..", "/dev/null", "a/b/c",
                                  ".hidden", "..\\..\\x", "lowbit/../../x"])
def test_export_writes_only_a_name_inside_diffusion_models(comfy_folders, krea2, name):  # noqa: F811
    model, _ = krea2
    before = _tree_snapshot(comfy_folders.tmp)
    _refused(LowbitExport().export, model, name, match="filename")
    assert _tree_snapshot(comfy_folders.tmp) == before


def test_export_through_a_linked_sub_folder_is_refused(comfy_folders, krea2):  # noqa: F811
    model, _ = krea2
    outside = comfy_folders.tmp / "outside"
    outside.mkdir()
    (comfy_folders.models / "diffusion_models" / "linked").symlink_to(outside)
    _refused(LowbitExport().export, model, "linked/m", match="leads outside")
    assert list(outside.iterdir()) == []


def test_export_never_replaces_a_file_unless_asked(comfy_folders, krea2):  # noqa: F811
    model, lora_file = krea2
    (quantized, _) = LowbitQuantize().quantize(model, "default", "quantize.default.format=int8")
    (with_lora,) = LowbitLoRA().attach(quantized, _copy_lora(comfy_folders, lora_file), 0.5)
    target = comfy_folders.models / "diffusion_models" / "someone" / "theirs.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"another user's model")
    _refused(LowbitExport().export, quantized, "someone/theirs", match="theirs.safetensors exists.*overwrite")
    assert target.read_bytes() == b"another user's model"
    shown = LowbitExport().export(quantized, "someone/theirs", overwrite=True)
    assert shown["result"][0] == "diffusion_models/someone/theirs.safetensors" and target.stat().st_size > 1000
    assert str(comfy_folders.base) not in shown["ui"]["text"][0]  # no absolute server path in the UI

    existing_lora = comfy_folders.models / "loras" / "mine.lora.safetensors"
    existing_lora.write_bytes(b"a LoRA someone trained")
    _refused(LowbitExport().export, with_lora, "mine", match="mine.lora.safetensors exists")
    assert existing_lora.read_bytes() == b"a LoRA someone trained"
    assert not (comfy_folders.models / "diffusion_models" / "mine.safetensors").exists()  # refused before writing
    shown = LowbitExport().export(with_lora, "fresh")
    assert "LoRA branches: loras/fresh.lora.safetensors" in shown["ui"]["text"][0]


def _copy_lora(folders, lora_file: str) -> str:
    (folders.models / "loras" / "style.safetensors").write_bytes(Path(lora_file).read_bytes())
    return "style.safetensors"


def test_the_lora_node_reads_only_comfyuis_lora_list(comfy_folders, krea2):  # noqa: F811
    model, lora_file = krea2
    _refused(LowbitLoRA().attach, model, lora_file, 1.0, match="not in ComfyUI's LoRA list")
    _refused(LowbitLoRA().attach, model, str(comfy_folders.secret), 1.0, match="not in ComfyUI's LoRA list")


# ------------------------------------------------------------------------------------------ CLI and Python API
def test_a_recipe_file_cannot_configure_hydra_callbacks(tmp_path):
    victim = tmp_path / "pwned.pth"
    evil = tmp_path / "evil.yaml"
    evil.write_text("hydra:\n  callbacks:\n    x:\n      _target_: lowbit_pipe.files.tempfiles.atomic_write_text\n"
                    f"      path: {victim}\n      text: import os\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "lowbit_pipe", f"recipe={evil}"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2 and "hydra.callbacks.x._target_" in proc.stderr, proc.stderr
    assert not victim.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text, match", [
    ("hydra:\n  callbacks:\n    x:\n      src: /etc/passwd\n", "hydra.callbacks"),
    ("hydra:\n  job_logging:\n    handlers:\n      f:\n        (): logging.FileHandler\n", r"\(\)"),
    ("hydra:\n  job:\n    env_set:\n      LD_PRELOAD: /tmp/x.so\n", "hydra.job.env_set"),
    ("hydra:\n  searchpath: [file:///etc]\n", "hydra.searchpath"),
    ("defaults:\n  - override /hydra/launcher: ray\n", "Hydra plugin"),
    ("evaluate:\n  objective: ${oc.env:LOWBIT_TEST_SECRET}\n", "resolver 'oc.env'"),
    ("a: &x 1\nb: *x\n", "anchors"),
])
def test_recipe_files_are_data(tmp_path, monkeypatch, text, match):
    monkeypatch.setenv("LOWBIT_TEST_SECRET", CANARY)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=match) as err:
        compose_recipe(str(path))
    assert CANARY not in str(err.value)


def test_run_folder_and_sweep_data_stay_allowed_in_a_recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("hydra:\n  run:\n    dir: runs/${now:%Y}\n  sweeper:\n    params:\n      seed: 1,2\n"
                    "quantize:\n  default:\n    format: fp8\n")
    assert compose_recipe(str(path)).quantize.default.format == "fp8"


def test_resolvers_need_the_command_lines_opt_in(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWBIT_TEST_FORMAT", "fp8")
    path = tmp_path / "r.yaml"
    path.write_text("quantize:\n  default:\n    format: ${oc.env:LOWBIT_TEST_FORMAT}\n")
    with pytest.raises(RecipeError, match="--allow-resolvers"):
        compose_recipe(str(path))
    assert compose_recipe(str(path), allow_resolvers=True).quantize.default.format == "fp8"
    assert compose_recipe("default", ["quantize.default.format=${oc.env:LOWBIT_TEST_FORMAT}"]).quantize.default.format \
        == "fp8"  # the command line's own overrides are the user's words


def test_a_team_folder_on_the_search_path_is_checked_like_a_recipe_file(tmp_path):
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "ours.yaml").write_text("hydra:\n  callbacks:\n    x:\n      a: 1\n")
    with pytest.raises(RecipeError, match="ours.yaml: hydra.callbacks"):
        recipe_file_args(["recipe=ours", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"])


def test_a_file_that_is_not_yaml_is_never_parsed(tmp_path):
    secret = tmp_path / "netrc"
    secret.write_text(f"machine x login {CANARY}: y\n")
    with pytest.raises(RecipeError, match="not a .yaml") as err:
        compose_recipe(str(secret))
    assert CANARY not in str(err.value)


def test_every_packaged_recipe_passes_the_rules():
    from lowbit_pipe.config.compose import read_recipe_file
    from lowbit_pipe.paths import packaged_recipes

    for name, path in packaged_recipes().items():
        assert isinstance(read_recipe_file(path, name), dict)


def test_the_cli_export_refuses_to_replace_a_file_without_overwrite(tmp_path):
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"keep me")
    from lowbit_pipe.config.preflight import preflight

    recipe = compose_recipe("default", [f"export.path={out}"])
    with pytest.raises(RecipeError, match=r"export.path.*m.safetensors exists.*export.overwrite=true"):
        preflight(recipe)
    preflight(compose_recipe("default", [f"export.path={out}", "export.overwrite=true"]))
    assert out.read_bytes() == b"keep me"


def test_of_two_writers_racing_for_one_new_path_exactly_one_wins(tmp_path):
    target = tmp_path / "m.safetensors"
    a, b = temp_path(target), temp_path(target)
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    publish(a, target, replace=False)
    with pytest.raises(FileExistsError):
        publish(b, target, replace=False)
    assert target.read_bytes() == b"a" and b.exists()
    from lowbit_pipe.files.tempfiles import write_error

    err = write_error(FileExistsError(17, "File exists", str(target)), target)
    assert isinstance(err, WriteError) and "another run" in str(err) and "export.overwrite=true" in str(err)


# ------------------------------------------------------------------------------------------ install
def _comfyui(root: Path) -> Path:
    (root / "comfy").mkdir(parents=True)
    (root / "custom_nodes").mkdir()
    return root


def test_install_refuses_a_linked_pack_folder_and_a_folder_it_did_not_write(tmp_path):
    from lowbit_pipe.comfy.install import PACK, install

    root = _comfyui(tmp_path / "comfyui")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "custom_nodes" / PACK).symlink_to(elsewhere)
    with pytest.raises(LowbitError, match="symbolic link"):
        install(root, force=True)
    assert list(elsewhere.iterdir()) == []
    (root / "custom_nodes" / PACK).unlink()
    theirs = root / "custom_nodes" / PACK
    theirs.mkdir()
    (theirs / "pyproject.toml").write_text("[project]\nname = 'theirs'\n")
    with pytest.raises(LowbitError, match="--force"):
        install(root)
    assert (theirs / "pyproject.toml").read_text() == "[project]\nname = 'theirs'\n"
    assert install(root, force=True).is_file()
    assert install(root).is_file()  # ours now: a reinstall needs no --force
