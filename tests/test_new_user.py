"""What a new user meets on a fresh clone with the README's commands (issue 29, item 6; issue 45): no silent no-op,
refusals before any work, errors that say what to set, progress while it works; a clone anywhere (any folder name,
its venv inside, no ComfyUI archive) passes both README test commands and leaves no run folder behind."""

from __future__ import annotations

import logging

import pytest
from conftest import cli, one_line_refusal

import lowbit_pipe
from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.errors import RecipeError

# ---- (a) lora.files without a lora stage -----------------------------------------------------------------------

def test_lora_files_without_a_lora_stage_are_refused(tmp_path):
    with pytest.raises(RecipeError) as err:
        compose_recipe("krea2_nvfp4", ["lora.files=[{path: /nonexistent/style.safetensors}]"])
    assert err.value.path == "lora.files"
    assert "no 'lora' stage" in str(err.value) and "add 'lora' after 'quantize'" in str(err.value)
    with pytest.raises(RecipeError, match="lora.files"):
        lowbit_pipe.run("krea2_nvfp4", ["lora.files=[{path: 'example:kohya:seed=1'}]"], run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # the recipe that has the stage still runs its files; an empty list needs no stage
    assert compose_recipe("krea2_nvfp4_lora").lora.files
    assert compose_recipe("krea2_nvfp4_lora", ["pipeline=[load,detect,quantize]", "lora.files=[]"])


def test_cli_refuses_lora_files_without_a_lora_stage(tmp_path):
    proc = cli(["recipe=krea2_nvfp4", "lora.files=[{path: /nonexistent/style.safetensors}]"], tmp_path)
    one_line_refusal(proc, "lora.files", "/nonexistent/style.safetensors", "no 'lora' stage")
    assert not (tmp_path / "runs").exists()


# ---- (b) lowbit_pipe.quantize on a module of no known architecture -----------------------------------------------

def test_quantize_api_says_which_layers_stay_float_and_warns_when_none_is_quantized():
    import torch

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    with pytest.warns(UserWarning, match="nothing was quantized") as caught:
        stats = lowbit_pipe.quantize(mlp, {"default": {"format": "fp8"}})
    message = str(caught[0].message)
    assert "all 2 Linear layers stay float" in message and "arch_keep_float=false" in message
    assert caught[0].filename == __file__  # points at the caller's line
    assert stats["layers"] == {} and stats["arch"] == "generic"
    assert stats["kept_float"] == {"0": "arch keep-float", "2": "arch keep-float"}
    stats = lowbit_pipe.quantize(mlp, {"default": {"format": "fp8"}, "arch_keep_float": False})
    assert stats["layers"] == {"fp8": 2} and stats["kept_float"] == {}


def test_quantize_api_on_a_deeper_module_warns_nothing():
    import warnings

    import torch

    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = lowbit_pipe.quantize(net, {"default": {"format": "int8"}})
    assert stats["layers"] == {"int8": 2} and sorted(stats["kept_float"]) == ["0", "3"]


# ---- (c) refusals before any work, errors that say what to set ---------------------------------------------------

@pytest.mark.parametrize("target", ["/proc/model.safetensors", "/proc/lowbit_pipe/out/model.safetensors"])
def test_an_export_path_that_cannot_be_written_is_refused_before_any_work(target, tmp_path):
    """Root passes every permission check and /proc refuses what its bits allow: the folder is tried, not read."""
    from lowbit_pipe.config.preflight import preflight

    with pytest.raises(RecipeError) as err:
        preflight(compose_recipe("default", [f"export.path={target}"]))
    assert err.value.path == "export.path" and "/proc is not a writable directory" in str(err.value)
    ok = tmp_path / "new" / "dir" / "model.safetensors"
    preflight(compose_recipe("default", [f"export.path={ok}"]))  # a folder to create is fine, and is not created
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []


def test_cli_refuses_an_export_path_under_proc_with_exit_2(tmp_path):
    one_line_refusal(cli(["export.path=/proc/lowbit_pipe/model.safetensors"], tmp_path), "export.path", "/proc")
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_of_another_size_names_the_keys_briefly_and_says_to_set_model_config(tiny_model, tmp_path):
    """A plain state dict (no lowbit_pipe header) of the tiny Krea 2: the model is built from the class defaults
    (28 blocks), so keys are missing; the message is short, counts the blocks and names model.config."""
    from safetensors.torch import save_file

    from lowbit_pipe.arch.tiny import tiny_model_config
    from lowbit_pipe.errors import StageError

    path = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_model("krea2").state_dict().items()}, str(path))
    with pytest.raises(StageError) as err:
        lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]"], run_dir=tmp_path / "run")
    message = str(err.value)
    assert "missing 362 (" in message and "transformer_blocks.2-27.*" in message and "unexpected none" in message
    assert "transformer_blocks: 2 in the file, 28 in the model" in message
    assert "Krea2Transformer2DModel class defaults" in message and "+model.config.num_layers=N" in message
    assert len(message) < 900 and "norm1.weight" not in message  # brief: no list of every key
    config = tiny_model_config("krea2")
    value = "{" + ", ".join(f"{k}: {list(v) if isinstance(v, (list, tuple)) else v}" for k, v in config.items()) + "}"
    result = lowbit_pipe.run("default", [f"model.path={path}", "pipeline=[load]", f"+model.config={value}"],
                             run_dir=tmp_path / "ok")
    assert result.report["stages"]["load"]["params"] == sum(p.numel() for p in tiny_model("krea2").parameters())


