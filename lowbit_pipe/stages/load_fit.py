"""Before any weight is read: does the file fit the model built on the meta device?

A header is a promise about sizes; reading it as it claims is what a hostile or corrupt file exploits (a sparse
file whose header claims a 1 GiB tensor costs no disk, but 1 GiB of memory per copy once read). So the load
stage builds the model structure first (no memory), refuses a constructor config no model has (a billion
layers would hang the meta build), and refuses any tensor claiming more bytes than the model's largest one
could take in fp32, or a file claiming more in all than the model, before reading a byte of data.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from lowbit_pipe.errors import CheckpointError

MAX_CONFIG_INT = 1 << 20  # layers, heads, widths: the largest released models are under 2**16 wide
_SLACK = 1 << 20  # a tensor may exceed the model's largest by this (an all-in-one file's extras, padding)


def check_config(kwargs: Mapping[str, Any], where: str) -> None:
    """Refuse a constructor config with an integer no model has (from a file's own header or model.config)."""
    for key, value in kwargs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and not -MAX_CONFIG_INT <= v <= MAX_CONFIG_INT:
                raise CheckpointError(where, f"model config {key}={str(value)[:60]} is past {MAX_CONFIG_INT}: no "
                                             "model is that size (a corrupt header, or model.config?)", key)


def check_fits(model: nn.Module, claims: Mapping[str, int], where: str) -> None:
    """`claims`: bytes per key the load would read. Each must fit the model's largest tensor in fp32, and all
    of them the whole model in fp32 (a quantized file is smaller, a float one at most that), with slack."""
    sizes = [t.numel() * 4 for t in list(model.parameters()) + list(model.buffers())]
    largest, total = max(sizes, default=0) + _SLACK, sum(sizes) + _SLACK
    for key, nbytes in claims.items():
        if nbytes > largest:
            raise CheckpointError(where, f"claims {nbytes} bytes, more than the model's largest tensor takes in fp32 "
                                         f"({largest - _SLACK}): a corrupt header, or not this model's checkpoint", key)
    if sum(claims.values()) > 2 * total:
        raise CheckpointError(where, f"its tensors claim {sum(claims.values())} bytes, more than twice the model's "
                                     f"{total - _SLACK} in fp32: not this model's checkpoint")
