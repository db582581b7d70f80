"""Teach a running ComfyUI to load and run lowbit_pipe's own kinds (the node pack's registration).

Stock ComfyUI refuses a file holding any `lowbit_<name>` record as a whole: `comfy/ops.py`
`_load_quantized_module` looks the record's `format` up in `comfy.quant_ops.QUANT_ALGOS` (KeyError),
and past that has one hard-coded branch per stock format. `install(quant_ops, ops)` changes exactly
three things (four with `model_patcher`), each recorded with its undo in a `lowbit_pipe.ledger.Ledger`:

1. the `LowbitLayout` comfy-kitchen layout (class and op handlers) is registered with comfy-kitchen's
   registry, the one ComfyUI's `quant_ops` re-exports (`lowbit_pipe.comfy.layout.register`);
2. `QUANT_ALGOS` gets one entry per kind the project's formats write (`written_kinds()`: found by asking
   every registered format what records it writes) that this ComfyUI needs: every `lowbit_*` kind, and
   each upstream kind its QUANT_ALGOS lacks (`awq_w4a16` / `svdquant_w4a4` everywhere, `asym_w4a8_int8`
   before ComfyUI 0.31.0, `convrot_w4a4` before 0.28.0, `mxfp8` without comfy-kitchen's MXFP8 layout; a
   ComfyUI that has the entry keeps it and loads those layers its own way). Each entry has the format's
   storage dtype, layout "LowbitLayout" and `quantize_input: False`, so ComfyUI's Linear hands the float
   input to the layout's linear (which quantizes activations the layer's own way);
3. `ops._load_quantized_module` (looked up as a module global at call time by the mixed-precision
   Linear) is wrapped: a record of a kind registered here is loaded through the project's formats
   (`format_for_record` + `from_tensors`, errors naming the layer) into a Parameter-wrapped
   LowbitLayout QuantizedTensor, with the module attributes ComfyUI's Linear.forward reads; every other
   record (or none) goes to the original function untouched. `ops._quantized_weight_state_dict` (ComfyUI's
   re-save) is wrapped too, so a re-saved lowbit layer keeps its whole record rather than only the keys
   ComfyUI knows;
4. with `model_patcher` (ComfyUI's `comfy.model_patcher` module; `install_into_comfyui` and the node pack pass
   it), `ModelPatcher.add_patches` is wrapped (`lowbit_pipe.comfy.stock_lora`): ComfyUI's stock LoRA loaders on
   a quantized layer give exact residual branches (a ComfyUI injection on that MODEL) instead of a LoRA rounded
   into the quantized weight, and refuse, naming the key, a patch kind a branch cannot express;
   `ModelPatcher.add_hook_patches` too, refusing hook LoRAs on quantized layers.

`Registration.uninstall()` unwinds the ledger: the same function objects are back, the dict entries
and the layout are gone, and the ledger's teardown report says so. Installing twice returns the
first, still active, Registration (nothing is wrapped twice).

`install` refuses (`compat.IncompatibleComfyUI`, a TypeError, before changing anything) a ComfyUI or
comfy-kitchen it cannot work with: no QUANT_ALGOS / layout registry / `_load_quantized_module`, a ComfyUI
that ignores `quantize_input` (before 0.27.0), a comfy-kitchen older than 0.2.13 (`compat` has the figures).

The ComfyUI modules are parameters so tests can pass stand-ins; `install_into_comfyui()` imports
`comfy.quant_ops`, `comfy.ops` and `comfy.model_patcher` itself (the node pack calls `compat.register_loader()`, which logs a
refusal instead of raising it). No ComfyUI code is imported here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from comfy_kitchen.tensor import QuantizedTensor

from lowbit_pipe.comfy import layout, stock_lora
from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import FORMATS, FormatSpec, format_for_record
from lowbit_pipe.formats.base import MAX_RECORD_BYTES, WEIGHT_ONLY_KEY
from lowbit_pipe.formats.comfy_versions import PACK_MIN_COMFYUI, IncompatibleComfyUI, check_comfy_kitchen
from lowbit_pipe.formats.common import MARKER_KEYS
from lowbit_pipe.ledger import Ledger

PREFIX = "lowbit_"
_MISSING = object()
_WRAPPER_MARK = "__lowbit_pipe_registration__"


@dataclass(frozen=True)
class Kind:
    """One record format our formats write (`lowbit_fp8`, `asym_w4a8_int8`, ...): which formats write it and how
    it is stored."""

    name: str  # the record's "format", e.g. "lowbit_fp8"
    formats: tuple[str, ...]  # our formats writing it, e.g. ("fp8",); ("w4a8", "w6a8") for asym_w4a8_int8
    storage_dtype: torch.dtype  # dtype of the stored `weight`
    parameters: frozenset[str]  # stored tensors besides `weight` (input_scale included: any layer may have one)
    variants: tuple[str, ...]  # the marker keys of the records seen, e.g. "lowbit_granularity=row"

    def quant_algo(self) -> dict[str, Any]:
        """The QUANT_ALGOS entry (the keys ComfyUI's entries have)."""
        return {"storage_t": self.storage_dtype, "parameters": set(self.parameters),
                "comfy_tensor_layout": layout.LAYOUT_NAME, "quantize_input": False}

    def carried(self) -> bool:
        """Whether LowbitLayout carries every tensor of this kind (else it cannot be registered)."""
        return self.parameters <= set(layout.TENSOR_FIELDS)


@functools.lru_cache(maxsize=1)
def written_kinds() -> dict[str, Kind]:
    """Every record format name the project's formats write, stock or ours, found by quantizing a small seeded
    weight with each rotation and granularity each format accepts (static / weight-only activations keep the
    name, so they need no probe)."""
    out_f, in_f = 32, 256  # fits every block size (mxfp8 32 x 32) and rotation group (convrot 256, quarot 128)
    weight = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)) * 0.02
    found: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS.values():
        if fmt.shape_problem(out_f, in_f) is not None:
            continue
        for rotation in fmt.rotations:
            for granularity in (None, "row", "tensor"):
                spec = FormatSpec(format=fmt.name, rotation=rotation, granularity=granularity)
                try:
                    fmt.check_spec(spec)
                    q = fmt.quantize(weight, spec)
                except (ValueError, FormatError):
                    continue
                name = str(q.record.get("format", ""))
                entry = found.setdefault(name, {"formats": [], "dtype": q.tensors["weight"].dtype,
                                                "parameters": {"input_scale"}, "variants": []})
                if entry["dtype"] != q.tensors["weight"].dtype:
                    raise RuntimeError(f"{name} is stored as {entry['dtype']} by format(s) {entry['formats']} and as "
                                       f"{q.tensors['weight'].dtype} by '{fmt.name}': one QUANT_ALGOS entry cannot "
                                       "describe both")
                if fmt.name not in entry["formats"]:
                    entry["formats"].append(fmt.name)
                entry["parameters"].update(k for k in q.tensors if k != "weight")
                variant = ", ".join(f"{k}={q.record[k]}" for k in MARKER_KEYS if k != "lowbit_format" and k in q.record)
                if variant not in entry["variants"]:
                    entry["variants"].append(variant)
    return {name: Kind(name, tuple(e["formats"]), e["dtype"], frozenset(e["parameters"]), tuple(e["variants"]))
            for name, e in sorted(found.items())}