def test_brief_keys_and_the_plus_hint_for_model_config():
    from lowbit_pipe.stages.load import brief_keys

    keys = [f"blocks.{i}.w" for i in (1, 2, 3, 7)] + ["norm.weight"]
    assert brief_keys(keys) == "5 (blocks.{1-3,7}.*, norm.weight)"
    assert brief_keys([]) == "none"
    with pytest.raises(RecipeError, match=r"takes any key, added with '\+': \+model.config.num_layers"):
        compose_recipe("default", ["model.config.num_layers=2"])
    assert compose_recipe("default", ["+model.config.num_layers=2"]).model.config == {"num_layers": 2}


def test_version_flag_prints_the_version_and_exits_0(tmp_path):
    from lowbit_pipe.version import __version__

    assert "--version prints lowbit_pipe's version" in cli(["--help"], tmp_path).stdout  # --help lists it
    proc = cli(["--version"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"lowbit_pipe {__version__} (Hydra ") and proc.stderr == ""
    assert not (tmp_path / "runs").exists()


def test_a_hydra_plugin_option_without_its_extra_names_the_pip_command(monkeypatch):
    from lowbit_pipe.config import preflight

    monkeypatch.setattr(preflight, "_importable", lambda module: False)
    for arg, extra in [("hydra/sweeper=optuna_budget", "optuna"), ("hydra/launcher=local", "sweep"),
                       ("hydra/launcher=ray", "ray"), ("+hydra/callbacks=mlflow", "mlflow")]:
        with pytest.raises(RecipeError) as err:
            preflight.check_extras(["quantize.default.format=int8", arg])
        assert f'pip install ".[{extra}]"' in str(err.value) and err.value.path == arg.lstrip("+").split("=")[0]
    monkeypatch.setattr(preflight, "_importable", lambda module: True)
    preflight.check_extras(["hydra/sweeper=optuna_budget", "hydra/launcher=ray"])
    preflight.check_extras(["hydra/launcher=basic", "quantize.default.format=int8"])  # needs nothing


@pytest.mark.skipif(__import__("conftest").has_module("hydra_plugins.hydra_optuna_sweeper"),
                    reason="the Optuna sweeper is installed here")
def test_cli_optuna_command_without_the_extra_is_one_line_exit_2(tmp_path):
    proc = cli(["-m", "recipe=krea2_nvfp4", "hydra/sweeper=optuna_budget", "evaluate.budget_bytes=3000000"], tmp_path)
    one_line_refusal(proc, "hydra/sweeper", 'pip install ".[optuna]"')
    assert not (tmp_path / "runs").exists()


# ---- (d) compile + evaluate -------------------------------------------------------------------------------------

def test_compile_then_evaluate_is_fast_and_silent(tmp_path, capfd):
    """The per-layer probes and the float reference run eagerly: no dynamo tracing of the hooks (a graph break
    and a warning block per hook, recompiles for the float layers), so evaluate after compile costs about
    what it costs without (the compile of the quantized blocks aside: aot_eager here, cheap)."""
    fast = ["evaluate.samples=1", "evaluate.trajectory_seeds=1", "evaluate.steps=2"]
    plain = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]", *fast], run_dir=tmp_path / "a")
    capfd.readouterr()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # torch's log handlers hold the stderr of import time: listen to its loggers
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch._inductor")]  # propagate=False
    for logger in loggers:
        logger.addHandler(handler)
    try:
        compiled = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,compile,evaluate]",
                                               "compile.backend=aot_eager", *fast], run_dir=tmp_path / "b")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert not records, records[0].getMessage()[:2000]
    assert "torch/_dynamo" not in err and "Graph break" not in err and "recompil" not in err.lower(), err[-3000:]
    assert compiled.report["dynamo"]["graph_breaks"] == 0
    assert compiled.report["dynamo"]["graphs"] <= 2  # the quantized blocks only: no float variant, no hook graph
    seconds = compiled.report["stages"]["evaluate"]["seconds"], plain.report["stages"]["evaluate"]["seconds"]
    assert seconds[0] < 6 * seconds[1] + 10, seconds
    # the figures are the eager run's (the reference is the eager float model either way)
    a, b = plain.report["evaluate"], compiled.report["evaluate"]
    assert b["rel_error"] == pytest.approx(a["rel_error"], rel=1e-3)
    assert b["layers"].keys() == a["layers"].keys()
    assert not [w for w in compiled.report["warnings"] if w["stage"] == "evaluate"]


