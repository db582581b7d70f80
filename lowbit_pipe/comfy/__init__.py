"""lowbit_pipe inside ComfyUI: the comfy-kitchen layout of our kinds and the registration that makes a running
ComfyUI load them.

    from lowbit_pipe.comfy import install_into_comfyui
    registration = install_into_comfyui()     # before any model loads; IncompatibleComfyUI where it cannot work
    ...
    registration.uninstall()                  # ComfyUI exactly as it was; returns the teardown report

The node pack calls `register_loader()` instead: the same registration where this ComfyUI can take it, else
None and one log line naming what is missing (`compat` has the version table).

The layout and the registration need comfy-kitchen (the `comfy` extra); `compat` needs nothing. Nothing
here imports ComfyUI except `install_into_comfyui` / `register_loader`, when called. Names are resolved
lazily, so `import lowbit_pipe.comfy` costs nothing until one is used.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "IncompatibleComfyUI": "lowbit_pipe.comfy.compat",
    "KINDS": "lowbit_pipe.comfy.compat",
    "register_loader": "lowbit_pipe.comfy.compat",
    "LAYOUT_NAME": "lowbit_pipe.comfy.layout",
    "LowbitLayout": "lowbit_pipe.comfy.layout",
    "to_quantized_tensor": "lowbit_pipe.comfy.layout",
    "to_quantized_weight": "lowbit_pipe.comfy.layout",
    "Kind": "lowbit_pipe.comfy.registry",
    "Registration": "lowbit_pipe.comfy.registry",
    "install": "lowbit_pipe.comfy.registry",
    "install_into_comfyui": "lowbit_pipe.comfy.registry",
    "installed": "lowbit_pipe.comfy.registry",
    "kinds_to_register": "lowbit_pipe.comfy.registry",
    "written_kinds": "lowbit_pipe.comfy.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lowbit_pipe.comfy' has no attribute '{name}'")
    import importlib

    return getattr(importlib.import_module(module), name)
