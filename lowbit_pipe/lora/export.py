"""Residual LoRA branches -> one LoRA file next to the model, named as the exported checkpoint is.

Baked LoRAs need nothing: they are in the weights. Residual branches are written as ONE LoRA:
per layer the concatenated pair the forward uses (`lora_A` [sum r, in], `lora_B` [out, sum r]),
with every adapter's scale (strength * alpha / rank, or strength * alpha / sqrt(rank) for an
rslora adapter) already folded into lora_B and no alpha keys nor adapter config, so it means
scale 1 to every loader (ComfyUI without `.alpha`: 1; diffusers / peft: alpha = rank). Loaded at
strength 1 it reproduces the residual exactly.

Key style follows the model file's layout (`layout`):

- "native" (export.layout=comfy, the default): `diffusion_model.<native module>.lora_A.weight` /
  `.lora_B.weight`, the native modules of the exported checkpoint through the same key map the
  export uses. Stock ComfyUI maps `diffusion_model.<module>` onto `<module>.weight` of any model
  (comfy/lora.py, `model_lora_keys_unet`). A fused native module (FLUX `qkv`, `linear1`) gets one
  exact pair: down = the parts' downs stacked [sum r, in], up = each part's up placed at the part's
  output rows and its own rank columns [out, sum r] (block diagonal; the other entries zero).
- "diffusers": peft / diffusers style, `transformer.<diffusers module>.lora_A.weight`; ComfyUI maps
  those for FLUX and Krea 2 (a fused FLUX part goes to its rows of `qkv` / `linear1`). A model with
  native names (a ComfyUI one) has a fused layer's pair cut into its parts' rows (each part keeping
  only the rank columns it uses).

The header metadata (`lowbit_pipe_lora`) says the key style and lists the adapters it was built from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit_pipe.errors import LoraError
from lowbit_pipe.lora.branches import LoraStack

METADATA_KEY = "lowbit_pipe_lora"
LAYOUTS = ("native", "diffusers")
PREFIX = {"native": "diffusion_model.", "diffusers": "transformer."}


@dataclass(frozen=True)
class ResidualPair:
    """One module's pair in the file: delta W = up @ down (every scale folded into up)."""

    module: str  # as written, without the key prefix
    down: torch.Tensor  # [sum r, in]
    up: torch.Tensor  # [out, sum r]
    sources: tuple[str, ...]  # the model's layers it came from


def residual_stacks(model: nn.Module) -> dict[str, LoraStack]:
    """{layer name: its non-empty LoraStack} in the model (not the ledger's float originals)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraStack) and module.branches and name.endswith(".lora"):
            out[name[: -len(".lora")]] = module
    return out


def has_residual_lora(model: nn.Module) -> bool:
    return bool(residual_stacks(model))


def _pairs_as_named(stacks: dict[str, LoraStack]) -> list[ResidualPair]:
    return [ResidualPair(name, s.down.detach(), s.up.detach(), (name,)) for name, s in stacks.items()]


def _swap_halves(up: torch.Tensor, layer: str, in_features: int) -> torch.Tensor:
    """Rows (scale, shift) <-> (shift, scale), as the key map swaps a modulation weight of 2 x in rows."""
    if up.shape[0] != 2 * in_features:
        return up
    a, b = up.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _to_native(stacks: dict[str, LoraStack], model: nn.Module, arch: Any, config: Any) -> list[ResidualPair]:
    """Diffusers-named branches -> pairs on the native modules (fused ones combined exactly)."""
    out: list[ResidualPair] = []
    fused: dict[str, list[tuple[str, LoraStack]]] = {}
    for name, stack in stacks.items():
        native, rows = arch.to_native(name, config)
        if rows is not None:
            fused.setdefault(native, []).append((name, stack))
            continue
        up = stack.up.detach()
        if arch.keymap.is_swapped(native):
            up = _swap_halves(up, name, stack.in_features)
        out.append(ResidualPair(native, stack.down.detach(), up, (name,)))
    for native, members in fused.items():
        # Every part's rows in the fused layer, from the parts' own sizes (parts without a branch too).
        parts = arch.from_native_name(native, config)
        offsets, start = {}, 0
        for part, _ in parts:
            try:
                size = model.get_submodule(part).out_features
            except AttributeError as err:
                raise LoraError(f"residual LoRA export: '{native}' fuses {[p for p, _ in parts]}, but the model has "
                                f"no Linear '{part}' to size its rows ({err})") from err
            offsets[part] = (start, start + size)
            start += size
        total = start
        for part, rows in parts:  # the key map's rows must be these (a wrong hidden size would misplace them)
            lo, hi = offsets[part]
            if rows.indices(total)[:2] != (lo, hi):
                raise LoraError(f"residual LoRA export: '{part}' sits at rows {lo}:{hi} of '{native}' by the model's "
                                f"sizes but at {rows} by the key map; the model's config does not fit its layers")
        members.sort(key=lambda m: offsets[m[0]][0])
        downs, blocks = _fused_blocks(members)
        rank = sum(d.shape[0] for d in downs)
        first = members[0][1].up
        up = torch.zeros(total, rank, dtype=first.dtype, device=first.device)
        for (name, stack), cols in zip(members, blocks):
            lo, hi = offsets[name]
            for (start, width), col in cols:
                up[lo:hi, col:col + width] = stack.up.detach()[:, start:start + width]
        out.append(ResidualPair(native, torch.cat(downs, dim=0), up, tuple(n for n, _ in members)))
    return out


Blocks = list[list[tuple[tuple[int, int], int]]]  # per part: ((start, width) in its stack's up, fused column)


def _fused_blocks(members: list[tuple[str, LoraStack]]) -> tuple[list[torch.Tensor], Blocks]:
    """The fused pair's down blocks, and per part [((start, width) of its up columns, fused column)].

    One adapter whose parts all carry the same down (a file written for the fused layer: one pair split
    by rows when attached) keeps that down once, its parts' ups stacked in the same columns; otherwise
    each part's branch gets columns of its own (block diagonal). Both are exact: a row of up @ down only
    reads that row of up."""
    downs: list[torch.Tensor] = []
    blocks: list[list[tuple[tuple[int, int], int]]] = [[] for _ in members]
    col = 0
    spans = []  # per part: {adapter: (start, width, down)} in its stack's column order
    for _, stack in members:
        start, span = 0, {}
        for b in stack.branches:
            span[b.name] = (start, b.rank, stack.down.detach()[start:start + b.rank])
            start += b.rank
        spans.append(span)
    names = list(dict.fromkeys(n for span in spans for n in span))
    for name in names:
        holders = [i for i, span in enumerate(spans) if name in span]
        first = spans[holders[0]][name][2]
        if len(holders) > 1 and all(torch.equal(spans[i][name][2], first) for i in holders):
            downs.append(first)
            for i in holders:
                blocks[i].append((spans[i][name][:2], col))
            col += first.shape[0]
            continue
        for i in holders:
            start, width, down = spans[i][name]
            downs.append(down)
            blocks[i].append(((start, width), col))
            col += width
    return downs, blocks


def _to_diffusers(stacks: dict[str, LoraStack], arch: Any, config: Any) -> list[ResidualPair]:
    """Natively named branches (a ComfyUI model) -> pairs on the diffusers modules; a fused layer's pair is
    cut into its parts' rows, each part keeping the rank columns it uses."""
    out: list[ResidualPair] = []
    for name, stack in stacks.items():
        parts = arch.from_native_name(name, config)
        down, up = stack.down.detach(), stack.up.detach()
        if len(parts) == 1 and parts[0][1] is None:
            if arch.keymap.is_swapped(name):
                up = _swap_halves(up, name, stack.in_features)
            out.append(ResidualPair(parts[0][0], down, up, (name,)))
            continue
        for part, rows in parts:
            piece = up[rows]
            used = piece.ne(0).any(dim=0)
            if 0 < int(used.sum()) < piece.shape[1]:
                out.append(ResidualPair(part, down[used], piece[:, used], (name,)))
            else:
                out.append(ResidualPair(part, down, piece, (name,)))
    return out