def test_a_repeated_warning_is_one_report_entry_with_its_count_and_torch_internal_deprecations_are_hidden(
        tmp_path, monkeypatch):
    import warnings

    from lowbit_pipe.stages import STAGES
    from lowbit_pipe.stages.base import Stage

    class Noisy(Stage):
        name = "detect"

        def run(self, ctx):
            for _ in range(3):
                warnings.warn("the same thing again")
            warnings.warn_explicit("deprecated inside torch", DeprecationWarning, "torch/utils/mkldnn.py", 19,
                                   module="torch.utils.mkldnn")
            return {}

    monkeypatch.setitem(STAGES, "detect", Noisy)
    result = lowbit_pipe.run("default", ["pipeline=[load,detect]"], run_dir=tmp_path / "run")
    assert result.report["warnings"] == [{"stage": "detect", "message": "the same thing again", "count": 3}]
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert summary.count("the same thing again") == 1 and "(x3)" in summary


# ---- (e) model.dtype=bfloat16 keeps diffusers' fp32 modules -------------------------------------------------------

def _fp32_split(model):
    from lowbit_pipe.arch.base import keeps_fp32
    from lowbit_pipe.quant.nn import QuantLinear

    kept = keeps_fp32(type(model))
    quant = [n + "." for n, m in model.named_modules() if isinstance(m, QuantLinear)]  # fp32 scales by design
    named = [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
             if t.is_floating_point() and not any(n.startswith(q) for q in quant)]
    return {t.dtype for n, t in named if kept(n)}, {t.dtype for n, t in named if not kept(n)}


