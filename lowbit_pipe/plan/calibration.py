"""Calibration: the model run on seeded example inputs, with forward hooks that record what a quantizer
needs from each layer's real input: static activation scales (the amax of the input after the layer's own
rotation) and GPTQ's input Hessians (a running mean of x^T x, bounded memory whatever the token count).
Hooks live only inside the `with`; nothing is kept but the statistics."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe.formats import get_format
from lowbit_pipe.kernels import rotation
from lowbit_pipe.plan.policy import LayerPlan
from lowbit_pipe.quant.gptq import HessianAccumulator


@contextlib.contextmanager
def input_amax(model: nn.Module, plans: list[LayerPlan]) -> Iterator[dict[str, float]]:
    """{layer: amax of its (rotated) input} over every forward run inside the `with`, for `plans`."""
    amax: dict[str, float] = {}

    def hook_for(plan: LayerPlan) -> Callable:
        kind, group = get_format(plan.spec.format).input_rotation(plan.spec, plan.shape[1])

        def hook(_module: nn.Module, args: tuple, _out: Any) -> None:
            x, _ = rotation.rotate_activation(args[0].detach(), kind, group or None)
            amax[plan.name] = max(amax.get(plan.name, 0.0), float(x.abs().amax()))
        return hook

    handles = [model.get_submodule(p.name).register_forward_hook(hook_for(p)) for p in plans]
    try:
        yield amax
    finally:
        for h in handles:
            h.remove()


def static_input_amax(model: nn.Module, plans: list[LayerPlan], run_examples: Callable[[], None]) -> dict[str, float]:
    """Input amax of every plan asking for static activations (runs the examples once, under no_grad).
    A planned layer the examples never reach is an error naming it."""
    static = [p for p in plans if p.spec is not None and p.spec.activations == "static"]
    if not static:
        return {}
    with input_amax(model, static) as amax, torch.no_grad():
        run_examples()
    missing = [p.name for p in static if p.name not in amax]
    if missing:
        raise ValueError(f"static activations: the calibration inputs never reach {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; use activations=dynamic for them")
    return amax


@contextlib.contextmanager
def input_hessians(model: nn.Module, plans: list[LayerPlan]) -> Iterator[dict[str, HessianAccumulator]]:
    """{layer: running Hessian of its (rotated) input} over every forward run inside the `with`, for `plans`."""
    hessians: dict[str, HessianAccumulator] = {}

    def hook_for(plan: LayerPlan, weight: torch.Tensor) -> Callable:
        kind, group = get_format(plan.spec.format).input_rotation(plan.spec, plan.shape[1])

        def hook(_module: nn.Module, args: tuple, _out: Any) -> None:
            if plan.name not in hessians:
                hessians[plan.name] = HessianAccumulator(plan.shape[1], kind, group or None, weight.device)
            hessians[plan.name].add(args[0])
        return hook

    handles = []
    for p in plans:
        module = model.get_submodule(p.name)
        handles.append(module.register_forward_hook(hook_for(p, module.weight)))
    try:
        yield hessians
    finally:
        for h in handles:
            h.remove()
