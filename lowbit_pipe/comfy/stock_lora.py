"""ComfyUI's own LoRA loaders on a quantized MODEL: exact residual branches, never a LoRA rounded into the weights.

What stock ComfyUI (0.29.0) does. Its LoRA loaders ("Load LoRA" = LoraLoader, LoraLoaderModelOnly, and custom
loaders built on `comfy.sd.load_lora_for_models`) clone the MODEL and call `ModelPatcher.add_patches`: weight
patches, applied when ComfyUI loads the model (comfy/model_patcher.py `patch_weight_to_device`; dynamic VRAM:
comfy/ops.py's cast path). On a layer whose weight is a comfy-kitchen QuantizedTensor (a quantized file: stock
`float8_e4m3fn`, `int8_tensorwise`, `nvfp4`, ..., or a lowbit kind through this pack's layout) the weight is
dequantized, the LoRA delta added and the sum quantized again (`set_weight` -> `requantize_from_float`, scales
recomputed, stochastic rounding). A LoRA's delta is far below a 4-bit or 8-bit step, so what comes out is
mostly rounding noise: measured through a ComfyUI 0.29.0 server (CPU, tiny models), the LoRA's effect came
out 9x too strong (Krea 2, recipe `auto`: nvfp4 + int8), 5x too weak (nvfp4 + ConvRot, weight-only) and 2.5x
too strong (FLUX.1 `auto`: static fp8), with no warning. On this pack's own quantized layers (Quantize's
QuantLinear) the patch would land on packed codes.

What the pack does instead (`install`, called by the loader registration, `lowbit_pipe.comfy.registry`):
`ModelPatcher.add_patches` is wrapped (a function patch, recorded in the registration's ledger and restored
by `Registration.uninstall()`). The wrapper splits each call's patches:

- a patch on the weight of a quantized layer of the diffusion model (`is_quantized`) becomes an exact residual
  branch, y = layer(x) + strength * scale * B (A x) on the layer's input, the arithmetic of the pack's "LoRA
  residual (lowbit_pipe)" node (`lowbit_pipe.lora.branches.LoraStack`); the branches of one call are ONE
  ComfyUI injection (`ResidualInjection`) set on that MODEL under a key of its own (`set_injections`).
  ComfyUI injects it when it loads the MODEL (`patch_model` -> `inject_model`) and ejects it when it unloads
  it or loads another clone (`eject_model`): inject registers one forward hook per layer on the loaded
  diffusion model (layers found by name then, so a copy ComfyUI makes of the model gets its own), eject
  removes them. Nothing else changes: the weights, the MODEL's `patches` and every other MODEL are untouched.
- everything else (patches on float layers, on biases, on other models such as a text encoder) goes to
  ComfyUI's own `add_patches` as before: ComfyUI applies float patches exactly.
- a patch on a quantized weight that a branch cannot express (LoKr, LoHa, OFT, a full diff, DoRA, LoCon mid
  weights, a weight function other than ComfyUI's `swap_scale_shift`, `strength_model` != 1) refuses the whole
  call, naming the key, before anything changes: the LoRA loader node fails with that message.

`ModelPatcher.add_hook_patches` (ComfyUI's hook LoRAs, whose patches it applies to the weights at sampling time)
is wrapped too, to refuse, naming the key, a patch on a quantized layer (no branch form for those here).

State: the wrapper keeps none. Each injection keeps its branches (the LoRA's factors, which the loader's
patches held before) and, while injected, the hook handles per loaded model (by its id; removed at eject).
The key of each injection is unique, because ComfyUI takes two clones with the same injection keys and no
weight patches for the same weights (`clone_has_same_weights`) and would not re-inject between them.

No ComfyUI import: the patcher is reached through the methods ComfyUI calls (`add_patches`, `inject`,
`eject`) and the ones it offers (`get_model_object`, `set_injections`).
"""

from __future__ import annotations

import functools
import uuid
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.comfy import weight_patches
from lowbit_pipe.comfy.weight_patches import UnsupportedPatchError
from lowbit_pipe.kernels import reference
from lowbit_pipe.lora import branches as br

INJECTION_PREFIX = "lowbit_pipe_stock_lora."
_WRAPPER_MARK = "__lowbit_pipe_stock_lora__"

# What the Export node and the docs say about stock ComfyUI without this pack (the module doc's figures).
STOCK_LORA_NOTE = (
    "Without this node pack, ComfyUI's own LoRA loaders merge a LoRA into the quantized weights and round them "
    "again: measured through a ComfyUI 0.29.0 server, the LoRA's effect came out 9x too strong (Krea 2, recipe "
    "auto: nvfp4 + int8), 5x too weak (nvfp4 + ConvRot, weight-only) and 2.5x too strong (FLUX.1 auto: static "
    "fp8), with no warning. With the pack installed they become exact residual branches.")


