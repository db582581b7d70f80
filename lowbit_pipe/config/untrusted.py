"""What recipe text from outside this process's own command line may contain: data, never a program.

A recipe file (`recipe=team.yaml`, a team folder on Hydra's search path), a dict handed to `lowbit_pipe.run`, and
everything a ComfyUI node receives (its recipe text and overrides: anyone who can reach the server sets them) are
read under these rules before Hydra or OmegaConf sees them:

- a size cap (`MAX_TEXT_BYTES`) and no YAML anchors or aliases (a few hundred bytes of nested aliases expand to
  gigabytes: "billion laughs"), both checked on the raw text before it is parsed;
- no `_target_` and no `()` key anywhere (what makes Hydra or Python's logging instantiate a callable);
- under `hydra:` only run / sweep folders, the sweeper's and launcher's own data and the job's name (no callbacks,
  logging, search path, environment); no `override /hydra/...` in `defaults` (plugins are chosen on the command line);
- no OmegaConf resolvers (`${oc.env:...}`, `${oc.decode:...}`, custom ones) except `${now:...}`, unless the caller
  opts in (`--allow-resolvers` on the command line, `allow_resolvers=True` in Python); plain `${other.key}` stays.

Error messages name the key path and the rule, never a value they were not given literally.
"""

from __future__ import annotations

from typing import Any, Iterator

import yaml
from omegaconf import grammar_parser
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

from lowbit_pipe.errors import RecipeError

MAX_TEXT_BYTES = 64 * 1024  # a recipe, or all of a node's overrides; the packaged recipes are under 4 KiB
SAFE_RESOLVERS = frozenset({"now"})  # Hydra's clock, for run folder names: reads nothing of the machine
# hydra.<key> a recipe file may set (data only); None: anything below it, `_target_` / `()` still refused.
HYDRA_DATA: dict[str, frozenset[str] | None] = {
    "run": frozenset({"dir"}),
    "sweep": frozenset({"dir", "subdir"}),
    "sweeper": None,  # params, n_trials, direction, ...: the sweeper chosen on the command line reads them
    "launcher": None,  # n_jobs, timeout_min, ...
    "job": frozenset({"name", "chdir"}),
    "mode": None,
}
INSTANTIATING_KEYS = ("_target_", "()")


def check_text(text: str, source: str) -> None:
    """Refuse recipe text over the size cap or with YAML anchors / aliases, before anything parses it."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_TEXT_BYTES:
        raise RecipeError(source, f"{size} bytes of recipe text; at most {MAX_TEXT_BYTES} are read")
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):  # events only: aliases are never expanded here
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                line = event.start_mark.line + 1 if event.start_mark is not None else "?"
                raise RecipeError(f"{source}:{line}", "YAML anchors and aliases (&name / *name) are not read in "
                                                      "recipes; write the values out")
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        raise RecipeError(where, f"not valid YAML ({getattr(err, 'problem', None) or type(err).__name__})") from None


def resolvers_in(value: str) -> list[str]:
    """The names of the OmegaConf resolvers `value` calls (`${name:...}`, nested ones too); a name built from an
    interpolation (`${${x}.env:...}`) is returned as written, so it never passes as a safe one."""
    if "${" not in value:
        return []
    try:
        tree = grammar_parser.parse(value)
    except GrammarParseError:
        return []  # not an interpolation OmegaConf can resolve: it stays a plain string
    names, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            names.append(node.resolverName().getText())
        todo.extend(getattr(node, "children", None) or [])
    return names


def check_value(value: str, where: str, *, allow_resolvers: bool = False) -> None:
    """Refuse a string that calls a resolver other than the safe ones (unless allowed)."""
    if allow_resolvers:
        return
    bad = [name for name in resolvers_in(value) if name not in SAFE_RESOLVERS]
    if bad:
        raise RecipeError(where, f"calls the resolver '{bad[0]}' (${{{bad[0]}:...}}): recipe text is data; only "
                                 f"${{key.path}} references and ${{now:...}} are read (on the command line, "
                                 "--allow-resolvers lets a recipe file you trust use resolvers)")


def _walk(data: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """(key path, key, value) of every entry of nested dicts and lists."""
    if isinstance(data, dict):
        for key, value in data.items():
            sub = f"{path}.{key}" if path else str(key)
            yield sub, key, value
            yield from _walk(value, sub)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            sub = f"{path}[{i}]"
            yield sub, None, value
            yield from _walk(value, sub)


def check_data(data: dict[str, Any], source: str, *, allow_resolvers: bool = False) -> None:
    """Refuse what would make a recipe mapping (parsed from a file, or a dict) more than data (module docstring)."""
    for path, key, value in _walk(data, ""):
        where = f"{source}: {path}"
        if key in INSTANTIATING_KEYS:
            raise RecipeError(where, f"'{key}' makes Hydra instantiate a callable; a recipe names no Python code")
        if isinstance(key, str):
            check_value(key, where, allow_resolvers=allow_resolvers)
        if isinstance(value, str):
            check_value(value, where, allow_resolvers=allow_resolvers)
    _check_hydra(data.get("hydra"), source)
    for i, item in enumerate(data.get("defaults") or []):
        group = next(iter(item), "") if isinstance(item, dict) and len(item) == 1 else ""
        if str(group).replace("override", "").strip().lstrip("/").startswith("hydra"):
            raise RecipeError(f"{source}: defaults[{i}]", f"'{group}' chooses a Hydra plugin; choose it on the "
                                                          "command line (e.g. hydra/launcher=joblib)")


def _check_hydra(block: Any, source: str) -> None:
    if block is None:
        return
    if not isinstance(block, dict):
        raise RecipeError(f"{source}: hydra", "must be a mapping (run / sweep folders, sweeper and launcher data)")
    for key, value in block.items():
        if key not in HYDRA_DATA:
            raise RecipeError(f"{source}: hydra.{key}", "a recipe file may set only hydra."
                                                        f"{{{', '.join(HYDRA_DATA)}}} (data); callbacks, logging, "
                                                        "search path and environment belong on the command line")
        allowed = HYDRA_DATA[key]
        if allowed is not None and isinstance(value, dict):
            extra = sorted(set(value) - allowed)
            if extra:
                raise RecipeError(f"{source}: hydra.{key}.{extra[0]}",
                                  f"a recipe file may set only hydra.{key}.{{{', '.join(sorted(allowed))}}}")
