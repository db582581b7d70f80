"""ComfyUI's own LoRA (weight patches on a MODEL) -> exact residual branches on the quantized layers.

A MODEL that went through ComfyUI's LoRA loaders carries `patches`: {"diffusion_model.<layer>.weight": [(
strength_patch, adapter, strength_model, offset, function), ...]}, applied to the float weight when ComfyUI
loads the model (comfy/model_patcher.py; the low-rank adapter's delta is strength_patch * alpha / rank * up @
down, or strength_patch * up @ down without an alpha: comfy/weight_adapter/lora.py). On a quantized layer
such a patch would be applied to the packed weight (or crash on it), and a small LoRA step drowns in a 4-bit
grid anyway. So the Quantize node takes every plain low-rank patch of a layer it quantizes off the MODEL and
puts it back as a residual branch with the same delta: delta = strength_patch * scale * up @ down, on the
layer's float input. Patches on layers that stay float stay ComfyUI's. What cannot be a branch (DoRA, LoCon
mid weights, LoKr / LoHa, full diffs, strength_model != 1, and, unless the caller gives the layers' shapes,
offsets and weight functions) on a quantized layer is refused with the layer named, before the MODEL is handed
out.

With the layers' shapes (`read_patches(..., shape_of=)`), two more patch forms are plain low-rank ones:
- an offset `(dim, start, size)`: ComfyUI applies the patch to `weight.narrow(dim, start, size)` (a diffusers
  LoRA's q / k / v on FLUX's fused `qkv`, `linear1`: comfy/lora.py, `model_lora_keys_unet`); as a branch, `up`
  (dim 0, output rows) or `down` (dim 1, input columns) zero-padded to the whole layer;
- ComfyUI's `swap_scale_shift` function (comfy/utils.py: the two row halves of the delta swapped; FLUX's
  `final_layer.adaLN_modulation.1` from diffusers' `norm_out.linear`): `up`'s row halves swapped.
Any other weight function is refused.

No ComfyUI import: the adapters are read by their documented fields (`name`, `weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

PREFIX = "diffusion_model."


class UnsupportedPatchError(ValueError):
    """A ComfyUI weight patch on a quantized layer that cannot be an exact residual branch."""


@dataclass(frozen=True)
class LowRankPatch:
    """One plain low-rank ComfyUI patch: delta W = strength * scale * up @ down."""

    layer: str  # native module name (no "diffusion_model." prefix)
    index: int  # its place in the layer's patch list (one LoRA loader node = one place, usually)
    down: torch.Tensor  # [rank, in] (the whole layer's in: zero columns outside an input offset)
    up: torch.Tensor  # [out, rank] (the whole layer's out: zero rows outside an output offset)
    scale: float  # alpha / rank, or 1 without alpha
    strength: float
    alpha: float | None = None  # the adapter's alpha (None: ComfyUI's scale is 1)


@dataclass
class WeightPatches:
    """A MODEL's weight patches, sorted: low-rank ones per layer, and why the others cannot be branches."""

    low_rank: dict[str, list[LowRankPatch]] = field(default_factory=dict)
    other: dict[str, str] = field(default_factory=dict)  # patch key -> why it is not a plain low-rank patch

    @property
    def layers(self) -> set[str]:
        return set(self.low_rank) | {_layer_of(k) for k in self.other if _layer_of(k)}


def _layer_of(key: str) -> str | None:
    if key.startswith(PREFIX) and key.endswith(".weight"):
        return key[len(PREFIX):-len(".weight")]
    return None


ShapeOf = Callable[[str], "tuple[int, int] | None"]  # native layer name -> (out_features, in_features), None: no layer


def read_patches(patches: dict[Any, list[tuple]], shape_of: ShapeOf | None = None) -> WeightPatches:
    """Sort a ModelPatcher's `patches` dict. With `shape_of`, offsets and ComfyUI's `swap_scale_shift` are placed
    on the whole layer (module doc); without, they are refused like any other patch form."""
    out = WeightPatches()
    for key, entries in patches.items():
        key = key if isinstance(key, str) else key[0]
        layer = _layer_of(key)
        for index, entry in enumerate(entries):
            why = _not_low_rank(entry, placeable=shape_of is not None)
            shape = shape_of(layer) if why is None and layer is not None and shape_of is not None else None
            if why is None and shape_of is not None and shape is None:
                why = "not a Linear layer's weight"
            if layer is None or why is not None:
                out.other.setdefault(key, why or "not a Linear weight")
                continue
            strength, adapter = float(entry[0]), entry[1]
            up, down, alpha = adapter.weights[0], adapter.weights[1], adapter.weights[2]
            rank = int(down.shape[0])
            scale = float(alpha) / rank if alpha is not None else 1.0
            down, up = down.reshape(rank, -1), up.reshape(up.shape[0], rank)
            if shape is not None:
                placed = _placed(down, up, shape, *(tuple(entry) + (None,) * 5)[3:5])
                if isinstance(placed, str):
                    out.other.setdefault(key, placed)
                    continue
                down, up = placed
            out.low_rank.setdefault(layer, []).append(LowRankPatch(layer, index, down, up, scale, strength,
                                                                   float(alpha) if alpha is not None else None))
    return out