def kinds_to_register(algos: dict) -> dict[str, Kind]:
    """The written kinds this ComfyUI needs from us: every `lowbit_*` kind, and each other kind its QUANT_ALGOS
    (`algos`, before our entries) lacks."""
    return {name: kind for name, kind in written_kinds().items() if name.startswith(PREFIX) or name not in algos}


# ---- the registration ------------------------------------------------------------------------------
@dataclass
class Registration:
    """What `install` changed in one ComfyUI (its two modules), and the ledger that undoes it."""

    quant_ops: Any
    ops: Any
    ledger: Ledger
    kinds: tuple[str, ...]  # the QUANT_ALGOS entries added (loaded through LowbitLayout)
    layout: str = layout.LAYOUT_NAME
    wrapped: tuple[str, ...] = ()  # names of the ComfyUI functions wrapped
    active: bool = True
    installs: int = 1  # how many install calls returned this registration
    report: dict[str, Any] | None = field(default=None, repr=False)  # the teardown report, after uninstall

    def uninstall(self) -> dict[str, Any]:
        """Undo everything (reverse order) and return the ledger's teardown report (`patches_restored`,
        `errors`, `unfreed`, ...). Idempotent: a second call returns the first report."""
        if not self.active:
            return self.report or {}
        self.active = False
        self.report = self.ledger.unwind().as_dict()
        return self.report

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


