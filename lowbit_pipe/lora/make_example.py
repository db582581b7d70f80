"""Seeded example LoRAs in every key style (for tests, benchmarks and runnable recipes; never committed).

Factors are random at a realistic scale: per layer, max |delta W| = `rel` x max |W| (default
0.4%, inside the 0.1-0.8% of typical LoRAs), written as diffusers / peft, kohya, ComfyUI /
BFL native or AI-toolkit keys. Native and kohya styles write fused native modules (FLUX qkv,
linear1) as ONE factor pair whose up rows stack the parts, as real files do.

    python -m lowbit_pipe.lora.make_example --model tiny_krea2 --style kohya --out lora_examples/a.safetensors

In a recipe, `lora.files=[{path: "example:kohya:seed=1"}]` generates one for the loaded model.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
from torch import nn

STYLES = ("peft", "kohya", "native", "aitoolkit")
BLOCKS = re.compile(r"(^|\.)(transformer_blocks|single_transformer_blocks|layers|blocks)\.\d+\.")


def _weight(layer: nn.Module) -> torch.Tensor:
    """The layer's float weight: dequantized for a QuantLinear or a comfy-kitchen QuantizedTensor weight."""
    from lowbit_pipe.quant.nn import QuantLinear

    if isinstance(layer, QuantLinear):
        return layer.dequantize()
    w = layer.weight.detach()
    return (w.dequantize() if hasattr(w, "dequantize") else w).float()


def example_lora(model: nn.Module, arch: Any = None, *, style: str = "peft", rank: int = 8, seed: int = 0,
                 rel: float = 0.004, alpha: float | None = None, pattern: str | None = None,
                 config: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) of a seeded LoRA for `model`'s block Linears in `style`."""
    from lowbit_pipe.lora.files import is_linear

    if style not in STYLES:
        raise ValueError(f"unknown LoRA key style '{style}' (known: {list(STYLES)})")
    rx = re.compile(pattern) if pattern else BLOCKS
    layers = {n: m for n, m in model.named_modules() if is_linear(m) and rx.search(n)}
    if not layers:
        raise ValueError(f"no Linear of the model matches '{rx.pattern}'")
    # kohya / native files carry alpha keys (rank / 2 here, so alpha matters); peft / AI-toolkit: alpha = rank.
    alpha = float(alpha if alpha is not None else (rank / 2 if style in ("kohya", "native") else rank))
    if arch is not None and config is None:
        config = arch.config_from_model(model)
    # Factors are drawn per native module (a fused one = several diffusers parts sharing `down`), the
    # same for every style, so all styles of one seed describe the same LoRA.
    groups: dict[str, list[tuple[str, slice | None]]] = {}
    for name in layers:
        target, rows = arch.to_native(name, config) if arch is not None else (name, None)
        groups.setdefault(target, []).append((name, rows))
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for target, parts in groups.items():
        parts.sort(key=lambda p: (p[1].start or 0) if p[1] is not None else 0)
        k = layers[parts[0][0]].in_features
        down = torch.randn(rank, k, generator=gen) / k**0.5
        ups = []
        for name, _ in parts:
            w = _weight(layers[name])
            up = torch.randn(w.shape[0], rank, generator=gen) / rank**0.5
            d = (up @ down) * (alpha / rank)
            ups.append(up * (rel * float(w.abs().amax()) / d.abs().amax().clamp_min(1e-30)))  # factors stay on the CPU
        if style in ("kohya", "native"):
            written = [(target, torch.cat(ups, dim=0))]
        else:
            written = [(name, up) for (name, _), up in zip(parts, ups)]
        for module, up in written:
            if style == "peft":
                key, a_suffix, b_suffix = f"transformer.{module}", "lora_A.weight", "lora_B.weight"
            elif style in ("aitoolkit", "native"):
                key, a_suffix, b_suffix = f"diffusion_model.{module}", "lora_A.weight", "lora_B.weight"
            else:
                key, a_suffix, b_suffix = "lora_unet_" + module.replace(".", "_"), "lora_down.weight", "lora_up.weight"
            tensors[f"{key}.{a_suffix}"] = down.clone()
            tensors[f"{key}.{b_suffix}"] = up.contiguous()
            if style in ("kohya", "native"):
                tensors[f"{key}.alpha"] = torch.tensor(alpha)
    metadata = {}
    if style == "peft":  # diffusers' own way to carry alpha for peft-style files
        metadata["lora_adapter_metadata"] = json.dumps({"transformer.r": rank, "transformer.lora_alpha": alpha})
    return tensors, metadata


def parse_spec(spec: str) -> dict[str, Any]:
    """`example:<style>[:seed=N][:rank=R][:rel=F][:alpha=A]` -> kwargs of `example_lora`."""
    parts = spec.split(":")
    if parts[0] != "example" or len(parts) < 2:
        raise ValueError(f"'{spec}': expected example:<style>[:seed=N][:rank=R][:rel=F][:alpha=A]")
    kwargs: dict[str, Any] = {"style": parts[1]}
    casts = {"seed": int, "rank": int, "rel": float, "alpha": float}
    for item in parts[2:]:
        key, _, value = item.partition("=")
        if key not in casts:
            raise ValueError(f"'{spec}': unknown option '{key}' (known: {sorted(casts)})")
        kwargs[key] = casts[key](value)
    return kwargs


def main(argv: list[str] | None = None) -> None:
    from omegaconf import OmegaConf

    from lowbit_pipe.arch import get_arch
    from lowbit_pipe.arch.tiny import build_tiny
    from lowbit_pipe.files.checkpoint import atomic_save
    from lowbit_pipe.paths import tiny_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny_krea2", help="a model= config (tiny_krea2, tiny_flux1, ...)")
    p.add_argument("--style", default="peft", choices=STYLES)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel", type=float, default=0.004)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = OmegaConf.to_container(OmegaConf.load(tiny_models()[args.model]))
    model = build_tiny(cfg["tiny_arch"], cfg["tiny_config"], cfg.get("seed", 0), torch.float32)
    tensors, metadata = example_lora(model, get_arch(cfg["tiny_arch"]), style=args.style, rank=args.rank, seed=args.seed,
                                     rel=args.rel)
    nbytes = atomic_save(tensors, args.out, metadata)
    print(f"{args.out}: {len(tensors)} tensors, {nbytes} bytes ({args.style}, rank {args.rank}, seed {args.seed})")


if __name__ == "__main__":
    main()
