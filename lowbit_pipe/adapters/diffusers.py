"""diffusers models (ModelMixin) and pipelines (DiffusionPipeline with a `.transformer`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lowbit_pipe.adapters.base import Adapter


def _public_config(config: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(config).items() if not k.startswith("_")}


class DiffusersModelAdapter(Adapter):
    name = "diffusers_model"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        from diffusers import ModelMixin

        return isinstance(obj, ModelMixin)

    def transformer(self, obj: Any) -> nn.Module:
        return obj

    def model_config(self, obj: Any) -> dict[str, Any]:
        return _public_config(obj.config)


class DiffusersPipelineAdapter(Adapter):
    name = "diffusers_pipeline"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        from diffusers import DiffusionPipeline

        return isinstance(obj, DiffusionPipeline) and getattr(obj, "transformer", None) is not None

    def transformer(self, obj: Any) -> nn.Module:
        return obj.transformer

    def model_config(self, obj: Any) -> dict[str, Any]:
        return _public_config(obj.transformer.config)