def is_quantized(module: nn.Module) -> bool:
    """A layer whose weight a ComfyUI weight patch cannot change exactly: lowbit_pipe's QuantLinear, or ComfyUI's
    mixed-precision Linear holding a comfy-kitchen QuantizedTensor (stock kinds, and lowbit kinds loaded through
    the pack's layout)."""
    from lowbit_pipe.quant.nn import QuantLinear

    if isinstance(module, QuantLinear):
        return True
    try:
        from comfy_kitchen.tensor import QuantizedTensor
    except ImportError:  # no comfy-kitchen: no ComfyUI-quantized layers either
        return False
    return isinstance(getattr(module, "_parameters", {}).get("weight"), QuantizedTensor)


def _key(patch_key: Any) -> str:
    return patch_key if isinstance(patch_key, str) else patch_key[0]


def _tree(patcher: Any) -> nn.Module | None:
    try:
        tree = patcher.get_model_object("diffusion_model")
    except (AttributeError, KeyError):
        return None
    return tree if isinstance(tree, nn.Module) else None


def _layer(tree: nn.Module, name: str) -> nn.Module | None:
    try:
        return tree.get_submodule(name)
    except AttributeError:
        return None


def quantized_targets(patcher: Any, patches: dict) -> dict[Any, str]:
    """{patch key: native layer name} of the `add_patches` keys that target the weight of a quantized layer of
    `patcher`'s diffusion model."""
    tree = _tree(patcher)
    if tree is None:
        return {}
    out = {}
    for k in patches:
        layer = weight_patches._layer_of(_key(k))
        module = _layer(tree, layer) if layer is not None else None
        if module is not None and is_quantized(module):
            out[k] = layer
    return out


class ResidualInjection:
    """One stock-LoRA call's branches on quantized layers, as a ComfyUI injection (`inject` / `eject` with the
    ModelPatcher, what ComfyUI's `PatcherInjection` has): a forward hook per layer adding its LoraStack's delta."""

    def __init__(self, stacks: dict[str, br.LoraStack], label: str):
        self.stacks = stacks  # native layer name -> LoraStack (not a submodule of any model)
        self.label = label
        self._hooks: dict[int, tuple[Any, list[Any]]] = {}  # id(loaded BaseModel) -> (its weakref, hook handles)

    def inject(self, patcher: Any) -> None:
        model = patcher.model
        if id(model) in self._hooks and self._hooks[id(model)][0]() is model:
            return
        tree = model.diffusion_model  # after ComfyUI's object patches (patch_model sets them before injecting)
        device = getattr(patcher, "load_device", None)
        handles = []
        try:
            for name, stack in self.stacks.items():
                layer = tree.get_submodule(name)
                if device is not None and stack.down is not None and stack.down.device != torch.device(device):
                    stack.to(device)
                handles.append(layer.register_forward_hook(functools.partial(_add_delta, stack), with_kwargs=True))
        except BaseException:
            for h in handles:
                h.remove()
            raise
        self._hooks[id(model)] = (weakref.ref(model), handles)

    def eject(self, patcher: Any) -> None:
        entry = self._hooks.pop(id(patcher.model), None)
        if entry is None:
            return
        for h in entry[1]:
            h.remove()
        offload = getattr(patcher, "offload_device", None)
        if offload is not None and not self.injected():  # the factors leave the GPU with the model, as ComfyUI's do
            for stack in self.stacks.values():
                if stack.down is not None and stack.down.device != torch.device(offload):
                    stack.to(offload)

    def injected(self) -> int:
        """How many loaded models carry this injection's hooks now."""
        return sum(1 for ref, _ in self._hooks.values() if ref() is not None)

    def __repr__(self) -> str:
        return f"ResidualInjection({self.label}: {len(self.stacks)} layers)"