def _placed(down: torch.Tensor, up: torch.Tensor, shape: tuple[int, int], offset: Any,
            function: Any) -> tuple[torch.Tensor, torch.Tensor] | str:
    """The factors on the whole [out, in] layer: an offset's slice zero-padded, ComfyUI's swap_scale_shift as
    swapped `up` halves; a reason string where the result would not be the delta ComfyUI computes."""
    out_f, in_f = shape
    if offset is not None:
        dim, start, size = (int(v) for v in offset)
        full = (out_f, in_f)[dim] if dim in (0, 1) else None
        part = (up.shape[0], down.shape[1])[dim] if dim in (0, 1) else None
        if full is None or part != size or start < 0 or start + size > full:
            return f"an offset {tuple(offset)} that does not fit the {out_f}x{in_f} layer with {tuple(up.shape)} @ " \
                   f"{tuple(down.shape)} factors"
        if dim == 0:
            up = torch.zeros(out_f, up.shape[1], dtype=up.dtype, device=up.device).index_copy_(
                0, torch.arange(start, start + size, device=up.device), up)
        else:
            down = torch.zeros(down.shape[0], in_f, dtype=down.dtype, device=down.device).index_copy_(
                1, torch.arange(start, start + size, device=down.device), down)
    if up.shape[0] != out_f or down.shape[1] != in_f:
        return f"factors {tuple(up.shape)} @ {tuple(down.shape)} that do not fit the {out_f}x{in_f} layer"
    if function is not None:
        if offset is not None or out_f % 2:
            return "a weight function on part of a layer"
        up = torch.cat([up[out_f // 2:], up[: out_f // 2]])  # swap_scale_shift of delta = of up's rows
    return down, up


def is_swap_scale_shift(function: Any) -> bool:
    """ComfyUI's `comfy.utils.swap_scale_shift` (by its module and name: this module imports no ComfyUI)."""
    return getattr(function, "__module__", None) == "comfy.utils" and getattr(function, "__name__", None) == "swap_scale_shift"


def _not_low_rank(entry: tuple, placeable: bool = False) -> str | None:
    strength_patch, adapter, strength_model, offset, function = (tuple(entry) + (None,) * 5)[:5]
    if isinstance(adapter, (tuple, list)):  # ComfyUI's tensor patches: ("diff", ...), ("set", ...), (tensor,), ...
        kind = adapter[0] if len(adapter) == 2 and isinstance(adapter[0], str) else "diff"
        return f"a full-weight '{kind}' patch (only plain LoRA can be a residual branch)"
    if getattr(adapter, "name", None) != "lora" or not isinstance(getattr(adapter, "weights", None), tuple):
        return f"a {type(adapter).__name__} patch (only plain LoRA can be a residual branch)"
    up, down, _alpha, mid, dora_scale, reshape = (tuple(adapter.weights) + (None,) * 6)[:6]
    if mid is not None:
        return "a LoRA with mid weights (LoCon)"
    if dora_scale is not None:
        return "a DoRA (its delta depends on the weight itself)"
    if reshape is not None:
        return "a LoRA that reshapes the weight"
    if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor)) or up.dim() != 2 or down.dim() != 2:
        return "a LoRA whose factors are not 2-D"
    if not placeable and (offset is not None or function is not None):
        return "a patch with an offset or a weight function"
    if function is not None and not is_swap_scale_shift(function):
        return f"a patch with a weight function ({getattr(function, '__qualname__', type(function).__name__)})"
    if float(strength_model) != 1.0:
        return f"strength_model {strength_model} (it scales the weight itself)"
    return None


def as_lora_states(patches: list[LowRankPatch]) -> list[tuple[dict[str, torch.Tensor], float]]:
    """The patches as LoRA state dicts in native names (one per patch-list place, like one LoRA file each),
    with ComfyUI's scale folded into `lora_B` and alpha = rank (scale 1 to every reader): [(state, strength)].
    A place whose layers carry different strengths is split per strength."""
    groups: dict[tuple[int, float], dict[str, torch.Tensor]] = {}
    for p in patches:
        state = groups.setdefault((p.index, p.strength), {})
        state[f"{p.layer}.lora_A.weight"] = p.down
        state[f"{p.layer}.lora_B.weight"] = p.up * p.scale if p.scale != 1.0 else p.up
        state[f"{p.layer}.alpha"] = torch.tensor(float(p.down.shape[0]))
    return [(state, strength) for (_, strength), state in sorted(groups.items(), key=lambda kv: kv[0])]