def test_bfloat16_keeps_the_fp32_modules_and_a_forward_warns_nothing(tmp_path):
    import warnings

    import torch

    from lowbit_pipe.arch import get_arch

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logging.getLogger("diffusers").addHandler(handler)
    try:
        result = lowbit_pipe.run("default", ["model.dtype=bfloat16", "pipeline=[load,detect,quantize,export]",
                                             "evaluate.samples=1"], run_dir=tmp_path / "run")
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert not records, records[0].getMessage()  # diffusers' "should be kept in float32" (a cast with to())
    model, arch, ctx = result.model, get_arch("krea2"), result.context
    assert type(model)._keep_in_fp32_modules  # Krea 2's norms
    assert _fp32_split(model) == ({torch.float32}, {torch.bfloat16})
    assert ctx.dtype == torch.bfloat16 and not result.report["warnings"]
    inputs = arch.example_inputs(ctx.model_config, batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16,
                                 device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        out = arch.output_tensor(model(**inputs))
    assert not [w for w in caught if "dtype" in str(w.message).lower()], [str(w.message) for w in caught]
    # the file (bf16, as ComfyUI files are) loads back with the same split, and computes the very same output
    back = lowbit_pipe.run("default", [f"model.path={result.export_path}", "model.dtype=bfloat16", "pipeline=[load]"],
                           run_dir=tmp_path / "back")
    assert _fp32_split(back.model) == ({torch.float32}, {torch.bfloat16})
    with torch.inference_mode():
        assert torch.equal(arch.output_tensor(back.model(**inputs)), out)


def test_compute_dtype_skips_the_fp32_modules(tiny_model, tmp_path):
    import torch

    from lowbit_pipe.arch.base import cast_keeping_fp32, compute_dtype

    wan = cast_keeping_fp32(tiny_model("wan"), torch.bfloat16)  # its first parameter is the fp32 modulation table
    assert next(wan.parameters()).dtype == torch.float32 and compute_dtype(wan) == torch.bfloat16
    result = lowbit_pipe.run("default", ["model=tiny_wan", "pipeline=[load,detect]"], model=wan, run_dir=tmp_path / "run")
    assert result.context.dtype == torch.bfloat16  # a passed-in model computes in its own dtype


# ---- (f) progress for load, export and evaluate; labelled images.png -----------------------------------------------

def test_console_task_lines_in_a_log():
    import io

    from lowbit_pipe.progress import Console

    log = io.StringIO()
    with Console(prefix="[job 1] ", err=log, interval=0.0).task("evaluate: forwards", 3) as task:
        for _ in range(3):
            task.advance()
    assert log.getvalue().splitlines() == [f"[job 1] evaluate: forwards: {i}/3" for i in (1, 2, 3)]
    quiet = io.StringIO()
    with Console(err=quiet).task("fast", 3) as task:
        task.advance(3)
    assert quiet.getvalue() == ""  # done in a blink: no line


def test_load_export_and_evaluate_report_progress(tmp_path):
    import io

    from lowbit_pipe.progress import Console
    from lowbit_pipe.running.runner import Runner

    source = lowbit_pipe.run("default", ["pipeline=[load,detect,export]"], run_dir=tmp_path / "float").export_path
    recipe = compose_recipe("default", [f"model.path={source}", "pipeline=[load,detect,quantize,evaluate,export]",
                                        "evaluate.samples=2", "evaluate.trajectory_seeds=1", "evaluate.steps=3",
                                        f"export.path={tmp_path / 'out.safetensors'}"])
    out, err = io.StringIO(), io.StringIO()
    Runner(recipe, tmp_path / "run", console=Console(out=out, err=err, interval=0.0)).run()
    lines = err.getvalue().splitlines()
    assert f"load: {source} (krea2, " in out.getvalue()  # what is read, how big
    tensors = len(__import__("safetensors").safe_open(source, "pt").keys())
    for label, total in [("load: read", tensors), ("load: check values", tensors), ("load: check and cast", tensors),
                         ("evaluate: forwards", 2 * (2 + 1 * 3))]:
        assert f"{label}: 1/{total}" in lines and f"{label}: {total}/{total}" in lines, (label, lines[:5])
    writes = [line for line in lines if line.startswith("export: write: ")]
    done, total = writes[-1].removeprefix("export: write: ").split("/")
    assert writes[0] == f"export: write: 1/{total}" and done == total


def test_images_png_panels_are_labelled(tmp_path):
    from PIL import Image

    from lowbit_pipe.measure.images import COLUMNS, LABEL_HEIGHT, grid_layout

    layout = grid_layout((128, 128), "krea2_nvfp4: int8 + nvfp4, 4 Euler steps", ["seed 1: PSNR 40.0 dB", "seed 2"])
    texts = [t for _, _, t in layout.texts]
    assert texts == ["krea2_nvfp4: int8 + nvfp4, 4 Euler steps", *COLUMNS, "seed 1: PSNR 40.0 dB", "seed 2"]
    assert layout.size == (3 * 128, 4 * LABEL_HEIGHT + 2 * 128) and len(layout.tiles) == 6
    bands = {y - 1 for _, y, _ in layout.texts}  # each text line's top (texts sit 1 px below it)
    for x, y in layout.tiles:  # no tile covers a label line
        assert all(top + LABEL_HEIGHT <= y or y + 128 <= top for top in bands), (x, y, bands)
    long = grid_layout((16, 16), "x" * 200, ["r"])  # cut to the image's width
    assert long.texts[0][2].endswith("...") and len(long.texts[0][2]) * 6 <= 48

    result = lowbit_pipe.run("krea2_nvfp4", ["pipeline=[load,detect,quantize,evaluate]", "evaluate.images=true",
                                             "evaluate.samples=1", "evaluate.steps=2", "evaluate.trajectory_seeds=2"],
                             run_dir=tmp_path / "run")
    labels = result.report["evaluate"]["images"]["labels"]
    seeds = result.report["evaluate"]["trajectory"]["seeds"]
    assert labels["title"] == "krea2_nvfp4: int8 + nvfp4, 2 Euler steps, stand-in VAE"
    assert labels["columns"] == list(COLUMNS)
    assert [r.split(":")[0] for r in labels["rows"]] == [f"seed {s}" for s in seeds] and "PSNR" in labels["rows"][0]
    grid = Image.open(tmp_path / "run" / "images.png").convert("RGB")
    title_band = grid.crop((0, 0, grid.size[0], LABEL_HEIGHT))
    assert len(set(title_band.getdata())) > 1  # text drawn on the band


# ---- (g) a clone named lowbit_pipe with its venv inside (issue 45) ---------------------------------------------------

def test_teardown_counts_host_allocations_by_package_folder_not_by_a_word_in_the_path(tmp_path):
    """tests/running/test_teardown.py's `_ours`: a venv inside a clone named lowbit_pipe (the default name) puts
    "lowbit_pipe" in every torch file's path; torch's allocations are still not ours."""
    from pathlib import Path

    import torch
    from test_teardown import is_ours

    clone = tmp_path / "lowbit_pipe"
    venv_torch = clone / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "_tensor.py"
    package = clone / "lowbit_pipe"
    assert not is_ours(str(venv_torch), (package,)) and is_ours(str(package / "stages" / "quantize.py"), (package,))
    assert not is_ours(str(clone / "lowbit_pipe_extra" / "x.py"), (package,))  # a sibling folder, not the package
    # with the folders this process imports from
    assert is_ours(str(Path(lowbit_pipe.__file__).parent / "running" / "runner.py")) and is_ours(__import__("diffusers").__file__)
    assert not is_ours(torch.__file__) and not is_ours("<frozen importlib._bootstrap>")


# ---- (h) the real-ComfyUI tests without the ComfyUI archive (issue 45) ---------------------------------------------

COMFYUI_TESTS = [f"comfy/{name}" for name in (  # paths under tests/
    "test_comfyui_server.py", "test_comfy_attention.py", "test_comfy_patchers.py", "test_lora_comfyui.py",
    "test_comfy_versions.py", "test_comfy_compile.py", "test_comfy_fused.py", "test_comfy_stock_lora_comfyui.py",
    "test_comfyui_browser.py")]


def test_without_the_comfyui_archive_each_real_comfyui_test_skips_with_one_line_saying_how_to_enable_it(tmp_path):
    """The README's `python -m pytest -q -m slow` in a clone with no ComfyUI archive anywhere: every test that needs
    it skips (none errors), before its fixtures do any work, and pytest prints one line saying how to enable them.
    LOWBIT_COMFYUI_ARCHIVE, when set, is the only place looked at: here a path that does not exist."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    missing = tmp_path / "nowhere" / "comfyui-0.29.0.tar.xz"
    env = {k: v for k, v in os.environ.items() if k != "LOWBIT_COMFYUI_REQUIRED"}  # CI's: fail rather than skip
    env["LOWBIT_COMFYUI_ARCHIVE"] = str(missing)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "comfyui", "-p", "no:cacheprovider",
                           *[str(tests / f) for f in COMFYUI_TESTS]], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out.splitlines()[-1]))
    assert set(counts) == {"skipped"} and counts["skipped"] >= 30, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(lines) == 1, lines  # one line for all of them
    assert f"SKIPPED [{counts['skipped']}] " in lines[0]
    for needle in ("no ComfyUI source archive", f"LOWBIT_COMFYUI_ARCHIVE={missing} names no file", "0.29.0",
                   "4f874c5", "set LOWBIT_COMFYUI_ARCHIVE=", "shared/comfyui-0.29.0.tar.xz"):
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / "runs").exists()


def test_require_archive_skips_or_under_ci_fails_and_each_real_comfyui_test_is_marked(monkeypatch, tmp_path):
    from pathlib import Path

    import comfyui_harness

    monkeypatch.delenv("LOWBIT_COMFYUI_REQUIRED", raising=False)
    monkeypatch.setenv("LOWBIT_COMFYUI_ARCHIVE", str(tmp_path / "missing.tar.xz"))
    with pytest.raises(pytest.skip.Exception, match="to run the real-ComfyUI tests, download"):
        comfyui_harness.require_archive()
    monkeypatch.setenv("LOWBIT_COMFYUI_REQUIRED", "1")  # what .ci/run sets: a lost archive fails
    with pytest.raises(pytest.fail.Exception, match="LOWBIT_COMFYUI_REQUIRED=1"):
        comfyui_harness.require_archive()
    archive = tmp_path / "copy.tar.gz"
    archive.write_bytes(b"")
    monkeypatch.setenv("LOWBIT_COMFYUI_ARCHIVE", str(archive))
    assert comfyui_harness.require_archive() == archive
    # every test module that reaches the archive (through the harness, the shared tree's fixture or the server bench)
    # marks its tests `comfyui`
    tests = Path(__file__).resolve().parent
    users = sorted(p.relative_to(tests).as_posix() for p in tests.rglob("test_*.py") if p.name != Path(__file__).name
                   and any(s in p.read_text() for s in ("from comfyui_harness import", "import comfyui_server",
                                                         "comfyui_src")))
    assert users == sorted(COMFYUI_TESTS), users
    for name in users:
        assert "pytest.mark.comfyui" in (tests / name).read_text(), name
    assert "export LOWBIT_COMFYUI_REQUIRED=1" in (tests.parent / ".ci" / "run").read_text().splitlines()


# ---- (i) tests leave no run folder in the user's runs/ (issue 45) ----------------------------------------------------

# The tests that wrote run dirs into the working directory's runs/ (7 per `pytest` run): the ComfyUI nodes without
# ComfyUI (nodes._run_dir falls back to ./runs) and lowbit_pipe.run without run_dir.
LEAKED = ["comfy/test_comfy_nodes.py::test_quantize_lora_export_purge_on_a_comfyui_model",
          "comfy/test_comfy_nodes.py::test_comfyui_lora_patches_become_exact_residual_branches",
          "comfy/test_comfy_nodes.py::test_a_comfyui_dora_patch_on_a_quantized_layer_is_refused_naming_it",
          "comfy/test_comfy_nodes.py::test_quantize_refuses_a_model_a_lowbit_node_made",
          "comfy/test_comfy_nodes.py::test_a_model_with_comfyui_lora_patches_is_refused",
          "test_new_user.py::test_compute_dtype_skips_the_fp32_modules"]


@pytest.mark.slow  # about a minute on 2 busy cores: the tests themselves run in the default set
def test_the_tests_that_wrote_run_folders_into_the_working_directory_write_them_under_tmp_path(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *[str(tests / t) for t in LEAKED]], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent),
                                                                            os.environ.get("PYTHONPATH", "")])},
                          timeout=600)
    assert proc.returncode == 0 and f"{len(LEAKED)} passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not list(tmp_path.rglob("report.json")), sorted(tmp_path.rglob("*"))[:9]


def test_every_lowbit_pipe_run_in_the_tests_names_its_run_dir():
    """lowbit_pipe.run without run_dir writes runs/<date>/<time> under the working directory: a test names one (under
    tmp_path), or changes into tmp_path first."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        source = path.read_text()
        chdir = "monkeypatch.chdir(tmp_path)" in source
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("lowbit_pipe.run", "api.run") and not chdir:
                keys = {k.arg for k in node.keywords}
                if "run_dir" not in keys and None not in keys:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


# ---- (j) raw and silent cases refused early, naming the key, or made explicit (issue 45) ---------------------------

def test_compute_device_cuda_without_cuda_is_refused_before_any_work(monkeypatch, tmp_path):
    import torch

    from lowbit_pipe.config.preflight import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError) as err:
        preflight(compose_recipe("default", ["quantize.compute_device=cuda"]))
    assert err.value.path == "quantize.compute_device" and "no CUDA device" in str(err.value)
    assert "quantize.compute_device=auto" in str(err.value)  # what to set instead
    with pytest.raises(RecipeError, match="quantize.compute_device"):
        lowbit_pipe.run("default", ["quantize.compute_device=cuda:1"], run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    preflight(compose_recipe("default", ["quantize.compute_device=auto"]))  # the GPU when there is one: fine
    preflight(compose_recipe("default", ["quantize.compute_device=cuda", "pipeline=[load,detect]"]))  # not used


@pytest.mark.parametrize("key", list(__import__("lowbit_pipe.config.validate", fromlist=["MAX_COUNTS"]).MAX_COUNTS))
def test_a_count_over_its_stated_bound_is_refused_naming_the_key_and_the_bound(key):
    from lowbit_pipe.config.validate import MAX_COUNTS

    bound = MAX_COUNTS[key]
    with pytest.raises(RecipeError) as err:
        compose_recipe("default", [f"{key}={bound + 1}"])
    assert err.value.path == key and f"at most {bound:,}" in str(err.value) and "MAX_COUNTS" in str(err.value)
    section, name = key.split(".")
    assert getattr(getattr(compose_recipe("default", [f"{key}={bound}"]), section), name) == bound


def test_fused_norm_rope_on_the_cpu_says_it_did_nothing_in_the_report_and_the_summary(tmp_path):
    result = lowbit_pipe.run("default", ["attention.fused_norm_rope=true", "pipeline=[load,detect,quantize]"],
                             run_dir=tmp_path / "run")
    fused = result.report["attention"]["fused_norm_rope"]
    assert "CUDA only" in fused["note"] and "on cpu" in fused["note"]
    assert fused["norm_kernel_calls"] == 0 and fused["rope_kernel_calls"] == 0
    said = [w["message"] for w in result.report["warnings"]]
    assert any(m.startswith("attention.fused_norm_rope=true did nothing in this run") for m in said), said
    assert "attention.fused_norm_rope=true did nothing" in (tmp_path / "run" / "summary.txt").read_text()
    lowbit_pipe.teardown(result)


def test_purge_on_a_folder_that_is_not_a_run_says_so_and_exits_1(tmp_path, capsys):
    import os
    import subprocess
    import sys

    from lowbit_pipe.purge import main as purge_main

    plain = tmp_path / "photos"
    (plain / "sub").mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stray = plain / f".model.safetensors.tmp-{dead.pid}"  # looks stale, but this is nobody's run: left alone
    stray.write_bytes(b"\0" * 10)
    assert purge_main([str(plain)]) == 1
    out, err = capsys.readouterr()
    assert "not a run folder" in err and str(plain) in err and "removed" not in out and stray.exists()
    run = tmp_path / "runs" / "2026-01-01" / "10-00-00"
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text("name: default\n")  # what a run writes first
    assert purge_main([str(tmp_path / "runs"), "--dry-run"]) == 0
    assert "would remove 0 stale temp file(s)" in capsys.readouterr().out
    assert os.path.exists(stray)


def test_stream_true_on_an_already_quantized_file_is_refused_before_the_work(tmp_path):
    from lowbit_pipe.config.preflight import preflight

    export = ["pipeline=[load,detect,quantize,export]"]
    quantized = lowbit_pipe.run("default", [*export, f"export.path={tmp_path / 'q.safetensors'}"],
                                run_dir=tmp_path / "q").export_path
    with pytest.raises(RecipeError) as err:
        preflight(compose_recipe("default", [f"model.path={quantized}", "model.stream=true", *export]))
    assert err.value.path == "model.stream" and "16 quantized layers" in str(err.value)
    assert "model.stream=auto or false" in str(err.value)
    with pytest.raises(RecipeError, match="model.stream"):
        lowbit_pipe.run("default", [f"model.path={quantized}", "model.stream=true", *export,
                                    f"export.path={tmp_path / 'again.safetensors'}"], run_dir=tmp_path / "again")
    assert not (tmp_path / "again").exists()
    floating = lowbit_pipe.run("default", ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'f.safetensors'}"],
                               run_dir=tmp_path / "f").export_path
    preflight(compose_recipe("default", [f"model.path={floating}", "model.stream=true", *export]))  # streams
    preflight(compose_recipe("default", [f"model.path={quantized}", *export]))  # auto: loads it whole, as before


