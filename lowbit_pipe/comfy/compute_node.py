"""Compute (lowbit_pipe): how the nvfp4 layers of one MODEL compute, the recipe's `quantize.nvfp4_compute` for a
MODEL, on a copy of its diffusion model: the MODEL given is unchanged.

`auto` is today's behaviour and returns the MODEL given as it is (stock ComfyUI computes a stock `nvfp4` layer
weight-only before Blackwell; the pack's nvfp4 kinds run lowbit_pipe's default, weight-only there too). The other
settings (`recipe.NVFP4_COMPUTE`, the same meanings): `weight_only` (the dequantized weight times the input, in its
dtype), `nvfp4` (NVFP4 activations emulated, the file's numerics), `fp8` (Hopper's fp8 tensor cores: the weight's
NVFP4 values rounded to e4m3 under a per-row scale, per-token fp8 activations; `formats/nvfp4.py`).

Which layers, in a structural copy of the tree (`lowbit_pipe.comfy.tree`: new modules, the same tensors):
- a file's nvfp4 kinds the pack loads (`LowbitLayout` weights of format nvfp4: `lowbit_nvfp4`, rotated): the copy's
  weight is a QuantizedTensor of the same tensors whose Params carry `compute`;
- a file's stock `nvfp4` layers (comfy-kitchen's `TensorCoreNVFP4Layout`, which ComfyUI runs itself): the copy's
  weight is the same tensors as a `LowbitLayout` QuantizedTensor of format nvfp4 (checked by the format, naming
  the layer), loaded as the pack loads `lowbit_nvfp4` (ComfyUI hands the float input to the layout);
- Quantize's nvfp4 QuantLinears: the copy's layer gets `compute`, as the recipe setting does.
The changed layers' `_full_precision_mm` is off on the copy: the setting decides, a weight-only record included.

Purge: the change is recorded in the ledger of the run behind the MODEL (a run of this node's own for a MODEL no pack
node made, like Compile's): its undo replaces every layer of the copy that this node or the run changed by the
layer at the same path of the tree the run started from (`node_runs.hollow`, as for the LoRA node's copies) and drops
the node state; the copy is sealed with the run's other trees, and the weights this node made (with what their
layouts settled: plans, `fp8_row_scale`) are watched until freed. Put it after the LoRA nodes: a LoRA node rebuilds its MODEL from the run's base tree (this node's copy
only where it came before any LoRA).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lowbit_pipe.comfy import node_runs
from lowbit_pipe.comfy.node_runs import PURGES, NodeRun, NodeState
from lowbit_pipe.formats.nvfp4 import NVFP4_COMPUTE
from lowbit_pipe.quant.nn import QuantLinear

CATEGORY = "lowbit_pipe"
STOCK_NVFP4_LAYOUT = "TensorCoreNVFP4Layout"  # comfy-kitchen's nvfp4 layout (ComfyUI's QUANT_ALGOS['nvfp4'])
CONVERTED_KIND = "lowbit_nvfp4"  # the pack's QUANT_ALGOS kind (quantize_input False) a converted stock layer takes


def nvfp4_layers(tree: nn.Module) -> list[tuple[str, str]]:
    """(name, kind) of every nvfp4 layer of `tree` this node can set; kind: "file" (a LowbitLayout weight of format
    nvfp4), "stock" (comfy-kitchen's nvfp4 layout) or "pack" (Quantize's QuantLinear)."""
    from lowbit_pipe.comfy import layout

    found = []
    for name, module in tree.named_modules():
        if isinstance(module, QuantLinear):
            if module.format.name == "nvfp4":
                found.append((name, "pack"))
            continue
        weight = getattr(module, "_parameters", {}).get("weight")
        if layout.is_lowbit(weight) and weight._params.format_name == "nvfp4":
            found.append((name, "file"))
        elif getattr(weight, "_layout_cls", None) == STOCK_NVFP4_LAYOUT:
            found.append((name, "stock"))
    return found


def stock_weight(module: nn.Module, where: str) -> Any:
    """A stock nvfp4 layer's weight as lowbit_pipe's QuantizedWeight (the same tensors), checked by the format."""
    from lowbit_pipe.formats import get_format
    from lowbit_pipe.formats.base import WEIGHT_ONLY_KEY

    weight = module._parameters["weight"]
    p = weight._params
    if getattr(p, "transposed", False) or getattr(module, "pre_quant_scale", None) is not None:
        raise ValueError(f"{where}: a stock nvfp4 weight with a pre_quant_scale or stored transposed; lowbit_pipe's "
                         "nvfp4 format computes neither (leave this MODEL's compute on auto)")
    n, k = (int(s) for s in p.orig_shape)
    record: dict[str, Any] = {"format": "nvfp4"}
    if tuple(weight._qdata.shape) != (n, k // 2):
        record["lowbit_shape"] = [n, k]
    if getattr(module, "_full_precision_mm_config", False):
        record[WEIGHT_ONLY_KEY] = True
    tensors = {"weight": weight._qdata, "weight_scale": p.block_scale, "weight_scale_2": p.scale}
    input_scale = getattr(module, "input_scale", None)
    if isinstance(input_scale, torch.Tensor):
        tensors["input_scale"] = input_scale.detach().float().reshape(())
    return get_format("nvfp4").from_tensors(tensors, record, where)


def _set_layer(module: nn.Module, name: str, kind: str, mode: str, where: str) -> None:
    """Set `mode` on one layer of the copy (its module is the copy's own; the weight tensors stay shared)."""
    from lowbit_pipe.comfy import layout

    if kind == "pack":
        module.compute = mode
        return
    weight = module._parameters["weight"]
    if kind == "file":
        qt = type(weight)(weight._qdata, layout.LAYOUT_NAME, dataclasses.replace(weight._params, compute=mode))
    else:
        q = stock_weight(module, f"{where}: layer '{name}'")
        q.compute = mode
        qt = layout.to_quantized_tensor(q, weight._params.orig_dtype)
        module.quant_format, module.layout_type = CONVERTED_KIND, layout.LAYOUT_NAME
    module._parameters["weight"] = layout.as_parameter(qt)
    module._full_precision_mm = False  # the setting decides (a weight-only record: `weight_only` / `auto` honour it)


def with_nvfp4_compute(model: Any, mode: str, made_by: str = "Compute (lowbit_pipe)",
                       node_id: str | None = None) -> tuple[Any, str]:
    """(MODEL, text): `model` as it is for "auto", else a MODEL of its own whose nvfp4 layers compute by `mode`,
    recorded in the run behind `model` (one of this call's own for a MODEL no pack node made)."""
    from lowbit_pipe.comfy import layout

    if mode not in NVFP4_COMPUTE:
        raise ValueError(f"{made_by}: nvfp4_compute '{mode}' is not one of {', '.join(NVFP4_COMPUTE)}")
    source = model.get_model_object("diffusion_model")
    node_runs.check_usable(source, made_by)
    layers = nvfp4_layers(source)
    if mode == "auto":
        return model, f"nvfp4 compute: auto (the MODEL as given: {len(layers)} nvfp4 layers at their default)"
    if not layers:
        raise ValueError(f"{made_by}: this MODEL has no nvfp4 layer (a file's nvfp4 / lowbit_nvfp4 layers, or "
                         "Quantize's nvfp4 layers); other formats have no compute choice")
    if any(kind != "pack" for _, kind in layers) and layout.LAYOUT_NAME not in layout.ck_base.LAYOUTS:
        raise ValueError(f"{made_by}: the pack's loader registration is not active in this ComfyUI (see its log at "
                         "start): file layers cannot take a compute setting")
    return _apply(model, source, layers, mode, made_by, node_id)


def _apply(model: Any, source: nn.Module, layers: list[tuple[str, str]], mode: str, made_by: str,
           node_id: str | None) -> tuple[Any, str]:
    from lowbit_pipe.comfy.patchers import model_with_tree, release_weights
    from lowbit_pipe.comfy.tree import structural_copy
    from lowbit_pipe.ledger import Ledger

    state = node_runs.state_of(source)
    release_weights(model)  # the copy takes the model's own weights, not another clone's patched ones
    tree = structural_copy(source)
    for name, kind in layers:
        _set_layer(tree.get_submodule(name), name, kind, mode, made_by)
    if state is None:
        run = NodeRun(Ledger(), made_by, node_id)
        new_state = NodeState(run, source, base=tree)
    else:  # a LoRA node after this one re-attaches to `base`: this copy where no LoRA is on it yet
        run = state.run
        new_state = NodeState(run, state.source, base=tree if not state.loras else state.base, loras=state.loras)
    float_tree = new_state.source
    node_runs.set_state(tree, new_state)
    run.ledger.record("comfy_compute", f"{made_by}: nvfp4 compute {mode} on {len(layers)} layers",
                      lambda: node_runs.hollow(tree, float_tree), check=lambda: node_runs.state_gone(tree))
    for name, kind in layers:
        module = tree.get_submodule(name)
        run.ledger.watch(f"{made_by}: {name}", module if kind == "pack" else module.weight._params)
    counts = {kind: sum(1 for _, k in layers if k == kind) for kind in ("file", "stock", "pack")}
    text = (f"nvfp4 compute: {mode} on {len(layers)} layers ({counts['file']} of the pack's file kinds, "
            f"{counts['stock']} stock nvfp4, {counts['pack']} from Quantize)")
    return model_with_tree(model, tree, run.clone_id), text


class LowbitCompute:
    DESCRIPTION = ("Sets how the model's nvfp4 layers compute, on a copy (the MODEL given is unchanged): auto (as "
                   "loaded: before Blackwell ComfyUI runs nvfp4 weight-only), weight_only, nvfp4 (NVFP4 activations "
                   "emulated: the file's numerics) or fp8 (Hopper's fp8 tensor cores: faster than weight-only, a "
                   "little more error). Works on nvfp4 files (stock or the pack's kinds) and on Quantize's MODEL. "
                   "Put it after the LoRA nodes. Purge gives it back.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("the model with its nvfp4 layers computing as set (a new MODEL; auto: the MODEL given)",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802 - ComfyUI's name
        return {"required": {
            "model": ("MODEL", {"tooltip": "a model with nvfp4 layers (an nvfp4 file, or Quantize's MODEL)"}),
            "nvfp4_compute": (list(NVFP4_COMPUTE), {"default": "auto", "tooltip": (
                "auto: as loaded; weight_only: dequantize + a GEMM in the input's dtype; nvfp4: NVFP4 activations "
                "(emulated before Blackwell); fp8: fp8 weights and activations on fp8 tensor cores (Hopper)")}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def IS_CHANGED(cls, unique_id: str | None = None, **_: Any) -> str:  # noqa: N802
        return f"purges={PURGES.of(unique_id)}"

    def apply(self, model: Any, nvfp4_compute: str = "auto", unique_id: str | None = None) -> dict[str, Any]:
        made_by = f"Compute (lowbit_pipe) node {unique_id}" if unique_id else "Compute (lowbit_pipe)"
        out, text = with_nvfp4_compute(model, nvfp4_compute, made_by, unique_id)
        return {"ui": {"text": [text]}, "result": (out,)}
