"""The contract every tensor format implements, and the plain data it produces.

A format turns a float weight [out, in] into a `QuantizedWeight`: the exact
tensors ComfyUI stores for that layer (keyed by suffix: "weight",
"weight_scale", ...) plus the `.comfy_quant` record. Formats know nothing of
stages or recipes.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from lowbit_pipe.errors import FormatError

ROTATIONS = ("none", "convrot", "quarot", "hadanorm")
ACTIVATION_MODES = ("dynamic", "static", "none")
GRANULARITIES = ("row", "tensor")


@dataclass(frozen=True)
class FormatSpec:
    """What a layer rule asks of a format."""

    format: str
    rotation: str = "none"  # one of ROTATIONS
    rotation_group: int | None = None  # None: the rotation's default (convrot 256, quarot 128)
    granularity: str = "row"  # weight scale granularity for int8 / fp8: "row" or "tensor"
    activations: str = "dynamic"  # "dynamic" per-token, "static" (calibrated input_scale), "none" (weight-only)


@dataclass
class QuantizedWeight:
    """A quantized weight as plain data: on-disk tensors plus its record."""

    format: str  # registry name of the format that made it
    shape: tuple[int, int]  # logical (out_features, in_features)
    tensors: dict[str, torch.Tensor]  # suffix -> tensor, exactly as stored
    record: dict[str, Any] = field(default_factory=dict)  # the `.comfy_quant` JSON

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def encode_record(record: dict[str, Any]) -> torch.Tensor:
    """`.comfy_quant` tensor: compact JSON bytes as uint8."""
    data = json.dumps(record, separators=(",", ":"), sort_keys=False).encode("utf-8")
    return torch.tensor(list(data), dtype=torch.uint8)


def decode_record(tensor: torch.Tensor, where: str) -> dict[str, Any]:
    """Parse a `.comfy_quant` tensor; `where` names the file and key for errors."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise FormatError(f"{where}: .comfy_quant must be a 1-D uint8 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    try:
        record = json.loads(bytes(tensor.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{where}: .comfy_quant is not valid JSON ({err})") from err
    if not isinstance(record, dict) or "format" not in record:
        raise FormatError(f"{where}: .comfy_quant record has no 'format' field: {record!r}")
    return record


class Format(ABC):
    """One tensor format. Subclasses are stateless; register them in formats/__init__.py."""

    name: ClassVar[str]  # our name, used in recipes ("int8", "nvfp4", ...)
    comfy_name: ClassVar[str]  # the "format" string in `.comfy_quant`
    bits_per_weight: ClassVar[float]  # storage cost including scales, for planning
    rotations: ClassVar[tuple[str, ...]] = ("none",)  # rotations this format can carry
    weight_only_on_cpu: ClassVar[bool] = False  # CPU reference skips activation quantization
    fused_lora_on_cuda: ClassVar[bool] = False  # `linear(..., lora=(down, up))` fuses the LoRA branch on CUDA

    @abstractmethod
    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        """Quantize a float weight [out, in] (any float dtype)."""

    @abstractmethod
    def dequantize(self, q: QuantizedWeight) -> torch.Tensor:
        """Float32 weight [out, in] in the ORIGINAL (unrotated) basis."""

    @abstractmethod
    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """y = x W^T + b with this format's weight and activation quantization; returns x.dtype."""

    @abstractmethod
    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        """Rebuild from stored tensors, checking shapes and dtypes against the record.

        `where` names the file and layer; every FormatError raised names it.
        """

    def check_spec(self, spec: FormatSpec) -> None:
        """Raise ValueError if this format cannot honour `spec` (checked at recipe validation)."""
        if spec.rotation not in self.rotations:
            raise ValueError(f"format '{self.name}' does not support rotation '{spec.rotation}' (supports {list(self.rotations)})")

    def logical_shape(self, weight_shape: tuple[int, ...], record: dict[str, Any]) -> tuple[int, int]:
        """Logical (out, in) of a layer from its stored `weight` shape (packed formats override)."""
        return (int(weight_shape[0]), int(weight_shape[1]))

    def supports_shape(self, out_features: int, in_features: int) -> bool:
        """Whether a layer of this shape can be stored in this format (else it stays float)."""
        return True

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        """Bytes the stored tensors of one layer take (formats override with the exact count)."""
        return int(round(self.bits_per_weight * out_features * in_features / 8))
