"""Plain torch modules: the module is the transformer."""

from __future__ import annotations

from typing import Any

from torch import nn

from lowbit_pipe.adapters.base import Adapter


class ModuleAdapter(Adapter):
    name = "module"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def transformer(self, obj: Any) -> nn.Module:
        return obj

    def model_config(self, obj: Any) -> dict[str, Any]:
        config = getattr(obj, "config", None)
        return dict(config) if isinstance(config, dict) else {}
