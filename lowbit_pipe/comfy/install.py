"""Install the node pack into a ComfyUI folder: `python -m lowbit_pipe.comfy install /path/to/ComfyUI`.

Run it with ComfyUI's own Python after `pip install lowbit_pipe` there. It writes one small file,
`custom_nodes/lowbit_pipe_nodes/__init__.py`, which ComfyUI imports at start like any node pack: it
exports the nodes and registers lowbit_pipe's own kinds (`lowbit_*` records) with ComfyUI's loader, so
"Load Diffusion Model" reads every file lowbit_pipe writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowbit_pipe.checkpoint import atomic_write_text
from lowbit_pipe.errors import LowbitError

PACK = "lowbit_pipe_nodes"
SHIM = '''"""lowbit_pipe's ComfyUI nodes (written by `python -m lowbit_pipe.comfy install`; the code is lowbit_pipe's)."""

from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowbit_pipe.comfy.registry import install_into_comfyui

REGISTRATION = install_into_comfyui()  # lowbit_* kinds load through ComfyUI's own loader nodes

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
'''


def install(comfyui_dir: str | Path, *, force: bool = False) -> Path:
    """Write the node pack's entry file into `comfyui_dir/custom_nodes`; returns its path."""
    root = Path(comfyui_dir)
    if not (root / "custom_nodes").is_dir() or not (root / "comfy").is_dir():
        raise LowbitError(f"{root}: not a ComfyUI folder (no custom_nodes/ and comfy/ in it)")
    target = root / "custom_nodes" / PACK / "__init__.py"
    if target.exists() and target.read_text() != SHIM and not force:
        raise LowbitError(f"{target} exists with other content; pass --force to replace it")
    target.parent.mkdir(exist_ok=True)
    atomic_write_text(target, SHIM)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lowbit_pipe.comfy", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="add the node pack to a ComfyUI folder")
    i.add_argument("comfyui_dir")
    i.add_argument("--force", action="store_true", help="replace an entry file with other content")
    args = p.parse_args(argv)
    try:
        path = install(args.comfyui_dir, force=args.force)
    except LowbitError as err:
        print(f"lowbit_pipe: {err}")
        return 2
    print(f"installed: {path} (restart ComfyUI; lowbit_pipe must be installed in ComfyUI's Python)")
    return 0
