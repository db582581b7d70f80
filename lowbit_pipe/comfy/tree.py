"""A copy of a module tree's structure that shares every tensor: what a ComfyUI node changes instead of
the MODEL it was given.

ComfyUI caches node outputs and hands one MODEL to many nodes; a node that swapped modules of the
diffusion model it received in place would change every other user of it. Nodes clone the MODEL and
set a new diffusion model on the clone as an object patch (ComfyUI's own mechanism; it swaps it in
while sampling and back after). That new model is this copy: new module objects (and new parameter,
buffer and child dicts) down to the leaves, the very same Parameter and buffer tensors inside, so it
costs no weight memory. Swapping a Linear for a QuantLinear, or adding a LoRA stack to a layer of the
copy, leaves the original untouched. Other container attributes (hook dicts, records) are copied one
level deep; objects inside them are shared, so state that refers to the original tree's modules (a LoRA
registry) must be rebuilt on the copy, not carried over (the LoRA node re-attaches from the base).
"""

from __future__ import annotations

import copy

from torch import nn


def structural_copy(module: nn.Module) -> nn.Module:
    """A new module tree with the same classes, attributes and tensors (shared), and its own dicts."""
    memo: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> nn.Module:
        if id(m) in memo:  # a module used twice stays one module
            return memo[id(m)]
        new = copy.copy(m)
        memo[id(m)] = new
        new._parameters = dict(m._parameters)
        new._buffers = dict(m._buffers)
        new._modules = {name: (visit(child) if child is not None else None) for name, child in m._modules.items()}
        for key, value in m.__dict__.items():  # other containers too (hook dicts, records, lists)
            if key not in ("_parameters", "_buffers", "_modules") and isinstance(value, (dict, list, set)):
                new.__dict__[key] = type(value)(value) if not isinstance(value, dict) else copy.copy(value)
        return new

    return visit(module)
