"""Fallback for unknown transformers: quantize every Linear but the first and the last.

Never raises on an odd module; warns, naming the model class, so runs on unknown models stay visible.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy


def _block_paths(model: nn.Module) -> tuple[str, ...]:
    """ModuleLists of >= 2 same-class children (the repeated blocks)."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(m) for m in mod}) == 1 and name:
            if not any(name.startswith(p + ".") for p in out):
                out.append(name)
    return tuple(out)


def generic_policy(model: nn.Module) -> LayerPolicy:
    """Keep the first and last Linear (embedders / output projection) in float; block lists as found."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    keep = tuple(dict.fromkeys(names[:1] + names[-1:]))
    return LayerPolicy(keep_float=keep, sensitive=(), block_paths=_block_paths(model))


class Generic(Arch):
    """Not registered: built per model by `for_model`, so its policy can depend on the module tree."""

    id = "generic"
    diffusers_class = ""
    policy = LayerPolicy()

    def __init__(self, policy: LayerPolicy | None = None, model_class: str = ""):
        self.policy = policy or LayerPolicy()  # instance attribute shadows the empty class default
        self.model_class_name = model_class

    @classmethod
    def for_model(cls, model: nn.Module) -> Generic:
        name = type(model).__name__
        warnings.warn(f"unknown architecture '{name}': using the generic policy (all Linear layers but the first "
                      f"and the last are quantized)", stacklevel=2)
        return cls(generic_policy(model), name)

    def detect_model(self, model: nn.Module) -> bool:
        return False

    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        return False

    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        raise NotImplementedError("the generic arch has no class kwargs convention; use config_from_model")

    def config_from_model(self, model: nn.Module) -> ArchConfig:
        return self.config_from_keys({n: tuple(p.shape) for n, p in model.named_parameters()})

    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        """Best effort: hidden = most common Linear in_features; layers = entries of the largest block list."""
        ins = Counter(s[1] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2)
        hidden = ins.most_common(1)[0][0] if ins else 0
        blocks = Counter(k.split(".")[0] for k in shapes if len(k.split(".")) > 2 and k.split(".")[1].isdigit())
        prefix = blocks.most_common(1)[0][0] if blocks else None
        layers = len({k.split(".")[1] for k in shapes if prefix and k.startswith(prefix + ".")})
        outs = [s[0] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2 and s[1] == hidden]
        return ArchConfig(arch=self.id, num_layers=layers, hidden_size=hidden, num_heads=0, num_kv_heads=0,
                          head_dim=0, mlp_hidden=max(outs, default=0), extra={"model_class": self.model_class_name})

    def lora_targets(self, name: str, config: ArchConfig | None = None) -> list[tuple[str, slice | None]]:
        from lowbit_pipe.arch.lora import lora_module_name, strip_lora_prefixes

        stripped, kohya = strip_lora_prefixes(lora_module_name(name))
        return [] if kohya else [(stripped, None)]

    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        raise NotImplementedError("no example inputs for an unknown architecture")


def arch_for_model(model: nn.Module) -> Arch:
    """The registered arch of a live module, else a `Generic` one (with a warning); never raises."""
    from lowbit_pipe.arch.registry import detect_model

    return detect_model(model) or Generic.for_model(model)
