"""lowbit_pipe.comfy: the LowbitLayout comfy-kitchen layout and the registration into (stand-ins of) ComfyUI.

No ComfyUI here: comfy-kitchen provides QuantizedTensor; `comfy.quant_ops` / `comfy.ops` are stand-in modules
with the names the registration touches. bench/comfy_check.py runs the real ComfyUI loader.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("comfy_kitchen")

from comfy_kitchen.tensor import QuantizedTensor
from comfy_kitchen.tensor import base as ck_base

from lowbit_pipe.comfy import layout as L
from lowbit_pipe.comfy import registry as R
from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import FormatSpec, QuantizedWeight, encode_record, get_format

# (format, rotation, granularity): every lowbit kind the project writes
KINDS = [
    ("int8", "quarot", None),
    ("int8", "hadanorm", None),
    ("fp8", "convrot", None),
    ("fp8", "none", "row"),
    ("nvfp4", "convrot", None),
    ("nvfp4", "quarot", None),
]
IDS = [f"{f}-{r}-{g or 'default'}" for f, r, g in KINDS]
N, K = 48, 512


def _quantize(fmt_name: str, rotation: str, granularity: str | None, activations: str = "dynamic",
              seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, 3] += 0.3  # an outlier column: rotations matter
    fmt = get_format(fmt_name)
    q = fmt.quantize(w, FormatSpec(fmt_name, rotation, None, granularity))
    return fmt.with_activations(q, activations, input_amax=torch.tensor(4.0), where="test")


@pytest.fixture()
def registered():
    with L.registered() as ledger:
        yield ledger
    assert L.LAYOUT_NAME not in ck_base.LAYOUTS


# ---- the layout ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_name,rotation,granularity", KINDS, ids=IDS)
@pytest.mark.parametrize("activations", ["dynamic", "static", "none"])
def test_linear_bit_exact(registered, fmt_name, rotation, granularity, activations):
    q = _quantize(fmt_name, rotation, granularity, activations)
    assert q.record["format"] == f"lowbit_{fmt_name}"
    fmt = get_format(fmt_name)
    qt = L.to_quantized_tensor(q, torch.float32)
    assert isinstance(qt, QuantizedTensor) and qt.shape == (N, K) and qt.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(N, generator=g)
    for x in (torch.randn(7, K, generator=g), torch.randn(2, 5, K, generator=g) * 3):
        for b in (bias, None):
            want = fmt.linear(x, q, b)
            with torch.inference_mode():  # ComfyUI's executor: aten.linear arrives intact
                got_inf = F.linear(x, qt, b)
            with torch.no_grad():  # F.linear decomposes into aten.t + aten.addmm / aten.mm
                got_ng = F.linear(x, qt, b)
            assert torch.equal(got_inf, want)
            assert torch.equal(got_ng, want)


@pytest.mark.parametrize("fmt_name,rotation,granularity", KINDS, ids=IDS)
def test_bf16_compute(registered, fmt_name, rotation, granularity):
    q = _quantize(fmt_name, rotation, granularity)
    fmt = get_format(fmt_name)
    qt = L.to_quantized_tensor(q, torch.bfloat16)
    x = torch.randn(3, 4, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(N).bfloat16()
    want = fmt.linear(x, q, bias)
    with torch.inference_mode():
        assert torch.equal(F.linear(x, qt, bias), want)
    with torch.no_grad():
        assert torch.equal(F.linear(x, qt, bias), want)
    assert qt.dequantize().dtype == torch.bfloat16
    assert torch.equal(qt.dequantize(), fmt.dequantize(q).to(torch.bfloat16))


@pytest.mark.parametrize("fmt_name,rotation,granularity", KINDS, ids=IDS)
def test_dequantize_state_dict_moves(registered, fmt_name, rotation, granularity):
    q = _quantize(fmt_name, rotation, granularity, "static")
    fmt = get_format(fmt_name)
    qt = L.to_quantized_tensor(q, torch.float32)
    want = fmt.dequantize(q)
    assert torch.equal(qt.dequantize(), want)
    assert torch.equal(qt.t().dequantize(), want.t())
    assert qt.t().shape == (K, N) and qt.t().t()._params.transposed is False

    # The carried QuantizedWeight is the very same tensors.
    back = L.to_quantized_weight(qt)
    assert back.format == q.format and back.shape == q.shape and back.record == q.record
    assert set(back.tensors) == set(q.tensors) and all(back.tensors[k] is q.tensors[k] for k in q.tensors)

    # state_dict: comfy-kitchen's convention (suffixes of "<layer>.weight"); round trip through the format.
    sd = qt.state_dict("blk.weight")
    expect = {"blk.weight", "blk.weight_scale"} | ({"blk.weight_scale_2"} if "weight_scale_2" in q.tensors else set())
    assert set(sd) == expect
    tensors = {k[len("blk."):]: v for k, v in sd.items()} | {"input_scale": q.tensors["input_scale"]}
    q2 = fmt.from_tensors(tensors, json.loads(bytes(encode_record(q.record).tolist())), "test")
    qt2 = L.to_quantized_tensor(q2, torch.float32)
    x = torch.randn(4, K)
    with torch.inference_mode():
        assert torch.equal(F.linear(x, qt2), F.linear(x, qt))

    # Device moves / copies go through comfy-kitchen's generic handlers and Params.to_device / clone.
    for moved in (qt.to("cpu"), qt.to(torch.device("cpu"), copy=True), qt.clone(), qt.detach(),
                  torch.nn.Parameter(qt, requires_grad=False)):
        assert isinstance(moved, QuantizedTensor) and moved._layout_cls == L.LAYOUT_NAME
        assert torch.equal(moved.dequantize(), want)
        with torch.inference_mode():
            assert torch.equal(F.linear(x, moved), fmt.linear(x, q, None))
    copy = qt.clone()
    assert copy._qdata is not qt._qdata and copy._params.scale is not qt._params.scale
    half = qt.to(torch.bfloat16)  # a dtype change only changes the compute dtype, never the stored codes
    assert half.dtype == torch.bfloat16 and torch.equal(half._qdata, qt._qdata)
    assert torch.equal(half.dequantize(), want.to(torch.bfloat16))
    empty = torch.empty_like(qt)  # ComfyUI's cast_to: empty_like + copy_
    empty.copy_(qt)
    assert torch.equal(empty.dequantize(), want)
    # The optional tensors follow device moves only when present.
    assert qt._params._tensor_fields() == [f for f in ("scale", "scale_2", "input_scale")
                                           if getattr(qt._params, f) is not None]


@pytest.mark.parametrize("fmt_name,rotation,granularity", KINDS, ids=IDS)
def test_flatten_unflatten(registered, fmt_name, rotation, granularity):
    """ComfyUI's dynamic-VRAM path rebuilds weights from their inner tensors (__tensor_flatten__ /
    __tensor_unflatten__): the optional fields travel as non-tensor None, the present ones as inner tensors."""
    q = _quantize(fmt_name, rotation, granularity)
    qt = L.to_quantized_tensor(q, torch.float32)
    inner, ctx = qt.__tensor_flatten__()
    assert inner == ["_qdata"] + [f"_param_{f}" for f in ("scale", "scale_2") if getattr(qt._params, f) is not None]
    rebuilt = QuantizedTensor.__tensor_unflatten__({a: getattr(qt, a).clone() for a in inner}, ctx, None, None)
    assert rebuilt._params.input_scale is None and rebuilt._params.record == qt._params.record
    x = torch.randn(3, K)
    with torch.inference_mode():
        assert torch.equal(F.linear(x, rebuilt), F.linear(x, qt))


def test_other_ops_fall_back_to_dequantize(registered):
    q = _quantize("int8", "quarot", None)
    qt = L.to_quantized_tensor(q, torch.float32)
    w = get_format("int8").dequantize(q)
    assert torch.equal(qt * 2, w * 2)
    assert torch.equal(qt[:3], w[:3])
    x = torch.randn(K, 5)
    assert torch.equal(torch.mm(qt, x), w @ x)  # weight on the left: not a linear, plain math
    y = torch.randn(3, N)
    assert torch.equal(torch.mm(y, qt), y @ w)  # untransposed weight on the right: plain math


def test_requantize_keeps_the_kind(registered):
    for fmt_name, rotation, granularity in KINDS:
        q = _quantize(fmt_name, rotation, granularity, "static")
        qt = L.to_quantized_tensor(q, torch.float32)
        w = get_format(fmt_name).dequantize(q)
        again = qt.requantize_from_float(w, scale="recalculate", stochastic_rounding=7, inplace_ops=True)
        assert again._layout_cls == L.LAYOUT_NAME
        q2 = L.to_quantized_weight(again)
        assert q2.record == q.record and set(q2.tensors) == set(q.tensors)
        assert q2.tensors["input_scale"] is q.tensors["input_scale"]
        assert all(q2.tensors[k].shape == q.tensors[k].shape for k in q.tensors)


def test_to_quantized_tensor_refuses_what_it_cannot_carry():
    q = get_format("int8").quantize(torch.randn(16, 256) * 0.02, FormatSpec("int8", "quarot"))
    odd = QuantizedWeight(q.format, q.shape, {**q.tensors, "weight_lut": torch.zeros(4)}, q.record)
    with pytest.raises(ValueError, match="weight_lut"):
        L.to_quantized_tensor(odd, torch.float32)
    with pytest.raises(TypeError):
        L.to_quantized_weight(torch.zeros(2, 2))


def test_registered_context_restores_comfy_kitchen():
    table = ck_base._LAYOUT_DISPATCH_TABLE
    before_layouts = dict(ck_base.LAYOUTS)
    before_ops = {op: dict(h) for op, h in table.items()}
    with L.registered():
        assert ck_base.LAYOUTS[L.LAYOUT_NAME] is L.LowbitLayout
        assert all(table[op][L.LowbitLayout] is fn for op, fn in L.OP_HANDLERS.items())
        with L.registered():  # nested: the inner undo puts the outer registration back
            pass
        assert ck_base.LAYOUTS[L.LAYOUT_NAME] is L.LowbitLayout
    assert ck_base.LAYOUTS == before_layouts
    assert {op: dict(h) for op, h in table.items()} == before_ops


# ---- the registration, against stand-ins of comfy.quant_ops / comfy.ops -------------------------------
def stock_algos() -> dict:
    """A QUANT_ALGOS with the kinds of ComfyUI 0.29.0 (no asym_w4a8_int8, awq_w4a16, svdquant_w4a4)."""
    def entry(dtype, params, layout, quantize_input=None):
        e = {"storage_t": dtype, "parameters": set(params), "comfy_tensor_layout": layout}
        return e if quantize_input is None else {**e, "quantize_input": quantize_input}
    return {"float8_e4m3fn": entry(torch.float8_e4m3fn, {"weight_scale", "input_scale"}, "TensorCoreFP8E4M3Layout"),
            "float8_e5m2": entry(torch.float8_e5m2, {"weight_scale", "input_scale"}, "TensorCoreFP8E5M2Layout"),
            "nvfp4": entry(torch.uint8, {"weight_scale", "weight_scale_2", "input_scale"}, "TensorCoreNVFP4Layout"),
            "mxfp8": entry(torch.float8_e4m3fn, {"weight_scale", "input_scale"}, "TensorCoreMXFP8Layout"),
            "int8_tensorwise": entry(torch.int8, {"weight_scale"}, "TensorWiseINT8Layout", False),
            "convrot_w4a4": entry(torch.int8, {"weight_scale"}, "TensorCoreConvRotW4A4Layout", False)}


def _stand_ins():
    """Stand-ins of comfy.quant_ops and comfy.ops: a dict QUANT_ALGOS, comfy-kitchen's registry functions, and a
    fake `_load_quantized_module` / `_quantized_weight_state_dict` with the stock signatures (not ComfyUI code)."""
    quant_ops = types.ModuleType("fake_quant_ops")
    quant_ops.QUANT_ALGOS = stock_algos()
    quant_ops.register_layout_class = ck_base.register_layout_class
    quant_ops.get_layout_class = ck_base.get_layout_class
    ops = types.ModuleType("fake_ops")
    calls = []

    def _load_quantized_module(module, super_load, state_dict, prefix, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs, load_extra_params=False):
        calls.append(prefix)
        state_dict.pop(f"{prefix}comfy_quant", None)
        module.weight = torch.nn.Parameter(state_dict.pop(f"{prefix}weight").float(), requires_grad=False)
        super_load(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def _quantized_weight_state_dict(module, sd, prefix, extra_quant_conf=None, extra_quant_params=()):
        if isinstance(module.weight, QuantizedTensor):
            sd.update(module.weight.state_dict(f"{prefix}weight"))
            conf = {"format": module.quant_format, **(extra_quant_conf or {})}
            sd[f"{prefix}comfy_quant"] = encode_record(conf)
            for name in extra_quant_params:
                if getattr(module, name, None) is not None:
                    sd[f"{prefix}{name}"] = getattr(module, name)
        else:
            sd[f"{prefix}weight"] = module.weight
        if module.bias is not None:
            sd[f"{prefix}bias"] = module.bias
        return sd

    ops._load_quantized_module = _load_quantized_module
    ops._quantized_weight_state_dict = _quantized_weight_state_dict

    class Linear(torch.nn.Module):
        """ComfyUI's mixed-precision Linear as far as the loader sees it (attributes and lookups)."""

        _disabled_formats = set()

        def __init__(self, in_features, out_features, bias=True):
            super().__init__()
            self.factory_kwargs = {"device": None, "dtype": torch.float32}
            self._orig_shape = (out_features, in_features)
            self._full_precision_mm = False
            self._full_precision_mm_config = False
            self.bias = torch.nn.Parameter(torch.empty(out_features)) if bias else None

        def _load_from_state_dict(self, *args):
            ops._load_quantized_module(self, super()._load_from_state_dict, *args, load_extra_params=True)

        def state_dict(self, *args, destination=None, prefix="", **kwargs):
            sd = destination if destination is not None else {}
            return ops._quantized_weight_state_dict(self, sd, prefix, extra_quant_params=("input_scale",))

        def forward(self, x):
            return F.linear(x, self.weight, self.bias)

    return quant_ops, ops, Linear, calls


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _layer_state(q: QuantizedWeight, bias: torch.Tensor | None, prefix: str = "") -> dict[str, torch.Tensor]:
    sd = {f"{prefix}{k}": v.clone() for k, v in q.tensors.items()}
    sd[f"{prefix}comfy_quant"] = encode_record(q.record)
    if bias is not None:
        sd[f"{prefix}bias"] = bias.clone()
    return sd


