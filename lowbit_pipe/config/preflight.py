"""Checks that need no weights, run before `load` (and before any run dir exists).

On a 12B model a late failure costs minutes: a missing LoRA file, a CUDA device that is not
there or an export path that cannot be written is refused here in one line naming the recipe
key and the path. The CLI exits with code 2; `lowbit_pipe.run` raises before creating the run dir.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from lowbit_pipe.errors import CheckpointError, RecipeError
from lowbit_pipe.files.checkpoint import export_targets, read_header, shard_files
from lowbit_pipe.recipe import Recipe


def _check_model_path(path: str) -> None:
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise RecipeError("model.path", f"{path}: a directory without config.json is not a diffusers model folder")
        return
    if not p.exists():
        raise RecipeError("model.path", f"{path}: no such file or directory")
    if p.suffix == ".json":  # a shard index: its shards must be there and readable
        try:
            files = shard_files(path)
        except CheckpointError as err:
            raise RecipeError("model.path", str(err)) from None
        for f in files:
            _check_safetensors("model.path", f)
        return
    _check_safetensors("model.path", path)


def _check_safetensors(key: str, path: str) -> None:
    if not Path(path).is_file():
        raise RecipeError(key, f"{path}: no such file")
    try:
        read_header(path)
    except CheckpointError as err:
        raise RecipeError(key, str(err)) from None


# What to set instead of a CUDA device this machine lacks, per key.
_NO_CUDA_INSTEAD = {"model.device": "use model.device=cpu or auto",
                    "quantize.compute_device": "use quantize.compute_device=auto (the GPU when there is one) or null "
                                               "(where the weights are)"}


def check_device(device: str | None, key: str = "model.device") -> None:
    if device is None or not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise RecipeError(key, f"'{device}' asked for, but this machine has no CUDA device ({_NO_CUDA_INSTEAD[key]})")
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise RecipeError(key, f"'{device}' asked for, but there are {torch.cuda.device_count()} CUDA devices")


def _quantized_layers(path: str) -> int:
    """How many quantized layers a single-file checkpoint or shard index says it holds, from its headers alone:
    `.comfy_quant` records and ComfyUI's `_quantization_metadata` header (0 for a float file, or a header this
    cannot read: the load stage names what is wrong with it)."""
    import json

    try:
        files = shard_files(path) if path.endswith(".json") else [path]
        headers = [read_header(f) for f in files]
    except CheckpointError:
        return 0
    names = {k[: -len(".comfy_quant")] for h in headers for k in h.tensors if k.endswith(".comfy_quant")}
    try:
        described = json.loads(headers[0].metadata.get("_quantization_metadata") or "{}").get("layers") or {}
    except (ValueError, AttributeError):
        described = {}
    return max(len(names), len(described) if isinstance(described, dict) else 0)


def _check_stream_source(recipe: Recipe) -> None:
    """model.stream=true over a file whose header says it is quantized already: a stream reads float checkpoints,
    and would find out only at export, after the quantize stage's work."""
    from lowbit_pipe.plan.stream_choice import stream_mode

    path = recipe.model.path
    if path is None or Path(path).is_dir() or stream_mode(recipe.model.stream) != "true":
        return
    n = _quantized_layers(path)
    if n:
        raise RecipeError("model.stream", f"true, but {path} holds {n} quantized layers already (its header says so); "
                                          "a stream reads float checkpoints: set model.stream=auto or false to load it "
                                          "whole")


def _writable_dir(path: Path) -> tuple[Path, str] | None:
    """(the folder, why) when `path` cannot be written to or created; None when it can.

    Tried, not inferred from permission bits: as root `os.access` says yes to everything, and /proc, a
    read-only mount or a full quota refuse what the bits allow. A temp file is created and removed in the
    folder when it exists, else a temp folder in its nearest existing ancestor (where mkdir would start)."""
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return p, "not a directory"
    try:
        if p == path:
            fd, name = tempfile.mkstemp(prefix=".lowbit_pipe-probe-", dir=p)
            os.close(fd)
            os.unlink(name)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".lowbit_pipe-probe-", dir=p))
    except OSError as err:
        return p, err.strerror or type(err).__name__
    return None


