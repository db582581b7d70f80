"""Diffusers <-> native (ComfyUI / BFL) layout for state dicts that hold quantized layers.

Float tensors go through the architecture's key map. A quantized layer is all
keys `<layer>.*` (weight, scales, `.comfy_quant`, bias) and moves as a unit:
renamed, or, where the native module fuses several diffusers modules (FLUX
`qkv`, `linear1`), concatenated along output rows. That is exact only when
every stored tensor is either per output row or identical across the parts
(same record, same scalar scale); anything else is refused with the layer
named, never approximated.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from lowbit_pipe.arch.base import Arch, ArchConfig
from lowbit_pipe.errors import FormatError

RECORD = "comfy_quant"


def quantized_layers(state: dict[str, Any]) -> list[str]:
    return sorted(k[: -len(RECORD) - 1] for k in state if k.endswith("." + RECORD))


def _split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(layer -> {suffix: tensor}) for quantized layers, and the float rest."""
    layers = quantized_layers(state)
    quant: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
    rest = {}
    for key, value in state.items():
        owner = key.rsplit(".", 1)[0]
        if owner in quant:
            quant[owner][key[len(owner) + 1:]] = value
        else:
            rest[key] = value
    return quant, rest


def _row_axes(layer: str, tensors: dict[str, torch.Tensor]) -> dict[str, int | None]:
    """The layer's format's `row_axes` (tensors stored transposed, or input-side and shared), read from its
    `.comfy_quant` record."""
    from lowbit_pipe.formats import decode_record, format_for_record

    if RECORD not in tensors:
        return {}
    return format_for_record(decode_record(tensors[RECORD], layer), layer).row_axes


def _identical(values: list[torch.Tensor]) -> bool:
    """Same shape, dtype and bytes (any dtype, fp8 included)."""
    first = values[0].contiguous().reshape(-1).view(torch.uint8)
    return all(v.shape == values[0].shape and v.dtype == values[0].dtype
               and torch.equal(v.contiguous().reshape(-1).view(torch.uint8), first) for v in values)


