"""Detect an architecture from a raw state dict or key->shape map, in any layout people download.

Handles diffusers and ComfyUI / BFL native layouts, with or without prefixes, and
already-quantized files (a layer with `<name>.comfy_quant` and a packed weight): every
decision reads LOGICAL shapes, never packed ones (the Krea 2 `txtfusion.projector` trap).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lowbit_pipe.errors import FormatError, LowbitError

if TYPE_CHECKING:
    from torch import nn

    from lowbit_pipe.arch.base import Arch, ArchConfig

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "model.", "net.")
# Tensors a quantized layer stores beside `weight` / `bias`: those of the ComfyUI layouts in docs/formats.md,
# plus side-tensor names other quantizers write.
QUANT_AUX = ("comfy_quant", "weight_scale", "weight_scale_2", "input_scale", "weight_s_rel", "weight_s_channel",
             "weight_codebook", "weight_correction", "weight_zero", "weight_zeros", "scale_weight", "scale_input", "weight_global_scale",
             "weight_proj_down", "weight_proj_up", "weight_smooth_factor")
# Values per stored byte along in_features for packed formats, when `formats` does not know the format.
PACKED_FACTOR = {"nvfp4": 2.0, "convrot_w4a4": 2.0, "awq_w4a16": 2.0, "asym_w4a8_int8": 2.0, "mxfp4": 2.0}


class UnknownArchError(LowbitError, ValueError):
    """No registered architecture matches; callers fall back to the generic policy."""


def strip_prefix(state: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Drop a common wrapper prefix (`model.diffusion_model.`, `diffusion_model.`, `transformer.`, ...).

    Keys outside the chosen prefix (VAE / text encoders of all-in-one files) are dropped.
    Returns (stripped map, prefix or "").
    """
    keys = list(state)
    for p in PREFIXES:
        n = sum(k.startswith(p) for k in keys)
        if n and (n * 2 >= len(keys) or "diffusion_model" in p):
            return {k[len(p):]: v for k, v in state.items() if k.startswith(p)}, p
    return dict(state), ""


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in (v.shape if hasattr(v, "shape") else v))


def records_from_state_dict(state: Mapping[str, Any]) -> dict[str, dict]:
    """`.comfy_quant` records of a state dict holding tensors, by layer name."""
    from lowbit_pipe.formats import decode_record

    return {k[: -len(".comfy_quant")]: decode_record(v, k) for k, v in state.items()
            if k.endswith(".comfy_quant") and isinstance(v, torch.Tensor)}


def packed_logical_shape(shape: tuple[int, ...], record: Mapping[str, Any]) -> tuple[int, int]:
    """Fallback (out, in) of a packed weight whose format `formats` does not know (packing: docs/formats.md).

    An explicit `shape` / `orig_shape` / `logical_shape` in the record wins: a padded
    nvfp4 weight (K rounded up) cannot be unpadded from its shape alone.
    """
    for key in ("lowbit_shape", "logical_shape", "orig_shape", "shape"):
        if isinstance(record.get(key), (list, tuple)) and len(record[key]) == 2:
            return int(record[key][0]), int(record[key][1])
    name = record.get("format")
    bits = record.get("lowbit_bits") or record.get("bits")
    if name == "asym_w4a8_int8" and bits:
        return int(shape[0]), int(shape[1]) * 8 // int(bits)  # 6-bit: 4 values in 3 bytes
    return int(shape[0]), int(shape[1] * PACKED_FACTOR.get(name, 1.0))


def logical_shape(name: str, shape: tuple[int, ...], record: Mapping[str, Any]) -> tuple[int, ...]:
    """Logical shape of `<name>.weight` stored as `shape` under a `.comfy_quant` record."""
    if len(shape) != 2:
        return shape
    from lowbit_pipe.formats import format_for_record

    try:
        return tuple(format_for_record(dict(record), name).logical_shape(shape, dict(record)))
    except FormatError:
        return packed_logical_shape(shape, record)


