"""Tensor formats: a name -> Format registry. One module per format."""

from __future__ import annotations

# Importing the modules registers them (order matters for format_for_record: w4a8 reads
# both 4- and 6-bit asym_w4a8_int8 records, so it registers before w6a8).
from lowbit_pipe.formats import awq_w4a16, convrot_w4a4, fp8, int8, mxfp8, nvfp4, svdquant_w4a4, w4a8, w6a8  # noqa: F401
from lowbit_pipe.formats.base import Format, FormatSpec, QuantizedWeight, decode_record, encode_record
from lowbit_pipe.formats.common import is_stock_loadable
from lowbit_pipe.formats.registry import FORMATS, format_for_record, get_format, register

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
