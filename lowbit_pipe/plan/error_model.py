"""Per-layer error of each candidate, measured on the layer's own calibration inputs (as the byte budget does),
and how many rows each layer sees per forward (the M of its speed-table entries).

A layer's error is ||x W^T - linear_q(x)|| / ||x W^T|| on up to `rows` captured input rows; float is 0.
Squared errors add up like output noise power: the solver sums them and a measured scale maps the sum to
the model's output error (lowbit_pipe.plan.target_plan)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe.formats import get_format
from lowbit_pipe.ledger import tensor_bytes
from lowbit_pipe.plan.budget import _layer_error, capture_inputs
from lowbit_pipe.plan.candidates import Candidate


@dataclass(frozen=True)
class LayerOption:
    candidate: Candidate
    nbytes: int  # the layer as stored and held (weights, scales, record, derived buffers, bias)
    rel_error: float


def measure_options(model: nn.Module, names: list[str], candidates: list[Candidate] | dict[str, list[Candidate]],
                    run_calibration: Callable[[], None], *, rows: int = 256, seed: int = 0) -> dict[str, list[LayerOption]]:
    """Every layer's options among `candidates` (those its shape fits; float always fits), with their bytes and
    error (`candidates` per layer name, or one list for all). Raises naming a layer the calibration never ran."""
    with capture_inputs(model, names, rows, seed) as captured, torch.no_grad():
        run_calibration()
    out: dict[str, list[LayerOption]] = {}
    for name in names:
        if name not in captured:
            raise RuntimeError(f"calibration never ran layer '{name}': cannot measure its sensitivity")
        linear = model.get_submodule(name)
        bias = tensor_bytes(linear.bias) if linear.bias is not None else 0
        opts = []
        for cand in (candidates[name] if isinstance(candidates, dict) else candidates):
            if cand.spec is None:
                opts.append(LayerOption(cand, tensor_bytes(linear), 0.0))
            elif get_format(cand.spec.format).supports_shape(linear.out_features, linear.in_features):
                err, nbytes = _layer_error(linear, cand.spec, captured[name])
                opts.append(LayerOption(cand, nbytes + bias, err))
        out[name] = opts
    return out


def quantized_bytes(linear: nn.Module, spec) -> int:
    """The layer's bytes in `spec` as the budget counts them (weights, scales, record, derived buffers, bias),
    for layers the recipe fixes (a rule's format). A static input scale (one scalar) is not counted."""
    from dataclasses import replace

    from lowbit_pipe.formats import encode_record

    fmt = get_format(spec.format)
    if spec.activations == "static":
        spec = replace(spec, activations="dynamic")
    q = fmt.with_activations(fmt.quantize(linear.weight.detach(), spec), spec.activations, None)
    derived = sum(t.numel() * t.element_size() for t in fmt.derived_tensors(q).values())
    bias = tensor_bytes(linear.bias) if linear.bias is not None else 0
    return q.nbytes + encode_record(q.record).numel() + derived + bias


@contextlib.contextmanager
def _count_rows(model: nn.Module, names: list[str]) -> Iterator[dict[str, list[int]]]:
    calls: dict[str, list[int]] = {n: [] for n in names}

    def hook_for(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple, _out: Any) -> None:
            calls[name].append(args[0].numel() // args[0].shape[-1])
        return hook

    handles = [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in names]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def layer_calls(model: nn.Module, names: list[str], forward: Callable[[], Any]) -> dict[str, list[int]]:
    """The rows (tokens x batch) of each call of each named layer during one `forward()`: a layer's time per
    forward is the sum of its calls' times."""
    with _count_rows(model, names) as calls, torch.no_grad():
        forward()
    return calls
