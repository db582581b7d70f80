"""Ledger unit tests: every entry kind is undone, proven, and a leak or a lost patch is named."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch
from torch import nn

from lowbit_pipe.ledger import Ledger, tensor_bytes


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_swap_restores_the_original_and_proves_the_new_module_dead():
    net, ledger = _net(), Ledger()
    original = net[0]
    new = nn.Linear(8, 16)
    nbytes = tensor_bytes(new)
    ledger.swap_module(net, "0", new)
    assert net[0] is new and ledger.swapped() == ["0"] and ledger.original("0") is original
    ref = weakref.ref(new)
    del new
    report = ledger.unwind()
    assert net[0] is original
    assert ref() is None
    assert report.patches_restored == 1 and report.unfreed == [] and report.retained_bytes == 0
    assert report.bytes_freed == nbytes and report.proven


def test_a_leaked_reference_is_named_with_its_bytes_then_freed_on_a_second_teardown():
    net, ledger = _net(), Ledger()
    leak = nn.Linear(8, 16)
    nbytes = tensor_bytes(leak)
    ledger.swap_module(net, "0", leak)
    report = ledger.unwind()
    assert report.unfreed == [f"0 (Linear) (still referenced, {nbytes} bytes)"]
    assert report.retained_bytes == nbytes and report.bytes_freed == 0
    del leak
    again = ledger.unwind()  # idempotent: nothing to undo, the leak is re-checked
    assert again.unfreed == [] and again.retained_bytes == 0 and again.bytes_freed == nbytes
    assert "already torn down" in again.notes[0]


def test_patches_on_objects_classes_and_library_functions_are_restored_exactly():
    lib = types.ModuleType("fake_lib")
    lib.func = lambda x: x
    original_func = lib.func

    class Thing:
        def method(self):
            return "class"

    thing = Thing()
    net = _net()
    ledger = Ledger()
    assert ledger.patch_function(lib, "func", lambda x: 2 * x) is original_func
    ledger.patch_attr(thing, "method", lambda: "instance")  # shadows the class attribute
    ledger.patch_attr(Thing, "extra", 1)  # did not exist
    ledger.patch_attr(net, "forward", lambda x: x)
    assert lib.func(3) == 6 and thing.method() == "instance" and Thing.extra == 1
    report = ledger.unwind()
    assert lib.func is original_func
    assert thing.method() == "class" and "method" not in vars(thing)
    assert not hasattr(Thing, "extra")
    assert "forward" not in vars(net)
    assert report.patches_restored == 4 and report.unfreed == [] and report.errors == []
    assert report.undone == {"function_patch": 1, "attr_patch": 3}


def test_a_patch_someone_else_replaced_is_reported_and_their_value_kept():
    lib = types.ModuleType("fake_lib")
    lib.func = lambda: "original"
    ledger = Ledger()
    ledger.patch_function(lib, "func", lambda: "ours")
    theirs = lambda: "theirs"  # noqa: E731
    lib.func = theirs  # another tool patched on top of us
    report = ledger.unwind()
    assert lib.func is theirs
    assert report.unfreed == ["fake_lib.func (function_patch: undo failed)"]
    assert "changed by someone else" in report.errors[0] and report.patches_restored == 0


def test_an_undo_that_fails_is_named_and_unwinding_goes_on():
    net, ledger = _net(), Ledger()
    lib = types.ModuleType("fake_lib")
    lib.value = 1
    ledger.patch_attr(lib, "value", 2)
    ledger.swap_module(net, "2", nn.Linear(16, 4), keep_original="drop")
    report = ledger.unwind()
    assert lib.value == 1  # the earlier entry was still undone
    assert "2 (module_swap: undo failed)" in report.unfreed
    assert "dropped" in report.errors[0]


def test_hooks_are_removed_and_proven():
    net, ledger = _net(), Ledger()
    calls = []
    ledger.hook(net[0].register_forward_hook(lambda m, i, o: calls.append(1)), "0 (forward hook)")
    net(torch.randn(2, 8))
    report = ledger.unwind()
    net(torch.randn(2, 8))
    assert calls == [1] and len(net[0]._forward_hooks) == 0
    assert report.patches_restored == 1 and report.undone == {"hook": 1}


def test_caches_are_cleared_counted_and_an_unclearable_one_is_reported():
    store = {"h": torch.ones(64, 64)}
    stuck = {"x": torch.ones(8)}
    ledger = Ledger()
    ledger.cache("hadamard", store.clear, nbytes=64 * 64 * 4, is_empty=lambda: not store)
    ledger.cache("stuck", lambda: None, nbytes=32, is_empty=lambda: not stuck)
    ledger.cache("opaque", lambda: None, nbytes=None)
    report = ledger.unwind()
    assert store == {}
    by_name = {c["name"]: c for c in report.caches}
    assert by_name["hadamard"] == {"name": "hadamard", "bytes": 16384, "verified": True}
    assert by_name["opaque"]["bytes"] is None and not by_name["opaque"]["verified"]
    assert report.bytes_freed == 16384
    assert report.unfreed == ["stuck (cache: cache not empty after clear)"]


def test_owned_nested_containers_are_emptied_even_if_someone_holds_the_outer_one():
    ledger = Ledger()
    stats = {"layer.0": {"amax": torch.ones(128), "hist": [torch.ones(256), torch.ones(256)]}}
    ledger.own("calibration", stats)
    refs = [weakref.ref(stats["layer.0"]["amax"]), weakref.ref(stats["layer.0"]["hist"][1])]
    outer = stats  # a stale reference to the container: the tensors must still go
    del stats
    report = ledger.unwind()
    assert all(r() is None for r in refs) and outer == {}
    assert report.unfreed == [] and report.bytes_freed == (128 + 512) * 4


def test_hold_pops_the_parked_tensor_and_tensor_leaks_are_named():
    holder: dict = {"pool": [torch.zeros(1024)]}
    ledger = Ledger()
    ledger.hold("buffer pool", holder, "pool")
    scratch = torch.zeros(100)
    ledger.tensor("scratch", scratch)
    report = ledger.unwind()
    assert "pool" not in holder
    assert report.unfreed == ["scratch (still referenced, 400 bytes)"] and report.retained_bytes == 400
    assert report.bytes_freed == 4096


def test_patch_attr_refuses_submodules():
    with pytest.raises(TypeError, match="swap_module"):
        Ledger().patch_attr(_net(), "0", nn.Identity())


def test_a_model_the_user_already_dropped_tears_down_cleanly():
    net, ledger = _net(), Ledger()
    original_ref = weakref.ref(net[0])
    ledger.swap_module(net, "0", nn.Linear(8, 16))
    net_ref = weakref.ref(net)
    del net
    gc.collect()
    assert net_ref() is None  # the ledger does not keep the user's model alive
    assert original_ref() is not None  # it holds the original until teardown
    report = ledger.unwind()
    assert original_ref() is None and report.unfreed == [] and report.errors == []