def _check_export(recipe: Recipe) -> None:
    if "export" not in recipe.pipeline or recipe.export.path is None:
        return
    out = Path(recipe.export.path)
    check_export_path(out, "export.path", overwrite=recipe.export.overwrite, lora="lora" in recipe.pipeline)
    src = recipe.model.path
    if src is not None and out.exists() and Path(src).exists() and out.resolve() == Path(src).resolve():
        raise RecipeError("export.path", f"{out} is the input model.path; an export never overwrites its input")


def check_export_path(out: Path, key: str, *, overwrite: bool, lora: bool = True) -> None:
    """Refuse, before any work, an export path that is a folder, cannot be written, or names a file that exists
    (unless `overwrite`): the command line's export.path and lowbit_pipe.export's path alike."""
    if out.is_dir():
        raise RecipeError(key, f"{out} is a directory; name the .safetensors file to write")
    blocked = _writable_dir(out.parent)
    if blocked is not None:
        folder, why = blocked
        raise RecipeError(key, f"{out}: cannot write there ({folder} is not a writable directory: {why})")
    if out.exists() and not os.access(out, os.W_OK):
        raise RecipeError(key, f"{out}: exists and is not writable")
    check_not_taken(out, key, overwrite=overwrite, lora=lora)


def check_not_taken(out: Path, key: str, *, overwrite: bool, lora: bool = True) -> None:
    """Refuse an export whose file (or shard index, or LoRA file) exists, unless `overwrite`: nothing is replaced
    without being asked."""
    targets = export_targets(out)
    taken = next((p for p in (targets.path, targets.index, *([targets.lora] if lora else []))
                  if os.path.lexists(p)), None)
    if taken is not None and not overwrite:
        raise RecipeError(key, f"{taken} exists; an export never replaces a file unless asked "
                               "(export.overwrite=true)")


def _check_loras(recipe: Recipe) -> None:
    if "lora" not in recipe.pipeline:
        return
    for i, spec in enumerate(recipe.lora.files):
        if spec.path.startswith("example:"):
            continue
        _check_safetensors(f"lora.files[{i}].path", spec.path)


_OPTUNA = ("hydra_plugins.hydra_optuna_sweeper", "optuna", "Hydra's Optuna sweeper (hydra-optuna-sweeper)")
_JOBLIB = ("hydra_plugins.hydra_joblib_launcher", "sweep", "Hydra's joblib launcher (hydra-joblib-launcher)")
_SUBMITIT = ("hydra_plugins.hydra_submitit_launcher", "sweep", "Hydra's submitit launcher (hydra-submitit-launcher)")
# Hydra config group options (ours in conf/hydra/, and Hydra's own names) -> (module they need, the pyproject extra
# that installs it, what it is). Without it Hydra stops with a multi-line "Could not load 'hydra/sweeper/optuna'".
EXTRAS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("hydra/sweeper", "optuna_budget"): _OPTUNA, ("hydra/sweeper", "optuna"): _OPTUNA,
    ("hydra/launcher", "local"): _JOBLIB, ("hydra/launcher", "joblib"): _JOBLIB,
    ("hydra/launcher", "slurm"): _SUBMITIT, ("hydra/launcher", "submitit_slurm"): _SUBMITIT,
    ("hydra/launcher", "submitit_local"): _SUBMITIT,
    ("hydra/launcher", "ray"): ("ray", "ray", "Ray"),
    ("hydra/launcher", "gpus"): ("cloudpickle", "sweep", "cloudpickle"),
    ("hydra/launcher", "lowbit_gpus"): ("cloudpickle", "sweep", "cloudpickle"),
    ("hydra/callbacks", "mlflow"): ("mlflow", "mlflow", "MLflow"),
}


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_extras(overrides: list[str]) -> None:
    """Refuse a Hydra plugin option (hydra/sweeper=optuna_budget, hydra/launcher=ray, ...) whose optional extra is
    not installed, naming the pip command, before Hydra fails on it."""
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        need = EXTRAS.get((key.strip(), value.strip()))
        if need is not None and not _importable(need[0]):
            module, extra, what = need
            raise RecipeError(key.strip(), f"'{value.strip()}' needs {what}, which is not installed: "
                                           f"pip install \".[{extra}]\" (from the source tree; "
                                           f"else pip install \"lowbit_pipe[{extra}]\")")