def installed(ops: Any) -> Registration | None:
    """The active Registration whose wrapper is (anywhere in the `__wrapped__` chain of)
    `ops._load_quantized_module`, else None."""
    fn, seen = getattr(ops, "_load_quantized_module", None), set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        reg = getattr(fn, _WRAPPER_MARK, None)
        if reg is not None and reg.active:
            return reg
        fn = getattr(fn, "__wrapped__", None)
    return None


def install(quant_ops: Any, ops: Any, model_patcher: Any = None) -> Registration:
    """Register LowbitLayout, the QUANT_ALGOS entries of `kinds_to_register` and the loader wrapper into ComfyUI's
    `comfy.quant_ops` / `comfy.ops` modules (or stand-ins with the same names), and with `model_patcher` (ComfyUI's
    `comfy.model_patcher`) the stock-LoRA conversion (`stock_lora.install`). Idempotent. IncompatibleComfyUI
    (nothing changed) where `check_comfyui` refuses them."""
    existing = installed(ops)
    if existing is not None:
        existing.installs += 1
        return existing
    algos = check_comfyui(quant_ops, ops)

    ledger = Ledger()
    kinds = kinds_to_register(algos)
    uncarried = sorted(name for name, kind in kinds.items() if not kind.carried())
    if uncarried:  # a format writing tensors LowbitLayout has no field for: a lowbit_pipe bug, caught by the tests
        raise RuntimeError(f"LowbitLayout cannot carry kind(s) {uncarried}: add their tensors to layout.TENSOR_FIELDS")
    reg = Registration(quant_ops, ops, ledger, tuple(kinds))
    try:
        layout.register(ledger, register_class=quant_ops.register_layout_class)
        if quant_ops.get_layout_class(layout.LAYOUT_NAME) is not layout.LowbitLayout:
            raise IncompatibleComfyUI(f"ComfyUI's get_layout_class('{layout.LAYOUT_NAME}') does not find the "
                                      "registered class: ComfyUI and lowbit_pipe see different comfy-kitchen "
                                      "registries (or ComfyUI runs without comfy-kitchen)")
        for kind in kinds.values():
            ledger.set_item(algos, kind.name, kind.quant_algo(), f"QUANT_ALGOS['{kind.name}']")
        original_load = ops._load_quantized_module
        ledger.patch_function(ops, "_load_quantized_module", _load_wrapper(original_load, algos, reg))
        wrapped = ["_load_quantized_module"]
        original_save = getattr(ops, "_quantized_weight_state_dict", None)
        if callable(original_save):
            ledger.patch_function(ops, "_quantized_weight_state_dict", _state_dict_wrapper(original_save, reg))
            wrapped.append("_quantized_weight_state_dict")
        patcher_class = getattr(model_patcher, "ModelPatcher", None)
        if patcher_class is not None:
            wrapped += stock_lora.install(ledger, patcher_class)
        reg.wrapped = tuple(wrapped)
    except BaseException:
        reg.active = False
        ledger.unwind()
        raise
    return reg


