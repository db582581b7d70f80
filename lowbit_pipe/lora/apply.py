"""attach / remove / set_strength / bake_files: LoRA files onto a (quantized) model.

    handle = attach(model, "style.safetensors", strength=0.8)
    handle.set_strength(0.5)   # exact: the branches' scale changes (baked parts are baked again)
    handle.remove()            # every layer back to what the other adapters alone give
    # handle.set_strength / handle.remove on a removed handle raise LoraRemovedError

A model keeps a registry `model._lowbit_lora` {adapter name: LoraHandle}, so remove and
re-weight find every stack of an adapter, including the mirror stacks on the float originals
the ledger holds for quantized layers (why: evaluate's float reference swaps those originals
back in, and must then run float + LoRA, to compare like with like). The module functions
`remove(model, name)` / `set_strength(model, name, s)` do the same as the handle's methods.

Baked parts (DoRA, dense `diff`) are kept per layer as a `LayerBakes`: the layer's tensors before
the first adapter baked into it, and the adapters baked since, in attach order. Removing or
re-weighting one restores those tensors and bakes the others again, so in any order a layer
equals a fresh bake of the adapters still attached, and is bit for bit its pre-LoRA self once
none is left. Every tensor swap goes through the ledger when there is one.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lowbit_pipe.lora import branches as br
from lowbit_pipe.lora.bake import _replace, bake_group, bake_layer, check_bakeable
from lowbit_pipe.lora.files import LayerFactors, LoraData, LoraError, check_matched, parse_lora
from lowbit_pipe.quant.nn import QuantLinear

REGISTRY = "_lowbit_lora"


class LoraRemovedError(LoraError):
    """A LoraHandle used after its adapter came off the model (remove, or a ledger teardown)."""


@dataclass
class BakedAdapter:
    """One adapter's non-residual parts (DoRA / dense) on one layer, at its strength."""

    name: str
    factors: list[LayerFactors]
    strength: float


@dataclass
class LayerBakes:
    """The adapters baked into one layer (attach order) and the layer's tensors before the first of them."""

    module: str
    pristine: dict[str, torch.Tensor | None]  # the layer's parameters and buffers before any adapter bake
    adapters: list[BakedAdapter] = field(default_factory=list)
    written: dict[str, torch.Tensor | None] = field(default_factory=dict)  # what the last bake left in the layer


@dataclass(eq=False)
class LoraHandle:
    """What one attached adapter did; `set_strength(s)` and `remove()` act on it."""

    name: str
    source: str
    strength: float
    layers: list[str] = field(default_factory=list)  # residual branches (diffusers module names)
    baked: list[str] = field(default_factory=list)  # layers its DoRA / dense parts were baked into
    ranks: list[int] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # warnings (unmatched keys with strict=False)
    # (where, weakref to its LoraStack), incl. float-original mirrors: weak, so a handle kept past a teardown or
    # a layer swap never keeps a stack (and its factors) alive; `live_stacks()` gives the ones still there
    stacks: list[tuple[str, weakref.ref]] = field(default_factory=list)
    bakes: dict[str, LayerBakes] = field(default_factory=dict, repr=False)  # per baked layer (shared with others)
    ledger: Any = None
    rslora: bool = False
    removed: bool = False
    model_ref: Any = field(default=None, repr=False)  # weakref to the model it is attached to

    def live_stacks(self) -> list[tuple[str, br.LoraStack]]:
        return [(where, stack) for where, stack in ((w, ref()) for w, ref in self.stacks) if stack is not None]

    def figures(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "strength": self.strength, "layers": len(self.layers),
                "baked_layers": len(self.baked), "ranks": self.ranks, "alphas": self.alphas, "rslora": self.rslora,
                "skipped": self.skipped}

    @property
    def attached(self) -> bool:
        model = self.model_ref() if self.model_ref is not None else None
        return not self.removed and model is not None and registry(model).get(self.name) is self

    def _model(self) -> nn.Module:
        """The model this adapter is attached to, or LoraRemovedError saying why it is not."""
        if self.removed:
            raise LoraRemovedError(f"LoRA '{self.name}' ({self.source}) was removed from its model; attach the file "
                                   "again for a new handle")
        model = self.model_ref() if self.model_ref is not None else None
        if model is None:
            raise LoraRemovedError(f"LoRA '{self.name}' ({self.source}): the model it was attached to is gone")
        if registry(model).get(self.name) is not self:
            raise LoraRemovedError(f"LoRA '{self.name}' ({self.source}) is no longer attached to its model (removed, "
                                   "or taken off by a ledger teardown); attach the file again for a new handle")
        return model

    def set_strength(self, strength: float) -> None:
        """Re-weight this adapter: residual branches exactly (their scale changes, nothing is requantized);
        baked parts are baked again from the layer's pre-LoRA tensors, as a fresh attach at `strength` would."""
        _reweight(self._model(), self, strength)

    def remove(self) -> None:
        """Take this adapter off: its branches go; layers it baked into become a fresh bake of the adapters
        still attached (bit for bit their pre-LoRA tensors when none is left). The handle is then dead."""
        _detach(self._model(), self)


