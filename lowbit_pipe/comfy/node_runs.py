"""What the ComfyUI nodes made, who owns it, and how a Purge ends it without leaving a silent float model.

ComfyUI caches every node's outputs and re-uses them while the node's inputs look unchanged, so the pack
cannot keep its state in the node objects, and a MODEL it handed out may be used again long after. The
rules this module implements:

- Every diffusion-model tree a node makes (a structural copy, lowbit_pipe.comfy.tree) carries a `NodeState`:
  the `NodeRun` that owns it (a quantize run, or a LoRA node's own ledger when it worked on a MODEL no
  quantize run made), the float tree it started from, the quantized tree before any LoRA, and the LoRAs.
- Purge tears a NodeRun down (its ledger, in reverse, with the proof), then `seal`s every tree made from it:
  a tree that is used again raises `PurgedModelError` naming the node and what to do, instead of computing
  with float layers.
- `PURGES` counts purges per node id. The node that made a NodeRun reports that count from `IS_CHANGED`, so
  after a Purge a re-queued workflow re-runs it (and everything downstream) by itself; untouched, the count
  stays and ComfyUI's cache is used as usual. It is the pack's one piece of process state, by necessity:
  ComfyUI asks IS_CHANGED, a classmethod, with nothing but the node's constant inputs and its id.
"""

from __future__ import annotations

import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lowbit_pipe.errors import LowbitError
from lowbit_pipe.ledger import Ledger

STATE_ATTR = "_lowbit_node_state"
SEAL_ATTR = "_lowbit_purged"


class PurgedModelError(LowbitError):
    """A MODEL whose lowbit_pipe run was purged is used again."""


@dataclass(frozen=True)
class LoraSpec:
    """One LoRA on a node's tree: a file (path) or a state dict (ComfyUI's own LoRA patches, converted)."""

    source: Any  # str path, or a Mapping of LoRA tensors
    strength: float
    name: str


@dataclass(eq=False)
class NodeRun:
    """One thing Purge tears down: a quantize run (`result`, a RunResult) or a bare ledger (a LoRA node's)."""

    ledger: Ledger
    made_by: str  # "Quantize (lowbit_pipe) node 5", for messages
    node_id: str | None  # whose IS_CHANGED moves when this is purged
    result: Any = None  # lowbit_pipe.running.runner.RunResult of a quantize run
    trees: list[weakref.ref] = field(default_factory=list)
    purged: str | None = None  # after Purge: when and by what
    # ComfyUI's clone_base_uuid of every MODEL made from this run: ComfyUI unloads them together, nothing else.
    clone_id: uuid.UUID = field(default_factory=uuid.uuid4)

    def adopt(self, tree: nn.Module) -> None:
        self.trees.append(weakref.ref(tree))

    def live_trees(self) -> list[nn.Module]:
        return [t for t in (r() for r in self.trees) if t is not None]


@dataclass(eq=False)
class NodeState:
    """What a node's tree carries (a plain attribute, not a submodule)."""

    run: NodeRun
    source: nn.Module  # the float tree the run started from (upstream MODEL's)
    base: nn.Module  # the tree before any LoRA node (the quantized one, or the upstream tree for a LoRA-only run)
    loras: tuple[LoraSpec, ...] = ()


class PurgeCounter:
    """Purges per node id: what IS_CHANGED returns, so a purged node re-runs on the next queue."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def of(self, node_id: str | None) -> int:
        return self._count.get(str(node_id), 0)

    def bump(self, node_id: str | None) -> None:
        if node_id is not None:
            self._count[str(node_id)] = self.of(node_id) + 1


PURGES = PurgeCounter()


def state_of(tree: Any) -> NodeState | None:
    state = getattr(tree, "__dict__", {}).get(STATE_ATTR)
    return state if isinstance(state, NodeState) else None


def set_state(tree: nn.Module, state: NodeState) -> None:
    # A plain attribute (setattr of a Module value would register it as a child of the tree).
    tree.__dict__[STATE_ATTR] = state
    state.run.adopt(tree)


def drop_state(tree: nn.Module) -> None:
    tree.__dict__.pop(STATE_ATTR, None)


def state_gone(tree: nn.Module) -> bool | str:
    return True if STATE_ATTR not in tree.__dict__ else "node state still set"


def hollow(tree: nn.Module, float_tree: nn.Module) -> None:
    """A node's copy at Purge: each quantized, LoRA-carrying or re-weighted layer (a weight that is not the one at the
    same path of the tree the run started from: the Compute node's) replaced by the layer at that path of that tree,
    and its node state dropped, so the copy holds none of the run's tensors (it is sealed too)."""
    from lowbit_pipe.ledger import parent_of
    from lowbit_pipe.quant.nn import QuantLinear

    for name, module in list(tree.named_modules()):
        if name and (isinstance(module, QuantLinear) or "lora" in module._modules or _reweighted(module, float_tree, name)):
            parent, attr = parent_of(tree, name)
            setattr(parent, attr, float_tree.get_submodule(name))
    tree.__dict__.pop("_lowbit_lora", None)
    drop_state(tree)


def _reweighted(module: nn.Module, float_tree: nn.Module, name: str) -> bool:
    weight = module._parameters.get("weight")
    if weight is None:
        return False
    try:
        original = float_tree.get_submodule(name)
    except AttributeError:
        return False
    return weight is not original._parameters.get("weight")


def check_usable(tree: Any, what: str) -> None:
    """PurgedModelError when `tree` was sealed by a Purge."""
    reason = getattr(tree, "__dict__", {}).get(SEAL_ATTR)
    if reason is not None:
        raise PurgedModelError(f"{what}: {reason}")


def seal(tree: nn.Module, reason: str) -> None:
    """Make any further use of `tree` fail with `reason`: its forward (a pre-hook on the root, which also stops
    ComfyUI's samplers) and the pack's nodes (the attribute they check)."""
    tree.__dict__[SEAL_ATTR] = reason

    def refuse(module: nn.Module, args: Any) -> None:
        raise PurgedModelError(reason)

    tree.register_forward_pre_hook(refuse)


def purge(run: NodeRun, *, teardown: Any) -> dict[str, Any]:
    """Tear `run` down (`teardown(run)` returns the proof), seal its trees, move its node's purge count."""
    trees = run.live_trees()
    report = teardown(run)
    when = time.strftime("%H:%M:%S")
    run.purged = f"purged at {when}"
    reason = (f"this MODEL was made by {run.made_by}, whose run was purged by Purge (lowbit_pipe) at {when}; its "
              "quantized layers are gone. In the same queue: Purge ran before this node; connect this node's output "
              "(the sampler's LATENT, or what comes after it) to Purge's 'after' input so Purge runs last. From an "
              "earlier queue: Queue the workflow again: that node re-runs by itself")
    for tree in trees:
        seal(tree, reason)
    del trees
    PURGES.bump(run.node_id)
    return report
