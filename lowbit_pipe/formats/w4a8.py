"""asym_w4a8_int8 at 4 bits (recipe `w4a8`) and 6 bits (recipe `w6a8`, in w6a8.py).

Layout (comfy-kitchen `AsymW4A8Int8Layout`); the weight is always ConvRot-rotated
(group 256) and runs as W8A8: codes decode to an int8 grid, activations are
rotated and quantized per token to int8.
- weight int8 [N, K*bits/8]. A K/2-byte nibble plane, column 2i in the LOW
  nibble; at 6 bits followed by a K/4-byte plane with each code's top 2 bits
  (column c in byte c//4 at bit 2*(c%4)). Bit depth = row width * 8 / K.
- weight_s_rel e4m3 [N, K/16]: per-group scale relative to the row scale.
- weight_s_channel fp32 [N]: per-row scale.
- weight_codebook fp32 [16] (4-bit only): level table; code c decodes to
  codebook[c]. 6-bit codes are uniform: c - 32 (c in 1..63).
- weight_correction [K/16, N] (optional, asymmetric variant; we read it but do
  not produce it).
int8 grid: w8 = clamp(round(level * s_rel), -127, 127); weight = w8 * s_channel,
then de-rotated. Record: {"format": "asym_w4a8_int8", "group_size": 16,
"convrot_groupsize": 256}; 6-bit adds "lowbit_bits": 6 (informational: the
width alone cannot tell a 6-bit K from a 4-bit one without the scales).

Free choices (documented; the arithmetic otherwise mirrors comfy-kitchen):
- Codebook: always the fixed 16-level Lloyd-Max table for a group-normalized
  Gaussian (the table comfy-kitchen's CUDA decode kernel has built in).
  comfy-kitchen fits a k-means table instead when the rotated, group-normalized
  weights have excess kurtosis > -0.1, which ConvRot-rotated weights rarely
  reach; we never fit, so every layer shares the kernel's built-in LUT.
- Group scales: amax init, then 2 alternating least-squares refinements (scale
  = <w, level> / <level, level>, reassign), then codes are reassigned against
  the int8 grid the kernel actually decodes to. At 6 bits, each group also tries
  the two neighbouring e4m3 values of its scale and keeps the one with the
  least squared error through the grid (comfy-kitchen's quantize-time search).
These make our output bit-identical to comfy-kitchen whenever it picks the
fixed table (tested).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import common
from lowbit_pipe.formats.base import Format, FormatSpec, GridRounder, LinearPlan, QuantizedWeight
from lowbit_pipe.formats.registry import register
from lowbit_pipe.kernels import dispatch, reference, rotation

GROUP_SIZE = 16
CONVROT_GROUP = 256
W6_LEVELS = 31
ALS_ITERS = 2
E4M3_MAX_FINITE_BITS = 0x7E  # 0x7F is NaN in e4m3fn
# Lloyd-Max levels for a group-normalized Gaussian (16 levels).
LLOYD_MAX_16 = (
    -0.980602, -0.794529, -0.638165, -0.500986, -0.377321, -0.263187, -0.155210, -0.050720,
    0.052541, 0.156985, 0.265284, 0.379533, 0.502636, 0.638953, 0.794876, 0.980671,
)


def default_codebook() -> torch.Tensor:
    return torch.tensor(LLOYD_MAX_16, dtype=torch.float32)


def _nearest_sorted(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted 1-D `table` (ties -> lower index)."""
    last = table.numel() - 1
    pos = torch.searchsorted(table, values.contiguous())
    lo, hi = (pos - 1).clamp(0, last), pos.clamp(0, last)
    return torch.where((values - table[hi]).abs() < (values - table[lo]).abs(), hi, lo)


def _grid_levels(table: torch.Tensor, s_rel: torch.Tensor) -> torch.Tensor:
    """int8 value each level decodes to in every group: [N, G, L]."""
    return (table.view(1, 1, -1) * s_rel.float().unsqueeze(-1)).round().clamp(-127, 127)


