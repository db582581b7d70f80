"""A flow-matching Euler sampler over any arch's forward, for trajectory fidelity checks.

Rectified-flow convention (FLUX, Krea 2, Qwen-Image, SD3, Wan): x_1 is noise, the model predicts a
velocity v, and one Euler step from sigma to sigma' is x <- x + (sigma' - sigma) * v (exactly
FlowMatchEulerDiscreteScheduler.step). Sigmas run linearly 1 -> 0 (Krea 2's pipeline default,
linspace(1, 1/S, S) plus the terminal 0), no resolution shift. The conditioning (text states, ids)
comes from the arch's seeded `example_inputs`; only the latent and the timestep change per step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# Which forward kwarg holds the latent / the timestep (first present wins).
LATENT_KEYS = ("hidden_states", "x")
TIME_KEYS = ("timestep", "t")
# Archs whose transformer takes timesteps in [0, 1000] rather than sigma in [0, 1].
TIME_SCALE = {"sd3": 1000.0, "wan": 1000.0}


def sigmas(steps: int) -> torch.Tensor:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)


def _key(inputs: dict[str, Any], keys: tuple[str, ...], what: str) -> str:
    for k in keys:
        if k in inputs:
            return k
    raise KeyError(f"example inputs have no {what} (looked for {keys}; got {sorted(inputs)})")


def euler_sample(forward: Callable[[dict[str, Any]], torch.Tensor], inputs: dict[str, Any], steps: int,
                 time_scale: float = 1.0) -> torch.Tensor | list[torch.Tensor]:
    """Integrate from `inputs[latent]` (taken as the noise at sigma=1) to sigma=0.

    `forward(kwargs) -> velocity tensor` (the arch's output tensor). A latent given as a list of
    per-sample tensors (Z-Image) is stepped per sample, the velocity split along dim 0.
    Returns the final latent, same structure as the input one.
    """
    lkey, tkey = _key(inputs, LATENT_KEYS, "latent"), _key(inputs, TIME_KEYS, "timestep")
    kwargs = dict(inputs)
    x = kwargs[lkey]
    ref_t = kwargs[tkey]
    s = sigmas(steps)
    for i in range(steps):
        kwargs[tkey] = torch.full_like(ref_t, float(s[i]) * time_scale)
        kwargs[lkey] = x
        v = forward(kwargs)
        dt = float(s[i + 1] - s[i])
        if isinstance(x, (list, tuple)):
            x = [xi + dt * vi.reshape(xi.shape).to(xi.dtype) for xi, vi in zip(x, v.unbind(0))]
        else:
            x = x + dt * v.reshape(x.shape).to(x.dtype)
    return x


def flatten_latent(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """One tensor of a final latent (list latents are stacked)."""
    return torch.stack(list(x)) if isinstance(x, (list, tuple)) else x