def logical_shapes(state: Mapping[str, Any], records: Mapping[str, Mapping] | None = None) -> dict[str, tuple[int, ...]]:
    """key -> logical shape; quantization side tensors dropped, packed weights unpacked (in shape only)."""
    shapes = {k: _shape(v) for k, v in state.items() if not k.endswith(".comfy_quant")}
    recs = dict(records or {})
    if any(k.endswith(".comfy_quant") and isinstance(v, torch.Tensor) for k, v in state.items()):
        recs.update(records_from_state_dict(state))
    quantized = set(recs) | {k.rsplit(".", 1)[0] for k in state if k.endswith(".comfy_quant")}
    out = {}
    for k, s in shapes.items():
        layer, _, suffix = k.rpartition(".")
        if layer in quantized and suffix in QUANT_AUX:
            continue
        out[k] = logical_shape(layer, s, recs[layer]) if suffix == "weight" and layer in recs else s
    return out


def _strip_records(records: Mapping[str, Mapping] | None, prefix: str) -> dict[str, Mapping]:
    if not records:
        return {}
    return {(k[len(prefix):] if prefix and k.startswith(prefix) else k): v for k, v in records.items()}


def detect_state_dict(state: Mapping[str, Any], records: Mapping[str, Mapping] | None = None):
    """(Arch, ArchConfig, layout) of a state dict or key->shape map; layout is "diffusers" or "native".

    `records`: `.comfy_quant` records by layer name, for shape-only maps of quantized files (a
    state dict of tensors carries its own). Raises UnknownArchError when nothing matches.
    """
    from lowbit_pipe.arch.registry import ARCHS

    stripped, prefix = strip_prefix(state)
    shapes = logical_shapes(stripped, _strip_records(records, prefix))
    for arch in ARCHS.values():
        if arch.detect_keys(shapes):
            return arch, arch.config_from_keys(shapes), "diffusers"
    for arch in ARCHS.values():
        if arch.detect_native_keys(shapes):
            diff = arch.from_native(shapes)
            if not arch.detect_keys(diff):
                raise UnknownArchError(f"native keys look like '{arch.id}' but do not convert to its diffusers layout")
            return arch, arch.config_from_keys(diff), "native"
    sample = ", ".join(sorted(shapes)[:5])
    raise UnknownArchError(f"no known architecture matches these {len(shapes)} keys (prefix '{prefix}'; e.g. {sample})")


def detect_or_none(state: Mapping[str, Any], records: Mapping[str, Mapping] | None = None):
    """`detect_state_dict`, or None (with a warning) for an unknown model."""
    try:
        return detect_state_dict(state, records)
    except UnknownArchError as err:
        warnings.warn(str(err), stacklevel=2)
        return None


@dataclass(frozen=True)
class ModuleArch:
    """The architecture of a live module, and how its modules are named: the diffusers class's names,
    or the native (ComfyUI / BFL) ones, as in a ComfyUI diffusion model."""

    arch: Arch
    config: ArchConfig
    native: bool

    def policy_name(self, name: str) -> str:
        """The diffusers name a layer policy (keep-float, sensitive lists) knows this module by; a fused
        native module (FLUX `qkv`, `linear1`) goes by its first part, which shares its policy."""
        return self.arch.from_native_name(name, self.config)[0][0] if self.native else name


def detect_module(model: nn.Module) -> ModuleArch | None:
    """A live module's architecture: by its diffusers class, else by its state dict's keys (a ComfyUI
    model's diffusion_model has native names and its own class); None when nothing matches. A class of the
    diffusers name without a diffusers `config` goes by its keys: ComfyUI's Qwen-Image class is named
    `QwenImageTransformer2DModel` too."""
    from lowbit_pipe.arch.registry import detect_model

    arch = detect_model(model)
    if arch is not None and getattr(model, "config", None) is not None:
        return ModuleArch(arch, arch.config_from_model(model), native=False)
    state = model.state_dict()
    try:
        arch, config, layout = detect_state_dict({k: tuple(v.shape) for k, v in state.items()
                                                  if not k.endswith(".comfy_quant")},
                                                 records_from_state_dict(state))
    except UnknownArchError:
        return None
    return ModuleArch(arch, config, native=layout == "native")
