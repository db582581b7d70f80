"""Architectures: id -> Arch registry and detection (live modules, or state dicts in any layout)."""

from __future__ import annotations

from torch import nn

from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy

ARCHS: dict[str, Arch] = {}


def register(cls: type[Arch]) -> type[Arch]:
    ARCHS[cls.id] = cls()
    return cls


def get_arch(arch_id: str) -> Arch:
    try:
        return ARCHS[arch_id]
    except KeyError:
        raise KeyError(f"unknown arch '{arch_id}' (known: {', '.join(sorted(ARCHS))})") from None


def detect_model(model: nn.Module) -> Arch | None:
    """The registered arch of a live module, or None (the caller falls back to a generic policy)."""
    for arch in ARCHS.values():
        if arch.detect_model(model):
            return arch
    return None


def detect_keys(shapes: dict[str, tuple[int, ...]]) -> Arch | None:
    """The arch of a diffusers-layout key->shape map (prefix stripped, logical shapes), or None."""
    for arch in ARCHS.values():
        if arch.detect_keys(shapes):
            return arch
    return None


from lowbit_pipe.arch import chroma, flux1, flux2, krea2, qwen_image, sd3, wan, z_image  # noqa: E402,F401
from lowbit_pipe.arch.detect import (  # noqa: E402
    UnknownArchError,
    detect_or_none,
    detect_state_dict,
    logical_shapes,
    strip_prefix,
)
from lowbit_pipe.arch.generic import Generic, arch_for_model, generic_policy  # noqa: E402

__all__ = ["ARCHS", "Arch", "ArchConfig", "Generic", "LayerPolicy", "UnknownArchError", "arch_for_model",
           "detect_keys", "detect_model", "detect_or_none", "detect_state_dict", "generic_policy", "get_arch",
           "logical_shapes", "register", "strip_prefix"]
