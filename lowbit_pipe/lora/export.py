"""Residual LoRA branches -> one LoRA file next to the model.

Baked LoRAs need nothing: they are in the weights. Residual branches are written as ONE
peft / diffusers-style LoRA (`transformer.<diffusers module>.lora_A.weight` [sum r, in] and
`.lora_B.weight` [out, sum r]): per layer the concatenated pair the forward uses, with every
adapter's scale (strength * alpha / rank, or strength * alpha / sqrt(rank) for an rslora adapter)
already folded into lora_B and no alpha keys nor adapter config, so it means scale 1 to every
loader (diffusers / peft default alpha = rank; ComfyUI without `.alpha`: 1).
Loaded at strength 1 it reproduces the residual exactly. ComfyUI and diffusers both read this
key style for FLUX / Krea 2 (diffusers names, `transformer.` prefix); the adapters it was
built from are listed in the header metadata (`lowbit_pipe_lora`).
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from lowbit_pipe.lora.branches import LoraStack

PREFIX = "transformer."
METADATA_KEY = "lowbit_pipe_lora"


def residual_stacks(model: nn.Module) -> dict[str, LoraStack]:
    """{layer name: its non-empty LoraStack} in the model (not the ledger's float originals)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraStack) and module.branches and name.endswith(".lora"):
            out[name[: -len(".lora")]] = module
    return out


def has_residual_lora(model: nn.Module) -> bool:
    return bool(residual_stacks(model))


def residual_state_dict(model: nn.Module) -> dict:
    state = {}
    for layer, stack in residual_stacks(model).items():
        state[f"{PREFIX}{layer}.lora_A.weight"] = stack.down.detach().cpu().contiguous()
        state[f"{PREFIX}{layer}.lora_B.weight"] = stack.up.detach().cpu().contiguous()
    return state


def save_residual_lora(model: nn.Module, path: str | Path) -> int:
    """Write the model's residual LoRA branches as one LoRA file; returns bytes written (0: none, no file)."""
    from lowbit_pipe.checkpoint import atomic_save

    stacks = residual_stacks(model)
    if not stacks:
        return 0
    adapters: dict[str, dict] = {}
    for layer, stack in stacks.items():
        for b in stack.branches:
            a = adapters.setdefault(b.name, {"strength": b.strength, "source": b.source, "layers": 0, "ranks": set(),
                                             "alphas": set(), "rslora": False})
            a["layers"] += 1
            a["rslora"] = a["rslora"] or b.rslora
            a["ranks"].add(b.rank)
            a["alphas"].add(b.alpha)
    meta = {name: {**a, "ranks": sorted(a["ranks"]), "alphas": sorted(a["alphas"])} for name, a in adapters.items()}
    header = {"key_style": "diffusers", "scale_folded": True, "adapters": meta}
    return atomic_save(residual_state_dict(model), path, {METADATA_KEY: json.dumps(header)})