def test_install_derives_kinds_and_uninstall_restores_identity():
    quant_ops, ops, _, _ = _stand_ins()
    load0, save0 = ops._load_quantized_module, ops._quantized_weight_state_dict
    algos0 = dict(quant_ops.QUANT_ALGOS)
    reg = R.install(quant_ops, ops)
    # Our kinds, plus the upstream kinds this (0.29.0-like) ComfyUI lacks; the ones it has are not ours to load.
    assert set(reg.kinds) == {"lowbit_int8", "lowbit_fp8", "lowbit_nvfp4", "lowbit_mxfp8", "awq_w4a16", "svdquant_w4a4",
                              "asym_w4a8_int8"}
    assert quant_ops.QUANT_ALGOS["awq_w4a16"]["parameters"] >= {"weight_scale", "weight_zeros"}
    assert quant_ops.QUANT_ALGOS["lowbit_int8"]["storage_t"] == torch.int8
    assert quant_ops.QUANT_ALGOS["lowbit_fp8"]["storage_t"] == torch.float8_e4m3fn
    assert quant_ops.QUANT_ALGOS["lowbit_nvfp4"]["storage_t"] == torch.uint8
    assert quant_ops.QUANT_ALGOS["lowbit_nvfp4"]["parameters"] >= {"weight_scale", "weight_scale_2", "input_scale"}
    assert all(quant_ops.QUANT_ALGOS[k]["quantize_input"] is False for k in reg.kinds)
    assert all(quant_ops.QUANT_ALGOS[k]["comfy_tensor_layout"] == "LowbitLayout" for k in reg.kinds)
    assert quant_ops.get_layout_class("LowbitLayout") is L.LowbitLayout
    assert ops._load_quantized_module is not load0 and ops._load_quantized_module.__wrapped__ is load0

    # Installing twice wraps nothing twice.
    again = R.install(quant_ops, ops)
    assert again is reg and ops._load_quantized_module.__wrapped__ is load0 and reg.installs == 2

    report = reg.uninstall()
    assert ops._load_quantized_module is load0 and ops._quantized_weight_state_dict is save0
    assert quant_ops.QUANT_ALGOS == algos0
    assert "LowbitLayout" not in ck_base.LAYOUTS
    assert report["errors"] == [] and report["unfreed"] == []
    assert report["patches_restored"] == 2 + len(reg.kinds) + 1 + len(L.OP_HANDLERS)
    assert reg.uninstall() is report  # idempotent
    assert R.install(quant_ops, ops) is not reg  # a fresh install after uninstall
    R.installed(ops).uninstall()
    assert ops._load_quantized_module is load0


