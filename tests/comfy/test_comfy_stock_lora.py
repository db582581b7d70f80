"""The stock-LoRA conversion (lowbit_pipe.comfy.stock_lora) without ComfyUI: a stand-in ModelPatcher whose
add_patches / set_injections / inject / eject behave as ComfyUI 0.29.0's (comfy/model_patcher.py), around a
small diffusion model with quantized (QuantLinear) and float layers. The same against the real ComfyUI, for every
export kind: tests/comfy/test_comfy_stock_lora_comfyui.py (slow)."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn

from lowbit_pipe.comfy import stock_lora, weight_patches
from lowbit_pipe.comfy.weight_patches import UnsupportedPatchError
from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.quant.nn import QuantLinear

GEN = torch.Generator().manual_seed(0)


class LoRAAdapter:
    """ComfyUI's low-rank adapter as a patch carries it: `name` and (up, down, alpha, mid, dora_scale, reshape)."""

    name = "lora"

    def __init__(self, up, down, alpha=None, dora=None):
        self.weights = (up, down, alpha, None, dora, None)


class LoKrAdapter:
    name = "lokr"

    def __init__(self):
        self.weights = (torch.ones(2, 2), torch.ones(2, 2))


class Patcher:
    """ComfyUI's ModelPatcher, the parts the conversion meets: add_patches (keys present in the model's state
    dict, entries (strength_patch, adapter, strength_model, offset, function)), injections and their inject /
    eject, clone() sharing the model and copying the dicts."""

    def __init__(self, model: nn.Module):
        self.model, self.patches, self.injections, self.is_injected = model, {}, {}, False
        self.load_device = self.offload_device = torch.device("cpu")

    def get_model_object(self, name: str) -> nn.Module:
        return self.model.get_submodule(name)

    def clone(self) -> "Patcher":
        n = Patcher(self.model)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.injections = {k: v.copy() for k, v in self.injections.items()}
        return n

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        sd, added = self.model.state_dict(), []
        for k in patches:
            key, offset, function = (k, None, None) if isinstance(k, str) else (k[0], k[1], k[2] if len(k) > 2 else None)
            if key in sd:
                added.append(k)
                self.patches.setdefault(key, []).append((strength_patch, patches[k], strength_model, offset, function))
        self.patches_uuid = uuid.uuid4()
        return added

    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        self.hook_patches = {hook: patches}
        return list(patches)

    def set_injections(self, key, injections):
        self.injections[key] = injections

    def inject_model(self) -> None:
        for items in self.injections.values():
            for i in items:
                i.inject(self)
        self.is_injected = True

    def eject_model(self) -> None:
        for items in self.injections.values():
            for i in items:
                i.eject(self)
        self.is_injected = False


