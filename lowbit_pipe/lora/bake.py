"""Bake LoRA deltas into weights: `standard` (dequantize, add, requantize to nearest) and
`stochastic` (the same, with seeded stochastic rounding: unbiased, so small deltas survive on
average instead of washing out below half a quantization step).

Several stacks are pooled first (delta = sum over files), so each layer is requantized once.
The requantized layer keeps its format, rotation, granularity and static input scale.
Stochastic rounding: formats whose `quantize` takes a `generator` do it themselves (int8,
convrot_w4a4); fp8 and nvfp4 are done here on their value grids with the scales the format
chose; other formats fall back to nearest rounding with a warning.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
import zlib
from typing import Callable

import torch
from torch import nn

from lowbit_pipe.errors import LoraError
from lowbit_pipe.formats import FormatSpec, QuantizedWeight, common, get_format
from lowbit_pipe.formats.base import ACT_GRANULARITY_KEY
from lowbit_pipe.kernels import reference, rotation
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.recipe import BAKE_MODES  # lora.mode's baking modes (their names live with the recipe's schema)


def spec_of(layer: QuantLinear, where: str = "") -> FormatSpec:
    """The FormatSpec that reproduces a QuantLinear's layout (read from its record and tensors)."""
    record, tensors = layer.record, layer.qweight.tensors
    kind, group = common.record_rotation(record, where or layer.format.name)
    scale = tensors.get("weight_scale")
    granularity = "tensor" if layer.format.name in ("int8", "fp8") and scale is not None and scale.numel() == 1 else "row"
    return FormatSpec(layer.format.name, kind, group or None, granularity,
                      "static" if "input_scale" in tensors else "dynamic",
                      act_granularity=record.get(ACT_GRANULARITY_KEY))


def layer_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """Per-layer stream: results do not depend on the order layers are baked in."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def stochastic_round(x: torch.Tensor, table: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round each value to one of its two neighbours in the sorted `table`, up with probability
    (x - lo) / (hi - lo): E[result] = x (values outside the table are clamped first)."""
    table = table.to(x.device)
    x = x.clamp(float(table[0]), float(table[-1])).contiguous()
    hi_idx = torch.searchsorted(table, x).clamp(1, table.numel() - 1)
    lo, hi = table[hi_idx - 1], table[hi_idx]
    p = (x - lo) / (hi - lo)
    u = torch.rand(x.shape, generator=generator, device=x.device)
    return torch.where(u < p, hi, lo)


def _e4m3_table() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(values[torch.isfinite(values)])


def _e2m1_table() -> torch.Tensor:
    v = torch.tensor(reference.E2M1_VALUES)
    return torch.unique(torch.cat([-v, v]))