def check_comfyui(quant_ops: Any, ops: Any) -> dict:
    """ComfyUI's QUANT_ALGOS dict when `quant_ops` / `ops` (and the installed comfy-kitchen) can take the
    registration, else IncompatibleComfyUI naming what is missing and the versions needed. Changes nothing."""
    algos = getattr(quant_ops, "QUANT_ALGOS", None)
    if not isinstance(algos, dict):
        raise IncompatibleComfyUI(f"{getattr(quant_ops, '__name__', quant_ops)!r} has no QUANT_ALGOS dict: not the "
                                  f"quant_ops of a ComfyUI >= {PACK_MIN_COMFYUI}")
    for name in ("register_layout_class", "get_layout_class"):
        if not callable(getattr(quant_ops, name, None)):
            raise IncompatibleComfyUI(f"ComfyUI's quant_ops has no {name}: comfy-kitchen is missing or too old")
    if not callable(getattr(ops, "_load_quantized_module", None)):
        raise IncompatibleComfyUI("ComfyUI's comfy.ops has no _load_quantized_module (the mixed-precision loader "
                                  f"this registration wraps, there since ComfyUI 0.23.0; the pack needs "
                                  f">= {PACK_MIN_COMFYUI})")
    # A ComfyUI whose Linear reads `quantize_input` declares it in its own entries (int8_tensorwise, since
    # 0.27.0); one that does not quantizes every quantized layer's input with its layout, which LowbitLayout
    # refuses (it never quantizes activations for ComfyUI).
    own = [v for k, v in algos.items() if isinstance(v, dict) and v.get("comfy_tensor_layout") != layout.LAYOUT_NAME]
    if own and not any("quantize_input" in v for v in own):
        raise IncompatibleComfyUI("this ComfyUI's QUANT_ALGOS entries have no 'quantize_input' key: its Linear "
                                  "quantizes every quantized layer's input with the layer's layout (ComfyUI before "
                                  f"{PACK_MIN_COMFYUI})")
    try:
        installed_ck = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path: the feature check decides
        installed_ck = None
    check_comfy_kitchen(installed_ck, callable(getattr(QuantizedTensor, "requantize_from_float", None)))
    return algos


def install_into_comfyui() -> Registration:
    """`install` into the running ComfyUI (imports `comfy.quant_ops` and `comfy.ops`): what the node pack's
    `__init__.py` calls at custom-node import time, before any model loads."""
    import comfy.model_patcher
    import comfy.ops
    import comfy.quant_ops

    return install(comfy.quant_ops, comfy.ops, comfy.model_patcher)


