"""Quality figures: pure functions of tensors, computed in float64 so the figures are stable.

`ref` is always the float model's tensor and `out` the quantized one's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _flat(ref: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if ref.shape != out.shape:
        raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs output {tuple(out.shape)}")
    return ref.detach().double().flatten().cpu(), out.detach().double().flatten().cpu()


def rel_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    ref, out = _flat(ref, out)
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = _flat(ref, out)
    return float(F.cosine_similarity(ref, out, dim=0, eps=1e-30))


def max_abs_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = _flat(ref, out)
    return float((out - ref).abs().max())


def noise_power(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(sum ref^2, sum (out - ref)^2): the two sums SQNR is a ratio of; accumulate them over batches."""
    ref, out = _flat(ref, out)
    return float(ref.pow(2).sum()), float((out - ref).pow(2).sum())


def sqnr_db(ref: torch.Tensor | float, out: torch.Tensor | float) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum ref^2 / sum (out-ref)^2); inf when equal.

    Either two tensors, or two accumulated sums (signal, noise) from `noise_power`.
    """
    if isinstance(ref, torch.Tensor):
        signal, noise = noise_power(ref, out)
    else:
        signal, noise = float(ref), float(out)
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def psnr_db(ref: torch.Tensor, out: torch.Tensor, peak: float | None = None) -> float:
    """10*log10(peak^2 / MSE). `peak` defaults to max|ref| (model outputs have no fixed range);
    images in [0, 1] pass peak=1. inf when equal."""
    ref, out = _flat(ref, out)
    mse = float((out - ref).pow(2).mean())
    peak = float(ref.abs().max()) if peak is None else float(peak)
    if mse == 0:
        return math.inf
    return 10.0 * math.log10(peak * peak / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x.pow(2) / (2 * sigma * sigma))
    g = g / g.sum()
    return torch.outer(g, g)


def ssim(ref: torch.Tensor, out: torch.Tensor, data_range: float = 1.0, window: int = 11, sigma: float = 1.5) -> float:
    """Mean SSIM (Wang et al. 2004: Gaussian window 11, sigma 1.5, K1=0.01, K2=0.03) of images
    shaped (C, H, W) or (N, C, H, W); statistics over the valid region (no padding), as scikit-image
    does with gaussian_weights=True. The window shrinks to the image for images under 11 px."""
    if ref.shape != out.shape:
        raise ValueError(f"shape mismatch: reference {tuple(ref.shape)} vs output {tuple(out.shape)}")
    x, y = ref.detach().double().cpu(), out.detach().double().cpu()
    if x.dim() == 3:
        x, y = x[None], y[None]
    if x.dim() != 4:
        raise ValueError(f"ssim wants (C,H,W) or (N,C,H,W) images, got {tuple(ref.shape)}")
    n, c, h, w = x.shape
    size = min(window, h, w)
    kernel = _gaussian_window(size, sigma).expand(c, 1, size, size).contiguous()

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kernel, groups=c)

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = blur(x), blur(y)
    # Unbiased (sample) covariance, as in the paper's reference code and scikit-image.
    npx = size * size
    cov = npx / max(npx - 1, 1)
    vx = cov * (blur(x * x) - mx * mx)
    vy = cov * (blur(y * y) - my * my)
    vxy = cov * (blur(x * y) - mx * my)
    s = ((2 * mx * my + c1) * (2 * vxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return float(s.mean())


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """The model-output figures of one comparison."""
    return {
        "rel_error": rel_error(ref, out),
        "cosine": cosine(ref, out),
        "max_abs_error": max_abs_error(ref, out),
        "psnr_db": psnr_db(ref, out),
    }


def finite(x: float) -> float | None:
    """JSON has no inf/nan: a figure that is not finite (an exact match) is reported as null."""
    return x if math.isfinite(x) else None