def _add_delta(stack: br.LoraStack, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else kwargs["input"]
    down, up = stack.down, stack.up
    if down.device != x.device:  # the model runs on another device than the one it was injected for
        down, up = down.to(x.device), up.to(x.device)
    return output + reference.low_rank_delta(x, down, up)


def injection_for(patcher: Any, patches: dict, strength_patch: float = 1.0, strength_model: float = 1.0,
                  targets: dict[Any, str] | None = None) -> ResidualInjection:
    """The residual branches of `add_patches(patches, strength_patch, strength_model)`'s patches on quantized
    layers (`targets`, default `quantized_targets`); UnsupportedPatchError naming the first key a branch cannot
    express."""
    from lowbit_pipe.lora.apply import model_dtype

    tree = _tree(patcher)
    targets = quantized_targets(patcher, patches) if targets is None else targets
    as_patches: dict[str, list[tuple]] = {}
    for k, layer in targets.items():
        offset, function = (k[1], k[2] if len(k) > 2 else None) if not isinstance(k, str) else (None, None)
        as_patches.setdefault(_key(k), []).append((strength_patch, patches[k], strength_model, offset, function))

    def shape_of(layer: str) -> tuple[int, int] | None:
        module = _layer(tree, layer)
        out_f, in_f = getattr(module, "out_features", None), getattr(module, "in_features", None)
        return (int(out_f), int(in_f)) if isinstance(out_f, int) and isinstance(in_f, int) else None

    found = weight_patches.read_patches(as_patches, shape_of)
    if found.other:
        key, why = next(iter(found.other.items()))
        raise UnsupportedPatchError(
            f"lowbit_pipe: the LoRA puts a ComfyUI weight patch on '{key}', {why}, and that layer is quantized: "
            f"ComfyUI would round it into the quantized weight, and an exact residual branch cannot express it "
            f"({len(found.other)} such key{'s' if len(found.other) > 1 else ''}). Use a plain LoRA there, or the float "
            "model")
    dtype = model_dtype(tree)
    label = f"{INJECTION_PREFIX}{uuid.uuid4().hex[:12]}"
    stacks = {}
    for layer, items in found.low_rank.items():
        out_f, in_f = shape_of(layer)
        stack = br.LoraStack(in_f, out_f)
        # The factors in the model's dtype, with alpha (rank without one: ComfyUI's scale 1) and the strength: the
        # stack folds strength * alpha / rank into `up` in fp32, the LoRA residual node's arithmetic to the bit.
        stack.branches = tuple(
            br.LoraBranch(f"{label}#{i}", p.down.to(dtype), p.up.to(dtype),
                          p.alpha if p.alpha is not None else float(p.down.shape[0]), p.strength,
                          f"ComfyUI patch {weight_patches.PREFIX}{layer}.weight")
            for i, p in enumerate(items))
        stacks[layer] = stack
    return ResidualInjection(stacks, label)


def add_patches_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """`ModelPatcher.add_patches` with the patches on quantized layers turned into a ResidualInjection."""

    @functools.wraps(original)
    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        targets = quantized_targets(self, patches) if isinstance(patches, dict) else {}
        if not targets:
            return original(self, patches, strength_patch, strength_model)
        injection = injection_for(self, patches, strength_patch, strength_model, targets)  # refuses before changes
        rest = {k: v for k, v in patches.items() if k not in targets}
        added = list(original(self, rest, strength_patch, strength_model)) if rest else []
        self.set_injections(injection.label, [injection])
        return added + list(targets)

    setattr(add_patches, _WRAPPER_MARK, True)
    return add_patches


def add_hook_patches_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """`ModelPatcher.add_hook_patches` refusing weight patches on quantized layers: ComfyUI's hook LoRAs apply their
    patches to the weights at sampling time (`patch_hook_weight_to_device`), which on a quantized layer rounds them
    into it (this pack's QuantLinear: into its packed codes, silently); no branch form exists for them here."""

    @functools.wraps(original)
    def add_hook_patches(self, hook, patches, strength_patch=1.0, strength_model=1.0):
        targets = quantized_targets(self, patches) if isinstance(patches, dict) else {}
        if targets:
            key = _key(next(iter(targets)))
            raise UnsupportedPatchError(
                f"lowbit_pipe: a hook LoRA (weights ComfyUI patches at sampling time) puts a patch on '{key}', and that "
                f"layer is quantized ({len(targets)} such key{'s' if len(targets) > 1 else ''}): ComfyUI would round "
                "it into the quantized weight. Load the LoRA with a LoRA loader node instead (exact residual branches)")
        return original(self, hook, patches, strength_patch, strength_model)

    setattr(add_hook_patches, _WRAPPER_MARK, True)
    return add_hook_patches


def install(ledger: Any, model_patcher_class: type) -> list[str]:
    """Wrap `model_patcher_class.add_patches` (ComfyUI's `comfy.model_patcher.ModelPatcher`) and, where it has it,
    `add_hook_patches`, each recorded in `ledger`; the names wrapped. None (nothing changed) where it has no
    `add_patches` / `set_injections`, or carries the wrapper already."""
    add = getattr(model_patcher_class, "add_patches", None)
    if not callable(add) or not callable(getattr(model_patcher_class, "set_injections", None)):
        return []
    if getattr(add, _WRAPPER_MARK, False):
        return []
    ledger.patch_function(model_patcher_class, "add_patches", add_patches_wrapper(add))
    wrapped = ["ModelPatcher.add_patches"]
    hook = getattr(model_patcher_class, "add_hook_patches", None)
    if callable(hook):
        ledger.patch_function(model_patcher_class, "add_hook_patches", add_hook_patches_wrapper(hook))
        wrapped.append("ModelPatcher.add_hook_patches")
    return wrapped


def injections_of(patcher: Any) -> list[ResidualInjection]:
    """The stock-LoRA injections a MODEL carries (its own and those its clones inherited)."""
    out = []
    for key, items in (getattr(patcher, "injections", None) or {}).items():
        if str(key).startswith(INJECTION_PREFIX):
            out += [i for i in items if isinstance(i, ResidualInjection)]
    return out
