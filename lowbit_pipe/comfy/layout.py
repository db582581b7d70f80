"""`LowbitLayout`: a comfy-kitchen layout whose QuantizedTensor carries one lowbit_pipe QuantizedWeight.

ComfyUI keeps a quantized Linear's weight as a comfy-kitchen `QuantizedTensor` (`qdata` plus a frozen
`Params` dataclass, dispatched per layout class). Our kinds (`.comfy_quant` format `lowbit_<name>`:
int8 with quarot / hadanorm, fp8 with any rotation or per-row scales, nvfp4 / mxfp8 with any rotation;
and the upstream kinds the running ComfyUI's QUANT_ALGOS lacks: `awq_w4a16` / `svdquant_w4a4` everywhere,
`asym_w4a8_int8` before ComfyUI 0.31.0, ...) have no layout ComfyUI dispatches to, so this one computes them
with the project's own `Format` objects:

- `qdata` is the stored `weight` tensor, as on disk;
- `Params` holds the other stored tensors (`weight_scale` -> `scale`, `weight_scale_2` -> `scale_2`,
  `weight_zeros` -> `zeros`, `weight_proj_down` / `weight_proj_up` / `weight_smooth_factor` -> `proj_down` /
  `proj_up` / `smooth_factor`, `weight_s_rel` / `weight_s_channel` / `weight_codebook` / `weight_correction` ->
  `s_rel` / `s_channel` / `codebook` / `correction`, `input_scale`; the optional ones are None and `_tensor_fields()` lists only the present ones, so
  comfy-kitchen's generic device moves / clones / copies work), the format name, the record as JSON
  text (hashable), the logical `(out, in)` shape, and a `transposed` flag;
- `aten.linear` runs the format's `linear(x, q, bias)`: the layer's own math, rotation and activation
  quantization included (Triton on CUDA, the torch reference elsewhere), bit for bit what
  lowbit_pipe's `QuantLinear` computes;
- `aten.t` flips `transposed`; `aten.mm` / `aten.addmm` with a transposed weight (how `F.linear`
  decomposes outside `torch.inference_mode()`) run the same `linear`;
- anything else dequantizes (the format's `dequantize`, original unrotated basis, in `orig_dtype`)
  and calls the op on plain tensors.

Resolved once per Params, as QuantLinear resolves its LinearPlan once: at its first linear (or dequantize) a Params
settles a `Resolved` (its QuantizedWeight with the record parsed, the format's `LinearPlan` with the device facts of
its tensors' device, and `Format.derived_tensors`, computed at the first read by a path that needs them: nvfp4's
`fp8_row_scale`, hadanorm's row sums) and every later call reads it. It is a plain attribute of that Params object,
not a dataclass field: it is not compared, hashed, flattened or copied, so every Params comfy-kitchen builds (a
device move through `to_device`, `clone`, a dtype change through `dataclasses.replace`, ComfyUI's dynamic-VRAM
rebuild through `__tensor_unflatten__`) starts without one and settles its own on its own device, and it is freed
with its Params. `copy_from` (`copy_`: new values in place) drops it. Under torch.compile tracing (fake inner
tensors) nothing is kept. `compute` (QuantizedWeight.compute: nvfp4's `NVFP4_COMPUTE`) is a field: it travels with
every copy and enters the plan; never exported.

This module imports comfy-kitchen (Apache-2.0) only, never ComfyUI. Nothing is registered at import:
`register(ledger)` puts the layout class and its op handlers into comfy-kitchen's tables with a
recorded undo (`lowbit_pipe.comfy.registry.install` calls it); `registered()` is the same as a
context manager, for use without ComfyUI (tests, scripts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import torch
from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, QuantizedTensor, dequantize_args
from comfy_kitchen.tensor import base as ck_base

from lowbit_pipe.formats import Format, FormatSpec, QuantizedWeight, get_format
from lowbit_pipe.formats.base import ACT_GRANULARITY_KEY, WEIGHT_ONLY_KEY, LinearPlan
from lowbit_pipe.formats.common import record_rotation
from lowbit_pipe.ledger import Ledger

LAYOUT_NAME = "LowbitLayout"

# on-disk suffix -> Params field. `weight` itself is the QuantizedTensor's qdata.
TENSOR_FIELDS = {"weight_scale": "scale", "weight_scale_2": "scale_2", "weight_zeros": "zeros",
                 "weight_proj_down": "proj_down", "weight_proj_up": "proj_up", "weight_smooth_factor": "smooth_factor",
                 "weight_s_rel": "s_rel", "weight_s_channel": "s_channel", "weight_codebook": "codebook",
                 "weight_correction": "correction", "input_scale": "input_scale"}
# Params field -> suffix relative to `<layer>.weight`, comfy-kitchen's `state_dict_tensors` convention
# (ComfyUI calls `weight.state_dict(f"{prefix}weight")`). `input_scale` is not a suffix of `weight`: ComfyUI
# writes it from the module's own `input_scale` parameter (the registry registers one, as stock does).
_STATE_SUFFIX = {field: suffix[len("weight"):] for suffix, field in TENSOR_FIELDS.items() if suffix.startswith("weight")}

_MISSING = object()
RESOLVED_ATTR = "_resolved"  # the Params attribute holding its Resolved (not a dataclass field)
aten = torch.ops.aten


@functools.lru_cache(maxsize=4096)
def _record_of(text: str) -> dict[str, Any]:
    """The record dict of a Params' JSON text (parsed once per distinct record; treat as read-only)."""
    return json.loads(text)


