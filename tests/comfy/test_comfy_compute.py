"""LowbitLayout settles each weight's plan once (issue 47 item 1: the files path), and the Compute (lowbit_pipe) node
sets how a MODEL's nvfp4 layers compute, on a copy, undone by Purge. Without ComfyUI: comfy-kitchen's
QuantizedTensor on stand-in layers and the stand-in ModelPatcher of test_comfy_nodes."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

ck = pytest.importorskip("comfy_kitchen")
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402
from test_comfy_nodes import BaseModel, Patcher  # noqa: E402

from lowbit_pipe.comfy import layout as L  # noqa: E402
from lowbit_pipe.comfy.compute_node import LowbitCompute, stock_weight, with_nvfp4_compute  # noqa: E402
from lowbit_pipe.comfy.node_runs import PurgedModelError  # noqa: E402
from lowbit_pipe.comfy.nodes import NODE_CLASS_MAPPINGS, LowbitPurge  # noqa: E402
from lowbit_pipe.formats import FormatSpec, QuantizedWeight, get_format  # noqa: E402
from lowbit_pipe.formats.nvfp4 import NVFP4  # noqa: E402
from lowbit_pipe.quant.nn import QuantLinear  # noqa: E402

N, K = 48, 512
NVFP4_FMT = get_format("nvfp4")


def _weight(seed: int, fmt: str = "nvfp4", rotation: str = "convrot", activations: str = "dynamic") -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, 3] += 0.3
    f = get_format(fmt)
    return f.with_activations(f.quantize(w, FormatSpec(fmt, rotation)), activations)


@pytest.fixture()
def registered():
    with L.registered() as ledger:
        yield ledger


@pytest.fixture()
def counts(monkeypatch):
    """Calls of NVFP4.linear_plan and NVFP4.derived_tensors (what the layout must settle once)."""
    seen = {"plan": 0, "derived": 0}
    plan, derived = NVFP4.linear_plan, NVFP4.derived_tensors

    def counted_plan(self, *a, **k):
        seen["plan"] += 1
        return plan(self, *a, **k)

    def counted_derived(self, *a, **k):
        seen["derived"] += 1
        return derived(self, *a, **k)

    monkeypatch.setattr(NVFP4, "linear_plan", counted_plan)
    monkeypatch.setattr(NVFP4, "derived_tensors", counted_derived)
    return seen


# ---- the layout resolves once per Params ---------------------------------------------------------------------------
def test_the_plan_and_derived_tensors_are_settled_once_per_weight(registered, counts):
    q = _weight(0)
    q.compute = "fp8"
    qt = L.to_quantized_tensor(q, torch.float32)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(N)
    want = NVFP4_FMT.linear(x, q, bias)  # a bare QuantizedWeight: its own plan and row scale, per call
    counts.update(plan=0, derived=0)
    for _ in range(4):
        with torch.inference_mode():  # ComfyUI's sampling: aten.linear
            assert torch.equal(F.linear(x, qt, bias), want)
        with torch.no_grad():  # aten.t + aten.addmm: the transposed view reads what its weight settled
            assert torch.equal(F.linear(x, qt, bias), want)
    assert counts == {"plan": 1, "derived": 1}
    assert torch.equal(qt.dequantize(), NVFP4_FMT.dequantize(q)) and counts["plan"] == 1

    # A weight-only forward reads no derived tensor: none is computed.
    wo = L.to_quantized_tensor(_weight(0, activations="none"), torch.float32)
    with torch.inference_mode():
        F.linear(x, wo)
        F.linear(x, wo)
    assert counts == {"plan": 2, "derived": 1}


def test_every_new_params_settles_its_own(registered, counts):
    """comfy-kitchen moves, casts, copies and rebuilds by making new Params: each settles its own plan (device facts
    for its own device), and an in-place copy of other values never runs on what the old ones derived."""
    q, other = _weight(0), _weight(7)
    q.compute = other.compute = "fp8"
    qt = L.to_quantized_tensor(q, torch.float32)
    x = torch.randn(3, K)
    with torch.inference_mode():
        F.linear(x, qt)
        inner, ctx = qt.__tensor_flatten__()
        rebuilt = QuantizedTensor.__tensor_unflatten__({a: getattr(qt, a) for a in inner}, ctx, None, None)
        for made in (qt.to(torch.bfloat16), qt.clone(), rebuilt):
            assert getattr(made._params, L.RESOLVED_ATTR) is None and made._params.compute == "fp8"
            F.linear(x.to(made.dtype), made)
        assert counts["plan"] == 4
        target = torch.empty_like(qt)  # ComfyUI's cast_to: empty_like + copy_
        target.copy_(L.to_quantized_tensor(other, torch.float32))
        assert torch.equal(F.linear(x, target), NVFP4_FMT.linear(x, other, None))
    assert not torch.equal(NVFP4_FMT.linear(x, other, None), NVFP4_FMT.linear(x, q, None))


def test_what_a_weight_settled_goes_with_it(registered):
    """No cache outside the weight: once its QuantizedTensor is dropped, its Params (plan, row scale) are freed by
    reference counting alone, no cycle left for the collector."""
    q = _weight(0)
    q.compute = "fp8"
    qt = L.to_quantized_tensor(q, torch.float32)
    with torch.inference_mode():
        F.linear(torch.randn(2, K), qt)
    settled = getattr(qt._params, L.RESOLVED_ATTR)
    assert settled is not None and "fp8_row_scale" in settled.weight.runtime
    refs = [weakref.ref(qt._params), weakref.ref(settled), weakref.ref(settled.weight.runtime["fp8_row_scale"])]
    gc.disable()
    try:
        del qt, settled
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


# ---- the Compute node ---------------------------------------------------------------------------------------------
class FileLinear(nn.Module):
    """A layer as ComfyUI's mixed-precision loader leaves it: a QuantizedTensor weight Parameter, `quant_format`."""

    def __init__(self, weight: QuantizedTensor, quant_format: str, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.quant_format, self.layout_type = quant_format, weight._layout_cls
        self._full_precision_mm = self._full_precision_mm_config = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _file_model() -> Patcher:
    """A 'file' of three layers: lowbit_nvfp4 (ConvRot, the pack's layout), stock nvfp4 (comfy-kitchen's layout),
    int8 + QuaRot (the pack's layout, no compute choice)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(N, K, generator=g) * 0.05
    with ck.registry.use_backend("eager"):
        stock = QuantizedTensor.from_float(w, "TensorCoreNVFP4Layout")
    stock = QuantizedTensor(stock._qdata, stock._layout_cls, dataclasses.replace(stock._params, orig_dtype=torch.float32))
    tree = nn.Sequential(FileLinear(L.to_quantized_tensor(_weight(1), torch.float32), "lowbit_nvfp4", torch.randn(N)),
                         FileLinear(stock, "nvfp4", torch.randn(N)),
                         FileLinear(L.to_quantized_tensor(_weight(2, "int8", "quarot"), torch.float32), "lowbit_int8",
                                    torch.randn(N)))
    return Patcher(BaseModel(tree))


def _oracle(layer: nn.Module, compute: str, where: str) -> QuantLinear:
    """QuantLinear (the diffusers side) on the same stored tensors, with `compute`."""
    q = L.to_quantized_weight(layer.weight) if L.is_lowbit(layer.weight) else stock_weight(layer, where)
    out = QuantLinear(QuantizedWeight(q.format, q.shape, q.tensors, q.record), layer.bias.detach())
    out.compute = compute
    return out


@pytest.mark.parametrize("compute", ["fp8", "nvfp4", "weight_only"])
def test_compute_node_equals_quantlinear_and_purge_undoes_it(registered, compute):
    model = _file_model()
    tree = model.get_model_object("diffusion_model")
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        before = [layer(x) for layer in tree]
    oracles = [_oracle(tree[i], compute, f"layer {i}") for i in (0, 1)]

    shown = LowbitCompute().apply(model, compute, unique_id="9")
    (out,) = shown["result"]
    assert f"nvfp4 compute: {compute} on 2 layers (1 of the pack's file kinds, 1 stock nvfp4" in shown["ui"]["text"][0]
    copy = out.get_model_object("diffusion_model")
    assert copy is not tree
    with torch.inference_mode():
        for i in (0, 1):
            assert torch.equal(copy[i](x), oracles[i](x)), i
            assert L.is_lowbit(copy[i].weight) and copy[i].weight._params.compute == compute
            assert copy[i].weight._qdata.data_ptr() == tree[i].weight._qdata.data_ptr()  # the same stored codes
        assert copy[1].quant_format == "lowbit_nvfp4" and copy[1]._full_precision_mm is False
        assert torch.equal(copy[2](x), before[2]) and copy[2].weight is tree[2].weight  # int8: untouched
        assert all(torch.equal(layer(x), b) for layer, b in zip(tree, before))  # the MODEL given: as it was
    assert tree[1].weight._layout_cls == "TensorCoreNVFP4Layout" and tree[1].quant_format == "nvfp4"
    # the block scales are the file's, not a copy (nn.Parameter of a QuantizedTensor would have cloned them)
    assert copy[1].weight._params.scale.data_ptr() == tree[1].weight._params.block_scale.data_ptr()

    made = [weakref.ref(copy[i].weight._params) for i in (0, 1)]
    del copy
    text = LowbitPurge().purge(out)["ui"]["text"][0]
    assert '"retained_bytes": 0' in text and '"unfreed": []' in text and '"proven": true' in text, text
    assert all(r() is None for r in made)  # the node's weights (and what they settled) are gone
    with pytest.raises(PurgedModelError, match="Compute \\(lowbit_pipe\\) node 9"):
        out.get_model_object("diffusion_model")(x)
    with torch.inference_mode():
        assert all(torch.equal(layer(x), b) for layer, b in zip(tree, before))


def test_fp8_compute_differs_from_the_default_and_auto_keeps_the_model(registered):
    model = _file_model()
    tree = model.get_model_object("diffusion_model")
    (same,) = LowbitCompute().apply(model, "auto")["result"]
    assert same is model
    (fp8,) = LowbitCompute().apply(model, "fp8")["result"]
    x = torch.randn(4, K)
    with torch.inference_mode():  # on a CPU the default keeps the file's numerics (NVFP4 activations)
        assert not torch.equal(fp8.get_model_object("diffusion_model")[0](x), tree[0](x))


def test_compute_node_refusals(registered):
    with pytest.raises(ValueError, match="nvfp4_compute 'fp4' is not one of auto, weight_only, nvfp4, fp8"):
        with_nvfp4_compute(_file_model(), "fp4")
    int8_only = Patcher(BaseModel(nn.Sequential(FileLinear(L.to_quantized_tensor(_weight(2, "int8", "quarot"),
                                                                                  torch.float32), "lowbit_int8",
                                                           torch.randn(N)))))
    with pytest.raises(ValueError, match="no nvfp4 layer"):
        with_nvfp4_compute(int8_only, "fp8")
    assert NODE_CLASS_MAPPINGS["LowbitCompute"] is LowbitCompute


def test_compute_node_on_a_quantize_model(tmp_path, monkeypatch):
    """Quantize's nvfp4 QuantLinears: the copy's layers get the setting (the recipe's quantize.nvfp4_compute), the
    run's own keep theirs; Purge tears down the run and this copy with it."""
    from conftest import native_module
    from safetensors.torch import load_file

    import lowbit_pipe
    from lowbit_pipe.comfy.nodes import LowbitQuantize

    monkeypatch.chdir(tmp_path)  # outside ComfyUI the Quantize node writes its run dir under the working directory
    exported = lowbit_pipe.run("default", ["pipeline=[load,detect,export]", f"export.path={tmp_path / 'f.safetensors'}"],
                               run_dir=tmp_path / "float")
    model = Patcher(BaseModel(native_module(load_file(exported.export_path))))
    (quantized, _) = LowbitQuantize().quantize(model, "default", "quantize.default.format=nvfp4", unique_id="3")
    (fp8,) = LowbitCompute().apply(quantized, "fp8", unique_id="4")["result"]
    layers = [m for m in fp8.get_model_object("diffusion_model").modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.compute == "fp8" for m in layers)
    source = [m for m in quantized.get_model_object("diffusion_model").modules() if isinstance(m, QuantLinear)]
    assert source and all(m.compute is None for m in source)
    del source
    refs = [weakref.ref(m) for m in layers]
    del layers
    text = LowbitPurge().purge(fp8)["ui"]["text"][0]
    gc.collect()
    assert '"retained_bytes": 0' in text and '"unfreed": []' in text, text
    assert all(r() is None for r in refs)
    with pytest.raises(PurgedModelError):
        LowbitCompute().apply(quantized, "fp8")
