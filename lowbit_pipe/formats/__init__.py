"""Tensor formats: a name -> Format registry. One module per format."""

from __future__ import annotations

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats.base import (
    Format,
    FormatSpec,
    QuantizedWeight,
    decode_record,
    encode_record,
)

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


def is_stock_loadable(record: dict) -> bool:
    """Whether stock ComfyUI (its comfy-kitchen layouts) can load and run a record as written.

    False for records carrying our markers (`lowbit_format`, `lowbit_rotation`, ...): those
    layers need lowbit_pipe's own loader; the export stage should warn about them.
    """
    from lowbit_pipe.formats.common import is_stock_loadable as _check

    return _check(record)


# Importing the modules registers them (order matters for format_for_record: w4a8 reads
# both 4- and 6-bit asym_w4a8_int8 records, so it registers before w6a8).
from lowbit_pipe.formats import convrot_w4a4, fp8, int8, nvfp4, w4a8, w6a8  # noqa: E402,F401

__all__ = [
    "FORMATS",
    "Format",
    "FormatSpec",
    "QuantizedWeight",
    "decode_record",
    "encode_record",
    "format_for_record",
    "get_format",
    "is_stock_loadable",
    "register",
]
