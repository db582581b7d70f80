"""Architectures: id -> Arch registry and detection (live modules, or state dicts in any layout)."""

from __future__ import annotations

from lowbit_pipe.arch import chroma, flux1, flux2, krea2, qwen_image, sd3, wan, z_image  # noqa: F401
from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy
from lowbit_pipe.arch.detect import (
    ModuleArch,
    UnknownArchError,
    detect_module,
    detect_or_none,
    detect_state_dict,
    logical_shapes,
    strip_prefix,
)
from lowbit_pipe.arch.generic import Generic, arch_for_model, generic_policy
from lowbit_pipe.arch.registry import ARCHS, detect_keys, detect_model, get_arch, register

__all__ = ["ARCHS", "Arch", "ArchConfig", "Generic", "LayerPolicy", "ModuleArch", "UnknownArchError", "arch_for_model",
           "detect_module",
           "detect_keys", "detect_model", "detect_or_none", "detect_state_dict", "generic_policy", "get_arch",
           "logical_shapes", "register", "strip_prefix"]
