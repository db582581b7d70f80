"""QuantLinear's LinearPlan: resolved when the layer is built and when what it reads changes, never per call; the
forward gives the format's own result (plan=None, resolved from the record) bit for bit, in eager and compiled."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.formats.w4a8 import W4A8Plan
from lowbit_pipe.kernels import dispatch
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.bake import bake_layer
from lowbit_pipe.quant.nn import QuantLinear

SPECS = {
    "int8": FormatSpec("int8"),
    "int8+convrot": FormatSpec("int8", rotation="convrot"),
    "int8+hadanorm static": FormatSpec("int8", rotation="hadanorm", activations="static"),
    "fp8+quarot": FormatSpec("fp8", rotation="quarot"),
    "fp8 weight-only": FormatSpec("fp8", activations="none"),
    "nvfp4": FormatSpec("nvfp4"),
    "nvfp4 per tensor": FormatSpec("nvfp4", act_granularity="tensor"),
    "nvfp4 weight-only": FormatSpec("nvfp4", activations="none"),
    "mxfp8+hadanorm": FormatSpec("mxfp8", rotation="hadanorm"),
    "convrot_w4a4": FormatSpec("convrot_w4a4"),
    "w4a8": FormatSpec("w4a8"),
    "w6a8 static": FormatSpec("w6a8", activations="static"),
    "awq_w4a16": FormatSpec("awq_w4a16"),
    "svdquant_w4a4": FormatSpec("svdquant_w4a4"),
}


def _layer(spec: FormatSpec, seed: int = 0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 256, generator=gen) * 0.02)
        linear.bias.copy_(torch.randn(64, generator=gen))
    return QuantLinear.from_linear(linear, spec, input_amax=3.0 if spec.activations == "static" else None)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(seed))


class _Unreadable(dict):
    """A record that fails when read: proves the forward never parses it."""

    def _refuse(self, *args, **kwargs):
        raise AssertionError("the forward read the record")

    get = __getitem__ = __contains__ = __iter__ = keys = items = _refuse


@pytest.mark.parametrize("name", list(SPECS))
def test_forward_reads_the_plan_not_the_record_and_matches_the_format(name):
    layer, x = _layer(SPECS[name]), _x()
    with torch.no_grad():
        expected = layer.format.linear(x, layer.qweight, layer.bias)  # plan=None: resolved from the record
        layer.prepacked = layer.prepack()
        record, layer.record = layer.record, _Unreadable(layer.record)
        y = layer(x)
        layer.record = record
    assert torch.equal(y, expected)
    assert layer.plan.device == torch.device("cpu") and layer.plan.facts == dispatch.device_facts(layer.plan.device)


def test_plan_holds_the_record_facts():
    plan = _layer(SPECS["int8+convrot"]).plan
    assert (plan.rotation, plan.group, plan.activations, plan.compute, plan.shape) == ("convrot", 256, "dynamic",
                                                                                        None, (64, 256))
    assert _layer(SPECS["fp8 weight-only"]).plan.activations == "none"
    assert _layer(SPECS["nvfp4 per tensor"]).plan.per_tensor
    assert _layer(SPECS["convrot_w4a4"]).plan.rotation == "convrot"  # the format's own rotation, not a marker
    w6 = _layer(SPECS["w6a8 static"]).plan
    assert isinstance(w6, W4A8Plan) and (w6.k, w6.bits, w6.group, w6.activations) == (256, 6, 256, "static")


def test_compute_patched_through_the_ledger_and_undone_resolves_the_plan():
    layer, x = _layer(SPECS["nvfp4"]), _x()
    with torch.no_grad():
        before = layer(x)
        ledger = Ledger()
        ledger.patch_attr(layer, "compute", "fp8", "layer.compute")
        assert layer.plan.compute == "fp8"
        fp8 = layer(x)
        assert torch.equal(fp8, layer.format.linear(x, layer.qweight, layer.bias))  # q.compute == "fp8"
        assert not torch.equal(fp8, before)
        assert ledger.unwind().unfreed == []
        assert "compute" not in vars(layer) and layer.plan.compute is None
        assert torch.equal(layer(x), before)


def test_device_moves_resolve_the_plan_and_stale_facts_are_never_used():
    layer = _layer(SPECS["fp8+quarot"])
    cpu_plan = layer.plan
    moved = copy.deepcopy(layer).to("meta")
    assert moved.plan.device == torch.device("meta") and moved.plan.rotation == "quarot"
    assert moved.plan.facts_for(torch.empty(1)) is None  # an input elsewhere: decided per call
    assert cpu_plan.facts_for(torch.empty(1)) is cpu_plan.facts
    layer.to(torch.bfloat16)  # a dtype cast keeps the quantized tensors and the plan's content
    assert layer.plan == cpu_plan and layer.weight.dtype == torch.float8_e4m3fn


def test_load_state_dict_with_assign_resolves_the_plan():
    layer, other = _layer(SPECS["int8"]), _layer(SPECS["int8"], seed=5)
    state = {k: v.to("meta") for k, v in other.state_dict().items()}
    layer.load_state_dict(state, assign=True)
    assert layer.plan.device == torch.device("meta")


def test_a_bake_and_its_undo_need_no_new_plan():
    """A bake swaps buffer slots directly (and so does its undo): same names, shapes and device, so the plan stays
    valid and the forward reads the new tensors."""
    layer, x = _layer(SPECS["int8+hadanorm static"]), _x()
    plan = layer.plan
    with torch.no_grad():
        before = layer(x)
        ledger = Ledger()
        bake_layer(layer, torch.full((64, 256), 0.01), mode="standard", seed=0, where="l", ledger=ledger)
        baked = layer(x)
        assert not torch.equal(baked, before)
        assert torch.equal(baked, layer.format.linear(x, layer.qweight, layer.bias))
        assert ledger.unwind().unfreed == []
        assert layer.plan is plan and torch.equal(layer(x), before)


@pytest.mark.parametrize("name, compute", [("int8+convrot", None), ("fp8+quarot", None), ("nvfp4", "fp8"),
                                           ("nvfp4 per tensor", None), ("w4a8", None), ("svdquant_w4a4", None)])
def test_compiled_forward_is_one_graph_equal_to_eager(name, compute):
    layer, x = _layer(SPECS[name]), _x()
    layer.prepacked = layer.prepack()
    if compute is not None:
        layer.compute = compute
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(layer, backend="eager", fullgraph=True)(x)
        assert torch.equal(compiled, layer(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(SPECS))
def test_a_layer_left_on_another_device_computes_from_copies(name):
    """ComfyUI's partial load leaves layers it has no room for in host memory: the forward then copies the layer's
    tensors (and its LoRA factors) to the input's device for the call, and gives what the layer gives there."""
    from lowbit_pipe.lora.branches import LoraBranch, LoraStack

    layer, x = _layer(SPECS[name]), _x()
    gen = torch.Generator().manual_seed(9)
    layer.lora = LoraStack(256, 64)
    layer.lora.branches = (LoraBranch("style", torch.randn(4, 256, generator=gen) * 0.05,
                                      torch.randn(64, 4, generator=gen) * 0.05, alpha=4.0),)
    with torch.no_grad():
        assert torch.equal(layer._streamed(x), layer(x))


def test_the_forward_streams_only_a_layer_on_another_device(monkeypatch):
    monkeypatch.setattr(QuantLinear, "_streamed", lambda self, x: "streamed")
    layer, x = _layer(SPECS["int8"]), _x()
    assert isinstance(layer(x), torch.Tensor)
    assert copy.deepcopy(layer).to("meta")(x) == "streamed"