def record_text(record: dict[str, Any]) -> str:
    """The JSON text a Params stores: compact, keys in their order (as the export writes them)."""
    return json.dumps(record, separators=(",", ":"))


class LowbitLayout(QuantizedLayout):
    """A lowbit_pipe QuantizedWeight as a comfy-kitchen layout (see the module docstring)."""

    MIN_SM_VERSION = None  # the format picks its own path (Triton on CUDA, torch reference elsewhere)

    @dataclass(frozen=True)
    class Params(BaseLayoutParams):
        """`scale` (inherited) is the stored `weight_scale` (None if the format has none); `orig_shape` is the
        QuantizedTensor's logical shape ((in, out) while transposed); `logical_shape` stays (out, in)."""

        scale_2: torch.Tensor | None = None  # weight_scale_2 (nvfp4's global scale)
        zeros: torch.Tensor | None = None  # weight_zeros (awq_w4a16's per-group zero points)
        proj_down: torch.Tensor | None = None  # svdquant_w4a4's low-rank branch and smoothing
        proj_up: torch.Tensor | None = None
        smooth_factor: torch.Tensor | None = None
        s_rel: torch.Tensor | None = None  # asym_w4a8_int8's e4m3 group scales, per-row scale, 4-bit level table
        s_channel: torch.Tensor | None = None
        codebook: torch.Tensor | None = None
        correction: torch.Tensor | None = None  # its asymmetric variant's per-group correction (read, never written)
        input_scale: torch.Tensor | None = None  # static activation scale, when stored
        format_name: str = ""  # lowbit_pipe format name ("int8", "fp8", "nvfp4", ...)
        record: str = "{}"  # the layer's `.comfy_quant` record, JSON text
        logical_shape: tuple[int, int] = (0, 0)  # (out_features, in_features) of the stored weight
        transposed: bool = False  # set by aten.t: the tensor is logically weight.T
        compute: str | None = None  # QuantizedWeight.compute (nvfp4: NVFP4_COMPUTE); None: the format's default

        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, RESOLVED_ATTR, None)  # settled at the first use (see the module docstring)

        def _tensor_fields(self) -> list[str]:
            return [name for name in TENSOR_FIELDS.values() if getattr(self, name) is not None]

        def copy_from(self, src: Any, non_blocking: bool = False) -> None:
            """comfy-kitchen's in-place copy (`copy_`): new values, so what was derived from the old ones goes."""
            super().copy_from(src, non_blocking=non_blocking)
            object.__setattr__(self, RESOLVED_ATTR, None)

    # ---- comfy-kitchen layout API ---------------------------------------------------------------
    @classmethod
    def quantize(cls, tensor: torch.Tensor, format_name: str | None = None, record: str | dict | None = None,
                 input_scale: torch.Tensor | None = None, granularity: str | None = None,
                 compute: str | None = None, **kwargs: Any) -> tuple[torch.Tensor, Params]:
        """Re-quantize a float weight [out, in] as the same kind (ComfyUI's LoRA path:
        `requantize_from_float`, whose `requantize_kwargs` supply format, record, granularity, the
        static input scale and the compute setting). ComfyUI's `scale` / `stochastic_rounding` / `inplace_ops` are
        ignored: the format's own round-to-nearest quantizer decides the scales."""
        if format_name is None or record is None:
            raise ValueError(f"{LAYOUT_NAME} quantizes only an existing lowbit_pipe weight again "
                             "(requantize_from_float); it never quantizes activations")
        fmt = get_format(format_name)
        rec = _record_of(record) if isinstance(record, str) else dict(record)
        kind, group = record_rotation(rec, format_name)
        spec = FormatSpec(format=fmt.name, rotation=kind, rotation_group=group or None, granularity=granularity,
                          act_granularity=rec.get(ACT_GRANULARITY_KEY))
        with torch.no_grad():
            q = fmt.quantize(tensor.detach(), spec)
            if rec.get(WEIGHT_ONLY_KEY):
                q = fmt.with_activations(q, "none")
        if input_scale is not None:
            q = QuantizedWeight(q.format, q.shape, {**q.tensors, "input_scale": input_scale}, q.record)
        q.compute = compute
        qt = to_quantized_tensor(q, tensor.dtype)
        return qt._qdata, qt._params

    @classmethod
    def requantize_kwargs(cls, qtensor: QuantizedTensor) -> dict[str, Any]:
        p = qtensor._params
        return {"format_name": p.format_name, "record": p.record, "input_scale": p.input_scale,
                "granularity": _granularity(p), "compute": p.compute}

    @classmethod
    def dequantize(cls, qdata: torch.Tensor, params: Params) -> torch.Tensor:
        """The stored weight [out, in] (never transposed: QuantizedTensor.dequantize transposes), in the
        original (unrotated) basis, in `orig_dtype`."""
        r = resolved(qdata, params)
        return r.format.dequantize(r.weight, r.plan).to(params.orig_dtype)

    @classmethod
    def get_plain_tensors(cls, qtensor: QuantizedTensor) -> tuple[torch.Tensor | None, ...]:
        p = qtensor._params
        return (qtensor._qdata, p.scale, p.scale_2, p.input_scale, p.zeros, p.proj_down, p.proj_up, p.smooth_factor,
                p.s_rel, p.s_channel, p.codebook, p.correction)

    @classmethod
    def state_dict_tensors(cls, qdata: torch.Tensor, params: Params) -> dict[str, torch.Tensor]:
        """Suffixes relative to `<layer>.weight`: "" -> weight, "_scale" -> weight_scale, "_scale_2" ->
        weight_scale_2, "_zeros" -> weight_zeros, "_s_rel" -> weight_s_rel, ... (`input_scale` is the module's own
        parameter, see `_STATE_SUFFIX`)."""
        out = {"": qdata}
        for field, suffix in _STATE_SUFFIX.items():
            t = getattr(params, field)
            if t is not None:
                out[suffix] = t
        return out