def test_a_comfyui_that_knows_awq_w4a16_keeps_its_own_entry():
    quant_ops, ops, _, _ = _stand_ins()
    own = {"storage_t": torch.int8, "parameters": {"weight_scale", "weight_zeros"},
           "comfy_tensor_layout": "TensorCoreAWQW4A16Layout"}
    quant_ops.QUANT_ALGOS["awq_w4a16"] = own
    with R.install(quant_ops, ops) as reg:
        assert "awq_w4a16" not in reg.kinds and quant_ops.QUANT_ALGOS["awq_w4a16"] is own
    assert quant_ops.QUANT_ALGOS["awq_w4a16"] is own


@pytest.mark.parametrize("fmt_name,rotation,granularity", KINDS, ids=IDS)
def test_load_lowbit_record_into_stand_in(fmt_name, rotation, granularity):
    quant_ops, ops, Linear, calls = _stand_ins()
    q = _quantize(fmt_name, rotation, granularity, "static")
    bias = torch.randn(N)
    with R.install(quant_ops, ops):
        model = torch.nn.Sequential()
        model.add_module("blk", Linear(K, N))
        result = model.load_state_dict(_layer_state(q, bias, "blk."), strict=False)
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert calls == []  # the lowbit record never reached the original loader
        layer = model.blk
        assert isinstance(layer.weight, torch.nn.Parameter) and L.is_lowbit(layer.weight)
        assert layer.quant_format == f"lowbit_{fmt_name}" and layer.layout_type == "LowbitLayout"
        assert layer._full_precision_mm is False
        assert torch.equal(layer.bias, bias)
        x = torch.randn(3, 5, K)
        with torch.inference_mode():
            assert torch.equal(model.blk(x), get_format(fmt_name).linear(x, q, bias))
        # ComfyUI's re-save writes the whole record and every stored tensor.
        sd = layer.state_dict(prefix="blk.")
        assert json.loads(bytes(sd["blk.comfy_quant"].tolist())) == q.record
        assert {k for k in sd if k != "blk.comfy_quant"} == {f"blk.{k}" for k in q.tensors} | {"blk.bias"}
        assert all(_same_bytes(sd[f"blk.{k}"], v) for k, v in q.tensors.items())