def test_a_ratio_target_under_the_byte_floor_is_refused_before_calibration_and_timing(tmp_path, monkeypatch):
    from lowbit_pipe.errors import LowbitError
    from lowbit_pipe.plan import target_plan

    def calibrated(*args, **kwargs):
        raise AssertionError("calibrated before the floor was checked")

    monkeypatch.setattr(target_plan, "measure_options", calibrated)
    cache = tmp_path / "speed"
    with pytest.raises(LowbitError) as err:
        lowbit_pipe.run("krea2_auto_speed_tiny", ["quantize.target.ratio=0.01", f"quantize.speed_cache={cache}"],
                        run_dir=tmp_path / "run")
    message = str(err.value)
    assert "quantize.target.ratio" in message and "0.01 cannot be met" in message
    assert "at least 0.4295 of the float transformer" in message and "before any calibration" in message
    assert not cache.exists() or not list(cache.iterdir())  # refused before the speed table was timed


def test_byte_floor_is_a_lower_bound_of_the_solvers_smallest_plan(tmp_path):
    """The floor counts stored tensors from shapes; the solver's bytes (quantized_bytes) add records and derived
    buffers: the floor never refuses a target the solver could meet (the README's ratio 0.45 among them)."""
    from lowbit_pipe.formats import get_format
    from lowbit_pipe.ledger import tensor_bytes
    from lowbit_pipe.plan.candidates import Candidate
    from lowbit_pipe.plan.error_model import quantized_bytes
    from lowbit_pipe.plan.policy import plan_layers, spec_of
    from lowbit_pipe.plan.target_plan import byte_floor, free_layers
    from lowbit_pipe.stages.detect import linear_shapes

    ctx = lowbit_pipe.run("krea2_auto_speed_tiny", ["pipeline=[load,detect]"], run_dir=tmp_path / "run").context
    cfg, model = ctx.recipe.quantize, ctx.transformer
    names = free_layers(plan_layers(linear_shapes(model), cfg, ctx.policy, ctx.policy_name))
    for candidates in ([Candidate(spec_of(c)) for c in cfg.target.candidates],
                       [Candidate(spec_of(c)) for c in cfg.target.candidates] + [Candidate(None)]):
        smallest = tensor_bytes(model)
        for name in names:
            lin = model.get_submodule(name)
            smallest += min(tensor_bytes(lin) if c.spec is None else quantized_bytes(lin, c.spec) for c in candidates
                            if c.spec is None or get_format(c.spec.format).supports_shape(*lin.weight.shape)) \
                - tensor_bytes(lin)
        floor = byte_floor(model, names, {}, candidates)
        assert 0.98 * smallest <= floor <= smallest and floor < 0.45 * tensor_bytes(model)


