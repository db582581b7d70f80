"""convrot_w4a4: ConvRot-rotated int4 weight, int4 per-token activations.

Tensors (comfy-kitchen `TensorCoreConvRotW4A4Layout`):
- weight int8 [N, K/2]: signed int4 codes in [-7, 7], two's-complement nibbles,
  column 2i in the LOW nibble, column 2i+1 in the HIGH nibble.
- weight_scale fp32 [N]: per-row scale max(amax, 1e-10) / 7 of the rotated row.
Record: {"format": "convrot_w4a4", "convrot_groupsize": 256}. The rotation is part
of the format (ConvRot group 256, K % 256 == 0 required, which also satisfies
ComfyUI's fixed quant_group_size 64). Activations: x @ H per group, then dynamic
per-token int4 with the same rule (bit-exact with comfy-kitchen for fp32 input); or
static (a calibrated per-tensor `input_scale`, ours: stock ComfyUI ignores it); or none
(weight-only, the record's stock `full_precision_matrix_mult`).
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation

GROUP = 256


@register
class ConvRotW4A4(Format):
    name = "convrot_w4a4"
    comfy_name = "convrot_w4a4"
    bits_per_weight = 4.0
    rotations = ("convrot", "none")  # "none" in a spec means "the format's own ConvRot"
    values_per_byte = 2
    act_qmax = float(reference.INT4_MAX)

    def check_spec(self, spec: FormatSpec) -> None:
        super().check_spec(spec)
        if spec.rotation_group not in (None, GROUP):
            raise ValueError(f"convrot_w4a4: rotation_group must be {GROUP} (ComfyUI's loader), got {spec.rotation_group}")

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        return common.group_problem(in_features, GROUP, "the ConvRot group")

    def input_rotation(self, spec: FormatSpec, in_features: int) -> tuple[str, int]:
        return "convrot", GROUP

    def quantize(self, weight: torch.Tensor, spec: FormatSpec, generator: torch.Generator | None = None) -> QuantizedWeight:
        w = common.check_finite_weight(weight)
        n, k = w.shape
        if k % GROUP:
            raise FormatError(f"convrot_w4a4: in_features {k} is not a multiple of {GROUP}; keep this layer float")
        w_rot = rotation.rotate_weight(w, "convrot", GROUP)
        if generator is None:
            codes, scale = reference.quantize_rows_int4(w_rot)
        else:  # stochastic rounding floor(x + U[0, 1)) for LoRA bakes
            scale = w_rot.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / reference.INT4_MAX
            noise = torch.rand(w_rot.shape, generator=generator, device=w_rot.device)
            codes = torch.floor(w_rot / scale + noise).clamp(-7, 7).to(torch.int8)
        packed = common.pack_nibbles(codes, even_high=False).view(torch.int8)
        record = {"format": self.comfy_name, "convrot_groupsize": GROUP}
        return QuantizedWeight(self.name, (n, k), {"weight": packed, "weight_scale": scale.reshape(n).float()}, record)

    @staticmethod
    def codes(q: QuantizedWeight) -> torch.Tensor:
        """Signed int4 codes [N, K] as int8."""
        return common.to_signed4(common.unpack_nibbles(q.tensors["weight"], even_high=False)).to(torch.int8)

    def stored_rotation(self, q: QuantizedWeight) -> tuple[str, int]:
        return "convrot", int(q.record.get("convrot_groupsize", GROUP))  # part of the format, not a marker

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        w_rot = self.codes(q).float() * q.tensors["weight_scale"].float().reshape(-1, 1)
        return rotation.unrotate_weight(w_rot, "convrot", self.rotation_of(q, plan)[1])

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        plan = plan if plan is not None else self.linear_plan(q)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, plan=plan)
        group, static = plan.group, q.tensors.get("input_scale")
        codes = q.runtime.get("int8_codes")  # prepacked: the GEMM reads int8 codes, no unpacking per tile
        if dispatch.int8_supported(x, "convrot"):  # GPU: ConvRot + int4 quant; the GEMM unpacks int4 (or not)
            w = codes if codes is not None else q.tensors["weight"]
            return dispatch.int8_linear(x, w, q.tensors["weight_scale"], bias, "convrot", group, int4=True,
                                        input_scale=static, packed_weight=codes is None)
        x_rot, _ = rotation.rotate_activation(x, "convrot", group)
        y = reference.int4_linear(x_rot, codes if codes is not None else self.codes(q), q.tensors["weight_scale"],
                                  static)
        return common.out_dtype_result(y, bias, x.dtype)

    def prepack(self, q: QuantizedWeight) -> dict[str, torch.Tensor] | None:
        """The int4 codes unpacked to int8 [N, K] (8 bits per weight next to the stored 4): the INT8 GEMM reads
        them as it reads int8 weights, where unpacking nibbles in its main loop made it about half as fast on
        the H200 (bench/results/linear_speed_h200_rotmm.md: 0.63 ms against 0.30 ms at 4608 x 6144 x 6144)."""
        return {"int8_codes": self.codes(q)}

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        s = q.tensors["weight_scale"].float().reshape(-1, 1)
        return lambda values, cols: (values.float() / s).round().clamp(-reference.INT4_MAX, reference.INT4_MAX) * s

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        s = q.tensors["weight_scale"].float().reshape(-1, 1)
        codes = (values.float() / s).round().clamp(-reference.INT4_MAX, reference.INT4_MAX).to(torch.int8)
        packed = common.pack_nibbles(codes, even_high=False).view(torch.int8)
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": packed}, dict(q.record))

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", "weight_scale", "input_scale"), where, fmt)
        w = common.packed_codes(tensors, where, fmt, "packed int4")
        s = common.require(tensors, "weight_scale", where, fmt)
        n, k = self.logical_shape(tuple(w.shape), record)
        group = record.get("convrot_groupsize", GROUP)
        try:
            group = rotation.resolve_group("convrot", group)
        except (TypeError, ValueError) as err:
            raise FormatError(f"{where}: .comfy_quant 'convrot_groupsize': {err}") from err
        if k % group or k % 64:
            raise FormatError(f"{where}.weight: in_features {k} not a multiple of convrot_groupsize {group} and 64")
        common.check_dtype(s, "weight_scale", where, (torch.float32, torch.bfloat16, torch.float16))
        if s.numel() != n or s.dim() not in (1, 2) or (s.dim() == 2 and s.shape[1] != 1):
            raise FormatError(f"{where}.weight_scale: shape {tuple(s.shape)}, expected [{n}] (one per row)")
        common.check_finite_scale(s, "weight_scale", where)
        tensors_out = {"weight": w, "weight_scale": s.float().reshape(n),
                       **common.optional_input_scale(tensors, where)}
        return QuantizedWeight(self.name, (n, k), tensors_out, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        return out_features * in_features // 2 + 4 * out_features
