"""nvfp4: e2m1 codes, e4m3 block scales per 16 along K, fp32 global scale.

Tensors (ComfyUI / comfy-kitchen `TensorCoreNVFP4Layout`):
- weight uint8 [Np, Kp/2]: Np, Kp = N, K rounded up to multiples of 16 (zero
  padding, as comfy-kitchen's pad_16x). NIBBLE ORDER: column 2i in the HIGH
  nibble, column 2i+1 in the LOW nibble (comfy-kitchen `hi_first=True`, which
  its quantize and dequantize use by default). ModelOpt / compressed-tensors
  put the even column in the LOW nibble; converting is a nibble swap.
- weight_scale e4m3 [roundup(Np,128), roundup(Kp/16,4)]: block scales in the
  cuBLAS swizzled layout (see reference.swizzle_block_scales).
- weight_scale_2 fp32 scalar: amax / (6 * 448).
- input_scale fp32 scalar, optional: static activation global scale
  (amax_x / (6 * 448)), set by `attach_input_scale`.
Value = e2m1(code) * fp32(block) * weight_scale_2.

Dynamic activations: their global scale is amax / (6 * 448) of each token (row) by default, so a token's
codes never depend on the rest of the call (batch-mates, padding, the other stream's tokens); recipe
`act_granularity: tensor` takes it over the whole input of the call instead, as stock ComfyUI /
comfy-kitchen do, and writes "lowbit_act_granularity": "tensor" into the record (informational: stock
ComfyUI computes per tensor whatever the record says).

Record: {"format": "nvfp4"}; when padded we add "lowbit_shape": [N, K] (an
informational key ComfyUI ignores; it takes the shape from the module).
Rotations are ours only (nvfp4 in ComfyUI has no rotation): markers.

The global scale is computed from the fp32 weight (comfy-kitchen computes it
in the input dtype; identical for fp32 input, may differ in the last bit for
bf16 input). Everything else is bit-exact with comfy-kitchen.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import ACT_GRANULARITY_KEY, Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation

GLOBAL_DIV = reference.E2M1_MAX * reference.FP8_E4M3_MAX  # 6 * 448
NVFP4_COMPUTE = ("auto", "weight_only", "nvfp4", "fp8")  # recipe quantize.nvfp4_compute (recipe.py says what each does)


def computes_weight_only(mode: str, compute: str | None, x: torch.Tensor,
                         facts: dispatch.DeviceFacts | None = None) -> bool:
    """Whether an nvfp4 layer whose record says activations `mode` runs weight-only for input x under `compute`.
    `facts`: x's device's, settled by the layer (None: asked of the device here)."""
    if compute == "fp8":
        return False
    if compute == "weight_only" or (compute != "nvfp4" and mode == "none"):
        return True
    if compute not in (None, "auto"):
        return False
    return facts.lacks_fp4 if facts is not None else dispatch.lacks_fp4(x.device)


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


@register
class NVFP4(Format):
    name = "nvfp4"
    comfy_name = "nvfp4"
    bits_per_weight = 4.5
    rotations = ("none", "convrot", "quarot", "hadanorm")
    act_qmax = GLOBAL_DIV  # a static input_scale is the activations' NVFP4 global scale
    stock_input_scale = True
    act_granularities = ("token", "tensor")  # dynamic global scale per token (default) or per call (stock ComfyUI's)

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        # Padding works in our reference and in comfy-kitchen's fast path, but ComfyUI's
        # dequantize fallback returns the padded shape, so only unpadded layers are safe.
        return common.block_problem(out_features, in_features, 16, "NVFP4")

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = common.check_finite_weight(weight)
        n, k = w.shape
        kind, group = common.spec_rotation(spec, k)
        w_rot = rotation.rotate_weight(w, kind, group)
        global_scale = reference.positive_scale(w_rot.abs().amax(), GLOBAL_DIV).reshape(())
        np_, kp = _roundup(n, 16), _roundup(k, 16)
        if (np_, kp) != (n, k):
            w_rot = torch.nn.functional.pad(w_rot, (0, kp - k, 0, np_ - n))
        codes, block = reference.nvfp4_quantize_blocks(w_rot, global_scale)
        packed = common.pack_nibbles(codes, even_high=True)
        swizzled = reference.swizzle_block_scales(block)
        record: dict[str, Any] = {"format": self.comfy_name}
        if (np_, kp) != (n, k):
            record["lowbit_shape"] = [n, k]
        if spec.act_granularity == "tensor" and spec.activations == "dynamic":
            record[ACT_GRANULARITY_KEY] = "tensor"
        record = common.rotation_record(record, self.name, kind, group, stock_convrot=False)
        tensors = {"weight": packed, "weight_scale": swizzled, "weight_scale_2": global_scale}
        return QuantizedWeight(self.name, (n, k), tensors, record)

    def _dequantize_rotated(self, q: QuantizedWeight) -> torch.Tensor:
        """fp32 [N, K] in the stored (rotated) basis, padding cropped."""
        packed = q.tensors["weight"]
        np_, kp = packed.shape[0], packed.shape[1] * 2
        codes = common.unpack_nibbles(packed, even_high=True)
        block = reference.unswizzle_block_scales(q.tensors["weight_scale"], np_, kp // 16)
        w = reference.nvfp4_dequantize_blocks(codes, block, q.tensors["weight_scale_2"])
        n, k = q.shape
        return w[:n, :k]

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        kind, group = self.rotation_of(q, plan)
        return rotation.unrotate_weight(self._dequantize_rotated(q), kind, group)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        """NVFP4 activations emulated (dynamic: a global scale per token, or per call where the record asks for it
        (`act_per_tensor`); static: the stored input_scale), or weight-only (record `full_precision_matrix_mult`, or
        `q.compute`: see computes_weight_only)."""
        plan = plan if plan is not None else self.linear_plan(q)
        kind, group, facts, t = plan.rotation, plan.group, plan.facts_for(x), q.tensors
        if plan.compute == "fp8":
            return self._fp8_compute_linear(x, q, bias, plan)
        if computes_weight_only(plan.activations, plan.compute, x, facts):
            if dispatch.nvfp4_supported(x, kind):  # GPU: decode kernel + cuBLAS, or the register-decode GEMM
                return dispatch.nvfp4_weight_only_linear(x, t["weight"], t["weight_scale"], t["weight_scale_2"],
                                                         plan.shape[0], bias, kind, group)
            return self.weight_only_linear(x, q, bias, plan=plan)
        if dispatch.nvfp4_supported(x, kind):  # GPU: Triton act emulation + register-decoded NVFP4 GEMM
            return dispatch.nvfp4_linear(x, t["weight"], t["weight_scale"], t["weight_scale_2"], t.get("input_scale"),
                                         plan.shape[0], bias, kind, group, per_tensor=plan.per_tensor)
        x_rot, mu = rotation.rotate_activation(x, kind, group)
        n, k = plan.shape
        kp = t["weight"].shape[1] * 2
        if kp != k:
            x_rot = torch.nn.functional.pad(x_rot, (0, kp - k))
        xq = reference.nvfp4_fake_quant(x_rot, t.get("input_scale"), plan.per_tensor)[..., :k]
        y = xq @ self._dequantize_rotated(q).t()
        if mu is not None:
            y = y + rotation.mean_correction(mu, self.hadanorm_rowsums(q, group))
        return common.out_dtype_result(y, bias, x.dtype)

    def derived_tensors(self, q: QuantizedWeight) -> dict[str, torch.Tensor]:
        """Format.derived_tensors plus fp8 compute's per-row scale (N floats), so no forward recomputes it."""
        return {**super().derived_tensors(q), "fp8_row_scale": self.fp8_row_scale(q)}

    @staticmethod
    def fp8_row_scale(q: QuantizedWeight) -> torch.Tensor:
        """fp8 compute's per-row weight scale [N]: 6 * global * the row's largest block scale / 448, a bound on the
        row's |value| read from the block scales alone (no decode), so every decoded value fits e4m3."""
        n, _ = q.shape
        np_, kp = q.tensors["weight"].shape[0], q.tensors["weight"].shape[1] * 2
        block = reference.unswizzle_block_scales(q.tensors["weight_scale"], np_, kp // 16)[:n].float()
        bound = block.amax(dim=1) * q.tensors["weight_scale_2"].float() * reference.E2M1_MAX
        return reference.positive_scale(bound, reference.FP8_E4M3_MAX)

    def _fp8_compute_linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None,
                            plan: LinearPlan) -> torch.Tensor:
        """Compute "fp8" (Hopper has fp8 tensor cores, no FP4): the weight's e2m1 x block x global values rounded to
        e4m3 under a per-row scale, per-token fp8 activations (a static NVFP4 input_scale does not apply), an fp8
        GEMM. More error than NVFP4 weights alone: the weight's second rounding plus the activations'."""
        (n, k), kind, group = plan.shape, plan.rotation, plan.group
        row_scale = q.runtime.get("fp8_row_scale")  # the layer's derived buffer; a bare QuantizedWeight computes it
        if row_scale is None:
            row_scale = self.fp8_row_scale(q)
        t, facts = q.tensors, plan.facts_for(x)
        fused = kind if kind != "hadanorm" else "none"
        if dispatch.nvfp4_supported(x, fused) and dispatch.fp8_shape_supported(x, n, k, fused, facts):
            w8 = dispatch.nvfp4_fp8_weight(t["weight"], t["weight_scale"], t["weight_scale_2"], row_scale, n, k)
            if kind == "hadanorm":
                return dispatch.hadanorm_linear(
                    x, group, lambda xr: dispatch.fp8_linear(xr, w8, row_scale, None, bias, facts=facts),
                    self.hadanorm_rowsums(q, group))
            return dispatch.fp8_linear(x, w8, row_scale, None, bias, kind, group, facts=facts)
        w8 = reference.fp8_quantize(self._dequantize_rotated(q), row_scale.reshape(-1, 1))
        x_rot, mu = rotation.rotate_activation(x, kind, group)
        y = reference.fp8_linear(x_rot, w8, row_scale)
        if mu is not None:
            y = y + rotation.mean_correction(mu, self.hadanorm_rowsums(q, group))
        return common.out_dtype_result(y, bias, x.dtype)

    def _block_totals(self, q: QuantizedWeight) -> torch.Tensor:
        """global x block scale per (row, block of 16), fp32 [N, K/16] (unpadded layers only: GPTQ's domain)."""
        n, k = q.shape
        if q.tensors["weight"].shape != (n, k // 2):
            raise FormatError(f"{q.format}: fixed-grid rounding of a padded layer ({n}x{k}) is not supported")
        block = reference.unswizzle_block_scales(q.tensors["weight_scale"], n, k // 16).float()
        return q.tensors["weight_scale_2"].float() * block

    @staticmethod
    def _on_grid_scale(values: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """values / total clamped to e2m1's range, fp32; 0 in an all-zero block (total 0)."""
        safe = torch.where(total == 0, 1.0, total)
        data = torch.where(total == 0, 0.0, values.float() / safe)
        return data.clamp(-reference.E2M1_MAX, reference.E2M1_MAX)

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        totals = self._block_totals(q)  # unswizzled once

        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            # the codes' values without the codes (e2m1_round: a few launches per GPTQ column, no table copy)
            total = totals[:, cols // 16]
            return reference.e2m1_round(self._on_grid_scale(values, total)) * total
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        total = self._block_totals(q).repeat_interleave(16, dim=1)
        codes = reference.e2m1_encode(self._on_grid_scale(values, total))
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": common.pack_nibbles(codes, even_high=True)},
                               dict(q.record))

    def logical_shape(self, weight_shape: tuple[int, ...], record: dict[str, Any]) -> tuple[int, int]:
        shape = common.record_shape(record, "lowbit_shape", "nvfp4 record")
        if shape is not None:
            return shape
        return (int(weight_shape[0]), int(weight_shape[1]) * 2)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        common.check_no_unknown(tensors, ("weight", "weight_scale", "weight_scale_2", "input_scale"), where, fmt)
        w = common.require(tensors, "weight", where, fmt)
        s = common.require(tensors, "weight_scale", where, fmt)
        g = common.require(tensors, "weight_scale_2", where, fmt)
        common.check_dtype(w, "weight", where, (torch.uint8,))
        if w.dim() != 2:
            raise FormatError(f"{where}.weight: expected 2-D, got shape {tuple(w.shape)}")
        np_, kp = int(w.shape[0]), int(w.shape[1]) * 2
        if np_ % 16 or kp % 16:
            raise FormatError(f"{where}.weight: stored shape {tuple(w.shape)} is not padded to 16 x 16 (logical {np_} x {kp})")
        common.record_shape(record, "lowbit_shape", where)  # checked here, so its error names the layer
        n, k = self.logical_shape(tuple(w.shape), record)
        if not (np_ - 16 < n <= np_ and kp - 16 < k <= kp):
            raise FormatError(f"{where}.weight: stored shape {tuple(w.shape)} contradicts record lowbit_shape {[n, k]}")
        common.check_dtype(s, "weight_scale", where, (torch.float8_e4m3fn, torch.uint8))
        s = s.view(torch.float8_e4m3fn) if s.dtype == torch.uint8 else s
        common.check_shape(s, "weight_scale", where, (_roundup(np_, 128), _roundup(kp // 16, 4)), "swizzled 128x4 block-scale tiles")
        common.check_finite_scale(s, "weight_scale", where)
        common.check_dtype(g, "weight_scale_2", where, (torch.float32,))
        if g.numel() != 1:
            raise FormatError(f"{where}.weight_scale_2: expected a scalar, got shape {tuple(g.shape)}")
        common.check_finite_scale(g, "weight_scale_2", where)
        out = {"weight": w, "weight_scale": s, "weight_scale_2": g.reshape(()), **common.optional_input_scale(tensors, where)}
        if record.get(ACT_GRANULARITY_KEY, "tensor") not in ("tensor", "token"):
            raise FormatError(f"{where}: .comfy_quant '{ACT_GRANULARITY_KEY}' is {record[ACT_GRANULARITY_KEY]!r}, "
                              "expected 'tensor' (or 'token', the default)")
        common.check_rotation_fits(record, k, where)
        return QuantizedWeight(self.name, (n, k), out, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        np_, kp = _roundup(out_features, 16), _roundup(in_features, 16)
        scales = _roundup(np_, 128) * _roundup(kp // 16, 4)
        return np_ * kp // 2 + scales + 4