def test_weight_only_record_sets_full_precision():
    quant_ops, ops, Linear, _ = _stand_ins()
    q = _quantize("fp8", "convrot", None, "none")
    with R.install(quant_ops, ops):
        layer = Linear(K, N, bias=False)
        layer.load_state_dict(_layer_state(q, None), strict=False)
        assert layer._full_precision_mm is True and layer._full_precision_mm_config is True
        x = torch.randn(4, K)
        with torch.inference_mode():
            assert torch.equal(layer(x), get_format("fp8").linear(x, q, None))


def test_other_records_pass_through_untouched():
    quant_ops, ops, Linear, calls = _stand_ins()
    stock = get_format("int8").quantize(torch.randn(N, K), FormatSpec("int8"))
    assert stock.record["format"] == "int8_tensorwise"
    with R.install(quant_ops, ops):
        layer = Linear(K, N, bias=False)
        layer.load_state_dict({"weight": stock.tensors["weight"], "comfy_quant": encode_record(stock.record)},
                              strict=False)
        assert calls == [""] and not isinstance(layer.weight, QuantizedTensor)
        plain = Linear(K, N, bias=False)  # no record at all
        plain.load_state_dict({"weight": torch.randn(N, K)}, strict=False)
        assert calls == ["", ""]


def test_load_errors_name_the_layer():
    quant_ops, ops, Linear, _ = _stand_ins()
    q = _quantize("int8", "quarot", None)
    with R.install(quant_ops, ops):
        bad = _layer_state(q, None, "blocks.3.attn.wq.")
        del bad["blocks.3.attn.wq.weight_scale"]
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList([torch.nn.Module() for _ in range(4)])
        model.blocks[3].attn = torch.nn.Module()
        model.blocks[3].attn.wq = Linear(K, N, bias=False)
        with pytest.raises(FormatError, match=r"blocks\.3\.attn\.wq.*weight_scale"):
            model.load_state_dict(bad, strict=False)
        wrong = Linear(K, 2 * N, bias=False)
        with pytest.raises(FormatError, match=r"\(48, 512\).*\(96, 512\)"):
            wrong.load_state_dict(_layer_state(q, None), strict=False)
        unknown = _layer_state(q, None)
        unknown["comfy_quant"] = encode_record({**q.record, "format": "lowbit_int3"})
        with pytest.raises(FormatError, match="lowbit_int3"):
            Linear(K, N, bias=False).load_state_dict(unknown, strict=False)


