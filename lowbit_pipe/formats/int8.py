"""int8_tensorwise: int8 weight with a per-row (or per-tensor) fp32 scale, per-token dynamic int8 activations."""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import register
from lowbit_pipe.formats.base import Format, FormatSpec, QuantizedWeight
from lowbit_pipe.kernels import reference


@register
class Int8(Format):
    name = "int8"
    comfy_name = "int8_tensorwise"
    bits_per_weight = 8.0

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = weight.float()
        if spec.granularity == "tensor":
            amax = w.abs().amax().clamp_min(1e-12)
        else:
            amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        scale = amax / 127.0
        q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
        record: dict[str, Any] = {"format": self.comfy_name}
        return QuantizedWeight(self.name, tuple(w.shape), {"weight": q, "weight_scale": scale.float()}, record)

    def dequantize(self, q: QuantizedWeight) -> torch.Tensor:
        return q.tensors["weight"].float() * q.tensors["weight_scale"]

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        return reference.int8_linear(x, q.tensors["weight"], q.tensors["weight_scale"], bias)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        w, s = tensors.get("weight"), tensors.get("weight_scale")
        if w is None or s is None:
            raise FormatError(f"{where}: int8_tensorwise needs 'weight' and 'weight_scale', found {sorted(tensors)}")
        if w.dtype != torch.int8 or w.dim() != 2:
            raise FormatError(f"{where}.weight: expected a 2-D int8 tensor, got {w.dtype} {tuple(w.shape)}")
        if s.numel() not in (1, w.shape[0]):
            raise FormatError(f"{where}.weight_scale: {s.numel()} values for {w.shape[0]} rows (expected 1 or one per row)")
        s = s.float().reshape(-1, 1) if s.numel() > 1 else s.float().reshape(())
        return QuantizedWeight(self.name, tuple(w.shape), {"weight": w, "weight_scale": s}, dict(record))