def registry(model: nn.Module, ledger=None, create: bool = False) -> dict[str, LoraHandle]:
    reg = model.__dict__.get(REGISTRY)
    if reg is None and create:
        reg = {}
        if ledger is not None:
            ledger.patch_attr(model, REGISTRY, reg, name=f"{type(model).__name__}.{REGISTRY}")
        else:
            setattr(model, REGISTRY, reg)
    return reg if reg is not None else {}


def resolve_arch(model: nn.Module, arch: Any) -> Any:
    """The Arch to map LoRA names with: given, by id, or detected (by class, or by keys for a natively named
    model such as a ComfyUI diffusion model); None: generic names."""
    from lowbit_pipe.arch import detect_module, get_arch

    if isinstance(arch, str):
        return None if arch == "generic" else get_arch(arch)
    if arch is not None:
        return arch
    found = detect_module(model)
    return found.arch if found is not None else None


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype LoRA factors are kept in: the model's first plain float parameter's. Quantized weights
    (comfy-kitchen QuantizedTensors, which report a float dtype) and fp8 storage (ComfyUI's weight-only
    fp8, cast per call) say nothing about the compute dtype; without a plain one, float32. The branch
    runs in its input's dtype whatever this is (reference.low_rank_delta)."""
    for p in model.parameters():
        if p.dtype in COMPUTE_DTYPES and type(p.data) is torch.Tensor:
            return p.dtype
    return torch.float32


def load(model: nn.Module, path_or_state: str | Path | Mapping[str, torch.Tensor], *, arch: Any = None,
         config: Any = None, strict: bool = True, alpha: float | None = None) -> tuple[LoraData, list[str]]:
    """Parse and map a LoRA onto `model`; (data, warnings). Strict: unmatched keys raise LoraError."""
    arch = resolve_arch(model, arch)
    data = parse_lora(path_or_state, model, arch=arch, config=config, alpha=alpha)
    problems = check_matched(data, strict)
    for line in problems:
        warnings.warn(line, stacklevel=3)
    return data, problems


def _by_layer(layers: list[LayerFactors]) -> dict[str, list[LayerFactors]]:
    out: dict[str, list[LayerFactors]] = {}
    for f in layers:
        out.setdefault(f.module, []).append(f)
    return out


def _branch(name: str, factors: list[LayerFactors], strength: float, source: str, dtype: torch.dtype,
            device: torch.device) -> br.LoraBranch:
    """One branch per adapter and layer; several factors for one layer (e.g. diffusers and native names in one
    file) concatenate along the rank with their scale (alpha / rank, or alpha / sqrt(rank)) folded into `up`."""
    if len(factors) == 1:
        f = factors[0]
        return br.LoraBranch(name, f.down.to(device, dtype), f.up.to(device, dtype), f.alpha, strength, source,
                             f.rslora)
    down = torch.cat([f.down.float() for f in factors], dim=0)
    up = torch.cat([f.up.float() * f.scale for f in factors], dim=1)
    return br.LoraBranch(name, down.to(device, dtype), up.to(device, dtype), float(down.shape[0]), strength, source)