def test_install_refuses_a_foreign_module():
    with pytest.raises(TypeError, match="QUANT_ALGOS"):
        R.install(types.ModuleType("x"), types.ModuleType("y"))
    quant_ops, ops, _, _ = _stand_ins()
    del ops._load_quantized_module
    with pytest.raises(TypeError, match="_load_quantized_module"):
        R.install(quant_ops, ops)
    assert quant_ops.QUANT_ALGOS.keys() == stock_algos().keys() and "LowbitLayout" not in ck_base.LAYOUTS


# ---- upstream kinds this ComfyUI lacks: asym_w4a8_int8 (ComfyUI < 0.31.0), convrot_w4a4 (< 0.28.0), mxfp8 -----
@pytest.mark.parametrize("fmt_name", ["w4a8", "w6a8"])
def test_asym_w4a8_loads_through_the_pack_where_comfyui_lacks_it(fmt_name):
    quant_ops, ops, Linear, calls = _stand_ins()
    fmt = get_format(fmt_name)
    q = fmt.with_activations(fmt.quantize(torch.randn(N, K) * 0.02, FormatSpec(fmt_name, "convrot")), "static",
                             input_amax=torch.tensor(4.0), where="test")
    assert q.record["format"] == "asym_w4a8_int8" and "asym_w4a8_int8" not in quant_ops.QUANT_ALGOS
    bias = torch.randn(N)
    with R.install(quant_ops, ops) as reg:
        assert "asym_w4a8_int8" in reg.kinds
        assert quant_ops.QUANT_ALGOS["asym_w4a8_int8"]["parameters"] >= {"weight_s_rel", "weight_s_channel",
                                                                         "weight_codebook"}
        layer = Linear(K, N)
        result = layer.load_state_dict(_layer_state(q, bias), strict=False)
        assert result.missing_keys == [] and result.unexpected_keys == [] and calls == []
        assert L.is_lowbit(layer.weight) and layer.quant_format == "asym_w4a8_int8"
        assert L.to_quantized_weight(layer.weight).format == fmt_name  # the row width picks 4 or 6 bits
        x = torch.randn(3, 5, K)
        with torch.inference_mode():
            assert torch.equal(layer(x), fmt.linear(x, q, bias))
        sd = layer.state_dict(prefix="")
        assert json.loads(bytes(sd["comfy_quant"].tolist())) == q.record
        assert all(_same_bytes(sd[k], v) for k, v in q.tensors.items())
    assert "asym_w4a8_int8" not in quant_ops.QUANT_ALGOS


