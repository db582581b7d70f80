"""attach / remove / set_strength / bake_files: LoRA files onto a (quantized) model.

A model keeps a registry `model._lowbit_lora` {adapter name: LoraHandle}, so remove and
re-weight find every stack of an adapter, including the mirror stacks on the float originals
the ledger holds for quantized layers (why: evaluate's float reference swaps those originals
back in, and must then run float + LoRA, to compare like with like).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lowbit_pipe.lora import branches as br
from lowbit_pipe.lora.bake import bake_group, bake_layer
from lowbit_pipe.lora.files import LayerFactors, LoraData, check_matched, parse_lora
from lowbit_pipe.nn import QuantLinear

REGISTRY = "_lowbit_lora"


@dataclass
class LoraHandle:
    """What one attached adapter did."""

    name: str
    source: str
    strength: float
    layers: list[str] = field(default_factory=list)  # residual branches (diffusers module names)
    baked: list[str] = field(default_factory=list)  # layers its DoRA / dense parts were baked into
    ranks: list[int] = field(default_factory=list)
    alphas: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # warnings (unmatched keys with strict=False)
    stacks: list[tuple[str, br.LoraStack]] = field(default_factory=list)  # incl. float-original mirrors
    pre_bake: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # exact undo of its bakes
    ledger: Any = None

    def figures(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "strength": self.strength, "layers": len(self.layers),
                "baked_layers": len(self.baked), "ranks": self.ranks, "alphas": self.alphas, "skipped": self.skipped}


def registry(model: nn.Module, ledger=None, create: bool = False) -> dict[str, LoraHandle]:  # noqa: ANN001
    reg = model.__dict__.get(REGISTRY)
    if reg is None and create:
        reg = {}
        if ledger is not None:
            ledger.patch_attr(model, REGISTRY, reg, name=f"{type(model).__name__}.{REGISTRY}")
        else:
            setattr(model, REGISTRY, reg)
    return reg if reg is not None else {}


def resolve_arch(model: nn.Module, arch: Any) -> Any:
    from lowbit_pipe.arch import detect_model, get_arch

    if isinstance(arch, str):
        return None if arch == "generic" else get_arch(arch)
    return arch if arch is not None else detect_model(model)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


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
    file) concatenate along the rank with their alpha / rank folded into `up`."""
    if len(factors) == 1:
        f = factors[0]
        return br.LoraBranch(name, f.down.to(device, dtype), f.up.to(device, dtype), f.alpha, strength, source)
    down = torch.cat([f.down.float() for f in factors], dim=0)
    up = torch.cat([f.up.float() * (f.alpha / f.rank) for f in factors], dim=1)
    return br.LoraBranch(name, down.to(device, dtype), up.to(device, dtype), float(down.shape[0]), strength, source)


def attach(model: nn.Module, path_or_state: str | Path | Mapping[str, torch.Tensor], *, strength: float = 1.0,
           name: str | None = None, arch: Any = None, config: Any = None, ledger=None, strict: bool = True,  # noqa: ANN001
           alpha: float | None = None, dtype: torch.dtype | None = None) -> LoraHandle:
    """Attach a LoRA as exact residual branches: y = Q(W) x + strength * alpha / rank * B (A x).

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
                        ledger=ledger)
    for module, factors in _by_layer(data.layers).items():
        layer = model.get_submodule(module)
        low = [f for f in factors if f.kind == "lora"]
        if low:
            device = _device(layer)
            stack = br.ensure_stack(layer, module, ledger)
            br.add_branch(stack, _branch(name, low, float(strength), data.where, dtype, device), module, ledger)
            handle.stacks.append((module, stack))
            handle.layers.append(module)
            _mirror(handle, module, layer, ledger)
        for f in factors:
            if f.kind != "lora":
                warnings.warn(f"{data.where}: '{module}' carries a {f.kind.upper()} adapter ({f.keys[0]}), which cannot be "
                              "a residual branch: baked into the weight", stacklevel=2)
                handle.pre_bake.setdefault(module, _tensors(layer))
                bake_layer(layer, lambda w, f=f: f.delta_weight(w, strength), mode="standard", seed=0, where=module,
                           ledger=ledger)
                handle.baked.append(module)
    registry(model, ledger, create=True)[name] = handle
    return handle


def _device(layer: nn.Module) -> torch.device:
    return next((t.device for t in list(layer.parameters()) + list(layer.buffers())), torch.device("cpu"))


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(layer._parameters), **dict(layer._buffers)}


def _mirror(handle: LoraHandle, module: str, layer: nn.Module, ledger) -> None:  # noqa: ANN001
    """Same branch on the float original the ledger holds for a quantized layer (see module doc)."""
    if ledger is None or not isinstance(layer, QuantLinear):
        return
    original = ledger.original(module)
    if not isinstance(original, nn.Linear) or isinstance(original, QuantLinear):
        return
    where = f"{module} (float original)"
    stack = br.ensure_stack(original, where, ledger)
    w = original.weight
    branch = handle.stacks[-1][1].branches[-1].map(lambda t: t.to(w.device))
    br.add_branch(stack, branch, where, ledger)
    handle.stacks.append((where, stack))


def remove(model: nn.Module, name: str) -> None:
    """Take adapter `name` off: its branches go, its baked layers get their exact pre-bake tensors back.
    Once every adapter is removed, every layer's output is its pre-LoRA value bit for bit."""
    reg = registry(model)
    if name not in reg:
        raise KeyError(f"no LoRA named '{name}' is attached (attached: {sorted(reg)})")
    handle = reg.pop(name)
    for where, stack in handle.stacks:
        if name in stack.names():
            br.remove_branch(stack, name, where, handle.ledger)
    for module, tensors in handle.pre_bake.items():
        layer = model.get_submodule(module)
        for key, t in tensors.items():
            (layer._parameters if key in layer._parameters else layer._buffers)[key] = t


def set_strength(model: nn.Module, name: str, strength: float) -> None:
    """Re-weight adapter `name` (exact: its branches' scale changes, nothing is requantized)."""
    reg = registry(model)
    if name not in reg:
        raise KeyError(f"no LoRA named '{name}' is attached (attached: {sorted(reg)})")
    handle = reg[name]
    if handle.baked:
        raise ValueError(f"LoRA '{name}' has parts baked into {handle.baked[:3]} (DoRA / dense): a bake cannot be "
                         "re-weighted exactly; remove it and attach it again with the new strength")
    for where, stack in handle.stacks:
        br.set_branch_strength(stack, name, strength, where, handle.ledger)
    handle.strength = float(strength)


def attached(model: nn.Module) -> dict[str, LoraHandle]:
    return dict(registry(model))


def bake_files(model: nn.Module, loras: list[tuple[Any, float]], *, mode: str = "standard", seed: int = 0,
               arch: Any = None, config: Any = None, ledger=None, strict: bool = True,
               groups: list[list[str]] = ()) -> dict[str, Any]:  # noqa: ANN001
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
                         "alphas": data.alphas, "skipped": problems})
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
    kept = []
    baked_layers = len(pooled)

    def delta_of(contributions):  # noqa: ANN001, ANN202
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
