"""The architecture registry: id -> Arch instance, and detection of a live module or a key map by it.
Architecture modules register themselves on import (lowbit_pipe.arch imports them all)."""

from __future__ import annotations

from torch import nn

from lowbit_pipe.arch.base import Arch

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
