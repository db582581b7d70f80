"""Architectures: id -> Arch registry and detection."""

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
    for arch in ARCHS.values():
        if arch.detect_keys(shapes):
            return arch
    return None


from lowbit_pipe.arch import flux1, krea2, qwen_image  # noqa: E402,F401

__all__ = ["ARCHS", "Arch", "ArchConfig", "LayerPolicy", "detect_keys", "detect_model", "get_arch", "register"]
