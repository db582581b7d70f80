"""Compose a Recipe from the packaged configs plus overrides, with one-line errors naming the key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.recipe import Recipe, validate

CONFIG_MODULE = "lowbit_pipe.conf"
CONFIG_NAME = "config"


def register_schema() -> None:
    """Register the Recipe dataclass as the schema node `lowbit_schema` (idempotent)."""
    ConfigStore.instance().store(name="lowbit_schema", node=Recipe)


def _full_key(err: BaseException) -> str | None:
    while err is not None:
        key = getattr(err, "full_key", None)
        if key:
            return key
        err = err.__cause__ or err.__context__
    return None


def _one_line(err: BaseException) -> RecipeError:
    """Hydra/OmegaConf errors span lines; keep the key path and the first sentence."""
    key = _full_key(err)
    cause = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = str(cause).strip().splitlines()
    message = text[0] if text else type(cause).__name__
    if key is None:
        for line in str(err).splitlines():
            if line.strip().startswith("full_key:"):
                key = line.split(":", 1)[1].strip()
        if key is None and "'" in str(err).splitlines()[0]:
            key = str(err).splitlines()[0].split("'")[1]
    if "not in" in message and key:
        message = "no such key" + (f" ({message})" if message else "")
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


FILE_RECIPE = "_lowbit_file"  # group option a recipe file or dict is served under


def register_recipe(data: dict[str, Any], source: str) -> str:
    """Serve a recipe file's (or dict's) content as the `recipe=` option FILE_RECIPE; returns that override.

    Hydra groups take names, not paths, so the content goes into Hydra's ConfigStore (seen by compose,
    hydra.main and in-process launchers). A complete recipe (a run dir's recipe.yaml: its `model:` has
    `tiny_config`) also replaces the model group, so nothing of the packaged default model is merged
    into it and a rerun is exact. Command-line overrides still apply on top.
    """
    data = dict(data)
    defaults = list(data.pop("defaults", None) or [])
    for item in defaults:
        ok = item == "_self_" or (isinstance(item, dict) and len(item) == 1 and next(iter(item)).startswith("override /"))
        if not ok:
            raise RecipeError(f"{source}: defaults", f"only 'override /<group>: <name>' entries are supported, got {item!r}")
    store = ConfigStore.instance()
    model = data.get("model")
    if isinstance(model, dict) and "tiny_config" in model:
        store.store(group="model", name=FILE_RECIPE, node=data.pop("model"))
        defaults = [d for d in defaults if not (isinstance(d, dict) and "override /model" in d)]
        defaults.append({"override /model": FILE_RECIPE})
    defaults = [d for d in defaults if d != "_self_"] + ["_self_"]
    store.store(group="recipe", name=FILE_RECIPE, node={"defaults": defaults, **data}, package="_global_")
    return f"recipe={FILE_RECIPE}"


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RecipeError("recipe", f"no recipe file at {path}")
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception as err:  # YAML parse errors: name the file, in one line
        raise RecipeError(str(path), f"not a valid YAML recipe ({str(err).splitlines()[0]})") from None


def recipe_file_args(args: list[str]) -> list[str]:
    """CLI: `recipe=<path.yaml>` -> `recipe=_lowbit_file` with the file registered (see register_recipe)."""
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key == "recipe" and (value.endswith((".yaml", ".yml")) or Path(value).is_file()):
            out.append(register_recipe(load_recipe_file(value), value))
        else:
            out.append(arg)
    return out


def compose_recipe(recipe: str | Path | dict | None = "default", overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Recipe by packaged name ("krea2_nvfp4"), YAML path, or dict, then CLI-style overrides."""
    register_schema()
    overrides = list(overrides)
    if isinstance(recipe, dict):
        choice = register_recipe(recipe, "<dict recipe>")
    elif recipe is not None and (str(recipe).endswith((".yaml", ".yml")) or Path(str(recipe)).is_file()):
        choice = register_recipe(load_recipe_file(recipe), str(recipe))
    else:
        choice = f"recipe={recipe or 'default'}"
    if not any(o.split("=", 1)[0].lstrip("+~") == "recipe" for o in overrides):
        overrides = [choice] + overrides
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base=None):
            cfg = compose(config_name=CONFIG_NAME, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise _one_line(err) from None
    finally:
        GlobalHydra.instance().clear()
    return to_recipe(cfg)


def check_cli(args: list[str]) -> None:
    """Validate CLI overrides before Hydra runs anything: each sweep value is checked too."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = [a for a in args if not a.startswith("-") and not a.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    try:
        parsed = OverridesParser.create().parse_overrides(plain)
    except HydraException as err:
        raise RecipeError("<command line>", str(err).splitlines()[0]) from None
    fixed, sweeps = [], []
    for o in parsed:
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            sweeps.append([f"{o.get_key_element()}={v}" for v in values])
        else:
            fixed.append(o.input_line)
    recipe = next((o.split("=", 1)[1] for o in fixed if o.split("=", 1)[0] == "recipe"), "default")
    rest = [o for o in fixed if o.split("=", 1)[0] != "recipe"]
    # Every sweep value once, the others at their first value: enough to catch any bad value.
    combos = [[s[0] for s in sweeps]] + [[s[j] if k == i else s[0] for k, s in enumerate(sweeps)]
                                        for i, sweep in enumerate(sweeps) for j in range(1, len(sweep))]
    for combo in combos if sweeps else [[]]:
        chosen = rest + combo
        rec = next((c.split("=", 1)[1] for c in combo if c.split("=", 1)[0] == "recipe"), recipe)
        compose_recipe(rec, [c for c in chosen if c.split("=", 1)[0] != "recipe"])
