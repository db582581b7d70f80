"""lowbit_pipe inside ComfyUI: the comfy-kitchen layout of our kinds and the registration that makes a running
ComfyUI load them (`install_into_comfyui()`, what the node pack calls at import).

    from lowbit_pipe.comfy import install_into_comfyui
    registration = install_into_comfyui()     # before any model loads
    ...
    registration.uninstall()                  # ComfyUI exactly as it was; returns the teardown report

Needs comfy-kitchen (the `comfy` extra); nothing here imports ComfyUI except `install_into_comfyui`.
Names are resolved lazily, so `import lowbit_pipe.comfy` costs nothing until one is used.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LAYOUT_NAME": "lowbit_pipe.comfy.layout",
    "LowbitLayout": "lowbit_pipe.comfy.layout",
    "to_quantized_tensor": "lowbit_pipe.comfy.layout",
    "to_quantized_weight": "lowbit_pipe.comfy.layout",
    "Kind": "lowbit_pipe.comfy.registry",
    "Registration": "lowbit_pipe.comfy.registry",
    "install": "lowbit_pipe.comfy.registry",
    "install_into_comfyui": "lowbit_pipe.comfy.registry",
    "installed": "lowbit_pipe.comfy.registry",
    "lowbit_kinds": "lowbit_pipe.comfy.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lowbit_pipe.comfy' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(module), name)
