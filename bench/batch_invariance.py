"""Batch and padding invariance of every registered format, on the CPU (issue 29 item 2).

Run:  python bench/batch_invariance.py [--out bench/results/batch_invariance.md] [--dtype float32 bfloat16]

For each format of the registry, each rotation it takes (and activations `dynamic` / `none`): four Linears of
width 512 with GELUs between them, the middle two quantized through `lowbit_pipe.quantize` (the generic policy
keeps the first and the last in float). One sample x [1, T, 512] is run

- alone, and as row 0 of a batch of four whose other samples are 100x louder ("batch");
- unpadded, and with P rows appended along the token dim: zeros ("pad 0") or 100x loud random rows ("pad r"),
  its first T tokens compared.

Formats with an opt-in per-tensor activation statistic (nvfp4's `act_granularity: tensor`, stock ComfyUI's math)
get a row of their own, which is expected to differ.

Each figure is max |y_alone - y_other| / max |y_alone| over the sample's tokens. A figure of 0 is bit-exact.
The float first and last Linears are part of every run, so a figure of a few 1e-7 (fp32) can be the CPU GEMM's
own reduction order changing with the row count, not the format.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit_pipe
from lowbit_pipe.formats import FORMATS

WIDTH, TOKENS, PAD, LOUD = 512, 24, 8, 100.0


def variants() -> list[tuple[str, dict]]:
    """(label, FormatChoice dict) for every registered format, rotation and activation mode."""
    out = []
    for name, fmt in FORMATS.items():
        rotations = [r for r in fmt.rotations if not (r == "none" and "convrot" in fmt.rotations
                                                      and name in ("convrot_w4a4", "w4a8", "w6a8"))]
        for rot in rotations:
            for acts in ("dynamic", "none"):
                if acts == "none" and rot != "none" and name not in ("int8", "fp8", "nvfp4", "mxfp8"):
                    continue
                choice = {"format": name, "rotation": rot, "activations": acts}
                label = name + ("" if rot == "none" else f" +{rot}") + ("" if acts == "dynamic" else " (weight-only)")
                out.append((label, choice))
                if acts == "dynamic" and "tensor" in getattr(fmt, "act_granularities", ()):
                    out.append((f"{label} (act_granularity tensor)", {**choice, "act_granularity": "tensor"}))
    return out


def stack(seed: int, dtype: torch.dtype) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(4):
        lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH ** 0.5)
            lin.bias.copy_(torch.randn(WIDTH, generator=gen) * 0.1)
        layers += [lin, nn.GELU()] if i < 3 else [lin]
    return nn.Sequential(*layers).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / a.abs().max())


@torch.no_grad()
def probe(choice: dict, dtype: torch.dtype, seed: int = 0) -> dict[str, float]:
    model = stack(seed, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowbit_pipe.quantize(model, {"default": choice})
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, TOKENS, WIDTH, generator=gen).to(dtype)
    mates = (torch.randn(3, TOKENS, WIDTH, generator=gen) * LOUD).to(dtype)
    loud_pad = (torch.randn(1, PAD, WIDTH, generator=gen) * LOUD).to(dtype)
    alone = model(x)
    batch = model(torch.cat([x, mates]))[:1]
    pad0 = model(torch.cat([x, torch.zeros(1, PAD, WIDTH, dtype=dtype)], dim=1))[:, :TOKENS]
    padr = model(torch.cat([x, loud_pad], dim=1))[:, :TOKENS]
    return {"batch": rel(alone, batch), "pad 0": rel(alone, pad0), "pad r": rel(alone, padr)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the Markdown table here")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = ["| format | dtype | batch | pad 0 | pad r |", "|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for dtype_name in args.dtype:
        dtype = getattr(torch, dtype_name)
        for label, choice in variants():
            r = probe(choice, dtype)
            line = f"| {label} | {dtype_name} | " + " | ".join(f"{r[k]:.1e}" if r[k] else "0" for k in r) + " |"
            lines.append(line)
            print(line, flush=True)
    if args.out:
        head = [f"# Batch and padding invariance (`python bench/batch_invariance.py --out {args.out}`)", "",
                f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; widths {WIDTH}, {TOKENS} tokens, "
                f"{PAD} padding rows, batch-mates and loud padding x{LOUD:g}. max |diff| / max |out| of the sample; "
                "0 = bit-exact.", ""]
        Path(args.out).write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