# ---- the wrappers --------------------------------------------------------------------------------
def _peek_record(state_dict: dict, prefix: str) -> dict[str, Any] | None:
    """The layer's `.comfy_quant` record without popping it; None when absent or unreadable (the
    original loader then deals with it as it always did)."""
    t = state_dict.get(f"{prefix}comfy_quant")
    if not isinstance(t, torch.Tensor) or t.numel() * t.element_size() > MAX_RECORD_BYTES:
        return None
    try:
        record = json.loads(t.detach().cpu().numpy().tobytes())
    except (ValueError, UnicodeDecodeError, TypeError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _load_wrapper(original: Callable[..., Any], algos: dict, reg: Registration) -> Callable[..., Any]:
    @functools.wraps(original)
    def _load_quantized_module(module, super_load, state_dict, prefix, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs, load_extra_params=False):
        record = _peek_record(state_dict, prefix)
        kind = str(record.get("format", "")) if record is not None else ""
        if not (kind.startswith(PREFIX) or kind in reg.kinds) or f"{prefix}weight" not in state_dict:
            return original(module, super_load, state_dict, prefix, local_metadata, strict,
                            missing_keys, unexpected_keys, error_msgs, load_extra_params=load_extra_params)
        _load_lowbit(module, record, algos, super_load, state_dict, prefix, local_metadata, strict,
                     missing_keys, unexpected_keys, error_msgs, load_extra_params)

    setattr(_load_quantized_module, _WRAPPER_MARK, reg)
    return _load_quantized_module


def _load_lowbit(module, record, algos, super_load, state_dict, prefix, local_metadata, strict,
                 missing_keys, unexpected_keys, error_msgs, load_extra_params) -> None:
    """The lowbit branch: what the stock branch does for its formats, through the project's format."""
    layer = prefix.rstrip(".")
    where = f"ComfyUI layer '{layer}'"
    kind = record["format"]
    if kind not in algos:
        raise FormatError(f"{where}: record format '{kind}' is not a kind this lowbit_pipe registered "
                          f"(registered: {', '.join(k for k in algos if k.startswith(PREFIX))})")
    orig_shape = tuple(getattr(module, "_orig_shape", ()))
    if len(orig_shape) != 2:
        raise FormatError(f"{where}: lowbit kinds load into 2-D Linear weights only, this module's weight is "
                          f"{orig_shape} ({type(module).__name__})")
    device = module.factory_kwargs["device"]
    compute_dtype = module.factory_kwargs["dtype"]

    # The layer's own tensors: every `<prefix><name>` without a further dot, except the bias (torch loads
    # it) and the record. The format refuses any it does not know, naming it.
    state_dict.pop(f"{prefix}comfy_quant")
    names = [k[len(prefix):] for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]]
    tensors = {n: state_dict.pop(prefix + n) for n in names if n != "bias"}
    manually_loaded = [prefix + n for n in tensors]
    fmt = format_for_record(record, where)
    q = fmt.from_tensors(tensors, record, where)
    if tuple(q.shape) != orig_shape:
        raise FormatError(f"{where}: stored weight is {tuple(q.shape)} (out, in), the model's layer is {orig_shape}")
    if device is not None:
        q = type(q)(q.format, q.shape, {k: v.to(device=device) for k, v in q.tensors.items()}, q.record)

    module.quant_format = kind
    module._full_precision_mm_config = bool(record.get(WEIGHT_ONLY_KEY, False))
    if not module._full_precision_mm:
        module._full_precision_mm = module._full_precision_mm_config
    if kind in getattr(module, "_disabled_formats", ()):
        module._full_precision_mm = True
    module.layout_type = layout.LAYOUT_NAME
    module.weight = torch.nn.Parameter(layout.to_quantized_tensor(q, compute_dtype), requires_grad=False)
    if load_extra_params and "input_scale" in q.tensors:
        # As stock does for fp8 / nvfp4: ComfyUI's re-save writes the module's input_scale. Our linear reads
        # the copy in the layout's Params (quantize_input is False, so ComfyUI itself never uses this one).
        module.register_parameter("input_scale", torch.nn.Parameter(q.tensors["input_scale"], requires_grad=False))

    super_load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    for key in manually_loaded:
        if key in missing_keys:
            missing_keys.remove(key)


def _state_dict_wrapper(original: Callable[..., Any], reg: Registration) -> Callable[..., Any]:
    @functools.wraps(original)
    def _quantized_weight_state_dict(module, sd, prefix, extra_quant_conf=None, extra_quant_params=()):
        weight = getattr(module, "weight", None)
        if layout.is_lowbit(weight):
            # The whole record (ComfyUI would write only the keys it knows: format and the weight-only flag).
            record = dict(layout._record_of(weight._params.record))
            if getattr(module, "_full_precision_mm_config", False):
                record[WEIGHT_ONLY_KEY] = True
            extra_quant_conf = {**record, **(extra_quant_conf or {})}
        return original(module, sd, prefix, extra_quant_conf=extra_quant_conf, extra_quant_params=extra_quant_params)

    setattr(_quantized_weight_state_dict, _WRAPPER_MARK, reg)
    return _quantized_weight_state_dict
