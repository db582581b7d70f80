"""The package's import graph (docs/layout.md): floors that imports only go down, and no cycle.

Every import counts: `from lowbit_pipe.x import y`, `from lowbit_pipe import x`, `import lowbit_pipe.x`,
`importlib.import_module("lowbit_pipe.x")`, at module level or inside a function (a lazy import is still an
arrow). The cycle check leaves out imports under `if TYPE_CHECKING:` (they never run); the floor check counts
them (a reader follows them all the same).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom up. A module of a folder imports its own folder, the ground floor and folders on lower floors. The
# ground floor is every root module that is not a face: it imports only the ground floor. The faces (CLI, Python
# API, purge, the ComfyUI node pack) sit on top and may import anything.
FLOORS: list[set[str]] = [
    {"kernels"},
    {"formats"},
    {"quant", "arch", "adapters"},
    {"measure"},
    {"plan"},
    {"attention", "files"},
    {"lora"},
    {"stages"},
    {"config", "running"},
]
FACES = {"lowbit_pipe", "lowbit_pipe.__main__", "lowbit_pipe.api", "lowbit_pipe.purge"}
FACE_FOLDERS = {"comfy"}

# The arrows up there are today, each with why; issue 42 item 2 (the plan as an artifact) removes them. The
# test fails on a new one and on a listed one that is gone (then delete its line here).
KNOWN_UP: dict[tuple[str, str], str] = {}


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package` (a package is named without `.__init__`)."""
    root = package.parent
    return {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(package.rglob("*.py"))}


def _imported(node: ast.AST, mods: dict[str, Path], where: str) -> list[str]:
    """The package modules one AST node imports (a `from pkg import name` names the submodule when it is one)."""
    top = next(iter(mods)).split(".")[0]
    if isinstance(node, ast.ImportFrom):
        assert node.level == 0, f"{where}: relative import (from {'.' * node.level}{node.module or ''}); write it absolute"
        if node.module == top or (node.module or "").startswith(top + "."):
            return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names]
    elif isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == top or a.name.startswith(top + ".")]
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
            "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
        name = node.args[0].value
        return [name] if isinstance(name, str) and (name == top or name.startswith(top + ".")) else []
    return []


def import_edges(package: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every edge, the edges that run: those not under `if TYPE_CHECKING:`), importer -> imported modules."""
    mods = module_files(package)
    every, running = collections.defaultdict(set), collections.defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            for target in _imported(node, mods, f"{path}:{getattr(node, 'lineno', '?')}"):
                if target != name:
                    every[name].add(target)
                    if id(node) not in typing_only:
                        running[name].add(target)
    return every, running


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Paths that lead from a module back to itself (depth-first from each module)."""
    found = []
    for start in list(edges):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges.get(node, ())):
                if nxt == start:
                    found.append(path)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def unit(module: str, package: Path) -> str:
    """A module's place: 'face' (a root face), its folder's name, or 'ground'."""
    if module in FACES:
        return "face"
    parts = module.split(".")
    if len(parts) > 2 or (package / parts[1]).is_dir():
        return parts[1]
    return "ground"


def floor(place: str) -> int:
    if place == "ground":
        return -1
    if place == "face" or place in FACE_FOLDERS:
        return len(FLOORS)
    levels = [i for i, names in enumerate(FLOORS) if place in names]
    assert levels, f"lowbit_pipe/{place}/ is on no floor: add it to FLOORS in tests/test_import_graph.py and docs/layout.md"
    return levels[0]


def arrows_up(edges: dict[str, set[str]], package: Path) -> dict[tuple[str, str], list[str]]:
    """(importer, imported place) -> imported modules, for each import that does not go down (or stay in its
    folder, or go between faces)."""
    up = collections.defaultdict(list)
    for importer, targets in edges.items():
        here = unit(importer, package)
        for target in sorted(targets):
            there = unit(target, package)
            if here == there or floor(here) == len(FLOORS):
                continue
            if floor(there) >= floor(here):
                up[(importer, there)].append(target)
    return dict(up)