# ---- QuantizedWeight <-> QuantizedTensor ------------------------------------------------------------
def _weight(qdata: torch.Tensor, params: LowbitLayout.Params) -> QuantizedWeight:
    tensors = {"weight": qdata}
    for suffix, field in TENSOR_FIELDS.items():
        t = getattr(params, field)
        if t is not None:
            tensors[suffix] = t
    return QuantizedWeight(params.format_name, tuple(params.logical_shape), tensors, _record_of(params.record),
                           compute=params.compute)


def _granularity(p: LowbitLayout.Params) -> str | None:
    """"tensor" / "row" for a scalar / per-row `weight_scale` (int8, fp8), else None (the format's own)."""
    s, n = p.scale, p.logical_shape[0]
    if s is None:
        return None
    if s.numel() == 1:
        return "tensor"
    return "row" if tuple(s.shape) in ((n, 1), (n,)) else None


class _Derived(Mapping[str, torch.Tensor]):
    """`Format.derived_tensors` of one weight, computed at the first read: a path that reads none (weight-only nvfp4
    reads no `fp8_row_scale`) never pays for them, and one that does pays once."""

    def __init__(self, fmt: Format, q: QuantizedWeight) -> None:
        self._fmt, self._q, self._tensors = fmt, q, None

    def _all(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self._fmt.derived_tensors(self._q)
        return self._tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._all()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


@dataclass(frozen=True)
class Resolved:
    """What a Params' forward reads, settled once (see the module docstring)."""

    format: Format
    weight: QuantizedWeight  # the Params' own tensors, its parsed record, `compute`, derived tensors as `runtime`
    plan: LinearPlan  # with the device facts of the stored tensors' device


def resolved(qdata: torch.Tensor, params: LowbitLayout.Params) -> Resolved:
    """The Resolved of `params` (with its `qdata`): settled at the first call, then read. Inner tensors that are not
    real (torch.compile's fake / functional tensors while tracing) get a fresh one each time, never kept."""
    found = getattr(params, RESOLVED_ATTR, None)
    if found is not None and found.weight.tensors["weight"] is qdata:
        return found
    fmt = get_format(params.format_name)
    q = _weight(qdata, params)
    plan = fmt.linear_plan(q, qdata.device)
    q.runtime = _Derived(fmt, QuantizedWeight(q.format, q.shape, q.tensors, q.record))  # type: ignore[assignment]
    out = Resolved(fmt, q, plan)
    if found is None and type(qdata) in (torch.Tensor, torch.nn.Parameter):  # another qdata (a contiguous copy): not kept
        object.__setattr__(params, RESOLVED_ATTR, out)
    return out


def to_quantized_tensor(q: QuantizedWeight, compute_dtype: torch.dtype) -> QuantizedTensor:
    """Wrap a QuantizedWeight (tensors as they are: no copy, no device move) as a LowbitLayout
    QuantizedTensor of logical shape `q.shape` and dtype `compute_dtype`."""
    extra = sorted(set(q.tensors) - {"weight", *TENSOR_FIELDS})
    if extra:
        raise ValueError(f"{LAYOUT_NAME}: format '{q.format}' stores tensor(s) {extra} this layout cannot carry "
                         f"(it carries weight, {', '.join(TENSOR_FIELDS)})")
    if "weight" not in q.tensors:
        raise ValueError(f"{LAYOUT_NAME}: QuantizedWeight of format '{q.format}' has no 'weight' tensor")
    get_format(q.format)  # unknown names fail here, not at the first forward
    shape = (int(q.shape[0]), int(q.shape[1]))
    fields = {field: q.tensors.get(suffix) for suffix, field in TENSOR_FIELDS.items()}
    params = LowbitLayout.Params(orig_dtype=compute_dtype, orig_shape=shape, format_name=q.format,
                                 record=record_text(q.record), logical_shape=shape, transposed=False,
                                 compute=q.compute, **fields)
    return QuantizedTensor(q.tensors["weight"], LAYOUT_NAME, params)


def as_parameter(qt: QuantizedTensor) -> torch.nn.Parameter:
    """`qt` as a module's weight Parameter holding the very tensors of `qt`'s Params: `nn.Parameter` detaches a tensor
    subclass, which comfy-kitchen does with a clone of every scale tensor (a copy of a file's weights would then
    hold its own block scales); the clone is dropped for `qt`'s Params at once."""
    param = torch.nn.Parameter(qt, requires_grad=False)
    param._params = qt._params
    return param


def to_quantized_weight(qt: QuantizedTensor) -> QuantizedWeight:
    """The QuantizedWeight a LowbitLayout QuantizedTensor carries (the stored, untransposed weight)."""
    if not is_lowbit(qt):
        raise TypeError(f"expected a {LAYOUT_NAME} QuantizedTensor, got {type(qt).__name__}"
                        + (f" of layout {qt._layout_cls}" if isinstance(qt, QuantizedTensor) else ""))
    q = _weight(qt._qdata, qt._params)
    return QuantizedWeight(q.format, q.shape, q.tensors, dict(q.record),  # the caller's own record (the parse is shared)
                           compute=q.compute)


def is_lowbit(t: Any) -> bool:
    return isinstance(t, QuantizedTensor) and t._layout_cls == LAYOUT_NAME


# ---- op handlers ------------------------------------------------------------------------------------
def _fallback(func: Any, args: tuple, kwargs: dict) -> Any:
    """Dequantize every QuantizedTensor argument (transposed ones as their transpose) and run `func`."""
    return func(*dequantize_args(args), **dequantize_args(kwargs))


def _plain(t: Any) -> Any:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _run_linear(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    r = resolved(w._qdata, w._params)
    return r.format.linear(_plain(x), r.weight, _plain(bias), plan=r.plan)


def _linear(qt: Any, args: tuple, kwargs: dict) -> Any:
    """aten.linear(input, weight, bias=None): the format's linear when the weight is ours (untransposed)."""
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not is_lowbit(w) or w._params.transposed or is_lowbit(args[0]):
        return _fallback(aten.linear.default, args, kwargs)
    return _run_linear(args[0], w, bias)


def _t(qt: Any, args: tuple, kwargs: dict) -> Any:
    """aten.t: a flag flip (the storage stays [out, in])."""
    w = args[0]
    if not is_lowbit(w):
        return _fallback(aten.t.default, args, kwargs)
    p = w._params
    new = dataclasses.replace(p, orig_shape=(p.orig_shape[1], p.orig_shape[0]), transposed=not p.transposed)
    object.__setattr__(new, RESOLVED_ATTR, getattr(p, RESOLVED_ATTR))  # the same tensors: what p settled holds
    return QuantizedTensor(w._qdata, LAYOUT_NAME, new)


def _mm(qt: Any, args: tuple, kwargs: dict) -> Any:
    """aten.mm(x, weight.t()) = linear(x, weight) without bias; anything else dequantizes."""
    a, b = args[0], args[1]
    if is_lowbit(b) and b._params.transposed and not is_lowbit(a) and not kwargs:
        return _run_linear(a, b, None)
    return _fallback(aten.mm.default, args, kwargs)


def _addmm(qt: Any, args: tuple, kwargs: dict) -> Any:
    """aten.addmm(bias, x, weight.t()) (beta = alpha = 1) = linear(x, weight, bias); else dequantize."""
    bias, a, b = args[0], args[1], args[2]
    plain_scalars = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1 and set(kwargs) <= {"beta", "alpha"}
    if is_lowbit(b) and b._params.transposed and not is_lowbit(a) and not is_lowbit(bias) and plain_scalars:
        return _run_linear(a, b, bias)
    return _fallback(aten.addmm.default, args, kwargs)


OP_HANDLERS = {
    aten.linear.default: _linear,
    aten.t.default: _t,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
}


# ---- registration with comfy-kitchen -------------------------------------------------------------
def register(ledger: Ledger, register_class: Any = None) -> None:
    """Register LowbitLayout (under "LowbitLayout") and its op handlers with comfy-kitchen, each with its
    undo in `ledger` (the undo restores whatever was there before: nothing, or an earlier registration).

    `register_class`: the `register_layout_class` to call (ComfyUI's quant_ops re-exports comfy-kitchen's);
    default comfy-kitchen's own. The class must land in comfy-kitchen's `LAYOUTS`, which QuantizedTensor
    dispatch reads.
    """
    layouts = ck_base.LAYOUTS
    ledger.set_item(layouts, LAYOUT_NAME, LowbitLayout, f"comfy_kitchen LAYOUTS['{LAYOUT_NAME}']")
    (register_class or ck_base.register_layout_class)(LAYOUT_NAME, LowbitLayout)  # the registry ComfyUI uses
    if layouts.get(LAYOUT_NAME) is not LowbitLayout:
        raise RuntimeError(f"registering {LAYOUT_NAME} did not reach comfy-kitchen's layout table "
                           f"({ck_base.__name__}.LAYOUTS): is ComfyUI using comfy-kitchen?")
    table = ck_base._LAYOUT_DISPATCH_TABLE
    for op, handler in OP_HANDLERS.items():
        if op not in table:
            ledger.set_item(table, op, {}, f"comfy_kitchen dispatch table [{op}]")
        ledger.set_item(table[op], LowbitLayout, handler, f"comfy_kitchen {op} handler for {LAYOUT_NAME}")


@contextlib.contextmanager
def registered() -> Iterator[Ledger]:
    """LowbitLayout registered with comfy-kitchen inside the block, unregistered after (without ComfyUI)."""
    ledger = Ledger()
    register(ledger)
    try:
        yield ledger
    finally:
        report = ledger.undo_all()
        if report.errors:
            raise RuntimeError(f"unregistering {LAYOUT_NAME}: {report.errors}")
