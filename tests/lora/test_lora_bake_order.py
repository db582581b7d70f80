"""Baked adapters (DoRA / dense parts) come off in any order: each layer is then exactly a fresh bake of the
adapters still attached (in attach order) onto the pristine weights; with none left, the pristine tensors.

Oracle: a fresh copy of the same (quantized) model with only the remaining adapter attached.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lowbit_pipe import api, lora
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora import LoraError

Q, UP, K = "transformer_blocks.0.attn.to_q", "transformer_blocks.0.ff.up", "transformer_blocks.0.attn.to_k"
BAKED = (Q, UP)


def _adapters(model) -> dict[str, dict[str, torch.Tensor]]:
    """a: DoRA on to_q, dense diff on ff.up, a residual LoRA on to_k; b: dense on to_q, DoRA on ff.up."""
    gen = torch.Generator().manual_seed(0)

    def w(name):
        layer = model.get_submodule(name)
        return layer.dequantize() if hasattr(layer, "dequantize") else layer.weight.detach()

    def rnd(*shape, scale=0.05):
        return torch.randn(*shape, generator=gen) * scale

    q, up, k = (f"transformer.{n}" for n in (Q, UP, K))
    wq, wup = w(Q), w(UP)
    a = {f"{q}.lora_A.weight": rnd(4, 256), f"{q}.lora_B.weight": rnd(256, 4),
         f"{q}.dora_scale": wq.norm(dim=1, keepdim=True) * 1.05,
         f"{up}.diff": rnd(*wup.shape, scale=0.3 * float(wup.abs().max())),
         f"{k}.lora_A.weight": rnd(4, 256), f"{k}.lora_B.weight": rnd(128, 4)}
    b = {f"{q}.diff": rnd(*wq.shape, scale=0.3 * float(wq.abs().max())),
         f"{up}.lora_A.weight": rnd(4, 256), f"{up}.lora_B.weight": rnd(wup.shape[0], 4),
         f"{up}.dora_scale": wup.norm(dim=1, keepdim=True) * 0.95}
    return {"a": a, "b": b}


def _tensors(model, name: str) -> dict[str, torch.Tensor]:
    layer = model.get_submodule(name)
    return {k: t for k, t in {**layer._parameters, **layer._buffers}.items() if t is not None}


def _attach(model, sd, name, strength, ledger=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "baked into the weight" warnings
        return lora.attach(model, sd, name=name, strength=strength, ledger=ledger)


STRENGTH = {"a": 0.9, "b": 0.6}


def _setup(tiny_model, fmt, ledger=None):
    model = tiny_model("krea2")
    if fmt is not None:
        api.quantize(model, {"default": {"format": fmt}}, ledger=ledger)
    return model


@pytest.mark.parametrize("fmt", ["int8", None])
@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_removal_in_any_order_equals_a_fresh_bake_of_the_rest(tiny_model, fmt, order):
    ledger = Ledger()
    model = _setup(tiny_model, fmt, ledger)
    reference = copy.deepcopy(model)  # same quantization, no LoRA
    pristine = {n: _tensors(model, n) for n in BAKED}
    sds = _adapters(model)
    handles = {n: _attach(model, sds[n], n, STRENGTH[n], ledger) for n in ("a", "b")}
    assert sorted(handles["a"].baked) == sorted(handles["b"].baked) == sorted(BAKED)
    for n in BAKED:
        assert not torch.equal(_tensors(model, n)["weight"], pristine[n]["weight"])

    first, second = order
    lora.remove(model, first)
    fresh = copy.deepcopy(reference)
    _attach(fresh, sds[second], second, STRENGTH[second])
    for n in BAKED:
        now, want = _tensors(model, n), _tensors(fresh, n)
        assert now.keys() == want.keys()
        for k in want:
            assert torch.equal(now[k], want[k]), f"{n}.{k} after removing '{first}' is not a fresh bake of '{second}'"
    assert list(lora.attached(model)) == [second]

    lora.remove(model, second)
    for n in BAKED:
        assert all(_tensors(model, n)[k] is t for k, t in pristine[n].items()), n  # the pristine objects themselves
    assert not lora.attached(model)
    del handles  # the test's own references; teardown proves the stacks die
    report = ledger.unwind()
    assert not report.errors and not any("lora" in u.lower() for u in report.unfreed), report.as_dict()


def test_three_adapters_middle_one_first(tiny_model):
    """a, b, c baked into the same layers; remove b, then a: what stays is a fresh bake of c; then a, c."""
    model = _setup(tiny_model, "int8")
    reference = copy.deepcopy(model)
    sds = _adapters(model)
    sds["c"] = {k: v * 0.5 if k.endswith("diff") or k.endswith("lora_B.weight") else v for k, v in sds["a"].items()}
    for n, s in (("a", 0.9), ("b", 0.6), ("c", 0.7)):
        _attach(model, sds[n], n, s)
    lora.remove(model, "b")
    fresh = copy.deepcopy(reference)
    _attach(fresh, sds["a"], "a", 0.9)
    _attach(fresh, sds["c"], "c", 0.7)
    for n in BAKED:
        assert all(torch.equal(_tensors(model, n)[k], t) for k, t in _tensors(fresh, n).items()), n


def test_reweighting_a_baked_adapter_equals_a_fresh_bake_at_that_strength(tiny_model):
    model = _setup(tiny_model, "int8")
    reference = copy.deepcopy(model)
    sds = _adapters(model)
    _attach(model, sds["a"], "a", 0.9)
    handle = _attach(model, sds["b"], "b", 0.6)
    handle.set_strength(0.3)
    lora.set_strength(model, "a", 0.4)
    fresh = copy.deepcopy(reference)
    _attach(fresh, sds["a"], "a", 0.4)
    _attach(fresh, sds["b"], "b", 0.3)
    for n in BAKED + (K,):
        want = _tensors(fresh, n)
        assert all(torch.equal(_tensors(model, n)[k], t) for k, t in want.items()), n
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model.get_submodule(K)(x), fresh.get_submodule(K)(x))  # the residual branch too


def test_a_layer_changed_since_the_bake_is_refused_not_clobbered(tiny_model):
    """bake_files after a baked adapter: removing the adapter would drop that bake silently, so it raises."""
    model = _setup(tiny_model, "int8")
    sds = _adapters(model)
    _attach(model, sds["a"], "a", 0.9)
    lora.bake_files(model, [(sds["b"], 1.0)])
    before = {n: _tensors(model, n) for n in BAKED}
    with pytest.raises(LoraError, match=r"cannot remove LoRA 'a': layer 'transformer_blocks\.0\.(attn\.to_q|ff\.up)' "
                                        r"was changed"):
        lora.remove(model, "a")
    assert list(lora.attached(model)) == ["a"]  # nothing changed
    assert all(_tensors(model, n)[k] is t for n in BAKED for k, t in before[n].items())


def test_teardown_after_an_out_of_order_removal_restores_the_pristine_tensors(tiny_model):
    ledger = Ledger()
    model = _setup(tiny_model, "int8", ledger)
    layers = {n: model.get_submodule(n) for n in BAKED}  # the QuantLinears (teardown swaps the float ones back)
    pristine = {n: _tensors(model, n) for n in BAKED}
    sds = _adapters(model)
    _attach(model, sds["a"], "a", 0.9, ledger)
    _attach(model, sds["b"], "b", 0.6, ledger)
    lora.remove(model, "a")  # b stays, baked again onto the pristine tensors
    report = ledger.undo_all()
    assert not report.errors and not report.unfreed, report.as_dict()
    for n, layer in layers.items():
        assert all({**layer._parameters, **layer._buffers}[k] is t for k, t in pristine[n].items()), n
    assert not hasattr(model, "_lowbit_lora")
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in BAKED)
