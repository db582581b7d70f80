"""Helpers shared by the format modules: validation, rotation records, packing."""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import comfy_versions as compat
from lowbit_pipe.kernels import rotation

# Record keys we add. Any of MARKER_KEYS means stock ComfyUI cannot run the layer
# (the "format" field is then also set to an unknown name so ComfyUI refuses it
# loudly instead of computing with a rotated weight). INFO_KEYS are harmless hints.
MARKER_KEYS = ("lowbit_format", "lowbit_rotation", "lowbit_rotation_group", "lowbit_granularity")
INFO_KEYS = ("lowbit_shape", "lowbit_bits", "lowbit_act_granularity")
# Upstream record formats (comfy-kitchen layouts) no stock ComfyUI release loads: the node pack does. Which
# ComfyUI / comfy-kitchen loads each kind: lowbit_pipe.comfy.compat (the one table).
NOT_IN_STOCK_COMFY = tuple(sorted(k for k, row in compat.KINDS.items() if row.pack_only))


def check_finite_weight(weight: torch.Tensor, what: str = "weight") -> torch.Tensor:
    """fp32 2-D copy of `weight`; FormatError on NaN/Inf or a wrong rank."""
    if weight.dim() != 2:
        raise FormatError(f"{what}: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise FormatError(f"{what}: expected a floating-point weight, got {weight.dtype}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise FormatError(f"{what}: {bad} NaN/Inf values; refusing to quantize")
    return w


def spec_rotation(spec: Any, in_features: int) -> tuple[str, int]:
    """(kind, group) actually applied to a layer: falls back to ("none", 0) when the
    layer's in_features is not a multiple of the group."""
    kind = spec.rotation
    if kind == "none":
        return "none", 0
    group = rotation.resolve_group(kind, spec.rotation_group)
    if in_features % group != 0:
        return "none", 0
    return kind, group


def lowbit_kind(record: dict[str, Any], fmt_name: str) -> dict[str, Any]:
    """`record` renamed to our kind `lowbit_<fmt_name>`: a format name stock ComfyUI does not know, so it
    refuses the file instead of computing something else; `lowbit_format` says which format reads it."""
    return {**record, "format": f"lowbit_{fmt_name}", "lowbit_format": fmt_name}


def rotation_record(base: dict[str, Any], fmt_name: str, kind: str, group: int, stock_convrot: bool) -> dict[str, Any]:
    """Add rotation fields to a record.

    `stock_convrot`: the comfy format itself carries ConvRot via
    {"convrot": true, "convrot_groupsize": g} (int8_tensorwise). Anything else
    rotated gets our markers and an unknown "format" so stock ComfyUI refuses it.
    """
    record = dict(base)
    if kind == "none":
        return record
    if kind == "convrot" and stock_convrot:
        record["convrot"] = True
        record["convrot_groupsize"] = int(group)
        return record
    record = lowbit_kind(record, fmt_name)
    record["lowbit_rotation"] = kind
    record["lowbit_rotation_group"] = int(group)
    return record


def record_rotation(record: dict[str, Any], where: str) -> tuple[str, int]:
    """(kind, group) a record says its weight was rotated with."""
    kind = record.get("lowbit_rotation")
    if kind is not None:
        if kind not in rotation.ROTATION_KINDS:
            raise FormatError(f"{where}: .comfy_quant 'lowbit_rotation' is '{kind}', not one of {list(rotation.ROTATION_KINDS)}")
        try:
            group = rotation.resolve_group(kind, record.get("lowbit_rotation_group"))
        except (TypeError, ValueError) as err:
            raise FormatError(f"{where}: .comfy_quant 'lowbit_rotation_group': {err}") from err
        return kind, group
    if record.get("convrot"):
        try:
            return "convrot", rotation.resolve_group("convrot", record.get("convrot_groupsize", 256))
        except (TypeError, ValueError) as err:
            raise FormatError(f"{where}: .comfy_quant 'convrot_groupsize': {err}") from err
    return "none", 0


def check_rotation_fits(record: dict[str, Any], in_features: int, where: str) -> tuple[str, int]:
    """`record_rotation`, refusing a group that does not divide the layer's in_features."""
    kind, group = record_rotation(record, where)
    if kind != "none" and in_features % group:
        raise FormatError(f"{where}.weight: in_features {in_features} not a multiple of the {kind} group {group} in the record")
    return kind, group


def record_int(record: dict[str, Any], key: str, default: int, where: str, low: int = 1, high: int = 2**31) -> int:
    """An integer field of a record (a group size, a bit count), in [low, high], or a FormatError naming it."""
    value = record.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise FormatError(f"{where}: .comfy_quant '{key}' is {str(value)[:80]}, expected an integer in [{low}, {high}]")
    return value


def record_shape(record: dict[str, Any], key: str, where: str) -> tuple[int, int] | None:
    """A record's logical [out, in] (nvfp4's `lowbit_shape`): two positive integers, or a FormatError naming it."""
    value = record.get(key)
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 2**31 for d in value)):
        raise FormatError(f"{where}: .comfy_quant '{key}' is {str(value)[:80]}, expected [out, in] of positive integers")
    return value[0], value[1]


