"""What an architecture module provides: detection, structural config, layer policy, example inputs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn


@dataclass(frozen=True)
class ArchConfig:
    """Structural facts about a detected transformer (logical shapes, never packed ones)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    text_layers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerPolicy:
    """Per-architecture layer lists. Patterns are globs, or `re:<regex>`, on diffusers module names."""

    keep_float: tuple[str, ...] = ()
    sensitive: tuple[str, ...] = ()
    block_paths: tuple[str, ...] = ()  # attribute paths of the repeated-block ModuleLists


class Arch(ABC):
    """One architecture. Stateless; registered in arch/__init__.py."""

    id: ClassVar[str]
    diffusers_class: ClassVar[str]  # class name in diffusers.models
    policy: ClassVar[LayerPolicy]

    def model_class(self) -> type[nn.Module]:
        import diffusers

        return getattr(diffusers, self.diffusers_class)

    def detect_model(self, model: nn.Module) -> bool:
        """Whether a live module is this architecture (by class; subclasses may look at modules)."""
        return type(model).__name__ == self.diffusers_class

    @abstractmethod
    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether a diffusers-layout state dict (prefix stripped, logical shapes) is this architecture."""

    @abstractmethod
    def config_from_model(self, model: nn.Module) -> ArchConfig:
        """Structural config of a live diffusers model."""

    @abstractmethod
    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        """Seeded forward kwargs (noisy latents, text states, timestep, ...) for `model(**inputs)`."""

    def output_tensor(self, output: Any) -> torch.Tensor:
        """The prediction tensor out of a forward's return value."""
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, (tuple, list)):
            return output[0]
        return output.sample