def _fuse(native: str, parts: list[tuple[str, dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """Concatenate quantized parts (name, tensors, logical rows) along output rows, exactly or not at all."""
    first = parts[0][1]
    if any(set(p[1]) != set(first) for p in parts):
        raise FormatError(f"{native}: fused parts {[p[0] for p in parts]} store different tensors; export.layout=diffusers keeps them apart")
    axes = _row_axes(native, first)
    out = {}
    for suffix in first:
        values = [p[1][suffix] for p in parts]
        axis = axes.get(suffix, 0)
        if axis is None and _identical(values):  # input side, shared by the parts (whatever its shape)
            out[suffix] = values[0]
        elif axis == 1 and all(v.dim() == 2 and v.shape[1] == rows for v, (_, _, rows) in zip(values, parts)):
            out[suffix] = torch.cat(values, dim=1)
        elif axis == 0 and all(v.dim() >= 1 and v.shape[0] == rows for v, (_, _, rows) in zip(values, parts)) and \
                all(v.shape[1:] == values[0].shape[1:] for v in values):
            out[suffix] = torch.cat(values, dim=0)
        elif _identical(values):
            out[suffix] = values[0]
        else:
            raise FormatError(f"{native}: '{suffix}' of {[p[0] for p in parts]} is neither per-row nor shared "
                              "(e.g. different per-tensor or global scales), so the fused native layer cannot be "
                              "written exactly; use a per-row format for these layers or export.layout=diffusers")
    return out


def to_native(state: dict[str, torch.Tensor], arch: Arch, config: ArchConfig,
              out_features: dict[str, int]) -> dict[str, torch.Tensor]:
    """Diffusers-layout state (quantized layers included) -> native layout. `out_features`: logical rows per layer."""
    quant, rest = _split_state(state)
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    renamed: dict[str, torch.Tensor] = {}
    for name in quant:
        native, rows = arch.to_native(name, config)
        if rows is None:
            if arch.keymap is not None and arch.keymap.is_swapped(native):
                raise FormatError(f"{name}: its native rows are (shift, scale)-swapped; keep this modulation layer float "
                                  "or use export.layout=diffusers")
            renamed.update({f"{native}.{s}": t for s, t in quant[name].items()})
        else:
            groups[native].append((rows.start or 0, name))
    for native, members in groups.items():
        expected = {n for n, _ in arch.from_native_name(native, config)}
        missing = expected - {name for _, name in members}
        if missing:
            raise FormatError(f"{native}: fuses {sorted(expected)} but {sorted(missing)} stayed float; quantize all "
                              "parts alike or use export.layout=diffusers")
    out = arch.state_dict_to_native(rest)
    out.update(renamed)
    for native, members in groups.items():
        members.sort()
        parts = [(name, quant[name], out_features[name]) for _, name in members]
        out.update({f"{native}.{s}": t for s, t in _fuse(native, parts).items()})
    return out


def split_rows(layer: str, tensors: dict[str, torch.Tensor], total: int, bounds: list[tuple[str, int, int]],
               row_axes: dict[str, int | None] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Split one fused layer's tensors into parts (name, start row, stop row): per-row tensors by rows,
    shared ones (scalars, records, codebooks, the format's input-side tensors) copied. `row_axes`: the
    format's (read from the layer's record when None). Raises FormatError where that is not exact."""
    axes = _row_axes(layer, tensors) if row_axes is None else row_axes
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _, _ in bounds}
    for suffix, t in tensors.items():
        axis = axes.get(suffix, 0)
        if axis is None:
            for name, _, _ in bounds:
                out[name][suffix] = t.clone()
        elif axis == 1 and t.dim() == 2 and t.shape[1] == total:
            for name, start, stop in bounds:
                out[name][suffix] = t[:, start:stop].contiguous()
        elif t.dim() >= 1 and t.shape[0] == total:
            if suffix == "weight_scale" and t.dim() == 2 and t.dtype != torch.float32 and any(
                    (stop - start) % 128 for _, start, stop in bounds):
                # Swizzled block scales tile 128 rows together: parts must not cut a tile.
                raise FormatError(f"{layer}.{suffix}: swizzled block scales cannot be split at rows "
                                  f"{[(a, b) for _, a, b in bounds]} (not multiples of 128)")
            for name, start, stop in bounds:
                out[name][suffix] = t[start:stop].clone()
        elif t.numel() == 1 or suffix in (RECORD, "weight_codebook"):
            for name, _, _ in bounds:
                out[name][suffix] = t.clone()
        else:
            raise FormatError(f"{layer}.{suffix}: shape {tuple(t.shape)} cannot be split into {[b[0] for b in bounds]}")
    return out


def from_native(state: dict[str, torch.Tensor], arch: Arch, config: ArchConfig,
                logical_rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """Native-layout state (prefix stripped) -> diffusers layout. `logical_rows`: rows per native quantized layer."""
    quant, rest = _split_state(state)
    out = arch.from_native(rest)
    for native, tensors in quant.items():
        parts = arch.from_native_name(native, config)
        if len(parts) == 1 and parts[0][1] is None:
            out.update({f"{parts[0][0]}.{s}": t for s, t in tensors.items()})
            continue
        total = logical_rows[native]
        bounds = [(name, rows.start or 0, rows.stop if rows.stop is not None else total) for name, rows in parts]
        for name, part in split_rows(native, tensors, total, bounds).items():
            out.update({f"{name}.{s}": t for s, t in part.items()})
    return out


def fused_groups(arch: Arch, config: ArchConfig, names: list[str]) -> dict[str, list[tuple[str, int, int | None]]]:
    """Native fused module -> its diffusers parts (name, start, stop) for the layers in `names` that fuse."""
    groups: dict[str, list[tuple[str, int, int | None]]] = defaultdict(list)
    if arch.keymap is None:
        return {}
    for name in names:
        native, rows = arch.to_native(name, config)
        if rows is not None:
            groups[native].append((name, rows.start or 0, rows.stop))
    return {k: sorted(v, key=lambda p: p[1]) for k, v in groups.items()}
