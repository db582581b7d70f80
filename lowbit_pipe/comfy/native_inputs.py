"""Inputs in the layout ComfyUI's diffusion models take, and the calibration run that feeds them.

A ComfyUI diffusion model (native names, ComfyUI's own module classes) is called as `model(x, timesteps,
context, **extra)`: x a latent [B, C, H, W], context the text states [B, T, F], extra what the arch needs
besides (FLUX.1: the pooled text `y`, the `guidance`). The CLI calibrates a diffusers model on the arch's
seeded example inputs (`Arch.example_inputs`), denoised by lowbit_pipe's Euler sampler. Here the same
seeded tensors are rearranged into ComfyUI's layout (`example_inputs`), or taken from a ComfyUI
CONDITIONING / LATENT (`comfy_inputs`), and `calibration_runner` denoises them with the same sampler
through the diffusion model's own forward: on the same inputs, the Quantize node calibrates what the CLI
calibrates, up to the two implementations' float rounding.

Krea 2 and FLUX.1 are supported (their layouts are checked against ComfyUI's own model classes in the
tests); other architectures are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.errors import LowbitError

SUPPORTED = ("krea2", "flux1")
PATCH = 2  # both pack 2 x 2 latent pixels into one token


@dataclass
class NativeInputs:
    """One calibration sample in ComfyUI's layout."""

    x: torch.Tensor  # latent [B, C, H, W] (the noise at sigma = 1)
    context: torch.Tensor  # [B, T, F]
    timestep: torch.Tensor  # [B], sigma in [0, 1]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # FLUX.1: y (pooled), guidance


def _require(arch_id: str, what: str) -> None:
    if arch_id not in SUPPORTED:
        raise LowbitError(f"{what} inside ComfyUI supports {', '.join(SUPPORTED)} diffusion models; this one is "
                          f"'{arch_id}'. Quantize it with the CLI or lowbit_pipe.quantize(..., calibrate=...)")


def _linear(tree: nn.Module, name: str) -> nn.Module:
    try:
        return tree.get_submodule(name)
    except AttributeError:
        raise LowbitError(f"the diffusion model has no layer '{name}' (not the ComfyUI model class expected)") from None


def diffusers_config(arch_id: str, tree: nn.Module) -> dict[str, Any]:
    """The keys of the diffusers config `Arch.example_inputs` reads, from a native tree's layer widths."""
    _require(arch_id, "calibration")
    if arch_id == "krea2":
        return {"in_channels": int(_linear(tree, "first").in_features),
                "num_text_layers": int(_linear(tree, "txtfusion.projector").in_features),
                "text_hidden_dim": int(_linear(tree, "txtmlp.1").in_features)}
    guidance = "guidance_in.in_layer" in dict(tree.named_modules())
    return {"in_channels": int(_linear(tree, "img_in").in_features),
            "joint_attention_dim": int(_linear(tree, "txt_in").in_features),
            "pooled_projection_dim": int(_linear(tree, "vector_in.in_layer").in_features),
            "guidance_embeds": guidance}


def unpack_latent(tokens: torch.Tensor, channels: int) -> torch.Tensor:
    """[B, h*w, C*2*2] patch tokens -> [B, C, 2h, 2w] (the inverse of both archs' patchify)."""
    b, n, _ = tokens.shape
    side = int(round(n ** 0.5))
    x = tokens.reshape(b, side, side, channels, PATCH, PATCH)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, channels, side * PATCH, side * PATCH)


def example_inputs(arch_id: str, tree: nn.Module, *, batch: int, image_tokens: int, text_tokens: int,
                   generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> NativeInputs:
    """The arch's seeded example inputs (the very tensors the CLI draws), in ComfyUI's layout."""
    from lowbit_pipe.arch import get_arch

    config = diffusers_config(arch_id, tree)
    d = get_arch(arch_id).example_inputs(config, batch=batch, image_tokens=image_tokens, text_tokens=text_tokens,
                                         generator=generator, dtype=dtype, device=device)
    x = unpack_latent(d["hidden_states"], config["in_channels"] // (PATCH * PATCH))
    text = d["encoder_hidden_states"]
    context = text.reshape(text.shape[0], text.shape[1], -1)  # Krea 2: [B, T, L, D] -> [B, T, L*D]
    extra = {}
    if arch_id == "flux1":
        extra["y"] = d["pooled_projections"]
        if "guidance" in d:
            extra["guidance"] = d["guidance"]
    return NativeInputs(x, context, d["timestep"], extra)


def comfy_inputs(arch_id: str, conditioning: list, latent: dict[str, Any] | None, *, generator: torch.Generator,
                 dtype: torch.dtype, device: torch.device | str, fallback: NativeInputs) -> NativeInputs:
    """A ComfyUI CONDITIONING (its first entry) and LATENT (its size; the noise is seeded here) as inputs;
    what they lack comes from `fallback` (the arch's example inputs)."""
    _require(arch_id, "calibration")
    if not conditioning or not isinstance(conditioning[0], (list, tuple)) or len(conditioning[0]) < 2:
        raise LowbitError("calibration conditioning: expected ComfyUI's CONDITIONING (a list of [tensor, dict])")
    cond, options = conditioning[0][0], conditioning[0][1]
    context = cond.to(device, dtype)
    batch = context.shape[0]
    shape = tuple(latent["samples"].shape) if latent is not None else tuple(fallback.x.shape)
    if len(shape) == 5:  # a video-style latent [B, C, T, H, W] of one frame
        shape = (shape[0], shape[1], shape[3], shape[4])
    x = torch.randn((batch, *shape[1:]), generator=generator).to(device, dtype)
    extra = {}
    if arch_id == "flux1":
        pooled = options.get("pooled_output")
        extra["y"] = pooled.to(device, dtype) if pooled is not None else fallback.extra["y"][:1].expand(batch, -1)
        if "guidance" in fallback.extra:
            extra["guidance"] = torch.full((batch,), float(options.get("guidance", 3.5)), device=device, dtype=dtype)
    timestep = torch.rand(batch, generator=generator).to(device, dtype)
    return NativeInputs(x, context, timestep, extra)


def forward(tree: nn.Module, x: torch.Tensor, timestep: torch.Tensor, inputs: NativeInputs) -> torch.Tensor:
    """The diffusion model's own forward on ComfyUI-layout inputs: its velocity prediction."""
    return tree(x, timestep, inputs.context, **inputs.extra)


def calibration_runner(arch_id: str, tree: nn.Module, sample: Callable[[int], NativeInputs], *, samples: int,
                       steps: int) -> Callable[[], None]:
    """`run()`: `samples` input sets (`sample(i)`), each denoised in `steps` Euler steps (lowbit_pipe.measure.sampler, the
    CLI's calibration sampler) through `tree`'s forward, or run once at its timestep when steps is 0."""
    from lowbit_pipe.measure import sampler

    _require(arch_id, "calibration")

    def run() -> None:
        with torch.no_grad():
            for i in range(samples):
                inputs = sample(i)
                if steps:
                    sampler.euler_sample(lambda kw: forward(tree, kw["x"], kw["t"], inputs),
                                         {"x": inputs.x, "t": inputs.timestep}, steps,
                                         sampler.TIME_SCALE.get(arch_id, 1.0))
                else:
                    forward(tree, inputs.x, inputs.timestep, inputs)
    return run
