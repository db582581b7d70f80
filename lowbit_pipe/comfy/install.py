"""Install the node pack into a ComfyUI: `python -m lowbit_pipe.comfy install /path/to/ComfyUI`, or
`python -m lowbit_pipe.comfy install --base-directory DIR` for a ComfyUI started with `--base-directory DIR`
(which reads custom nodes from DIR/custom_nodes).

Run it with ComfyUI's own Python after `pip install lowbit_pipe` there. It writes, in
`custom_nodes/lowbit_pipe_nodes/`:

- `__init__.py`, the entry ComfyUI imports at start like any node pack: it exports the nodes and, where this
  ComfyUI can take it, registers lowbit_pipe's kinds with ComfyUI's loader (`compat.register_loader`), so
  "Load Diffusion Model" reads every file lowbit_pipe writes; where it cannot, the nodes still load and one
  log line says what needs a newer ComfyUI;
- `pyproject.toml`, the pack's metadata in the Comfy Registry's convention (`requires-comfyui` included);
- `example_workflows/*.json`, copies of the package's example workflows, when it has any, each with its thumbnail
  (`<name>.jpg`, drawn from the workflow where Pillow is installed: lowbit_pipe.comfy.thumbnails);
- `web/lowbit_pipe.js`, the front-end extension that shows the nodes' text on the nodes (`WEB_DIRECTORY`), and
  `locales/en/main.json`, which names the pack's template category as the node library names its nodes.

Every file is written atomically. A pack folder this command did not write (no `__init__.py` of ours in it: another
pack of the same name, or an empty folder someone made) is refused without `--force`; a symbolic link at the pack
folder or inside it is refused always (writing through it would land wherever it points).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

from lowbit_pipe.errors import LowbitError
from lowbit_pipe.files.checkpoint import atomic_write_text
from lowbit_pipe.formats.comfy_versions import PACK_MIN_COMFY_KITCHEN, SUPPORTED_COMFYUI
from lowbit_pipe.version import __version__

PACK = "lowbit_pipe_nodes"
WORKFLOWS = "example_workflows"
WORKFLOW_SOURCE = Path(__file__).resolve().parent / WORKFLOWS  # package data (pyproject: lowbit_pipe.comfy)
WEB = "web"  # the front-end extension (WEB_DIRECTORY), package data too
WEB_SOURCE = Path(__file__).resolve().parent / WEB
# ComfyUI's front end names a pack's template category by its folder ("lowbit_pipe_nodes") unless the pack's
# locales name it: the same name as the node library's category.
LOCALE = {"templateWorkflows": {"category": {PACK: "lowbit_pipe"}}}
SHIM = '''"""lowbit_pipe's ComfyUI nodes (written by `python -m lowbit_pipe.comfy install`; the code is lowbit_pipe's)."""

from lowbit_pipe.comfy.compat import register_loader
from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

REGISTRATION = register_loader()  # None, with one log line saying why, where this ComfyUI cannot load lowbit kinds
WEB_DIRECTORY = "./web"  # the front-end extension that shows the nodes' text on the nodes

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
'''
# Entry files earlier versions of this command wrote: replaced without --force (they are ours).
PREVIOUS_SHIMS = ('''"""lowbit_pipe's ComfyUI nodes (written by `python -m lowbit_pipe.comfy install`; the code is lowbit_pipe's)."""

from lowbit_pipe.comfy.compat import register_loader
from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

REGISTRATION = register_loader()  # None, with one log line saying why, where this ComfyUI cannot load lowbit kinds

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
''', '''"""lowbit_pipe's ComfyUI nodes (written by `python -m lowbit_pipe.comfy install`; the code is lowbit_pipe's)."""

from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowbit_pipe.comfy.registry import install_into_comfyui

REGISTRATION = install_into_comfyui()  # lowbit_* kinds load through ComfyUI's own loader nodes

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
''',)


@dataclass(frozen=True)
class PackFile:
    """One file of the node pack: its path relative to the pack folder and its text (or bytes: a thumbnail)."""

    relpath: str
    text: str | bytes


def registry_pyproject(version: str = __version__) -> str:
    """The pack's pyproject.toml in the Comfy Registry's convention ([project] and [tool.comfy]; the spec:
    docs.comfy.org/registry/specifications). No PublisherId: that is the publishing account's id, which only
    whoever publishes the pack to the registry has."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise LowbitError(f"lowbit_pipe version '{version}' is not X.Y.Z, which the Comfy Registry's 'version' needs")
    q = json.dumps  # a JSON string is a valid TOML basic string
    description = ("lowbit_pipe's ComfyUI nodes (quantize a MODEL by a recipe, exact LoRA branches, export, purge) "
                   "and the loader registration of lowbit_pipe's own kinds")
    return "\n".join([
        "# Written by `python -m lowbit_pipe.comfy install`; the pack's code is the lowbit_pipe package installed in",
        f"# ComfyUI's Python (its `comfy` extra: comfy-kitchen >= {PACK_MIN_COMFY_KITCHEN}).",
        "[project]",
        f"name = {q(PACK)}",
        f"version = {q(version)}",
        f"description = {q(description)}",
        'license = { text = "Apache-2.0" }',
        'requires-python = ">=3.11"',
        "",
        "[tool.comfy]",
        'DisplayName = "lowbit_pipe"',
        f"requires-comfyui = {q(SUPPORTED_COMFYUI)}",
        "",
    ])