class Tree(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = QuantLinear.from_linear(nn.Linear(64, 32), FormatSpec(format="int8"), where="q")
        self.qkv = QuantLinear.from_linear(nn.Linear(64, 96), FormatSpec(format="int8"), where="qkv")
        self.mod = QuantLinear.from_linear(nn.Linear(64, 32), FormatSpec(format="int8"), where="mod")
        self.f = nn.Linear(64, 32)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.diffusion_model = Tree()


@pytest.fixture
def patched_class():
    """The stand-in's add_patches wrapped as the registration wraps ComfyUI's, undone after the test."""
    ledger = Ledger()
    assert stock_lora.install(ledger, Patcher) == ["ModelPatcher.add_patches", "ModelPatcher.add_hook_patches"]
    assert stock_lora.install(ledger, Patcher) == []  # never wrapped twice
    yield Patcher
    report = ledger.unwind()
    assert report.patches_restored == 2 and report.errors == []
    assert not hasattr(Patcher.add_patches, "__wrapped__") and not hasattr(Patcher.add_hook_patches, "__wrapped__")


def _lora(out_f: int, in_f: int, rank: int = 4, alpha: float | None = 2.0) -> LoRAAdapter:
    return LoRAAdapter(torch.randn(out_f, rank, generator=GEN) * 0.1, torch.randn(rank, in_f, generator=GEN) * 0.1, alpha)


def _delta(a: LoRAAdapter) -> torch.Tensor:
    up, down, alpha = a.weights[:3]
    return up.double() @ down.double() * (alpha / down.shape[0] if alpha is not None else 1.0)


def _swap(t: torch.Tensor) -> torch.Tensor:
    shift, scale = t.chunk(2, dim=0)
    return torch.cat([scale, shift])


_swap.__module__, _swap.__name__ = "comfy.utils", "swap_scale_shift"  # what ComfyUI's FLUX key map carries


def test_patches_on_quantized_layers_become_exact_branches_and_float_ones_stay_comfyuis(patched_class):
    base = Patcher(Base())
    tree = base.model.diffusion_model
    x = torch.randn(5, 64, generator=GEN)
    with torch.no_grad():
        before = {n: tree.get_submodule(n)(x).double() for n in ("q", "qkv", "mod", "f")}
    q, f, mod = _lora(32, 64), _lora(32, 64), _lora(32, 64, alpha=None)
    parts = [_lora(32, 64, rank=3) for _ in range(3)]  # a diffusers q / k / v on a fused qkv: offsets on rows
    patches = {"diffusion_model.q.weight": q, "diffusion_model.f.weight": f,
               ("diffusion_model.mod.weight", None, _swap): mod, "diffusion_model.f.bias": (torch.ones(32),)}
    patches.update({("diffusion_model.qkv.weight", (0, 32 * i, 32)): p for i, p in enumerate(parts)})
    lora = base.clone()
    added = lora.add_patches(patches, 0.7)

    assert set(added) == set(patches)  # every key taken: none "NOT LOADED"
    assert set(lora.patches) == {"diffusion_model.f.weight", "diffusion_model.f.bias"}  # float: ComfyUI's
    assert lora.patches["diffusion_model.f.weight"][0][:2] == (0.7, f)
    assert base.patches == {} and base.injections == {}  # the MODEL given is untouched
    (label, items), = lora.injections.items()
    assert label.startswith(stock_lora.INJECTION_PREFIX) and set(items[0].stacks) == {"q", "qkv", "mod"}

    lora.inject_model()
    with torch.no_grad():
        got = {n: tree.get_submodule(n)(x).double() for n in ("q", "qkv", "mod", "f")}
    qkv_delta = torch.cat([_delta(p) for p in parts])
    for name, delta in (("q", _delta(q)), ("qkv", qkv_delta), ("mod", _swap(_delta(mod)))):
        want = before[name] + 0.7 * x.double() @ delta.T
        assert torch.allclose(got[name], want, rtol=1e-5, atol=1e-6), name
    assert torch.equal(got["f"], before["f"])  # no hook on float layers: ComfyUI patches their weight
    again = lora.clone()  # a clone shares the model and the injection: one set of hooks while injected
    again.inject_model()
    assert sum(len(tree.get_submodule(n)._forward_hooks) for n in ("q", "qkv", "mod")) == 3

    lora.eject_model()
    with torch.no_grad():
        assert all(torch.equal(tree.get_submodule(n)(x).double(), before[n]) for n in before)  # bit for bit
    assert all(not tree.get_submodule(n)._forward_hooks for n in before)
    assert items[0].injected() == 0


def test_two_loras_are_two_injections_with_keys_of_their_own(patched_class):
    base = Patcher(Base())
    first = base.clone()
    first.add_patches({"diffusion_model.q.weight": _lora(32, 64)}, 1.0)
    second = first.clone()
    second.add_patches({"diffusion_model.q.weight": _lora(32, 64)}, 0.5)
    # ComfyUI takes two clones with the same injection keys and no weight patches for the same weights: distinct
    # keys make it re-inject when it switches between them.
    assert len(first.injections) == 1 and len(second.injections) == 2 and set(first.injections) < set(second.injections)
    assert len(stock_lora.injections_of(second)) == 2


@pytest.mark.parametrize("adapter, why", [
    (LoKrAdapter(), "LoKrAdapter patch"),
    (("diff", (torch.zeros(32, 64),)), "full-weight 'diff' patch"),
    (LoRAAdapter(torch.ones(32, 2), torch.ones(2, 64), None, dora=torch.ones(32)), "DoRA"),
])
def test_a_patch_kind_a_branch_cannot_express_is_refused_naming_the_key(patched_class, adapter, why):
    base = Patcher(Base())
    lora = base.clone()
    patches = {"diffusion_model.f.weight": _lora(32, 64), "diffusion_model.q.weight": _lora(32, 64),
               "diffusion_model.mod.weight": adapter}
    with pytest.raises(UnsupportedPatchError, match=f"'diffusion_model.mod.weight', a {why}.*quantized"):
        lora.add_patches(patches, 1.0)
    assert lora.patches == {} and lora.injections == {}  # refused before anything changed
    lora.add_patches({"diffusion_model.f.weight": adapter}, 1.0)  # on a float layer: ComfyUI's to apply
    assert list(lora.patches) == ["diffusion_model.f.weight"] and lora.injections == {}


def test_other_weight_functions_and_strength_model_are_refused(patched_class):
    lora = Patcher(Base())
    with pytest.raises(UnsupportedPatchError, match="'diffusion_model.q.weight', a patch with a weight function"):
        lora.add_patches({("diffusion_model.q.weight", None, torch.neg): _lora(32, 64)})
    with pytest.raises(UnsupportedPatchError, match="'diffusion_model.q.weight', strength_model 0.5"):
        lora.add_patches({"diffusion_model.q.weight": _lora(32, 64)}, 1.0, 0.5)
    with pytest.raises(UnsupportedPatchError, match=r"'diffusion_model.qkv.weight', an offset \(0, 80, 32\)"):
        lora.add_patches({("diffusion_model.qkv.weight", (0, 80, 32)): _lora(32, 64)})


def test_read_patches_without_shapes_still_refuses_offsets():
    patches = {"diffusion_model.q.weight": [(1.0, _lora(32, 64), 1.0, (0, 0, 32), None)]}
    assert "offset" in weight_patches.read_patches(patches).other["diffusion_model.q.weight"]
    placed = weight_patches.read_patches(patches, lambda layer: (96, 64))
    (p,) = placed.low_rank["q"]
    assert p.up.shape == (96, 4) and torch.equal(p.up[32:], torch.zeros(64, 4))


def test_a_model_without_quantized_layers_goes_to_comfyui_untouched(patched_class):
    lora = Patcher(nn.Module())
    lora.model.diffusion_model = nn.Sequential(nn.Linear(4, 4))
    lora.add_patches({"diffusion_model.0.weight": _lora(4, 4)})
    assert list(lora.patches) == ["diffusion_model.0.weight"] and lora.injections == {}


def test_a_hook_lora_on_a_quantized_layer_is_refused_naming_the_key(patched_class):
    lora = Patcher(Base())
    assert lora.add_hook_patches("hook", {"diffusion_model.f.weight": _lora(32, 64)}) == ["diffusion_model.f.weight"]
    with pytest.raises(UnsupportedPatchError, match="hook LoRA.*'diffusion_model.q.weight'.*quantized"):
        lora.add_hook_patches("hook", {"diffusion_model.f.weight": _lora(32, 64), "diffusion_model.q.weight": _lora(32, 64)})
