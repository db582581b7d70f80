"""The embedded tiny models: the real diffusers classes at tiny configs (conf/model/tiny_<arch>.yaml),
with seeded random weights. No download; the default command and the tests run on them."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from lowbit_pipe.arch.base import cast_keeping_fp32
from lowbit_pipe.arch.registry import get_arch
from lowbit_pipe.paths import tiny_models


def tiny_model_config(arch_id: str) -> dict[str, Any]:
    """The diffusers config kwargs of the packaged tiny model of `arch_id` (its model group's `tiny_config`)."""
    files = tiny_models()
    key = f"tiny_{arch_id}"
    if key not in files:
        raise KeyError(f"no embedded tiny model for arch '{arch_id}' (have: {', '.join(sorted(files))})")
    return dict(OmegaConf.to_container(OmegaConf.load(files[key]))["tiny_config"])


def build_tiny(arch_id: str, config: dict[str, Any], seed: int, dtype: torch.dtype) -> nn.Module:
    """The real diffusers class at a tiny config, with seeded random weights."""
    cls = get_arch(arch_id).model_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
        # Constant-initialised tensors (norm gains, modulation tables) get seeded noise, so
        # every path carries signal as in a trained model and quantization error shows.
        with torch.no_grad():
            for param in model.parameters():
                if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                    param.add_(torch.randn_like(param) * 0.1)
    # diffusers' fp32 modules (Krea 2's norms) stay float32, as from_pretrained(torch_dtype=dtype) leaves them.
    return cast_keeping_fp32(model, dtype).eval()
