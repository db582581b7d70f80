"""Compose a Recipe from the packaged configs plus overrides, with one-line errors naming the key path.

Sources, in Hydra's search path: the primary config folder `conf/` (config.yaml, the `model/` and
`hydra/` groups) and the packaged recipes of `recipes/`, served as the `recipe=` group from Hydra's
ConfigStore (they live in their own top-level folder, not inside `conf/`). A team adds its own recipe
folder with Hydra's search path: `hydra.searchpath=[file:///team/conf]` finds `/team/conf/recipe/*.yaml`
as more `recipe=` options; or it passes a file: `recipe=/team/mine.yaml`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lowbit_pipe.config import untrusted
from lowbit_pipe.config.validate import validate
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.paths import config_dir, packaged_recipes, tiny_models
from lowbit_pipe.recipe import Recipe

CONFIG_NAME = "config"
# Recipe keys that map any key to a value (constructor kwargs): Hydra's struct mode makes a new key there an
# override with '+' (+model.config.num_layers=2), or an entry of a recipe file's mapping.
FREE_DICTS = ("model.config", "model.tiny_config")
FILE_RECIPE = "_lowbit_file"  # group option a recipe file or dict is served under
SCHEMA_NAME = "lowbit_schema"


def read_recipe_file(path: Path, source: str, *, allow_resolvers: bool = False) -> dict[str, Any]:
    """A recipe file's mapping, read under lowbit_pipe.config.untrusted's rules (size, anchors, `_target_`, hydra,
    resolvers) before anything parses it."""
    size = path.stat().st_size
    if size > untrusted.MAX_TEXT_BYTES:  # refused unread
        raise RecipeError(source, f"{size} bytes; a recipe file is at most {untrusted.MAX_TEXT_BYTES}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(source, f"cannot be read as UTF-8 text ({type(err).__name__})") from None
    return parse_recipe_text(text, source, allow_resolvers=allow_resolvers)


def parse_recipe_text(text: str, source: str, *, allow_resolvers: bool = False) -> dict[str, Any]:
    """YAML recipe text -> its mapping, checked (lowbit_pipe.config.untrusted) before and after parsing."""
    untrusted.check_text(text, source)
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False) if text.strip() else {}
    except Exception as err:  # noqa: BLE001 - what YAML itself accepted but OmegaConf does not: name the file, in one line
        raise RecipeError(source, f"not a valid YAML recipe ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise RecipeError(source, f"a recipe is a mapping of stage keys, got {type(data).__name__}")
    untrusted.check_data(data, source, allow_resolvers=allow_resolvers)
    return data


def _store_recipe(name: str, data: dict[str, Any], source: str, provider: str | None = None) -> None:
    """Serve a recipe mapping as the `recipe=<name>` option (package _global_: its keys are top-level)."""
    data = dict(data)
    defaults = list(data.pop("defaults", None) or [])
    for item in defaults:
        ok = item == "_self_" or isinstance(item, str) or (
            isinstance(item, dict) and len(item) == 1 and next(iter(item)).startswith("override /"))
        if not ok:
            raise RecipeError(f"{source}: defaults", "entries are another recipe's name or "
                                                     f"'override /<group>: <name>', got {item!r}")
    defaults = [d for d in defaults if d != "_self_"] + ["_self_"]
    ConfigStore.instance().store(group="recipe", name=name, node={"defaults": defaults, **data}, package="_global_",
                                 provider=provider)


def register_schema() -> None:
    """Register the Recipe schema (`lowbit_schema`), the help template and every packaged recipe (idempotent).

    Each compose calls this. Storing the schema costs ~40 ms (OmegaConf builds it from the dataclass), so what is
    already in Hydra's store is kept: the schema and help do not change within a process, and a packaged recipe is
    stored again only when its file changed (size and mtime, e.g. edited while a ComfyUI server runs)."""
    from lowbit_pipe.config.help import register_help

    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=Recipe)
        register_help()
    stored = store.repo.get("recipe", {})
    for name, path in packaged_recipes().items():
        stat = path.stat()
        provider = f"lowbit_pipe:{path}:{stat.st_size}:{stat.st_mtime_ns}"  # the file as it was when stored
        if getattr(stored.get(f"{name}.yaml"), "provider", None) != provider:
            _store_recipe(name, read_recipe_file(path, str(path)), str(path), provider=provider)


def register_recipe(data: dict[str, Any], source: str, *, allow_resolvers: bool = False) -> str:
    """Serve a recipe file's (or dict's) content as the `recipe=` option FILE_RECIPE; returns that override.
    The content is checked as recipe text from outside is (lowbit_pipe.config.untrusted).

    A complete recipe (a run dir's recipe.yaml: its `model:` has `tiny_config`) also replaces the model
    group, so nothing of the packaged default model is merged into it and a rerun is exact. Command-line
    overrides still apply on top.
    """
    untrusted.check_data(data, source, allow_resolvers=allow_resolvers)
    data = dict(data)
    defaults = list(data.pop("defaults", None) or [])
    model = data.get("model")
    if isinstance(model, dict) and "tiny_config" in model:
        ConfigStore.instance().store(group="model", name=FILE_RECIPE, node=data.pop("model"))
        defaults = [d for d in defaults if not (isinstance(d, dict) and "override /model" in d)]
        defaults.append({"override /model": FILE_RECIPE})
    _store_recipe(FILE_RECIPE, {"defaults": defaults, **data}, source)
    return f"recipe={FILE_RECIPE}"


def load_recipe_file(path: str | Path, *, allow_resolvers: bool = False) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError("recipe", f"no recipe file at {path}")
    if path.suffix not in (".yaml", ".yml"):  # never parse (and quote in errors) a file that is not a recipe
        raise RecipeError("recipe", f"{path} is not a .yaml / .yml recipe file")
    return read_recipe_file(path, str(path), allow_resolvers=allow_resolvers)


def _is_file_recipe(value: str) -> bool:
    return value.endswith((".yaml", ".yml")) or Path(value).is_file()


def recipe_file_args(args: list[str], *, allow_resolvers: bool = False) -> list[str]:
    """CLI: `recipe=<path.yaml>` -> `recipe=_lowbit_file` with the file registered (see register_recipe); the
    recipe folders a `hydra.searchpath` adds are checked as recipe files are."""
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "recipe" and _is_file_recipe(value):
            arg = register_recipe(load_recipe_file(value, allow_resolvers=allow_resolvers), value,
                                  allow_resolvers=allow_resolvers)
        out.append(arg)
    check_searchpath_recipes(args, allow_resolvers=allow_resolvers)
    return out


def check_searchpath_recipes(overrides: list[str], *, allow_resolvers: bool = False) -> None:
    """Hydra reads the `recipe/*.yaml` of a folder on its search path (`hydra.searchpath=[file:///team/conf]`)
    itself: check each of them as a recipe file before it can. (Other groups there, e.g. a team's
    hydra/launcher, are Hydra configs the command line chose.)"""
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key.lstrip("+~") != "hydra.searchpath":
            continue
        for entry in value.strip("[]").split(","):
            entry = entry.strip().strip("'\"")
            if entry.startswith("file://"):
                for path in sorted((Path(entry.removeprefix("file://")) / "recipe").glob("*.y*ml")):
                    read_recipe_file(path, str(path), allow_resolvers=allow_resolvers)


def _full_key(err: BaseException) -> str | None:
    while err is not None:
        key = getattr(err, "full_key", None)
        if key:
            return key
        err = err.__cause__ or err.__context__
    return None


def _one_line(err: BaseException) -> RecipeError:
    """Hydra/OmegaConf errors span lines; keep the key path and the first sentence."""
    missing = getattr(err, "missing_cfg_file", None) or ""
    if isinstance(err, MissingConfigException) and missing.startswith("recipe/"):
        name = missing.rsplit("/", 1)[-1]
        known = sorted(o for o in (err.options or []) if o != FILE_RECIPE) or sorted(packaged_recipes())
        return RecipeError("recipe", f"unknown recipe '{name}' (known: {', '.join(known)}; or a .yaml file path)")
    if isinstance(err, MissingConfigException) and missing.startswith("model/"):
        name = missing.rsplit("/", 1)[-1]
        known = sorted(o for o in (err.options or []) if o != FILE_RECIPE) or sorted(tiny_models())
        return RecipeError("model", f"'{name}' is no option of the config group 'model' (choices: {', '.join(known)}); "
                                    "a weights file or diffusers folder goes in model.path=...")
    key = _full_key(err)
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    if len(text) > 1 and text[0].endswith("raised while composing config:"):  # Hydra's wrapper: the cause is next
        text = text[1:]
    message = text[0] if text else type(cause).__name__
    if key is None:
        for line in str(err).splitlines():
            if line.strip().startswith("full_key:"):
                key = line.split(":", 1)[1].strip()
        if key is None and "'" in str(err).splitlines()[0]:
            key = str(err).splitlines()[0].split("'")[1]
    if "not in" in message and key:
        message = "no such key" + (f" ({message})" if message else "")
        head = next((d for d in FREE_DICTS if key.startswith(d + ".")), None)
        if head is not None:  # a mapping of any keys: a new one is added with Hydra's '+'
            message += f"; {head} takes any key, added with '+': +{key}=..."
    return RecipeError(key or "<recipe>", message)


def to_recipe(cfg: DictConfig) -> Recipe:
    """DictConfig (schema-typed) -> validated Recipe dataclass."""
    try:
        container = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
        recipe = OmegaConf.to_object(container)
    except OmegaConfBaseException as err:
        raise _one_line(err) from None
    if not isinstance(recipe, Recipe):
        raise RecipeError("<recipe>", "the config is not a lowbit_pipe recipe")
    return validate(recipe)


def compose_recipe(recipe: str | Path | dict | None = "default", overrides: list[str] | tuple[str, ...] = (), *,
                   allow_resolvers: bool = False) -> Recipe:
    """Recipe by packaged name ("krea2_nvfp4"), YAML path, or dict, then CLI-style overrides
    (`hydra.searchpath=[...]` adds a team's recipe folder). A file or dict recipe is read under
    lowbit_pipe.config.untrusted's rules; `allow_resolvers` lets it call OmegaConf resolvers (${oc.env:...})."""
    register_schema()
    overrides = list(overrides)
    source = None
    if isinstance(recipe, dict):
        choice = register_recipe(recipe, "<dict recipe>", allow_resolvers=allow_resolvers)
    elif recipe is not None and _is_file_recipe(str(recipe)):
        source = str(recipe)
        choice = register_recipe(load_recipe_file(recipe, allow_resolvers=allow_resolvers), source,
                                 allow_resolvers=allow_resolvers)
    else:
        choice = f"recipe={recipe or 'default'}"
    check_searchpath_recipes(overrides, allow_resolvers=allow_resolvers)
    if not any(o.split("=", 1)[0].lstrip("+~") == "recipe" for o in overrides):
        overrides = [choice] + overrides
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
        return to_recipe(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise _in_file(_one_line(err), source) from None
    except RecipeError as err:
        raise _in_file(err, source) from None
    finally:
        GlobalHydra.instance().clear()


def _in_file(err: RecipeError, source: str | None) -> RecipeError:
    """A composition error of a file recipe names the file too."""
    if source is None or source in err.problem:
        return err
    return RecipeError(err.path, f"{err.problem} (recipe file {source})")


def split_cli(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Hydra's own argument parser: (its flags, the overrides). Two-word flags (`--cfg job`, `-cn x`,
    `--info config`) keep their values out of the overrides."""
    from hydra._internal.utils import get_args_parser

    try:
        flags = get_args_parser().parse_args(args)
    except SystemExit:
        raise RecipeError("<command line>", f"cannot parse the arguments {args}") from None
    return flags, list(flags.overrides)


def cli_recipes(overrides: list[str], *, allow_resolvers: bool = False) -> list[Recipe]:
    """Every recipe a command line asks for, composed and validated before Hydra runs anything: each sweep
    value once, the other sweeps at their first value (enough to catch any bad value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_args = [a for a in overrides if a.split("=", 1)[0].lstrip("+~").startswith("hydra.searchpath")]
    plain = [a for a in overrides if not a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except HydraException as err:
        split = next((a for a in plain if a.count("[") > a.count("]") or a.count("{") > a.count("}")), None)
        hint = (f"; '{split}' looks cut at a space by the shell: quote the whole override "
                f"(\"{split} ...\") or leave the spaces out") if split else ""
        raise RecipeError("<command line>", str(err).splitlines()[0] + hint) from None
    fixed, sweeps = [], []
    for o in parsed:
        if o.is_sweep_override():
            sweeps.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            fixed.append(o.input_line)
    recipe = next((o.split("=", 1)[1] for o in fixed if o.split("=", 1)[0] == "recipe"), "default")
    rest = [o for o in fixed if o.split("=", 1)[0] != "recipe"] + hydra_args
    combos = [[s[0] for s in sweeps]] + [[s[j] if k == i else s[0] for k, s in enumerate(sweeps)]
                                        for i, sweep in enumerate(sweeps) for j in range(1, len(sweep))]
    out = []
    for combo in combos if sweeps else [[]]:
        rec = next((c.split("=", 1)[1] for c in combo if c.split("=", 1)[0] == "recipe"), recipe)
        out.append(compose_recipe(rec, [c for c in rest + combo if c.split("=", 1)[0] != "recipe"],
                                  allow_resolvers=allow_resolvers))
    return out
