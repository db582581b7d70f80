"""The MODELs (ComfyUI ModelPatchers) the nodes hand out, and letting ComfyUI's model management go of them.

A node's MODEL is a MODEL of its own: a clone of the one it was given, around a new BaseModel that is a
shallow copy of the upstream one (same config, sampling object and other children) whose `diffusion_model` is
the node's tree, and which carries none of ComfyUI's loading state yet. ComfyUI loads and unloads it as the
separate model it is, the way it does a quantized file opened with Load Diffusion Model.

Why not an object patch on a clone (ComfyUI's usual way to swap a submodule): clones share one BaseModel and
its loading state. With dynamic VRAM (comfy-aimdo, ComfyUI's default on a GPU since 0.2x) loading records
every parameter and buffer of the patched-in tree to restore later, and unloading takes the object patch off
first, then restores those records into the upstream float tree: a quantized layer's `weight` buffer onto a
float Linear, "KeyError: attribute 'weight' already exists" (ComfyUI 0.29 on the H200, in Purge's unload).

A MODEL whose tree holds lowbit_pipe's QuantLinear layers (Quantize's, and the nodes' MODELs made from it) is a
plain ModelPatcher, never a dynamic-VRAM one: dynamic VRAM streams ComfyUI's own layers (`comfy_cast_weights`)
through its cache on the GPU and copies every other tensor (QuantLinear's buffers) again from its host backup at
each load, that is at each queue: 1.1-1.2 s a queue for the full-size Krea 2 in fp8 or int8 on the H100 (840
pageable host-to-device copies, ~12 GB), 0.8 s in krea2_nvfp4, against ~0.05 s for stock ComfyUI's own fp8 file.
A plain patcher moves the tree to the GPU once and keeps it there until ComfyUI needs the memory back (short of
memory, a layer it leaves in host memory computes from copies: QuantLinear._streamed). A tree of ComfyUI's own
layers (a quantized file, LoRA branches on it) keeps the upstream patcher's kind.

Every MODEL of one node run carries the run's id as ComfyUI's `clone_base_uuid`, so "unload a model and its
clones" before a Purge lets go of all of them and of nothing else. A MODEL's `cached_patcher_init` (how ComfyUI
rebuilds a model: a non-dynamic delegate when conditioning has hooks, a copy per GPU) rebuilds this MODEL
around a structural copy of the same tree, never the float file the upstream MODEL was loaded from.
"""

from __future__ import annotations

import copy
import inspect
import uuid
from typing import Any

from torch import nn

from lowbit_pipe.comfy import node_runs
from lowbit_pipe.quant.nn import QuantLinear

# What ComfyUI's patchers keep on the model they load (ModelPatcher / ModelPatcherDynamic __init__ and load):
# a new BaseModel starts without it; the patcher's constructor sets it up afresh.
_LOADING_STATE = ("model_loaded_weight_memory", "lowvram_patch_counter", "model_lowvram",
                  "current_weight_patches_uuid", "model_offload_buffer_memory", "dynamic_vbars", "dynamic_pins")
# BaseModel's own attributes the patchers set, which ComfyUI reads without a default: reset, not removed.
_RESET = {"device": None, "current_patcher": None}
# ModelPatcher.__init__'s values for the above, for ComfyUIs whose clone() takes no model_override.
_INITIAL_STATE = {"model_loaded_weight_memory": 0, "lowvram_patch_counter": 0, "model_lowvram": False,
                  "current_weight_patches_uuid": None, "model_offload_buffer_memory": 0}


