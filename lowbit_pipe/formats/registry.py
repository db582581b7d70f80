"""The format registry: recipe name -> Format instance. Format modules register themselves on import
(lowbit_pipe.formats imports them all)."""

from __future__ import annotations

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats.base import Format

FORMATS: dict[str, Format] = {}


def register(cls: type[Format]) -> type[Format]:
    """Class decorator: add a format to the registry under its `name`."""
    FORMATS[cls.name] = cls()
    return cls


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown format '{name}' (known: {', '.join(sorted(FORMATS))})") from None


def format_for_record(record: dict, where: str) -> Format:
    """The format that reads a `.comfy_quant` record (by its ComfyUI name or our marker)."""
    name = record.get("lowbit_format") or record.get("format")
    for fmt in FORMATS.values():
        if name in (fmt.comfy_name, fmt.name):
            return fmt
    raise FormatError(f"{where}: unknown format '{name}' in .comfy_quant (known: {', '.join(sorted(f.comfy_name for f in FORMATS.values()))})")
