"""What the nodes accept from a prompt. Anyone who can reach a ComfyUI server sets every node input, so each one
is checked as hostile before it is used:

- a recipe is "auto", a packaged recipe's name, a `.yaml` file inside `models/lowbit_recipes/` (checked after the
  real path is resolved), or YAML text; the text and overrides are data (lowbit_pipe.config.untrusted: size cap, no
  anchors, no `_target_`, no resolvers) and may set only the sections the Quantize node runs;
- a file name to write is a name, with at most one sub-folder, resolved inside its models folder, never replacing
  a file unless the node's `overwrite` input says so;
- errors name the input and the rule, never a file's content or a value they were not given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from lowbit_pipe.config import untrusted
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.paths import packaged_recipes

RECIPE_FOLDER = "lowbit_recipes"  # under ComfyUI's models folder: the recipe files a node may read
# Recipe sections the Quantize node runs (load, detect, quantize; the MODEL input is the model). Anything else in a
# node's recipe text or overrides would be ignored, so it is refused, naming it.
NODE_SECTIONS = frozenset({"name", "seed", "quantize", "attention", "teardown", "defaults"})
# Keys of those sections that name a file or are not what the node does.
NODE_REFUSED = {
    "quantize.speed_cache": "names a folder on the server (the speed table lives in the user's cache)",
    "quantize.target": "is planned on the diffusers model with the command line, not in the node",
    "quantize.calibration_prompts": "needs a diffusers pipeline; the node calibrates on its CONDITIONING input",
}
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+|\[\d+\])*")


def _refuse_key(path: str, where: str) -> None:
    top = re.split(r"[.\[]", path, maxsplit=1)[0]
    if top not in NODE_SECTIONS:
        raise RecipeError(where, f"'{top}' is not read by the Quantize node (it runs load, detect, quantize on the "
                                 f"MODEL given; it reads {', '.join(sorted(NODE_SECTIONS - {'defaults'}))})")
    for key, why in NODE_REFUSED.items():
        if path == key or path.startswith(key + ".") or path.startswith(key + "["):
            raise RecipeError(where, f"{key} {why}")


def check_recipe_data(data: dict, where: str) -> None:
    """A node's YAML recipe text, parsed: only the sections the node runs, no file-naming keys."""
    for top, value in data.items():
        if isinstance(value, dict):
            for key in value:
                _refuse_key(f"{top}.{key}", f"{where}: {top}.{key}")
        else:
            _refuse_key(str(top), f"{where}: {top}")


