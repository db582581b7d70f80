"""Adapter contract."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class Adapter:
    """Reaches the transformer and its config inside a model object."""

    name = "base"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        raise NotImplementedError

    def transformer(self, obj: Any) -> nn.Module:
        raise NotImplementedError

    def model_config(self, obj: Any) -> dict[str, Any]:
        """The transformer's constructor config (diffusers config), {} if unknown."""
        return {}

    def prepare(self, obj: Any) -> None:
        """Make the object ready for the pipeline to work on its modules (or refuse it, saying why)."""

    def prompt_runner(self, obj: Any, prompts: list[str], steps: int, seed: int,
                      resolution: int | None) -> Callable[[], None] | None:
        """A function that generates `prompts` with the model object's own pipeline (text encoder, sampler), for
        calibration hooks on its transformer; None where the object has no pipeline to generate with."""
        return None