def test_a_comfyui_that_has_the_upstream_kinds_keeps_them():
    quant_ops, ops, _, _ = _stand_ins()
    own = {"storage_t": torch.int8, "parameters": {"weight_scale", "weight_s_channel"},
           "comfy_tensor_layout": "AsymW4A8Int8Layout", "quantize_input": False}
    quant_ops.QUANT_ALGOS["asym_w4a8_int8"] = own
    del quant_ops.QUANT_ALGOS["convrot_w4a4"], quant_ops.QUANT_ALGOS["mxfp8"]  # a 0.27.0 without MXFP8
    with R.install(quant_ops, ops) as reg:
        assert "asym_w4a8_int8" not in reg.kinds and quant_ops.QUANT_ALGOS["asym_w4a8_int8"] is own
        assert {"convrot_w4a4", "mxfp8"} <= set(reg.kinds)
        assert quant_ops.QUANT_ALGOS["convrot_w4a4"]["comfy_tensor_layout"] == "LowbitLayout"
    assert "convrot_w4a4" not in quant_ops.QUANT_ALGOS and quant_ops.QUANT_ALGOS["asym_w4a8_int8"] is own


def test_install_refuses_a_comfyui_that_ignores_quantize_input():
    quant_ops, ops, _, _ = _stand_ins()
    for entry in quant_ops.QUANT_ALGOS.values():  # ComfyUI 0.23 .. 0.26: no entry says quantize_input
        entry.pop("quantize_input", None)
    before = dict(quant_ops.QUANT_ALGOS)
    with pytest.raises(R.IncompatibleComfyUI, match="quantize_input.*0.27.0"):
        R.install(quant_ops, ops)
    assert quant_ops.QUANT_ALGOS == before and "LowbitLayout" not in ck_base.LAYOUTS
