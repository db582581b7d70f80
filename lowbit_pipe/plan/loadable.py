"""Which candidate formats the export's loader can load (quantize.target.loads_in)."""

from __future__ import annotations

import torch

from lowbit_pipe.formats import FormatSpec, get_format, is_stock_loadable

LOADERS = ("lowbit_pipe", "comfyui_pack", "comfyui")


def loadable(spec: FormatSpec | None, loader: str) -> bool:
    """Float always loads; lowbit_pipe and ComfyUI with the node pack load every format; stock ComfyUI the kinds
    its loader knows, judged on the `.comfy_quant` record the format writes for this spec (a rotation can turn
    a stock kind into a pack-only one: rotated fp8 is `lowbit_fp8`)."""
    if loader not in LOADERS:
        raise ValueError(f"unknown loader '{loader}' (known: {', '.join(LOADERS)})")
    if spec is None or loader != "comfyui":
        return True
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))  # any shape every format stores
    return is_stock_loadable(get_format(spec.format).quantize(weight, spec).record)
