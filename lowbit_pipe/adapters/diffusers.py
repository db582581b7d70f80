"""diffusers models (ModelMixin) and pipelines (DiffusionPipeline with a `.transformer`)."""

from __future__ import annotations

from typing import Any, Callable

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

    def prompt_runner(self, obj: Any, prompts: list[str], steps: int, seed: int,
                      resolution: int | None) -> Callable[[], None] | None:
        import torch

        size = {"height": resolution, "width": resolution} if resolution is not None else {}

        def run() -> None:
            # Latents out: the VAE decode runs nothing the transformer's hooks need. CPU generators: the same
            # starting noise on any device. The pipeline's progress bar is off for these calls, then as it was.
            saved = dict(getattr(obj, "_progress_bar_config", {}))
            obj.set_progress_bar_config(disable=True)
            try:
                for i, prompt in enumerate(prompts):
                    with torch.no_grad():
                        obj(prompt=prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed + i),
                            output_type="latent", **size)
            finally:
                obj._progress_bar_config = saved
        return run