def attach(model: nn.Module, path_or_state: str | Path | Mapping[str, torch.Tensor], *, strength: float = 1.0,
           name: str | None = None, arch: Any = None, config: Any = None, ledger=None, strict: bool = True,
           alpha: float | None = None, dtype: torch.dtype | None = None) -> LoraHandle:
    """Attach a LoRA as exact residual branches: y = Q(W) x + strength * scale * B (A x), scale = alpha / rank
    (alpha / sqrt(rank) for rslora). Returns the handle: `handle.set_strength(s)`, `handle.remove()`.

    Adapter parts that cannot be a residual (DoRA, dense `diff`) are baked (nearest rounding) with a
    warning naming the layer. With a ledger every change is recorded and teardown takes it off again.
    """
    source = str(path_or_state) if not isinstance(path_or_state, Mapping) else "<state dict>"
    name = name or (Path(source).stem if not isinstance(path_or_state, Mapping) else f"lora{len(registry(model))}")
    if name in registry(model):
        raise ValueError(f"a LoRA named '{name}' is already attached; remove it first or pass another name")
    data, problems = load(model, path_or_state, arch=arch, config=config, strict=strict, alpha=alpha)
    dtype = dtype or model_dtype(model)
    handle = LoraHandle(name, data.where, float(strength), ranks=data.ranks, alphas=data.alphas, skipped=problems,
                        ledger=ledger, rslora=data.rslora, model_ref=weakref.ref(model))
    by_layer = _by_layer(data.layers)
    for module, factors in by_layer.items():  # refuse before changing anything
        if any(f.kind != "lora" for f in factors):
            check_bakeable(model.get_submodule(module), module)
            record = _record_of(model, module)
            if record is not None:
                _check_unchanged(model.get_submodule(module), record, f"attach LoRA '{name}'")
    for module, factors in by_layer.items():
        layer = model.get_submodule(module)
        low = [f for f in factors if f.kind == "lora"]
        if low:
            device = _device(layer)
            stack = br.ensure_stack(layer, module, ledger)
            br.add_branch(stack, _branch(name, low, float(strength), data.where, dtype, device), module, ledger)
            handle.stacks.append((module, weakref.ref(stack)))
            handle.layers.append(module)
            _mirror(handle, module, layer, ledger)
        parts = [f for f in factors if f.kind != "lora"]
        if parts:
            for f in parts:
                warnings.warn(f"{data.where}: '{module}' carries a {f.kind.upper()} adapter ({f.keys[0]}), which "
                              "cannot be a residual branch: baked into the weight", stacklevel=2)
            record = _record_of(model, module) or LayerBakes(module, _tensors(layer))
            baked = BakedAdapter(name, parts, float(strength))
            _bake_parts(layer, module, baked, ledger)
            record.adapters.append(baked)
            record.written = _tensors(layer)
            handle.bakes[module] = record
            handle.baked.append(module)
    registry(model, ledger, create=True)[name] = handle
    if ledger is not None:  # undone first: a handle kept past the teardown lets go of the layers' tensors
        handle_ref = weakref.ref(handle)
        ledger.record("lora_handle", f"LoRA '{name}' (handle)", lambda: _forget(handle_ref()))
    return handle


def _forget(handle: LoraHandle | None) -> None:
    """What a ledger teardown does to a handle: it drops its bake records (which hold the layers' pre-LoRA
    tensors) and stacks; its methods then raise LoraRemovedError (its model's registry is gone)."""
    if handle is not None:
        handle.bakes, handle.stacks = {}, []


def _device(layer: nn.Module) -> torch.device:
    return next((t.device for t in list(layer.parameters()) + list(layer.buffers())), torch.device("cpu"))


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(layer._parameters), **dict(layer._buffers)}