def _override_values(arg: str) -> list[str]:
    """The value(s) of one `key=value` command-line override: a sweep's values each (`a,b`), else the value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        (parsed,) = OverridesParser.create().parse_overrides([arg])
    except HydraException:
        return []  # composing names what is wrong with it
    if parsed.is_sweep_override():
        return [str(v) for v in parsed.sweep_string_iterator()]
    value = parsed.value()
    return [value] if isinstance(value, str) else []


def check_groups(overrides: list[str]) -> None:
    """Refuse `model=<name>` naming no option of the `model` group, saying so and listing the options, before
    Hydra's own message (which names the primary config, `config`, and lists nothing). A team folder added with
    hydra.searchpath may hold more options: then Hydra decides."""
    from lowbit_pipe.paths import tiny_models

    keys = [a.lstrip("+~").partition("=")[0].strip() for a in overrides]
    if any(k.startswith("hydra.searchpath") for k in keys):
        return
    choices = sorted(tiny_models())
    for arg, key in zip(overrides, keys):
        if key != "model" or "=" not in arg or arg.startswith("~"):
            continue
        for value in _override_values(arg.lstrip("+")):
            if value not in choices:
                raise RecipeError("model", f"'{value}' is no option of the config group 'model' (choices: "
                                           f"{', '.join(choices)}); a weights file or diffusers folder goes in "
                                           "model.path=...")


def _hydra_dir(overrides: list[str], key: str, default: str) -> str:
    """The value a command line gives the Hydra key `key` (hydra.run.dir, hydra.sweep.dir), else `default`."""
    for arg in overrides:
        k, _, value = arg.lstrip("+").partition("=")
        if k.strip() == key:
            return value.strip()
    return default


def check_run_dir(overrides: list[str], *, multirun: bool) -> None:
    """Refuse a command line whose run dir cannot be created (the working directory, or the folder hydra.run.dir /
    hydra.sweep.dir names, is not writable) in one line that says to set hydra.run.dir, before Hydra fails on it
    with a traceback. The fixed part of the path is tried (up to the first `${...}`), as export.path's folder is."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    configured = "runs/multirun/${now:...}" if multirun else "runs/${now:...}"  # conf/config.yaml
    value = _hydra_dir(overrides, key, configured)
    fixed = Path(value.split("${", 1)[0] or ".")
    folder = fixed if fixed.is_absolute() else Path.cwd() / fixed
    blocked = _writable_dir(folder)
    if blocked is not None:
        where, why = blocked
        raise RecipeError(key, f"cannot create the run dir ({value}) under {folder} ({where} is not a writable "
                               f"directory: {why}): run from a writable directory, or set {key}=/a/writable/folder")


def preflight(recipe: Recipe, *, model_given: bool = False) -> None:
    """Raise RecipeError (one line, naming the key and the path) for what can be refused without weights.
    `model_given`: a model object is passed in (model.path is then not read)."""
    if recipe.model.path is not None and not model_given:
        _check_model_path(recipe.model.path)
        _check_stream_source(recipe)
    check_device(recipe.model.device)
    if "quantize" in recipe.pipeline:
        check_device(recipe.quantize.compute_device, "quantize.compute_device")
    _check_export(recipe)
    _check_loras(recipe)
