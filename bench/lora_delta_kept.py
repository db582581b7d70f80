"""How much of a LoRA delta each mode keeps, per format, at realistic LoRA scales. Runs on the CPU.

    python bench/lora_delta_kept.py [--out bench/results/lora_delta_kept.json] [--md bench/results/lora_delta_kept.md]

Setup: W ~ N(0, 0.02) [1024 x 2048] quantized per format (the loaded quantized model); a rank-32
LoRA delta dW scaled so max|dW| = rel * max|W|, rel in {0.1%, 0.3%, 0.8%}.
- kept  = <W'_q - W_q, dW> / |dW|^2: the fraction of the delta the weights carry (1 = all of it;
          measured on dequantized weights; for residual on the layer outputs y(x) over 256 inputs).
- noise = |W'_q - W_q - dW| / |dW|: what the bake changed that is NOT the delta, relative to it.
standard = dequantize, add, requantize to nearest; stochastic = seeded stochastic rounding (one
bake; the mean over seeds column averages 8); residual = exact branch (kept 1, noise 0 up to fp32).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe.formats import (
    FormatSpec,
    get_format,
)
from lowbit_pipe.lora.bake import bake_layer, delta_kept, supports_stochastic
from lowbit_pipe.lora.branches import LoraBranch, LoraStack
from lowbit_pipe.quant.nn import QuantLinear

SHAPE = (1024, 2048)
RANK = 32
RELS = (0.001, 0.003, 0.008)
FORMATS = [("int8", FormatSpec("int8")), ("int8+convrot", FormatSpec("int8", rotation="convrot")),
           ("fp8", FormatSpec("fp8")), ("nvfp4", FormatSpec("nvfp4")),
           ("nvfp4+convrot", FormatSpec("nvfp4", rotation="convrot")), ("convrot_w4a4", FormatSpec("convrot_w4a4")),
           ("w4a8", FormatSpec("w4a8")), ("w6a8", FormatSpec("w6a8"))]
SEEDS = 8


def _setup(rel: float) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(*SHAPE, generator=gen) * 0.02)
    linear.weight.requires_grad_(False)
    down = torch.randn(RANK, SHAPE[1], generator=gen) / SHAPE[1] ** 0.5
    up = torch.randn(SHAPE[0], RANK, generator=gen)
    scale = rel * float(linear.weight.abs().max()) / float((up @ down).abs().max())
    up = up * scale
    return linear, down, up, up @ down


def _noise(before: torch.Tensor, after: torch.Tensor, delta: torch.Tensor) -> float:
    return float((after - before - delta).norm() / delta.norm())


def measure(name: str, spec: FormatSpec, rel: float) -> dict:
    linear, down, up, delta = _setup(rel)
    base = QuantLinear.from_linear(linear, spec)
    w0 = base.dequantize()
    row = {"format": name, "rel": rel}
    q = QuantLinear.from_linear(linear, spec)
    row["standard_kept"] = bake_layer(q, delta, mode="standard", seed=0, where="layer")
    row["standard_noise"] = _noise(w0, q.dequantize(), delta)
    kept = []
    row["stochastic"] = supports_stochastic(get_format(spec.format))
    for seed in range(SEEDS if row["stochastic"] else 0):
        q = QuantLinear.from_linear(linear, spec)
        kept.append(bake_layer(q, delta, mode="stochastic", seed=seed, where="layer"))
        if seed == 0:
            row["stochastic_kept"] = kept[0]
            row["stochastic_noise"] = _noise(w0, q.dequantize(), delta)
    row["stochastic_kept_mean8"] = sum(kept) / len(kept) if kept else None
    # Residual, measured on outputs: (Q + branch)(x) - Q(x) against x dW^T.
    q = QuantLinear.from_linear(linear, spec)
    stack = LoraStack(SHAPE[1], SHAPE[0])
    stack.branches = (LoraBranch("l", down, up, alpha=float(RANK), strength=1.0),)
    q.add_module("lora", stack)
    x = torch.randn(256, SHAPE[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dy = q(x) - q.format.linear(x, q.qweight, None)
    want = x @ delta.t()
    row["residual_kept"] = delta_kept(torch.zeros_like(want), dy, want)
    row["residual_noise"] = float((dy - want).norm() / want.norm())
    return row


def markdown(rows: list[dict], command: str) -> str:
    lines = ["# LoRA delta kept per bake mode", "",
             f"`{command}` (CPU, {platform.processor() or platform.machine()}, torch {torch.__version__}).", "",
             f"W ~ N(0, 0.02) {SHAPE[0]}x{SHAPE[1]}, rank-{RANK} LoRA, max|dW| = rel x max|W|. "
             "kept = <W'-W, dW>/|dW|^2 (1 = the whole delta); noise = |W'-W-dW|/|dW|. "
             "Residual is measured on layer outputs.", "",
             "| format | rel | standard kept | standard noise | stochastic kept (1 seed) | stochastic kept (mean of 8) "
             "| stochastic noise | residual kept | residual noise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sr = (f"{r['stochastic_kept']:.3f} | {r['stochastic_kept_mean8']:.3f} | {r['stochastic_noise']:.2f}"
              if r["stochastic"] else "n/a (no SR: nearest) | n/a | n/a")
        lines.append(f"| {r['format']} | {r['rel'] * 100:.1f}% | {r['standard_kept']:.3f} | {r['standard_noise']:.2f} | "
                     f"{sr} | {r['residual_kept']:.6f} | {r['residual_noise']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/lora_delta_kept.json")
    p.add_argument("--md", default="bench/results/lora_delta_kept.md")
    p.add_argument("--formats", default=",".join(n for n, _ in FORMATS))
    args = p.parse_args()
    wanted = args.formats.split(",")
    start = time.time()
    rows = [measure(n, s, rel) for n, s in FORMATS if n in wanted for rel in RELS]
    command = "python bench/lora_delta_kept.py" + (f" --formats {args.formats}" if args.formats != p.get_default("formats") else "")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": command, "shape": SHAPE, "rank": RANK, "seeds": SEEDS,
                                          "torch": torch.__version__, "seconds": round(time.time() - start, 1),
                                          "rows": rows}, indent=2))
    md = markdown(rows, command)
    Path(args.md).write_text(md)
    print(md)


if __name__ == "__main__":
    main()