def _mirror(handle: LoraHandle, module: str, layer: nn.Module, ledger) -> None:
    """Same branch on the float original the ledger holds for a quantized layer (see module doc)."""
    if ledger is None or not isinstance(layer, QuantLinear):
        return
    original = ledger.original(module)
    if not isinstance(original, nn.Linear) or isinstance(original, QuantLinear):
        return
    where = f"{module} (float original)"
    stack = br.ensure_stack(original, where, ledger)
    w = original.weight
    branch = handle.live_stacks()[-1][1].branches[-1].map(lambda t: t.to(w.device))
    br.add_branch(stack, branch, where, ledger)
    handle.stacks.append((where, weakref.ref(stack)))


def _record_of(model: nn.Module, module: str) -> LayerBakes | None:
    """The bake record of layer `module` (shared by every attached adapter baked into it), or None."""
    return next((h.bakes[module] for h in registry(model).values() if module in h.bakes), None)


def _bake_parts(layer: nn.Module, module: str, baked: BakedAdapter, ledger) -> None:
    for f in baked.factors:
        bake_layer(layer, lambda w, f=f: f.delta_weight(w, baked.strength), mode="standard", seed=0, where=module,
                   ledger=ledger)


def _same(current: torch.Tensor | None, written: torch.Tensor | None) -> bool:
    """`current` is what we wrote, or its copy after the model moved device or dtype."""
    if current is written:
        return True
    if current is None or written is None or current.shape != written.shape:
        return False
    return torch.equal(current.detach(), written.detach().to(current.device, current.dtype))


def _check_unchanged(layer: nn.Module, record: LayerBakes, action: str) -> None:
    """Refuse to rebuild a layer someone else changed after our last bake (e.g. bake_files): restoring its
    pre-LoRA tensors would silently throw that change away."""
    now = _tensors(layer)
    if now.keys() != record.written.keys() or not all(_same(now[k], record.written[k]) for k in now):
        names = [b.name for b in record.adapters]
        raise LoraError(f"cannot {action}: layer '{record.module}' was changed after LoRA(s) {names} were baked into "
                        "it (another bake or requantization); removing or re-weighting a baked adapter there would "
                        "drop that change")


def _placed(saved: torch.Tensor | None, current: torch.Tensor | None) -> torch.Tensor | None:
    """A saved tensor where the layer's current one lives (the same object when nothing moved)."""
    if saved is None or current is None or (saved.device == current.device and saved.dtype == current.dtype):
        return saved
    moved = saved.detach().to(current.device, current.dtype)
    return nn.Parameter(moved, requires_grad=current.requires_grad) if isinstance(current, nn.Parameter) else moved


def _rebake(layer: nn.Module, record: LayerBakes, ledger) -> None:
    """Layer := its pre-LoRA tensors with `record.adapters` baked in again, in order (the ledger records each swap)."""
    now = _tensors(layer)
    restore = {k: _placed(t, now.get(k)) for k, t in record.pristine.items()}
    restore = {k: t for k, t in restore.items() if now.get(k) is not t}
    if restore:
        _replace(layer, restore, f"{record.module} (pre-LoRA tensors)", ledger)
    for baked in record.adapters:
        _bake_parts(layer, record.module, baked, ledger)
    record.written = _tensors(layer)


def _detach(model: nn.Module, handle: LoraHandle) -> None:
    for module, record in handle.bakes.items():  # refuse before changing anything
        _check_unchanged(model.get_submodule(module), record, f"remove LoRA '{handle.name}'")
    registry(model).pop(handle.name)
    handle.removed = True
    for where, stack in handle.live_stacks():
        if handle.name in stack.names():
            br.remove_branch(stack, handle.name, where, handle.ledger)
    for module, record in handle.bakes.items():
        record.adapters = [b for b in record.adapters if b.name != handle.name]
        _rebake(model.get_submodule(module), record, handle.ledger)
    handle.bakes, handle.stacks = {}, []  # a kept dead handle holds no tensors of the model