def example_workflows(source: Path = WORKFLOW_SOURCE) -> list[PackFile]:
    """The package's example workflows (every `*.json` in `source`, checked to be JSON), each with its thumbnail
    (`<name>.jpg`, drawn from the workflow: lowbit_pipe.comfy.thumbnails; none without Pillow); none when the
    folder is missing or empty."""
    from lowbit_pipe.comfy import thumbnails
    from lowbit_pipe.comfy.nodes import NODE_DISPLAY_NAME_MAPPINGS

    if not source.is_dir():
        return []
    out = []
    for path in sorted(source.glob("*.json")):
        text = path.read_text()
        try:
            workflow = json.loads(text)
        except json.JSONDecodeError as err:
            raise LowbitError(f"{path}: not valid JSON ({err}); not copied into the node pack") from err
        out.append(PackFile(f"{WORKFLOWS}/{path.name}", text))
        image = thumbnails.draw(workflow, NODE_DISPLAY_NAME_MAPPINGS)
        if image is not None:
            out.append(PackFile(f"{WORKFLOWS}/{path.stem}.jpg", image))
    return out


def web_files(source: Path = WEB_SOURCE) -> list[PackFile]:
    """The front-end extension's files (`web/*.js`) and the pack's locale (its template category's name)."""
    scripts = [PackFile(f"{WEB}/{p.name}", p.read_text()) for p in sorted(source.glob("*.js"))]
    return [*scripts, PackFile("locales/en/main.json", json.dumps(LOCALE, indent=1) + "\n")]


def pack_files(workflow_source: Path = WORKFLOW_SOURCE) -> list[PackFile]:
    """Everything `install` writes into custom_nodes/lowbit_pipe_nodes/."""
    return [PackFile("__init__.py", SHIM), PackFile("pyproject.toml", registry_pyproject()),
            *example_workflows(workflow_source), *web_files()]


def custom_nodes_dir(comfyui_dir: str | Path | None = None, *, base_directory: str | Path | None = None) -> Path:
    """The custom_nodes folder ComfyUI reads: `comfyui_dir/custom_nodes` of a ComfyUI root, or
    `base_directory/custom_nodes` (created) of a `--base-directory` folder."""
    if (comfyui_dir is None) == (base_directory is None):
        raise LowbitError("give either the ComfyUI folder or --base-directory (the folder ComfyUI is started with "
                          "--base-directory), not both / neither")
    if base_directory is not None:
        base = Path(base_directory)
        if not base.is_dir():
            raise LowbitError(f"{base}: --base-directory is not an existing folder")
        return base / "custom_nodes"
    root = Path(comfyui_dir)
    if not (root / "custom_nodes").is_dir() or not (root / "comfy").is_dir():
        raise LowbitError(f"{root}: not a ComfyUI folder (no custom_nodes/ and comfy/ in it); for a ComfyUI started "
                          "with --base-directory, pass that folder as --base-directory")
    return root / "custom_nodes"


def install(comfyui_dir: str | Path | None = None, *, base_directory: str | Path | None = None,
            force: bool = False, workflow_source: Path = WORKFLOW_SOURCE) -> Path:
    """Write the node pack into ComfyUI's custom_nodes folder (see the module docstring); returns the path of its
    entry file (`.../lowbit_pipe_nodes/__init__.py`)."""
    pack = custom_nodes_dir(comfyui_dir, base_directory=base_directory) / PACK
    files = pack_files(workflow_source)  # read (and checked) before anything is written
    target = pack / "__init__.py"
    _check_target(pack, files, force)
    for f in files:
        path = pack / f.relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(f.text, bytes):
            _write_bytes(path, f.text)
        else:
            atomic_write_text(path, f.text)
    return target


def _write_bytes(path: Path, data: bytes) -> None:
    """`data` to `path` through a temporary file and a rename (a failure leaves `path` as it was)."""
    from lowbit_pipe.files.tempfiles import publish, temp_path

    tmp = temp_path(path)
    try:
        tmp.write_bytes(data)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_target(pack: Path, files: list[PackFile], force: bool) -> None:
    """Refuse a symlinked pack folder (or file or sub-folder in it), and a same-name folder this command did not
    write unless `force`."""
    for path in [pack, *{pack / Path(f.relpath).parent for f in files}, *(pack / f.relpath for f in files)]:
        if path.is_symlink():
            raise LowbitError(f"{path} is a symbolic link (to {path.readlink()}); install writes only into a real "
                              "folder: remove the link first")
    if not pack.exists() or force:
        return
    entry = pack / "__init__.py"
    ours = entry.is_file() and entry.read_text() in (SHIM, *PREVIOUS_SHIMS)
    if not ours:
        what = "an __init__.py with other content" if entry.exists() else "no __init__.py of this command's"
        raise LowbitError(f"{pack} exists with {what} (another node pack of that name?); pass --force to replace "
                          "its files")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowbit_pipe.comfy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="add the node pack to a ComfyUI")
    i.add_argument("comfyui_dir", nargs="?", help="the ComfyUI folder (comfy/ and custom_nodes/ in it)")
    i.add_argument("--base-directory", dest="base_directory", default=None,
                   help="instead of the ComfyUI folder: the folder ComfyUI is started with --base-directory "
                        "(the pack goes into its custom_nodes/, created if missing)")
    i.add_argument("--force", action="store_true",
                   help="write into a same-name folder this command did not create (its files are replaced)")
    args = p.parse_args(argv)
    try:
        path = install(args.comfyui_dir, base_directory=args.base_directory, force=args.force)
    except LowbitError as err:
        print(f"lowbit_pipe: {err}")
        return 2
    written = ", ".join(f.relpath for f in pack_files())
    print(f"installed: {path.parent} ({written}); restart ComfyUI (lowbit_pipe must be installed in ComfyUI's "
          f"Python; the loader registration needs ComfyUI {SUPPORTED_COMFYUI})")
    return 0
