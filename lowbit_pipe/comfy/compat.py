"""The node pack's loader registration on whatever ComfyUI it finds: `register_loader()`, what the pack's
`__init__.py` calls (it imports ComfyUI and comfy-kitchen when called, never at import). The version table it
and the export read is `lowbit_pipe.formats.comfy_versions`, re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any

from lowbit_pipe.formats.comfy_versions import (  # noqa: F401 - the table, re-exported for the pack's users
    INSTALL_HINT,
    KINDS,
    PACK_MIN_COMFY_KITCHEN,
    PACK_MIN_COMFYUI,
    PREFIX,
    SUPPORTED_COMFYUI,
    IncompatibleComfyUI,
    KindSupport,
    check_comfy_kitchen,
    comfy_warning,
    stock_loads,
    support,
    version_tuple,
)


def register_loader(log: logging.Logger | None = None) -> Any:
    """What the node pack's `__init__.py` calls: `registry.install` into the running ComfyUI where it can work,
    returning the Registration; else None and ONE log line saying what is missing and which versions are
    needed (the pack's nodes are registered either way: they need no loader registration)."""
    log = log or logging.getLogger("lowbit_pipe.comfy")
    try:
        from lowbit_pipe.comfy import registry
    except ImportError as err:
        if not (err.name or "").startswith("comfy_kitchen"):
            raise  # lowbit_pipe itself is broken: not a version question
        return _refused(log, f"comfy-kitchen cannot be imported ({err})")
    try:
        import comfy.ops
        import comfy.quant_ops
    except ImportError as err:
        return _refused(log, f"this ComfyUI has no mixed-precision loader: importing comfy.quant_ops / comfy.ops "
                             f"failed ({err})")
    try:
        import comfy.model_patcher as model_patcher
    except ImportError as err:
        model_patcher, patcher_error = None, err
    try:
        registration = registry.install(comfy.quant_ops, comfy.ops, model_patcher)
    except IncompatibleComfyUI as err:
        return _refused(log, str(err))
    if model_patcher is None:
        log.warning("lowbit_pipe: importing comfy.model_patcher failed (%s): ComfyUI's own LoRA loaders on quantized "
                    "layers are not turned into exact residual branches (ComfyUI rounds them into the weights); use "
                    "'LoRA residual (lowbit_pipe)'", patcher_error)
    return registration


def _refused(log: logging.Logger, why: str) -> None:
    log.warning("lowbit_pipe: nodes registered, but ComfyUI's model loaders will not read lowbit_pipe's own kinds "
                "(lowbit_*, awq_w4a16, svdquant_w4a4, and upstream kinds this ComfyUI lacks): %s. That needs ComfyUI "
                ">= %s with comfy-kitchen >= %s.", why, PACK_MIN_COMFYUI, PACK_MIN_COMFY_KITCHEN)
    return None
