"""ComfyUI's Krea 2 block arithmetic around the attention and MLP, torch's ops against the one-pass kernels
(lowbit_pipe.kernels.norm_rope.modulated_rms_norm / gated_residual) on the shapes a 1024² / 2048² step runs.

    python3 bench/modulation_kernels.py --out bench/results/modulation_kernels_h100
    TRITON_INTERPRET=1 python bench/modulation_kernels.py --device cpu --small --out /tmp/modulation   # runs
    (the interpreter truncates fp32 -> bf16 casts, docs/testing.md: on the CPU the shares differ; they are the GPU's)

Per block the stock code runs each twice: `(1 + scale) * norm(x) + shift` (Krea 2's RMSNorm is three passes in
torch: upcast, norm, cast back; then a multiply and an add) and `x + gate * y` (two passes). The torch rows use
lowbit_pipe's norm kernel for the norm, as the fused ComfyUI path did before these kernels; 'stock' rows are
ComfyUI's own RMSNorm code. Each kernel's output is compared with the torch ops' (share of elements that differ).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import print_and_save

from lowbit_pipe.kernels import norm_rope as R
from lowbit_pipe.measure.timing import TimingSettings, time_ms

SHAPES = [("krea2 1024² (4608 + 512 tokens)", 1, 5120, 6144), ("krea2 2048² (16384 + 512 tokens)", 1, 16896, 6144)]
SMALL = [("small", 2, 40, 96)]


def stock_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """ComfyUI 0.29.0's Krea 2 RMSNorm arithmetic."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight=w + 1.0, eps=1e-5).to(x.dtype)


def bench_shape(name: str, b: int, s: int, f: int, device: torch.device, settings: TimingSettings) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(b, s, f, generator=gen) * 3 + 1).bfloat16().to(device)
    y = torch.randn(b, s, f, generator=gen).bfloat16().to(device)
    w = (torch.randn(f, generator=gen) * 0.1).to(device)
    scale, shift, gate = (torch.randn(b, 1, 6 * f, generator=gen) * 0.5).bfloat16().to(device).chunk(6, -1)[:3]
    forms = {
        "modulated norm: stock (ComfyUI's norm, *, +)": lambda: (1 + scale) * stock_norm(x, w) + shift,
        "modulated norm: norm kernel, *, +": lambda: (1 + scale) * R.rms_norm(x, w, 1e-5, 1.0) + shift,
        "modulated norm: one kernel": lambda: R.modulated_rms_norm(x, w, 1e-5, 1.0, 1 + scale, shift),
        "gated residual: torch (*, +)": lambda: x + gate * y,
        "gated residual: one kernel": lambda: R.gated_residual(x, gate, y),
    }
    want = {"modulated": forms["modulated norm: stock (ComfyUI's norm, *, +)"](),
            "gated": forms["gated residual: torch (*, +)"]()}
    rows, base = [], {}
    for form, fn in forms.items():
        kind = "modulated" if form.startswith("modulated") else "gated"
        got = fn()
        ms = time_ms(fn, device, settings)
        base.setdefault(kind, ms)
        rows.append({"shape": name, "form": form, "ms": ms, "x_first": base[kind] / ms,
                     "share_differing": float((got != want[kind]).float().mean())})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    settings = TimingSettings(warmup=3, reps=50) if device.type == "cuda" else TimingSettings(warmup=0, reps=1)
    rows: list[dict[str, Any]] = []
    for name, b, s, f in SMALL if args.small else SHAPES:
        rows += bench_shape(name, b, s, f, device, settings)
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"`python3 {' '.join(sys.argv)}`", "",
             f"device: {dev} | torch {torch.__version__} | bf16; CUDA events over {settings.reps} calls; ratio to the "
             "first row of its kind in the same shape", "",
             "| shape | form | ms | x first row | share of outputs differing from torch's ops |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['form']} | {r['ms']:.4f} | {r['x_first']:.2f} | {r['share_differing']:.2e} |"
              for r in rows]
    print_and_save(args.out, lines, {"device": dev, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