def _rotated(w: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    kind, group = common.spec_rotation(spec, w.shape[1])
    return rotation.rotate_weight(w, kind, group)


def _sr_fp8(w: torch.Tensor, spec: FormatSpec, generator: torch.Generator) -> QuantizedWeight:
    q = get_format("fp8").quantize(w, spec)  # scales exactly as the format picks them
    scale = q.tensors["weight_scale"]
    x = _rotated(w, spec) * (1.0 / scale.float())
    codes = stochastic_round(x, _e4m3_table(), generator).to(torch.float8_e4m3fn)  # exact: on the grid
    return QuantizedWeight(q.format, q.shape, dict(q.tensors, weight=codes), q.record)


def _sr_nvfp4(w: torch.Tensor, spec: FormatSpec, generator: torch.Generator) -> QuantizedWeight:
    q = get_format("nvfp4").quantize(w, spec)
    packed = q.tensors["weight"]
    np_, kp = packed.shape[0], packed.shape[1] * 2
    w_rot = _rotated(w, spec)
    w_rot = nn.functional.pad(w_rot, (0, kp - w_rot.shape[1], 0, np_ - w_rot.shape[0]))
    block = reference.unswizzle_block_scales(q.tensors["weight_scale"], np_, kp // 16).float()
    total = (q.tensors["weight_scale_2"].float() * block).unsqueeze(-1)
    blocks = w_rot.reshape(np_, kp // 16, 16)
    x = torch.where(total == 0, torch.zeros_like(blocks), blocks / torch.where(total == 0, torch.ones_like(total), total))
    values = stochastic_round(x.reshape(np_, kp), _e2m1_table(), generator)
    packed = common.pack_nibbles(reference.e2m1_encode(values), even_high=True)
    return QuantizedWeight(q.format, q.shape, dict(q.tensors, weight=packed), q.record)


STOCHASTIC: dict[str, Callable[[torch.Tensor, FormatSpec, torch.Generator], QuantizedWeight]] = {
    "fp8": _sr_fp8,
    "nvfp4": _sr_nvfp4,
}


def supports_stochastic(fmt) -> bool:
    return "generator" in inspect.signature(fmt.quantize).parameters or fmt.name in STOCHASTIC


def requantize(layer: QuantLinear, weight: torch.Tensor, generator: torch.Generator | None = None,
               where: str = "") -> QuantizedWeight:
    """Quantize a float weight [out, in] into `layer`'s exact layout (stochastically with a generator)."""
    spec = spec_of(layer, where)
    fmt = layer.format
    if generator is None:
        q = fmt.quantize(weight, spec)
    elif "generator" in inspect.signature(fmt.quantize).parameters:
        q = fmt.quantize(weight, spec, generator=generator)
    elif fmt.name in STOCHASTIC:
        q = STOCHASTIC[fmt.name](weight, spec, generator)
    else:
        warnings.warn(f"{where}: format '{fmt.name}' has no stochastic rounding; baked with nearest rounding",
                      stacklevel=2)
        q = fmt.quantize(weight, spec)
    old = layer.qweight.tensors
    tensors = dict(q.tensors)
    for key in old.keys() - tensors.keys():  # e.g. a calibrated static input_scale: keep it
        tensors[key] = old[key]
    if set(tensors) != set(old):
        raise ValueError(f"{where}: requantized tensors {sorted(tensors)} differ from the layer's {sorted(old)}")
    return QuantizedWeight(q.format, q.shape, tensors, q.record)


def delta_kept(before: torch.Tensor, after: torch.Tensor, delta: torch.Tensor) -> float:
    """Fraction of `delta` the weight change carries: <after - before, delta> / |delta|^2 (1 = all of it)."""
    d = delta.double().flatten()
    return float(((after.double() - before.double()).flatten() @ d) / (d @ d).clamp_min(1e-300))


def bake_layer(layer: nn.Module, delta: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], *, mode: str,
               seed: int, where: str, ledger=None) -> float | None:
    """Add `delta` (fp32 [out, in], or a function of the current fp32 weight, for DoRA) to one layer.

    QuantLinear: requantized in place (its buffers replaced; the ledger records the originals).
    nn.Linear, or another float Linear (`files.is_linear`): weight replaced by (W + delta) in its
    dtype; one with quantized storage lowbit_pipe does not own is refused (`check_bakeable`).
    Returns the fraction of delta kept (quantized layers), else None.
    """
    if mode not in BAKE_MODES:
        raise ValueError(f"unknown bake mode '{mode}' (known: {list(BAKE_MODES)})")
    if isinstance(layer, QuantLinear):
        before = layer.dequantize()
        d = delta(before) if callable(delta) else delta.to(before.device)
        gen = layer_generator(seed, where, before.device) if mode == "stochastic" else None
        q = requantize(layer, before + d, gen, where)
        new = {k: t.to(getattr(layer, k).device) for k, t in q.tensors.items()}
        _replace(layer, new, where, ledger)
        return delta_kept(before, layer.dequantize(), d)
    check_bakeable(layer, where)
    w = layer.weight
    d = delta(w.detach().float()) if callable(delta) else delta.to(w.device)
    new = nn.Parameter((w.detach().float() + d).to(w.dtype), requires_grad=w.requires_grad)
    _replace(layer, {"weight": new}, where, ledger)
    return None


def check_bakeable(layer: nn.Module, where: str) -> None:
    """Raise (naming the layer) unless `bake_layer` can bake into `layer`: a QuantLinear, or a Linear with a
    plain float weight. ComfyUI's mixed-precision Linear holding a comfy-kitchen QuantizedTensor (or fp8
    storage) is refused: lowbit_pipe cannot requantize a layout it does not own."""
    from lowbit_pipe.lora.files import is_linear

    if isinstance(layer, QuantLinear):
        return
    if not is_linear(layer):
        raise TypeError(f"cannot bake a LoRA into '{where}': {type(layer).__name__} is not a Linear or QuantLinear")
    w = layer.weight
    if type(w.data) is not torch.Tensor or w.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise LoraError(f"cannot bake a LoRA into '{where}': its weight is a {type(w.data).__name__} of dtype "
                        f"{w.dtype} (quantized storage lowbit_pipe does not own, e.g. a layer ComfyUI loaded "
                        "quantized); a DoRA or dense adapter needs the weight rewritten: use ComfyUI's own LoRA loader "
                        "for it, or quantize the float model with lowbit_pipe and attach it there")


def bake_group(layers: list[tuple[str, QuantLinear]], deltas: dict[str, Callable[[torch.Tensor], torch.Tensor]], *,
               mode: str, seed: int, ledger=None) -> list[float]:
    """Bake into layers that were quantized as ONE fused native weight (FLUX qkv / linear1): requantize the
    fused weight jointly and split it, so the parts keep sharing their per-tensor scales and the native
    export stays exact. `deltas`: per layer name (layers without one only get requantized)."""
    from lowbit_pipe.files.layout import split_rows

    if mode not in BAKE_MODES:
        raise ValueError(f"unknown bake mode '{mode}' (known: {list(BAKE_MODES)})")
    label = "+".join(name for name, _ in layers)
    befores, news = [], []
    for name, layer in layers:
        before = layer.dequantize()
        d = deltas[name](before) if name in deltas else torch.zeros_like(before)
        befores.append((before, d))
        news.append(before + d)
    first = layers[0][1]
    gen = layer_generator(seed, label, news[0].device) if mode == "stochastic" else None
    fused = torch.cat(news)
    q = requantize(first, fused, gen, label)
    bounds, start = [], 0
    for name, layer in layers:
        bounds.append((name, start, start + layer.out_features))
        start += layer.out_features
    parts = split_rows(label, q.tensors, fused.shape[0], bounds, first.format.row_axes)
    kept = []
    for (name, layer), (before, d) in zip(layers, befores):
        _replace(layer, {k: t.to(getattr(layer, k).device) for k, t in parts[name].items()}, name, ledger)
        if name in deltas:
            kept.append(delta_kept(before, layer.dequantize(), d))
    return kept


def _replace(layer: nn.Module, tensors: dict[str, torch.Tensor], where: str, ledger=None) -> None:
    """Put new tensors in a layer's parameter / buffer slots; the ledger's undo puts the original objects back."""
    if getattr(layer, "prepacked", None) is not None:  # derived from the tensors replaced below: stale after
        if ledger is not None:
            ledger.patch_attr(layer, "prepacked", None, f"{where}.prepacked (cleared by the bake)")
        else:
            layer.prepacked = None
    if isinstance(layer, QuantLinear):  # its derived buffers (hadanorm row sums) follow the new tensors
        tensors = {**tensors, **layer.derived_for(tensors)}
    originals = {}
    for key, t in tensors.items():
        table = layer._parameters if key in layer._parameters else layer._buffers
        if key not in table:
            raise KeyError(f"{where}: no parameter or buffer '{key}' to bake into")
        originals[key] = table[key]
        table[key] = t
    if ledger is None:
        return
    ref = weakref.ref(layer)

    def table_of(owner: nn.Module, key: str) -> dict:
        return owner._parameters if key in owner._parameters else owner._buffers

    def undo() -> None:
        owner = ref()
        if owner is not None:
            for key, t in originals.items():
                table_of(owner, key)[key] = t

    def check() -> bool | str:
        owner = ref()
        ok = owner is None or all(table_of(owner, k)[k] is t for k, t in originals.items())
        return True if ok else "pre-bake tensors not restored"

    ledger.record("lora_bake", f"{where} (LoRA bake)", undo, check, {"originals": originals})