def test_run_dir_that_cannot_be_created_names_hydra_run_dir(tmp_path, monkeypatch):
    from lowbit_pipe.config.preflight import check_run_dir

    monkeypatch.chdir("/proc")  # not writable, even as root
    with pytest.raises(RecipeError) as err:
        check_run_dir(["quantize.default.format=int8"], multirun=False)
    assert err.value.path == "hydra.run.dir" and "set hydra.run.dir=" in str(err.value) and "/proc" in str(err.value)
    with pytest.raises(RecipeError, match="hydra.sweep.dir"):
        check_run_dir([], multirun=True)
    check_run_dir([f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S}}"], multirun=False)  # a writable one: fine
    assert list(tmp_path.iterdir()) == []  # tried, not created


def test_an_unknown_model_group_option_names_the_group_and_its_choices():
    from lowbit_pipe.config.preflight import check_groups
    from lowbit_pipe.paths import tiny_models

    for args in (["model=tiny_sdxl"], ["+model=tiny_sdxl"], ["model=tiny_krea2,tiny_sdxl", "evaluate.samples=1"]):
        with pytest.raises(RecipeError) as err:
            check_groups(args)
        assert err.value.path == "model" and "'tiny_sdxl' is no option of the config group 'model'" in str(err.value)
        assert all(name in str(err.value) for name in tiny_models()) and "model.path=" in str(err.value)
    check_groups(["model=tiny_flux1", "model.path=/x.safetensors", "model.stream=true"])
    check_groups(["model=team_model", "hydra.searchpath=[file:///team/conf]"])  # a team folder may add options


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_refusals_of_issue_45_are_one_line_with_exit_2(tmp_path):
    one_line_refusal(cli(["model=tiny_sdxl"], tmp_path), "model", "config group 'model'", "tiny_krea2")
    one_line_refusal(cli(["quantize.compute_device=cuda", "quantize.calibration_samples=2"], tmp_path),
                     "quantize.compute_device", "no CUDA device")
    one_line_refusal(cli(["pipeline=[load]"], "/proc"), "hydra.run.dir", "/proc", "set hydra.run.dir=")
    assert not (tmp_path / "runs").exists()


