"""ComfyUI's own LoRA (weight patches on a MODEL) -> exact residual branches on the quantized layers.

A MODEL that went through ComfyUI's LoRA loaders carries `patches`: {"diffusion_model.<layer>.weight": [(
strength_patch, adapter, strength_model, offset, function), ...]}, applied to the float weight when ComfyUI
loads the model (comfy/model_patcher.py; the low-rank adapter's delta is strength_patch * alpha / rank * up @
down, or strength_patch * up @ down without an alpha: comfy/weight_adapter/lora.py). On a quantized layer
such a patch would be applied to the packed weight (or crash on it), and a small LoRA step drowns in a 4-bit
grid anyway. So the Quantize node takes every plain low-rank patch of a layer it quantizes off the MODEL and
puts it back as a residual branch with the same delta: delta = strength_patch * scale * up @ down, on the
layer's float input. Patches on layers that stay float stay ComfyUI's. What cannot be a branch (DoRA, LoCon
mid weights, LoKr / LoHa, full diffs, offsets, weight functions, strength_model != 1) on a quantized layer is
refused with the layer named, before the MODEL is handed out.

No ComfyUI import: the adapters are read by their documented fields (`name`, `weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

PREFIX = "diffusion_model."


class UnsupportedPatchError(ValueError):
    """A ComfyUI weight patch on a quantized layer that cannot be an exact residual branch."""


@dataclass(frozen=True)
class LowRankPatch:
    """One plain low-rank ComfyUI patch: delta W = strength * scale * up @ down."""

    layer: str  # native module name (no "diffusion_model." prefix)
    index: int  # its place in the layer's patch list (one LoRA loader node = one place, usually)
    down: torch.Tensor  # [rank, in]
    up: torch.Tensor  # [out, rank]
    scale: float  # alpha / rank, or 1 without alpha
    strength: float


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


def read_patches(patches: dict[Any, list[tuple]]) -> WeightPatches:
    """Sort a ModelPatcher's `patches` dict."""
    out = WeightPatches()
    for key, entries in patches.items():
        key = key if isinstance(key, str) else key[0]
        layer = _layer_of(key)
        for index, entry in enumerate(entries):
            why = _not_low_rank(entry)
            if layer is None or why is not None:
                out.other.setdefault(key, why or "not a Linear weight")
                continue
            strength, adapter = float(entry[0]), entry[1]
            up, down, alpha = adapter.weights[0], adapter.weights[1], adapter.weights[2]
            rank = int(down.shape[0])
            scale = float(alpha) / rank if alpha is not None else 1.0
            out.low_rank.setdefault(layer, []).append(
                LowRankPatch(layer, index, down.reshape(rank, -1), up.reshape(up.shape[0], rank), scale, strength))
    return out


def _not_low_rank(entry: tuple) -> str | None:
    strength_patch, adapter, strength_model, offset, function = (tuple(entry) + (None,) * 5)[:5]
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
    if offset is not None or function is not None:
        return "a patch with an offset or a weight function"
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