def test_imports_only_go_down_the_floors():
    package = ROOT / "lowbit_pipe"
    every, _ = import_edges(package)
    up = arrows_up(every, package)
    new = {k: v for k, v in up.items() if k not in KNOWN_UP}
    assert new == {}, "imports that go up a floor (docs/layout.md): " + "; ".join(
        f"{a} imports {', '.join(t)}" for (a, _), t in new.items())
    gone = set(KNOWN_UP) - set(up)
    assert gone == set(), f"KNOWN_UP lists arrows that are gone (delete them): {sorted(gone)}"


def test_no_import_cycles():
    """One direction of imports: no module of the package imports, even lazily, one that imports it back."""
    _, running = import_edges(ROOT / "lowbit_pipe")
    found = cycles(running)
    assert found == [], [" -> ".join(c + [c[0]]) for c in found[:5]]


def test_every_folder_is_on_a_floor():
    """A new folder must be placed (and so named in docs/layout.md's floors) before it can be imported."""
    folders = {p.parent.name for p in (ROOT / "lowbit_pipe").glob("*/__init__.py")}
    placed = set().union(*FLOORS) | FACE_FOLDERS
    assert folders == placed, (sorted(folders - placed), sorted(placed - folders))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "lowbit_pipe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "lowbit_pipe"


def test_the_checks_catch_an_arrow_up_and_a_cycle_in_each_import_style(tmp_path):
    """The checks on a made-up package: each import style is seen, an arrow up and a cycle are reported,
    an import under TYPE_CHECKING makes no cycle."""
    package = _package(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "kernels/__init__.py": "",
        "kernels/a.py": "def f():\n    import lowbit_pipe.plan.b\n",  # lazy, `import x` style: up two floors
        "formats/__init__.py": "",
        "formats/c.py": "from lowbit_pipe import errors\n",  # down to the ground floor: fine
        "plan/__init__.py": "",
        "plan/b.py": "from lowbit_pipe.kernels import a\n",  # down, and back: a cycle
        "plan/d.py": "import importlib\nimportlib.import_module('lowbit_pipe.stages.e')\n",
        "stages/__init__.py": "",
        "stages/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lowbit_pipe.plan import d\n",
    })
    every, running = import_edges(package)
    assert every["lowbit_pipe.kernels.a"] == {"lowbit_pipe.plan.b"}
    assert every["lowbit_pipe.formats.c"] == {"lowbit_pipe.errors"}
    assert every["lowbit_pipe.plan.d"] == {"lowbit_pipe.stages.e"}
    assert every["lowbit_pipe.stages.e"] == {"lowbit_pipe.plan.d"} and "lowbit_pipe.stages.e" not in running
    up = arrows_up(every, package)
    assert set(up) == {("lowbit_pipe.kernels.a", "plan"), ("lowbit_pipe.plan.d", "stages")}
    assert cycles(running) == [["lowbit_pipe.kernels.a", "lowbit_pipe.plan.b"], ["lowbit_pipe.plan.b", "lowbit_pipe.kernels.a"]]
    # The ground floor may not stand on a folder.
    package = _package(tmp_path / "g", {"__init__.py": "", "errors.py": "from lowbit_pipe.formats import c\n",
                                        "formats/__init__.py": "", "formats/c.py": ""})
    assert arrows_up(import_edges(package)[0], package) == {("lowbit_pipe.errors", "formats"): ["lowbit_pipe.formats.c"]}


def test_docs_layout_draws_these_floors_and_names_every_module():
    """docs/layout.md's picture is FLOORS (floor N lists its folders), and it names every folder and module of the
    package, so the page cannot drift from the tree unnoticed."""
    import re

    text = (ROOT / "docs" / "layout.md").read_text()
    drawn = {int(m.group(1)): {w.rstrip("/") for w in m.group(2).split()}
             for m in re.finditer(r"^ {4}floor (\d+) +(.+)$", text, re.M)}
    assert drawn == dict(enumerate(FLOORS)), drawn
    ground = re.search(r"^ {4}ground floor +(.+)$", text, re.M).group(1).split()
    package = ROOT / "lowbit_pipe"
    assert sorted(ground) == sorted(m.split(".")[1] for m in module_files(package) if unit(m, package) == "ground")
    missing = [str(p.relative_to(package)) for p in package.rglob("*.py") if p.stem != "__init__"
               and not re.search(rf"\b{re.escape(p.stem)}\b", text)]
    missing += [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file() and f"{p.name}/" not in text]
    assert missing == [], f"docs/layout.md does not name {missing}"