# ---- (k) the README's first screen, and docs that agree (issue 45) -------------------------------------------------

def _readme() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_readme_opens_with_what_it_does_and_a_quick_start_before_any_benchmark():
    text = _readme()
    lines = text.splitlines()
    headings = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert lines[headings[0]] == "## Quick start", lines[headings[0]]
    quick = lines[headings[0]:headings[1]]
    assert len([line for line in quick if line.strip()]) <= 12, quick  # about ten lines
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    first_figure = next(i for i, line in enumerate(lines) if " ms " in line or "1.52x" in line or "H200" in line)
    assert headings[1] < first_table and headings[1] < first_figure  # no benchmark before the quick start is over
    assert "## Benchmarks" in lines and "| variant | ms | vs bf16 compiled | weight GB |" in lines  # kept, lower
    commands = [line.strip() for line in quick if line.startswith("    python -m lowbit_pipe")]
    assert commands and any("recipe=krea2_nvfp4 " in c for c in commands) and any("krea2_nvfp4_stock" in c for c in commands)


@pytest.mark.parametrize("recipe, stock", [("default", True), ("krea2_nvfp4_stock", True), ("flux1_fp8", True),
                                           ("krea2_nvfp4", False)])
def test_the_readmes_comfyui_promise_matches_what_each_recipe_exports(recipe, stock):
    """The first screen says which exports stock ComfyUI loads as they are and which need the node pack; each recipe
    it names is judged by the `.comfy_quant` records its formats write (lowbit_pipe.plan.loadable, what the export's
    warning uses)."""
    from lowbit_pipe.plan.loadable import loadable
    from lowbit_pipe.plan.policy import spec_of

    q = compose_recipe(recipe).quantize
    specs = [spec_of(q.default), *([spec_of(q.sensitive)] if q.sensitive is not None else []),
             *(spec_of(q.default, r) for r in q.rules if not r.keep)]
    assert all(loadable(spec, "comfyui") for spec in specs) == stock
    text = _readme()
    first_screen = text[: text.index("## Set up")]
    intro = first_screen[: first_screen.index("## Quick start")]
    named = "the default recipe" if recipe == "default" else f"`{recipe}`"
    stock_part, pack_part = intro.split("need this project's ComfyUI node pack")[0].split("Rotated NVFP4")
    assert named in (stock_part if stock else pack_part), (named, intro)
    quick = {line.split("#")[0].strip(): line.split("#", 1)[1] for line in first_screen.splitlines()
             if line.startswith("    python -m lowbit_pipe")}
    comment = quick.get("python -m lowbit_pipe" + ("" if recipe == "default" else f" recipe={recipe}"))
    if comment is not None:  # the quick start's own word on the command's export
        assert ("stock ComfyUI loads" in comment) == stock and ("node pack" in comment) == (not stock), comment


