"""Where a bench script's figures go: its JSON payload and its Markdown table, side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def save_outputs(out: str | Path, table: str, payload: dict[str, Any]) -> None:
    """`payload` as JSON at `out` (suffix .json) and the Markdown `table` beside it (.md), each written to a
    temporary file and renamed over the old one: a run killed mid-write leaves the previous table whole, and a
    script that saves after every row keeps what it measured when its device call is cut short."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out.with_suffix(".json"), json.dumps(payload, indent=1) + "\n"), (out.with_suffix(".md"), table)):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def print_and_save(out: str | Path, lines: list[str], payload: dict[str, Any]) -> None:
    """A finished table: its lines printed, then saved (`save_outputs`) with the command line added to `payload`."""
    table = "\n".join(lines) + "\n"
    print(table)
    save_outputs(out, table, {"command": " ".join(sys.argv), **payload})
