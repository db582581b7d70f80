"""LoRA residual branches on layers: a typed branch list per layer, attach / remove / re-weight.

Each LoRA'd layer (QuantLinear, a float nn.Linear, or another Linear: `is_linear`) gets one
child module `lora` (a `LoraStack`). Its `branches` tuple is the typed list (adapter name,
factors, alpha, strength); from it the stack builds ONE concatenated pair, `down` [sum r, K] and
`up` [N, sum r] with each branch's `scale` (strength * alpha / rank, or strength * alpha /
sqrt(rank) for rslora) folded into `up`, so a stack of any size costs two thin matmuls:
`delta = (x @ down.T) @ up.T` in the activation dtype, on the layer's unrotated input.

QuantLinear adds the delta in its forward; any other Linear (a float nn.Linear, ComfyUI's
mixed-precision Linear with a quantized or float weight) gets a forward hook doing the same on
its input (its state-dict keys stay untouched, so export and evaluate see the same module).
Being a child module, the stack follows `.to(device / dtype)` of its layer (LoRA factors DO
follow dtype casts, unlike the quantized buffers), and its buffers are non-persistent, so
the layer's state dict is exactly its pre-LoRA one.

Every change replaces the `branches` tuple (the stack rebuilds its pair on assignment) and,
with a ledger, records its undo by adapter name (attach -> remove, re-weight -> old strength).
An empty tuple skips the branch entirely: removing every LoRA gives back the pre-LoRA output
bit for bit.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.kernels import reference
from lowbit_pipe.lora.files import is_linear, lora_scale


@dataclass(frozen=True)
class LoraBranch:
    """One adapter on one layer: delta W = strength * alpha / rank * up @ down (alpha / sqrt(rank) with `rslora`)."""

    name: str  # adapter name (swap / remove key)
    down: torch.Tensor  # A [rank, in_features]
    up: torch.Tensor  # B [out_features, rank]
    alpha: float
    strength: float = 1.0
    source: str = ""  # file (and key) it came from, for messages
    rslora: bool = False  # rank-stabilized LoRA (peft use_rslora)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.strength * lora_scale(self.alpha, self.rank, self.rslora)

    def delta(self) -> torch.Tensor:
        """fp32 [out, in] weight delta (for bakes and oracles)."""
        return (self.up.float() @ self.down.float()) * self.scale

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> LoraBranch:
        return dataclasses.replace(self, down=fn(self.down), up=fn(self.up))


class LoraStack(nn.Module):
    """The LoRA branches of one layer. `forward(x)` is the summed delta output, or None when empty."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("down", None, persistent=False)
        self.register_buffer("up", None, persistent=False)
        self.branches: tuple[LoraBranch, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "branches":  # also on a ledger undo, which restores an older tuple by setattr
            self._rebuild()

    def _rebuild(self) -> None:
        branches = self.__dict__["branches"]
        for b in branches:
            if b.down.shape[1] != self.in_features or b.up.shape[0] != self.out_features or b.up.shape[1] != b.rank:
                raise ValueError(f"LoRA '{b.name}' ({b.source}): factors {tuple(b.up.shape)} @ {tuple(b.down.shape)} "
                                 f"do not fit a {self.out_features}x{self.in_features} layer")
        if not branches:
            self._buffers["down"] = self._buffers["up"] = None
            return
        dtype = branches[0].down.dtype
        # Scales folded into `up` in fp32, then stored in the factors' dtype (the activation dtype).
        ups = [(b.up.float() * b.scale).to(dtype) for b in branches]
        downs = [b.down.to(dtype) for b in branches]
        self._buffers["down"] = downs[0] if len(downs) == 1 else torch.cat(downs, dim=0)
        self._buffers["up"] = ups[0] if len(ups) == 1 else torch.cat(ups, dim=1)

    @property
    def rank(self) -> int:
        return sum(b.rank for b in self.branches)

    def names(self) -> list[str]:
        return [b.name for b in self.branches]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.low_rank_delta(x, self.down, self.up)

    def _apply(self, fn, recurse=True):
        # Branch factors live in a tuple (not buffers): move / cast them, then rebuild the pair.
        super()._apply(fn, recurse)
        self.branches = tuple(b.map(fn) for b in self.branches)
        return self

    def extra_repr(self) -> str:
        return ", ".join(f"{b.name}: rank={b.rank} alpha={b.alpha:g}{' rslora' if b.rslora else ''} "
                         f"strength={b.strength:g}" for b in self.branches)


def float_lora_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """Forward hook of a Linear that is no QuantLinear carrying a LoraStack: add its delta on the layer's
    input (None: output unchanged). Factors left on another device than the input (a layer ComfyUI runs
    from offloaded weights) are moved for the call."""
    stack = module._modules.get("lora")
    if stack is None or not stack.branches:
        return None
    x = args[0]
    if stack.down.device != x.device:
        return output + reference.low_rank_delta(x, stack.down.to(x.device), stack.up.to(x.device))
    return output + stack(x)


def stack_of(layer: nn.Module) -> LoraStack | None:
    stack = layer._modules.get("lora")
    return stack if isinstance(stack, LoraStack) else None


def conform(stack: LoraStack, branch: LoraBranch) -> LoraBranch:
    """`branch` on the stack's device and in its dtype (those of the branches already there)."""
    if not stack.branches:
        return branch
    ref = stack.branches[0].down
    if branch.down.device == ref.device and branch.down.dtype == ref.dtype:
        return branch
    return branch.map(lambda t: t.to(ref.device, ref.dtype))


def ensure_stack(layer: nn.Module, where: str, ledger=None) -> LoraStack:
    """The layer's LoraStack, installing it (and, on a float Linear, the forward hook); the ledger
    records both, and its undo takes them off again (the layer is then exactly as before)."""
    from lowbit_pipe.quant.nn import QuantLinear

    stack = stack_of(layer)
    if stack is not None:
        return stack
    if not is_linear(layer):
        raise TypeError(f"LoRA target '{where}' is a {type(layer).__name__}, not a Linear or QuantLinear")
    stack = LoraStack(int(layer.in_features), int(layer.out_features))
    layer.add_module("lora", stack)  # KeyError if the layer already has a non-module attribute 'lora'
    handle = None if isinstance(layer, QuantLinear) else layer.register_forward_hook(float_lora_hook)
    if ledger is None:
        if handle is not None:
            stack._hook = handle  # uninstall() removes it
        return stack
    layer_ref = weakref.ref(layer)

    def undo() -> None:
        owner = layer_ref()
        if owner is not None and owner._modules.get("lora") is stack_ref():
            del owner._modules["lora"]

    stack_ref = weakref.ref(stack)
    ledger.record("lora_stack", f"{where}.lora", undo,
                  lambda: True if layer_ref() is None or "lora" not in layer_ref()._modules else "LoRA stack still attached")
    ledger.watch(f"{where}.lora", stack)
    if handle is not None:
        ledger.hook(handle, f"{where}.lora (forward hook)")
    return stack


def uninstall(layer: nn.Module) -> None:
    """Take an (empty or not) LoraStack off a layer attached without a ledger."""
    stack = stack_of(layer)
    if stack is None:
        return
    hook = stack.__dict__.pop("_hook", None)
    if hook is not None:
        hook.remove()
    del layer._modules["lora"]


def change(stack: LoraStack, branches: tuple[LoraBranch, ...], undo: Callable[[LoraStack], None] | None,
           label: str, ledger=None) -> None:
    """Set a stack's branch tuple; with a ledger, record `undo(stack)` (which works by adapter name, so it
    stays right after the model moved device or dtype)."""
    stack.branches = tuple(branches)
    if ledger is not None and undo is not None:
        ref = weakref.ref(stack)

        def run() -> None:
            target = ref()
            if target is not None:
                undo(target)

        ledger.record("lora_branch", label, run)


def add_branch(stack: LoraStack, branch: LoraBranch, where: str, ledger=None) -> None:
    if branch.name in stack.names():
        raise ValueError(f"'{where}': a LoRA named '{branch.name}' is already attached (remove it or pick another name)")
    change(stack, stack.branches + (conform(stack, branch),),
           lambda s: setattr(s, "branches", without(s, branch.name)), f"{where}: +LoRA '{branch.name}'", ledger)


def remove_branch(stack: LoraStack, name: str, where: str, ledger=None) -> None:
    index = stack.names().index(name)
    old = stack.branches[index]

    def undo(s: LoraStack) -> None:
        items = list(s.branches)
        items.insert(min(index, len(items)), conform(s, old))
        s.branches = tuple(items)

    change(stack, without(stack, name), undo, f"{where}: -LoRA '{name}'", ledger)


def set_branch_strength(stack: LoraStack, name: str, strength: float, where: str, ledger=None) -> None:
    old = next(b.strength for b in stack.branches if b.name == name)
    change(stack, reweighted(stack, name, strength), lambda s: setattr(s, "branches", reweighted(s, name, old)),
           f"{where}: LoRA '{name}' strength {old:g} -> {strength:g}", ledger)


def without(stack: LoraStack, name: str) -> tuple[LoraBranch, ...]:
    return tuple(b for b in stack.branches if b.name != name)


def reweighted(stack: LoraStack, name: str, strength: float) -> tuple[LoraBranch, ...]:
    return tuple(dataclasses.replace(b, strength=float(strength)) if b.name == name else b for b in stack.branches)