def test_docs_layout_lists_every_packaged_recipe_and_team_md_agrees_with_cli_md_on_failed_sweep_jobs():
    from pathlib import Path

    from lowbit_pipe.paths import packaged_recipes

    docs = Path(__file__).resolve().parents[1] / "docs"
    layout = (docs / "layout.md").read_text()
    recipes_line = layout[layout.index("recipes/"): layout.index("lowbit_pipe/")]
    assert [n for n in packaged_recipes() if n not in recipes_line] == []
    cli_md, team = (docs / "cli.md").read_text(), " ".join((docs / "team.md").read_text().split())
    assert "a failed job does not stop the others, whatever the\nlauncher" in cli_md
    assert "ends the sweep before it is logged" not in team  # what team.md said: the CLI's exit ended the sweep
    assert "a failed job is a FAILED run with its error, whatever the launcher" in team


def test_python_api_refusals_come_before_any_work(tmp_path):
    import torch

    import lowbit_pipe
    from lowbit_pipe.errors import RecipeError

    with pytest.raises(RecipeError, match="'tiny_sdxl' is no option of the config group 'model' \\(choices: tiny_chroma"):
        lowbit_pipe.run("default", ["model=tiny_sdxl"], run_dir=tmp_path / "run")
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with pytest.raises(RecipeError, match="path.*/proc/x.*cannot write there"):
        lowbit_pipe.export(module, "/proc/x/out.safetensors")
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match="quantize.compute_device.*no CUDA device"):
            lowbit_pipe.quantize(module, {"compute_device": "cuda"})
        assert all(type(m) is torch.nn.Linear for m in module)  # nothing quantized


def test_a_list_cut_at_its_spaces_gets_a_quoting_hint(tmp_path):
    proc = cli(["pipeline=[load,", "detect]"], cwd=tmp_path)
    assert proc.returncode == 2 and "looks cut at a space by the shell: quote the whole override" in proc.stderr


def test_recipe_file_errors_name_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("quantize:\n  default:\n    format: [int8\n")
    with pytest.raises(RecipeError, match=r"broken.yaml:\d.*not valid YAML"):
        compose_recipe(str(broken))
    typo = tmp_path / "typo.yaml"
    typo.write_text("quantize:\n  defualt:\n    format: int8\n")
    with pytest.raises(RecipeError, match=r"quantize.defualt.*no such key.*recipe file .*typo.yaml"):
        compose_recipe(str(typo))