def model_with_tree(model: Any, tree: nn.Module, clone_id: uuid.UUID, patches: dict | None = None) -> Any:
    """A MODEL like `model` (its options, wrappers, patches) around its own BaseModel holding `tree`.
    `patches`: the weight patches the new MODEL keeps (default: `model`'s)."""
    out = _clone_onto(model, _base_with(model.model, tree))
    out.object_patches.pop("diffusion_model", None)  # an upstream object patch would hide `tree`
    if patches is not None and patches != model.patches:
        out.patches = patches
        out.patches_uuid = uuid.uuid4()  # ComfyUI reloads a model whose patch set changed by this id
    out.clone_base_uuid = clone_id
    out.cached_patcher_init = (_rebuild, (out.model, type(out), out.load_device, out.offload_device))
    return out


def _base_with(base: nn.Module, tree: nn.Module) -> nn.Module:
    shell = copy.copy(base)  # a new object; its __dict__ a shallow copy, the dicts inside still shared: replaced
    for key, value in base.__dict__.items():
        if isinstance(value, (dict, list, set)) and key not in _LOADING_STATE:
            shell.__dict__[key] = copy.copy(value)
    shell._modules["diffusion_model"] = tree
    for key in _LOADING_STATE:
        shell.__dict__.pop(key, None)
    for key, value in _RESET.items():
        if key in shell.__dict__:
            shell.__dict__[key] = value
    return shell


def _clone_onto(model: Any, shell: nn.Module) -> Any:
    fresh = ({}, {}, {}, set())  # backup, backup_buffers, object_patches_backup, pinned: nothing loaded yet
    params = inspect.signature(model.clone).parameters
    if "model_override" in params:  # the constructor sets up `shell`
        plain = "disable_dynamic" in params and any(isinstance(m, QuantLinear) for m in shell.diffusion_model.modules())
        out = model.clone(model_override=(shell, fresh), **({"disable_dynamic": True} if plain else {}))
    else:
        out = model.clone()
        out.model = shell
        for name, value in zip(("backup", "backup_buffers", "object_patches_backup", "pinned"), fresh):
            if hasattr(out, name):
                setattr(out, name, value)
        shell.device = getattr(out, "offload_device", None)
        for name, value in _INITIAL_STATE.items():
            setattr(shell, name, value)
    out.size = 0  # measured again (the quantized tree's bytes) when ComfyUI asks
    return out


def _rebuild(base: nn.Module, patcher_class: type, load_device: Any, offload_device: Any,
             disable_dynamic: bool = False) -> Any:
    """ComfyUI's model factory for a node's MODEL: a new BaseModel around a structural copy of its tree, which
    the run adopts (a Purge seals it too)."""
    from comfy.model_patcher import ModelPatcher

    from lowbit_pipe.comfy.tree import structural_copy

    tree = base.diffusion_model
    node_runs.check_usable(tree, "rebuilding a lowbit_pipe MODEL")
    copied = structural_copy(tree)
    state = node_runs.state_of(tree)
    if state is not None:
        node_runs.set_state(copied, state)
    cls = ModelPatcher if disable_dynamic else patcher_class
    return cls(_base_with(base, copied), load_device, offload_device)


def release_weights(model: Any) -> None:
    """Make the model ComfyUI shares between clones hold its own weights before a node copies them: ComfyUI
    applies a clone's weight patches (a LoRA) to the shared module when it loads that clone, and keeps them
    there while loaded. A copy taken then would carry another MODEL's LoRA."""
    base = getattr(model, "model", None)
    if getattr(base, "current_weight_patches_uuid", None) is None and not getattr(base, "model_lowvram", False):
        return
    unload_from_comfy(model)


def unload_from_comfy(model: Any) -> None:
    """Unload `model` and its clones through ComfyUI's model management (its bookkeeping then agrees: nothing
    of ours stays patched in or counted as loaded); every model on older ComfyUIs without the targeted call."""
    try:
        import comfy.model_management as mm
    except ImportError:  # not inside ComfyUI (tests with stand-in MODELs)
        return
    unload = getattr(mm, "unload_model_and_clones", None)
    if callable(unload) and hasattr(model, "clone_base_uuid"):
        unload(model, all_devices=True)
    else:
        mm.unload_all_models()
    mm.soft_empty_cache()