def scalar_or_row_scale(s: torch.Tensor, rows: int, key: str, where: str) -> torch.Tensor:
    """A per-tensor (-> shape ()) or per-row (-> [rows, 1]) fp32 scale, finite, or a FormatError naming it."""
    if s.numel() == 1:
        s = s.float().reshape(())
    elif tuple(s.shape) in ((rows, 1), (rows,)):
        s = s.float().reshape(-1, 1)
    else:
        raise FormatError(f"{where}.{key}: shape {tuple(s.shape)}, expected a scalar or [{rows}, 1]")
    check_finite_scale(s, key, where)
    return s


def optional_input_scale(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """{"input_scale": fp32 scalar} when the layer has a static (calibrated) one, else {}."""
    if "input_scale" not in tensors:
        return {}
    i = tensors["input_scale"]
    check_dtype(i, "input_scale", where, (torch.float32,))
    if i.numel() != 1:
        raise FormatError(f"{where}.input_scale: expected a scalar, got shape {tuple(i.shape)}")
    check_finite_scale(i, "input_scale", where)
    if float(i) <= 0:
        raise FormatError(f"{where}.input_scale: {float(i)}, expected > 0 (activations are divided by it)")
    return {"input_scale": i.reshape(())}


def is_stock_loadable(record: dict[str, Any]) -> bool:
    """True when a stock ComfyUI release (comfy-kitchen layouts) loads and runs this record as written. Not
    necessarily every release: `compat.support(record["format"])` says from which one (asym_w4a8_int8 from
    0.31.0, for example)."""
    if any(key in record for key in MARKER_KEYS):
        return False
    row = compat.support(str(record.get("format", "")))
    return row is not None and not row.pack_only


def require(tensors: dict[str, torch.Tensor], key: str, where: str, fmt: str) -> torch.Tensor:
    t = tensors.get(key)
    if t is None:
        raise FormatError(f"{where}: {fmt} needs tensor '{key}', found {sorted(tensors)}")
    if not isinstance(t, torch.Tensor):
        raise FormatError(f"{where}.{key}: expected a tensor, got {type(t).__name__}")
    return t


def block_problem(out_features: int, in_features: int, block: int, what: str) -> str | None:
    """A format with square-ish blocks on both dims (nvfp4's 16, mxfp8's 32): why it cannot store this shape."""
    if out_features % block or in_features % block:
        return f"{out_features}x{in_features} is not a multiple of {block} on both sides ({what} blocks of {block})"
    return None


def group_problem(in_features: int, group: int, what: str = "the group") -> str | None:
    """A format grouped along K (awq / svdquant's 64, ConvRot's 256): why it cannot store this many inputs."""
    if in_features % group:
        return f"in_features {in_features} is not a multiple of {what} {group}"
    return None


def packed_codes(tensors: dict[str, torch.Tensor], where: str, fmt: str, what: str = "packed codes") -> torch.Tensor:
    """The stored `weight` of a packed sub-byte format: int8 (uint8 read too) [N, packed K], viewed as int8."""
    w = require(tensors, "weight", where, fmt)
    check_dtype(w, "weight", where, (torch.int8, torch.uint8))
    if w.dim() != 2:
        raise FormatError(f"{where}.weight: expected 2-D {what}, got shape {tuple(w.shape)}")
    return w.view(torch.int8)


def check_dtype(t: torch.Tensor, key: str, where: str, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise FormatError(f"{where}.{key}: dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")


def check_shape(t: torch.Tensor, key: str, where: str, expected: tuple[int, ...], why: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({why})" if why else ""
        raise FormatError(f"{where}.{key}: shape {tuple(t.shape)}, expected {tuple(expected)}{extra}")


def check_finite_scale(t: torch.Tensor, key: str, where: str) -> None:
    if not torch.isfinite(t.float()).all():
        raise FormatError(f"{where}.{key}: scale contains NaN/Inf")


def check_no_unknown(tensors: dict[str, torch.Tensor], allowed: tuple[str, ...], where: str, fmt: str) -> None:
    extra = sorted(set(tensors) - set(allowed))
    if extra:
        raise FormatError(f"{where}: unexpected tensor(s) {extra} for {fmt} (allowed: {list(allowed)})")


def pack_nibbles(codes: torch.Tensor, even_high: bool) -> torch.Tensor:
    """Pack 4-bit codes [..., K] (values 0..15, any int dtype) into uint8 [..., K/2].

    even_high=True: column 2i in the high nibble (comfy-kitchen NVFP4, hi_first=True);
    even_high=False: column 2i in the low nibble (int4 W4A4 / W4A8 planes).
    """
    c = codes.to(torch.int32) & 0xF
    even, odd = c[..., 0::2], c[..., 1::2]
    packed = (even << 4) | odd if even_high else even | (odd << 4)
    return packed.to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, even_high: bool) -> torch.Tensor:
    """Inverse of `pack_nibbles`: uint8/int8 [..., K/2] -> int32 codes 0..15 [..., K]."""
    p = packed.view(torch.uint8).to(torch.int32) if packed.dtype == torch.int8 else packed.to(torch.int32)
    hi, lo = (p >> 4) & 0xF, p & 0xF
    first, second = (hi, lo) if even_high else (lo, hi)
    return torch.stack([first, second], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def to_signed4(codes: torch.Tensor) -> torch.Tensor:
    """Two's-complement nibble (0..15) -> signed value (-8..7)."""
    return torch.where(codes >= 8, codes - 16, codes)


def out_dtype_result(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)