def overrides(text: str) -> list[str]:
    """A node's override lines (key=value, one per line; '#' comments), each checked: a plain key path of a
    section the node runs, a value that calls no resolver."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > untrusted.MAX_TEXT_BYTES:
        raise RecipeError("overrides", f"{size} bytes; at most {untrusted.MAX_TEXT_BYTES} are read")
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        where = f"overrides line {n}"
        if not sep or not _KEY.fullmatch(key):
            raise RecipeError(where, "is not key=value with a plain key path (no '+', '~', '@', hydra flags)")
        if key == "recipe":
            raise RecipeError(where, "the recipe is the node's 'recipe' input, not an override")
        _refuse_key(key, f"{where}: {key}")
        untrusted.check_value(value, f"{where}: {key}")
        out.append(f"{key}={value.strip()}")
    return out


def safe_name(text: str, what: str, *, suffixes: tuple[str, ...]) -> PurePosixPath:
    """`text` as a relative file name: 'name' or 'folder/name', no '..', no hidden parts, no absolute path."""
    name = text.strip()
    parts = name.split("/")
    bad = (not name or "\\" in name or "\0" in name or name.startswith("/") or len(parts) > 2
           or any(p in ("", ".", "..") or p.startswith(".") for p in parts))
    if bad:
        raise ValueError(f"{what}: '{text}' is not a file name ('name' or 'folder/name', no '..', no absolute "
                         "path, nothing hidden)")
    path = PurePosixPath(name)
    if suffixes and path.suffix not in suffixes:
        path = path.with_name(path.name + suffixes[0])
    return path


def inside(base: Path, name: PurePosixPath, what: str) -> Path:
    """`base / name`, refused when its real path (symlinks resolved) leaves the real `base`."""
    target = base / name
    real_base = base.resolve()
    real = target.resolve()
    if real != real_base and real_base not in real.parents:
        raise ValueError(f"{what}: '{name}' leads outside {base.name}/ (a symbolic link?)")
    return target


def recipe_file(name: str, folder: Path | None) -> Path:
    """A recipe file the node may read: `name` inside `folder` (ComfyUI's models/lowbit_recipes)."""
    if folder is None:
        raise ValueError(f"recipe: '{name}' names a file, and only ComfyUI's models/{RECIPE_FOLDER}/ is read "
                         "(no ComfyUI here)")
    path = inside(folder, safe_name(name, "recipe", suffixes=()), "recipe")
    if not path.is_file():
        raise ValueError(f"recipe: no recipe file '{name}' in models/{RECIPE_FOLDER}/")
    return path


INTERNAL_SUFFIX = "_tiny"  # CI variants of a recipe for the embedded tiny models: not offered in the node's list


def offered_recipes() -> list[str]:
    """The packaged recipes the Quantize node offers in its list: those that set only what the node runs (the rules
    of `check_recipe_data`, through the packaged recipes they extend), without the tiny-model variants. Any packaged
    name still works when typed (the node's `recipe_text`, or an older workflow's value)."""
    return [name for name in packaged_recipes() if not name.endswith(INTERNAL_SUFFIX) and _runs_in_node(name)]


def _runs_in_node(name: str, depth: int = 0) -> bool:
    from lowbit_pipe.config.compose import read_recipe_file

    path = packaged_recipes().get(name)
    if path is None or depth > 8:
        return path is not None
    data = read_recipe_file(path, name)
    try:
        check_recipe_data(data, name)
    except RecipeError:
        return False
    bases = [item for item in data.get("defaults") or [] if isinstance(item, str) and item != "_self_"]
    return all(_runs_in_node(base, depth + 1) for base in bases)


def unknown_recipe(text: str) -> ValueError:
    """The refusal of a recipe input that names nothing the node may read: the cause on the first line (what
    ComfyUI's error panel shows first), the packaged names on the next."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    shown = shown.splitlines()[0] if shown.strip() else shown
    return ValueError(f"recipe: '{shown}' is not 'auto', a packaged recipe, a .yaml file in models/{RECIPE_FOLDER}/, "
                      f"or YAML text\npackaged recipes: {', '.join(sorted(packaged_recipes()))}")


def free_target(path: Path, what: str, *, overwrite: bool) -> None:
    """Refuse to write `path` over an existing file unless `overwrite`."""
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{what}: {path.name} exists in {path.parent.name}/; set 'overwrite' to replace it")


def recipe_arch(source: str | dict, depth: int = 0) -> str | None:
    """The architecture a recipe is written for: the tiny model its `defaults` choose (`override /model: tiny_krea2`),
    through the recipes it extends; None for a recipe of no architecture (default)."""
    from lowbit_pipe.config.compose import read_recipe_file
    from lowbit_pipe.paths import tiny_models

    if isinstance(source, str):
        path = packaged_recipes().get(source)
        if path is None or depth > 8:
            return None
        source = read_recipe_file(path, source)
    for item in source.get("defaults") or []:
        if isinstance(item, dict) and len(item) == 1 and next(iter(item)).replace(" ", "") == "override/model":
            model = tiny_models().get(str(next(iter(item.values()))))
            return read_recipe_file(model, model.name).get("tiny_arch") if model is not None else None
        if isinstance(item, str) and item != "_self_":
            found = recipe_arch(item, depth + 1)
            if found is not None:
                return found
    return None


def check_patterns(quantize: Any, layers: list[str], recipe: str, written_for: str | None, arch_id: str | None) -> None:
    """Refuse a recipe whose `quantize.rules` / `quantize.keep` patterns match no layer of the model: they name another
    architecture's layers (or none), and would be ignored without a word."""
    from lowbit_pipe.plan.policy import matches

    patterns = [(f"quantize.rules[{i}].match", r.match) for i, r in enumerate(quantize.rules)] + \
               [(f"quantize.keep[{i}]", p) for i, p in enumerate(quantize.keep)]
    for key, pattern in patterns:
        if not any(matches(pattern, name) for name in layers):
            made = f" (the recipe is written for {written_for}; this MODEL is {arch_id or 'unknown'})" \
                if written_for not in (None, arch_id) else ""
            raise ValueError(f"recipe '{recipe}': {key} '{pattern}' matches no layer of this MODEL{made}: use 'auto' "
                             f"or a recipe for this architecture")