def _assign_grid(target: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Nearest decoded grid level per weight; target = w / s_channel, [N, G, gs]."""
    n, g, gs = target.shape
    lv = levels.reshape(n * g, -1).contiguous()
    tg = target.reshape(n * g, gs).contiguous()
    last = lv.shape[1] - 1
    pos = torch.searchsorted(lv, tg)
    lo, hi = (pos - 1).clamp(0, last), pos.clamp(0, last)
    dlo = (tg - torch.gather(lv, 1, lo)).abs()
    dhi = (tg - torch.gather(lv, 1, hi)).abs()
    return torch.where(dhi < dlo, hi, lo).reshape(n, g, gs)


def _search_scale(target: torch.Tensor, s_rel: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group, the e4m3 neighbour of s_rel (or itself) with least grid error."""
    raw = s_rel.view(torch.uint8)
    candidates = [
        s_rel.float(),
        (raw - 1).clamp(min=1).view(torch.float8_e4m3fn).float(),
        (raw + 1).clamp(max=E4M3_MAX_FINITE_BITS).view(torch.float8_e4m3fn).float(),
    ]
    best_scale = best_err = best_idx = None
    for cand in candidates:
        levels = _grid_levels(table, cand)
        idx = _assign_grid(target, levels)
        err = (torch.gather(levels, 2, idx) - target).pow(2).sum(-1)
        if best_err is None:
            best_scale, best_err, best_idx = cand, err, idx
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, cand, best_scale)
        best_idx = torch.where(better.unsqueeze(-1), idx, best_idx)
    return best_scale.to(torch.float8_e4m3fn), best_idx


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] -> int8 storage [N, K*bits/8] (see module docstring)."""
    c = codes.to(torch.int32)
    low = common.pack_nibbles(c & 0xF, even_high=False)
    if bits == 4:
        return low.view(torch.int8)
    top = (c >> 4) & 0x3
    hi = top[:, 0::4] | (top[:, 1::4] << 2) | (top[:, 2::4] << 4) | (top[:, 3::4] << 6)
    return torch.cat([low, hi.to(torch.uint8)], dim=1).view(torch.int8)


def unpack_codes(packed: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: int32 codes [N, K]."""
    p = packed.view(torch.uint8)
    codes = common.unpack_nibbles(p[:, : k // 2], even_high=False)
    if bits == 6:
        hi = p[:, k // 2 :].to(torch.int32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=p.device)
        top = ((hi.unsqueeze(-1) >> shifts) & 0x3).reshape(p.shape[0], k)
        codes = codes | (top << 4)
    return codes


def quantize_rotated(w_rot: torch.Tensor, bits: int, group_size: int = GROUP_SIZE) -> dict[str, torch.Tensor]:
    """ConvRot-rotated fp32 [N, K] -> stored tensors (weight, weight_s_rel, weight_s_channel[, weight_codebook])."""
    n, k = w_rot.shape
    grouped = w_rot.reshape(n, k // group_size, group_size)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    if bits == 6:
        table = torch.arange(-W6_LEVELS, W6_LEVELS + 1, dtype=torch.float32, device=w_rot.device)
        scale = (amax / W6_LEVELS).clamp(min=1e-8)

        def assign(normalized: torch.Tensor) -> torch.Tensor:
            return (normalized.round().clamp(-W6_LEVELS, W6_LEVELS) + W6_LEVELS).long()
    else:
        table = default_codebook().to(w_rot.device)
        scale = amax.clamp(min=1e-8)

        def assign(normalized: torch.Tensor) -> torch.Tensor:
            return _nearest_sorted(normalized, table)

    idx = assign(grouped / scale)
    for _ in range(ALS_ITERS):
        lv = table[idx]
        scale = ((grouped * lv).sum(-1, keepdim=True) / (lv * lv).sum(-1, keepdim=True).clamp(min=1e-8)).clamp(min=1e-8)
        idx = assign(grouped / scale)
    shifted = table[idx] * scale
    s_channel = (shifted.abs().amax(dim=(1, 2)) / 127.0).clamp(min=1e-8)
    s_rel = (scale.squeeze(-1) / s_channel.unsqueeze(1)).float().to(torch.float8_e4m3fn)
    target = grouped / s_channel.view(-1, 1, 1)
    if bits == 6:
        s_rel, idx = _search_scale(target, s_rel, table)
        idx = idx + 1  # level index 0..62 -> stored code 1..63 (decodes as c - 32)
    else:
        idx = _assign_grid(target, _grid_levels(table, s_rel))
    out = {"weight": pack_codes(idx.reshape(n, k), bits), "weight_s_rel": s_rel, "weight_s_channel": s_channel.float()}
    if bits == 4:
        out["weight_codebook"] = table.clone()
    return out


def decode_int8_grid(tensors: dict[str, torch.Tensor], k: int, bits: int, group_size: int) -> torch.Tensor:
    """The int8 weight [N, K] (rotated basis) that the W8A8 GEMM consumes."""
    w = tensors["weight"]
    n = w.shape[0]
    codes = unpack_codes(w, k, bits)
    book = tensors.get("weight_codebook")
    values = book.float()[codes.long()] if book is not None else codes.float() - float(1 << (bits - 1))
    s_rel = tensors["weight_s_rel"].float()
    values = values.reshape(n, k // group_size, group_size) * s_rel.unsqueeze(-1)
    return values.reshape(n, k).round().clamp(-127, 127).to(torch.int8)


@dataclass(frozen=True)
class W4A8Plan(LinearPlan):
    """LinearPlan plus the layer's geometry (record fields and tensor shapes, which a bake or a load keeps)."""

    k: int
    bits: int
    group_size: int
    asymmetric: bool  # a stored weight_correction: computed as a float linear (comfy-kitchen's way)


@register
class W4A8(Format):
    name = "w4a8"
    comfy_name = "asym_w4a8_int8"
    bits_per_weight = 4.5
    bits: ClassVar[int] = 4
    rotations = ("convrot", "none")  # "none" in a spec means "the format's own ConvRot"
    act_qmax = 127.0

    def check_spec(self, spec: FormatSpec) -> None:
        super().check_spec(spec)
        if spec.rotation_group not in (None, CONVROT_GROUP):
            raise ValueError(f"{self.name}: rotation_group must be {CONVROT_GROUP}, got {spec.rotation_group}")

    def shape_problem(self, out_features: int, in_features: int) -> str | None:
        return common.group_problem(in_features, CONVROT_GROUP, "the ConvRot group")

    def input_rotation(self, spec: FormatSpec, in_features: int) -> tuple[str, int]:
        return "convrot", CONVROT_GROUP

    def quantize(self, weight: torch.Tensor, spec: FormatSpec) -> QuantizedWeight:
        w = common.check_finite_weight(weight)
        n, k = w.shape
        if k % CONVROT_GROUP:
            raise FormatError(f"{self.name}: in_features {k} is not a multiple of {CONVROT_GROUP}; keep this layer float")
        tensors = quantize_rotated(rotation.rotate_weight(w, "convrot", CONVROT_GROUP), self.bits)
        record: dict[str, Any] = {"format": self.comfy_name, "group_size": GROUP_SIZE, "convrot_groupsize": CONVROT_GROUP}
        if self.bits != 4:
            record["lowbit_bits"] = self.bits
        return QuantizedWeight(self.name, (n, k), tensors, record)

    @staticmethod
    def _geometry(q: QuantizedWeight) -> tuple[int, int, int, int]:
        """(k, bits, group_size, convrot_groupsize) of a quantized weight."""
        group_size = int(q.record.get("group_size", GROUP_SIZE))
        k = q.tensors["weight_s_rel"].shape[1] * group_size
        bits = q.tensors["weight"].shape[1] * 8 // k
        return k, bits, group_size, int(q.record.get("convrot_groupsize", CONVROT_GROUP))

    def stored_rotation(self, q: QuantizedWeight) -> tuple[str, int]:
        return "convrot", int(q.record.get("convrot_groupsize", CONVROT_GROUP))  # always rotated: part of the format

    def linear_plan(self, q: QuantizedWeight, device: torch.device | None = None) -> W4A8Plan:
        base = super().linear_plan(q, device)
        k, bits, group_size, _ = self._geometry(q)
        return W4A8Plan(**{f.name: getattr(base, f.name) for f in fields(base)}, k=k, bits=bits,
                        group_size=group_size, asymmetric="weight_correction" in q.tensors)

    def _resolved(self, q: QuantizedWeight, plan: LinearPlan | None) -> W4A8Plan:
        return plan if isinstance(plan, W4A8Plan) else self.linear_plan(q)

    def _rotated(self, q: QuantizedWeight, plan: W4A8Plan) -> torch.Tensor:
        k, group_size = plan.k, plan.group_size
        w8 = decode_int8_grid(q.tensors, k, plan.bits, group_size).float()
        w = w8 * q.tensors["weight_s_channel"].float().reshape(-1, 1)
        corr = q.tensors.get("weight_correction")
        if corr is not None:
            n = w.shape[0]
            w = (w.reshape(n, k // group_size, group_size) + corr.float().t().unsqueeze(-1)).reshape(n, k)
        return w

    def dequantize(self, q: QuantizedWeight, plan: LinearPlan | None = None) -> torch.Tensor:
        plan = self._resolved(q, plan)
        return rotation.unrotate_weight(self._rotated(q, plan), "convrot", plan.group)

    def linear(self, x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, *,
               plan: LinearPlan | None = None) -> torch.Tensor:
        plan = self._resolved(q, plan)
        if plan.activations == "none":
            return self.weight_only_linear(x, q, bias, plan=plan)
        k, bits, group_size, cgroup = plan.k, plan.bits, plan.group_size, plan.group
        if plan.asymmetric:  # comfy-kitchen runs it as a float linear
            y = x.float() @ self.dequantize(q, plan).t()
            return common.out_dtype_result(y, bias, x.dtype)
        w8 = q.runtime.get("int8_grid")  # prepacked, or decoded per call
        static = q.tensors.get("input_scale")
        if dispatch.int8_supported(x, "convrot"):  # GPU: Triton decode (unless prepacked) + the int8 path
            if w8 is None:
                w8 = dispatch.grid_decode(q.tensors, k, bits, group_size)
            return dispatch.int8_linear(x, w8, q.tensors["weight_s_channel"], bias, "convrot", cgroup,
                                        input_scale=static)
        if w8 is None:
            w8 = decode_int8_grid(q.tensors, k, bits, group_size)
        x_rot, _ = rotation.rotate_activation(x, "convrot", cgroup)
        y = reference.int8_linear_fp32(x_rot, w8, q.tensors["weight_s_channel"], static)
        return common.out_dtype_result(y, bias, x.dtype)

    def prepack(self, q: QuantizedWeight) -> dict[str, torch.Tensor] | None:
        """The decoded int8 grid [N, K] (8 bits per weight next to the stored 4.5 / 6.5): the W8A8 GEMM reads it
        directly instead of decoding the codes on every call. None for the asymmetric variant (float path)."""
        if "weight_correction" in q.tensors:
            return None
        k, bits, group_size, _ = self._geometry(q)
        return {"int8_grid": decode_int8_grid(q.tensors, k, bits, group_size)}

    def _grid(self, q: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(int8 grid levels per (row, group) [N, G, L], per-row scale [N], bits, group size)."""
        if "weight_correction" in q.tensors:
            raise FormatError(f"{q.format}: fixed-grid rounding of the asymmetric variant (weight_correction) "
                              "is not supported")
        k, bits, group_size, _ = self._geometry(q)
        book = q.tensors.get("weight_codebook")
        table = book.float() if book is not None else \
            torch.arange(-W6_LEVELS, W6_LEVELS + 1, dtype=torch.float32, device=q.tensors["weight"].device)
        return _grid_levels(table, q.tensors["weight_s_rel"]), q.tensors["weight_s_channel"].float(), bits, group_size

    def grid_rounder(self, q: QuantizedWeight) -> GridRounder:
        levels, s_ch, _, group_size = self._grid(q)  # the level tables, built once
        s_ch = s_ch.reshape(-1, 1)

        def round_columns(values: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            lv = levels[:, cols // group_size, :]  # [N, m, L]
            idx = _assign_grid((values.float() / s_ch).unsqueeze(-1), lv)
            return torch.gather(lv, 2, idx).squeeze(-1) * s_ch
        return round_columns

    def encode_on_grid(self, q: QuantizedWeight, values: torch.Tensor) -> QuantizedWeight:
        levels, s_ch, bits, group_size = self._grid(q)
        n, k = values.shape
        target = (values.float() / s_ch.reshape(-1, 1)).reshape(n, k // group_size, group_size)
        idx = _assign_grid(target, levels).reshape(n, k)
        codes = idx + 1 if bits == 6 else idx  # 6-bit: level index 0..62 -> stored code 1..63
        return QuantizedWeight(q.format, q.shape, {**q.tensors, "weight": pack_codes(codes, bits)}, dict(q.record))

    def logical_shape(self, weight_shape: tuple[int, ...], record: dict[str, Any]) -> tuple[int, int]:
        bits = int(record.get("lowbit_bits", 4))
        return (int(weight_shape[0]), int(weight_shape[1]) * 8 // bits)

    def from_tensors(self, tensors: dict[str, torch.Tensor], record: dict[str, Any], where: str) -> QuantizedWeight:
        fmt = self.comfy_name
        keys = ("weight", "weight_s_rel", "weight_s_channel", "weight_codebook", "weight_correction", "input_scale")
        common.check_no_unknown(tensors, keys, where, fmt)
        w = common.packed_codes(tensors, where, fmt)
        s_rel = common.require(tensors, "weight_s_rel", where, fmt)
        s_ch = common.require(tensors, "weight_s_channel", where, fmt)
        common.check_dtype(s_rel, "weight_s_rel", where, (torch.float8_e4m3fn, torch.uint8, torch.float32))
        s_rel = s_rel.view(torch.float8_e4m3fn) if s_rel.dtype == torch.uint8 else s_rel
        try:
            group_size = common.record_int(record, "group_size", GROUP_SIZE, where)
            cgroup = rotation.resolve_group("convrot", record.get("convrot_groupsize", CONVROT_GROUP))
        except (TypeError, ValueError) as err:
            raise FormatError(f"{where}: .comfy_quant group_size/convrot_groupsize: {err}") from err
        n = int(w.shape[0])
        if s_rel.dim() != 2 or s_rel.shape[0] != n:
            raise FormatError(f"{where}.weight_s_rel: shape {tuple(s_rel.shape)}, expected [{n}, K/{group_size}]")
        k = int(s_rel.shape[1]) * group_size
        bits = int(w.shape[1]) * 8 // k if k else 0
        if bits not in (4, 6) or bits * k != int(w.shape[1]) * 8:
            raise FormatError(f"{where}.weight: row width {w.shape[1]} bytes fits neither 4 nor 6 bits for K={k} (from weight_s_rel)")
        if "lowbit_bits" in record and common.record_int(record, "lowbit_bits", bits, where, 1, 8) != bits:
            raise FormatError(f"{where}.weight: record says lowbit_bits={record['lowbit_bits']} but the row width implies {bits}")
        if k % 16 or k % cgroup:
            raise FormatError(f"{where}.weight: in_features {k} not a multiple of 16 and convrot_groupsize {cgroup}")
        common.check_finite_scale(s_rel, "weight_s_rel", where)
        common.check_dtype(s_ch, "weight_s_channel", where, (torch.float32, torch.bfloat16, torch.float16))
        common.check_shape(s_ch, "weight_s_channel", where, (n,), "one per row")
        common.check_finite_scale(s_ch, "weight_s_channel", where)
        out = {"weight": w, "weight_s_rel": s_rel, "weight_s_channel": s_ch.float()}
        if "weight_codebook" in tensors:
            book = tensors["weight_codebook"]
            if bits != 4:
                raise FormatError(f"{where}.weight_codebook: 6-bit storage is uniform and takes no codebook")
            common.check_dtype(book, "weight_codebook", where, (torch.float32, torch.bfloat16, torch.float16))
            common.check_shape(book, "weight_codebook", where, (16,))
            common.check_finite_scale(book, "weight_codebook", where)
            out["weight_codebook"] = book.float()
        if "weight_correction" in tensors:
            corr = tensors["weight_correction"]
            common.check_dtype(corr, "weight_correction", where, (torch.float32, torch.bfloat16, torch.float16))
            common.check_shape(corr, "weight_correction", where, (k // group_size, n), "[groups, out]")
            common.check_finite_scale(corr, "weight_correction", where)
            out["weight_correction"] = corr
        out.update(common.optional_input_scale(tensors, where))
        return QuantizedWeight("w4a8" if bits == 4 else "w6a8", (n, k), out, dict(record))

    def storage_bytes(self, out_features: int, in_features: int, spec: FormatSpec | None = None) -> int:
        codes = out_features * in_features * self.bits // 8
        scales = out_features * (in_features // GROUP_SIZE) + 4 * out_features
        return codes + scales + (64 if self.bits == 4 else 0)

