"""The norm classes the one-pass norm kernels compute, by class name: how each computes (its weight offset, its
rounding). Read by the fused norm/RoPE path (attention.fused) and by the fold of q/k quantization into RoPE
(attention.fold), which sit on either side of the processors module."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class NormKind:
    """How a norm class computes, for the kernel: y = x̂ * (weight + offset); `diffusers_rounding`: its forward
    rounds x̂ to a 16-bit weight's dtype before multiplying, and a weight's dtype sets the output's (diffusers'
    RMSNorm); otherwise the output is in x's dtype."""

    offset: float
    diffusers_rounding: bool


# Norm classes (by module and name: the classes live in diffusers; torch.nn.RMSNorm is another class) -> kind.
NORM_KINDS = {
    "diffusers.models.transformers.transformer_krea2.Krea2RMSNorm": NormKind(1.0, False),
    # q / k norms of Qwen-Image, Z-Image, SD3 (FLUX and Wan build torch.nn.RMSNorm: not listed, not measured)
    "diffusers.models.normalization.RMSNorm": NormKind(0.0, True),
}


def norm_kind(module: nn.Module) -> NormKind | None:
    cls = type(module)
    return NORM_KINDS.get(f"{cls.__module__}.{cls.__qualname__}")