def residual_pairs(model: nn.Module, layout: str = "diffusers", *, arch: Any = None, config: Any = None,
                   native: bool | None = None) -> list[ResidualPair]:
    """The model's residual branches as the file's pairs, named for `layout` ("native" or "diffusers").

    `arch` / `config` / `native` (whether the model's modules carry native names) as the export knows
    them; detected from the model when not given. A model of no known architecture, or of one whose
    native names are its diffusers names, keeps its module names."""
    if layout not in LAYOUTS:
        raise ValueError(f"residual LoRA layout '{layout}': expected one of {list(LAYOUTS)}")
    stacks = residual_stacks(model)
    if arch is None or native is None or config is None:
        from lowbit_pipe.arch.detect import detect_module

        found = detect_module(model)
        if found is not None:
            arch = arch or found.arch
            config = config or found.config
            native = found.native if native is None else native
    if arch is None or arch.keymap is None or (layout == "native") == bool(native):
        return _pairs_as_named(stacks)
    if config is None:
        config = arch.config_from_model(model)
    if layout == "native":
        return _to_native(stacks, model, arch, config)
    return _to_diffusers(stacks, arch, config)


def residual_state_dict(model: nn.Module, layout: str = "diffusers", **kw: Any) -> dict[str, torch.Tensor]:
    """{key: tensor} of the residual LoRA file (see the module doc); kw: `residual_pairs`'s."""
    state = {}
    for pair in residual_pairs(model, layout, **kw):
        key = f"{PREFIX[layout]}{pair.module}"
        if f"{key}.lora_A.weight" in state:
            raise LoraError(f"residual LoRA export: two layers map to '{pair.module}' ({pair.sources})")
        state[f"{key}.lora_A.weight"] = pair.down.cpu().contiguous()
        state[f"{key}.lora_B.weight"] = pair.up.cpu().contiguous()
    return state


def residual_metadata(model: nn.Module, layout: str = "diffusers") -> dict[str, str]:
    """The file's header metadata: key style, and the adapters (strength, source, layers, ranks, alphas)."""
    adapters: dict[str, dict] = {}
    for stack in residual_stacks(model).values():
        for b in stack.branches:
            a = adapters.setdefault(b.name, {"strength": b.strength, "source": b.source, "layers": 0, "ranks": set(),
                                             "alphas": set(), "rslora": False})
            a["layers"] += 1
            a["rslora"] = a["rslora"] or b.rslora
            a["ranks"].add(b.rank)
            a["alphas"].add(b.alpha)
    meta = {name: {**a, "ranks": sorted(a["ranks"]), "alphas": sorted(a["alphas"])} for name, a in adapters.items()}
    header = {"key_style": layout, "prefix": PREFIX[layout], "scale_folded": True, "adapters": meta}
    return {METADATA_KEY: json.dumps(header)}


def save_residual_lora(model: nn.Module, path: str | Path, layout: str = "diffusers", **kw: Any) -> int:
    """Write the model's residual LoRA branches as one LoRA file in `layout`'s key style ("native":
    ComfyUI names, "diffusers": peft names); kw: `residual_pairs`'s. Returns bytes written (0: no branch,
    no file)."""
    from lowbit_pipe.files.checkpoint import atomic_save

    if not has_residual_lora(model):
        return 0
    state = residual_state_dict(model, layout, **kw)
    return atomic_save(state, path, residual_metadata(model, layout))
