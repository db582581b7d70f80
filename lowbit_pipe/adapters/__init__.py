"""How stages reach the transformer inside each kind of model object."""

from __future__ import annotations

from typing import Any

from lowbit_pipe.adapters.base import Adapter
from lowbit_pipe.adapters.comfy import ComfyModelAdapter
from lowbit_pipe.adapters.diffusers import DiffusersModelAdapter, DiffusersPipelineAdapter
from lowbit_pipe.adapters.module import ModuleAdapter

ADAPTERS: tuple[type[Adapter], ...] = (ComfyModelAdapter, DiffusersPipelineAdapter, DiffusersModelAdapter, ModuleAdapter)


def adapter_for(obj: Any) -> Adapter:
    for cls in ADAPTERS:
        if cls.accepts(obj):
            return cls()
    raise TypeError(f"lowbit_pipe cannot work on a {type(obj).__name__}: expected a diffusers pipeline or model, "
                    "a ComfyUI MODEL, or a torch.nn.Module")


__all__ = ["ADAPTERS", "Adapter", "ComfyModelAdapter", "adapter_for"]
