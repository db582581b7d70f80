"""Where the packaged configuration lives: `conf/` (primary config, `model/`, `hydra/` groups) and
`recipes/` (the `recipe=` group).

Both folders sit at the top of the source tree, beside `lowbit_pipe/`; `pip install .` copies them
into the package (`lowbit_pipe/conf`, `lowbit_pipe/recipes`, see pyproject's package-dir). So there
are exactly two places to look, and both are fixed: inside the imported package (an install), or
beside it (a source checkout, editable installs included). Nothing depends on the working directory.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _packaged(name: str) -> Path:
    installed = _PACKAGE / name
    if installed.is_dir():
        return installed
    source = _PACKAGE.parent / name
    if source.is_dir():
        return source
    raise FileNotFoundError(f"lowbit_pipe: no '{name}' folder in {_PACKAGE} (an install) or {_PACKAGE.parent} "
                            "(a source checkout); reinstall the package")


def config_dir() -> Path:
    """The primary config folder: config.yaml, model/, hydra/."""
    return _packaged("conf")


def recipes_dir() -> Path:
    """The packaged recipes (the `recipe=` group)."""
    return _packaged("recipes")


def packaged_recipes() -> dict[str, Path]:
    """Recipe name -> file, for every packaged recipe."""
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def tiny_models() -> dict[str, Path]:
    """Model group option -> file (the embedded tiny models: tiny_krea2, tiny_flux1, ...)."""
    return {p.stem: p for p in sorted((config_dir() / "model").glob("*.yaml"))}