def _reweight(model: nn.Module, handle: LoraHandle, strength: float) -> None:
    for module, record in handle.bakes.items():
        _check_unchanged(model.get_submodule(module), record, f"re-weight LoRA '{handle.name}'")
    for where, stack in handle.live_stacks():
        br.set_branch_strength(stack, handle.name, strength, where, handle.ledger)
    for module, record in handle.bakes.items():
        for baked in record.adapters:
            if baked.name == handle.name:
                baked.strength = float(strength)
        _rebake(model.get_submodule(module), record, handle.ledger)
    handle.strength = float(strength)


def _handle(model: nn.Module, name: str) -> LoraHandle:
    reg = registry(model)
    if name not in reg:
        raise KeyError(f"no LoRA named '{name}' is attached (attached: {sorted(reg)})")
    return reg[name]


def remove(model: nn.Module, name: str) -> None:
    """Take adapter `name` off (same as `handle.remove()`): its branches go; layers it baked into become a fresh
    bake of the adapters still attached. Once every adapter is removed, every layer's output is its pre-LoRA
    value bit for bit."""
    _detach(model, _handle(model, name))


def set_strength(model: nn.Module, name: str, strength: float) -> None:
    """Re-weight adapter `name` (same as `handle.set_strength(strength)`)."""
    _reweight(model, _handle(model, name), strength)


def attached(model: nn.Module) -> dict[str, LoraHandle]:
    return dict(registry(model))


def bake_files(model: nn.Module, loras: list[tuple[Any, float]], *, mode: str = "standard", seed: int = 0,
               arch: Any = None, config: Any = None, ledger=None, strict: bool = True,
               groups: list[list[str]] = ()) -> dict[str, Any]:
    """Bake several LoRAs ((path or state dict, strength) or (..., strength, alpha)) pooled: each layer
    requantized once.

    The float originals the ledger holds for quantized layers get the LoRAs as exact residual
    branches (evaluate then compares baked against float + LoRA). Returns report figures.
    """
    pooled: dict[str, list[tuple[LayerFactors, float]]] = {}
    per_file = []
    for i, (src, strength, *rest) in enumerate(loras):
        data, problems = load(model, src, arch=arch, config=config, strict=strict, alpha=rest[0] if rest else None)
        layers = _by_layer(data.layers)
        per_file.append({"source": data.where, "strength": strength, "layers": len(layers), "ranks": data.ranks,
                         "alphas": data.alphas, "rslora": data.rslora, "skipped": problems})
        for module, factors in layers.items():
            pooled.setdefault(module, []).extend((f, float(strength)) for f in factors)
            layer = model.get_submodule(module)
            low = [f for f in factors if f.kind == "lora"]
            if ledger is not None and isinstance(layer, QuantLinear) and low:
                original = ledger.original(module)
                if isinstance(original, nn.Linear) and not isinstance(original, QuantLinear):
                    where = f"{module} (float original)"
                    stack = br.ensure_stack(original, where, ledger)
                    branch = _branch(f"bake{i}", low, float(strength), data.where, original.weight.dtype,
                                     original.weight.device)
                    br.add_branch(stack, branch, where, ledger)
    for module in pooled:  # refuse before changing anything
        check_bakeable(model.get_submodule(module), module)
    kept = []
    baked_layers = len(pooled)

    def delta_of(contributions):
        return lambda w: sum(f.delta_weight(w, s) for f, s in contributions)

    # Layers quantized as one fused native weight are requantized together (exact native export).
    for group in groups:
        if any(name in pooled for name in group):
            members = [(name, model.get_submodule(name)) for name in group]
            if all(isinstance(layer, QuantLinear) for _, layer in members):
                deltas = {name: delta_of(pooled.pop(name)) for name in group if name in pooled}
                kept.extend(bake_group(members, deltas, mode=mode, seed=seed, ledger=ledger))
    for module, contributions in pooled.items():
        layer = model.get_submodule(module)
        k = bake_layer(layer, delta_of(contributions), mode=mode, seed=seed, where=module, ledger=ledger)
        if k is not None:
            kept.append(k)
    return {"files": per_file, "baked_layers": baked_layers, "quantized_layers_baked": len(kept),
            "delta_kept_mean": sum(kept) / len(kept) if kept else None,
            "delta_kept_min": min(kept) if kept else None}
