"""The RoPE kernels alone (lowbit_pipe.kernels.norm_rope): this tree's against another tree's, on the shapes the
shipped models run, with the memory traffic each reaches.

    python3 bench/rope_kernels.py --before .rope_before/norm_rope.py --out bench/results/rope_kernels_h100.json
    python bench/rope_kernels.py --device cpu --small --out /tmp/rope_kernels.json   # smoke (TRITON_INTERPRET=1)

Kernels: `rope` (diffusers' interleaved form, cos / sin [S, D] fp32: Krea 2, FLUX.1 in eager), `rope_e4m3` (the same
writing cuDNN's e4m3 operands: attention.fold_qk) and `rope_pairs` (ComfyUI's apply_rope, 2x2 matrices per pair:
Krea 2's q with 48 heads and k with 12, FLUX.1's 24). `--before`: a norm_rope.py of another tree (a file: it
imports only torch and triton), timed in the same process on the same inputs; its output is compared with this
tree's (share of elements bit-equal, largest difference). Each kernel is also checked against its torch form.
GB/s counts x read once, the output written once and the tables read once; the device's peak is for context only.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import print_and_save

from lowbit_pipe.kernels import norm_rope
from lowbit_pipe.measure.timing import TimingSettings, time_ms

# (name, kernel, batch, tokens, heads, head dim): 1024² is 4096 image + 512 text tokens, 2048² 16384 + 512
SHAPES = [
    ("krea2 1024 q", "rope", 1, 4608, 48, 128), ("krea2 2048 q", "rope", 1, 16896, 48, 128),
    ("krea2 1024 q", "rope_e4m3", 1, 4608, 48, 128), ("krea2 2048 q", "rope_e4m3", 1, 16896, 48, 128),
    ("krea2 1024 q", "rope_e4m3 untracked", 1, 4608, 48, 128),
    ("krea2 1024 q (ComfyUI)", "rope_pairs", 1, 4608, 48, 128), ("krea2 1024 k (ComfyUI)", "rope_pairs", 1, 4608, 12, 128),
    ("krea2 2048 q (ComfyUI)", "rope_pairs", 1, 16896, 48, 128),
    ("flux1 1024 q (ComfyUI)", "rope_pairs", 1, 4608, 24, 128), ("flux1 512 q (ComfyUI)", "rope_pairs", 1, 1536, 24, 128),
]
SMALL = [("small", "rope", 2, 40, 4, 64), ("small", "rope_e4m3", 2, 40, 4, 64), ("small", "rope_e4m3 untracked", 2, 40, 4, 64),
         ("small", "rope_pairs", 2, 40, 4, 64)]


def load_tree_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("norm_rope_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inputs(kind: str, b: int, s: int, h: int, d: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    angles = torch.rand(s, d // 2, generator=gen, dtype=torch.float64) * 6
    if kind == "rope_pairs":  # ComfyUI's [B, H, L, D] and freqs [1, 1, L, D/2, 2, 2] fp32
        x = torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16)
        f = torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).float().view(1, 1, s, d // 2, 2, 2)
        return {"x": x.to(device), "freqs": f.to(device)}
    x = torch.randn(b, s, h, d, generator=gen).to(torch.bfloat16)  # diffusers' [B, S, H, D]
    cos = angles.cos().repeat_interleave(2, 1).float().to(device)
    sin = angles.sin().repeat_interleave(2, 1).float().to(device)
    scale = torch.full((1,), 448.0 / (d ** 0.5 * 1.1), device=device)
    return {"x": x.to(device), "cos": cos, "sin": sin, "scale": scale}


def call(module: ModuleType, kind: str, t: dict[str, Any]) -> Callable[[], torch.Tensor]:
    if kind == "rope":
        return lambda: module.rope(t["x"], t["cos"], t["sin"], 1)
    if kind.startswith("rope_e4m3"):  # "untracked": this tree's kernel without the amax (the fold's default)
        amax = None if kind.endswith("untracked") and module is norm_rope else torch.zeros(1, device=t["x"].device)
        return lambda: module.rope_e4m3(t["x"], t["cos"], t["sin"], t["scale"], amax)
    return lambda: module.rope_pairs(t["x"], t["freqs"])


def reference(kind: str, t: dict[str, Any]) -> torch.Tensor:
    if kind == "rope":
        return norm_rope.reference_rope(t["x"], t["cos"], t["sin"], 1)
    if kind.startswith("rope_e4m3"):
        return norm_rope.reference_rope_e4m3(t["x"], t["cos"], t["sin"], float(t["scale"]))
    return norm_rope.reference_rope_pairs(t["x"], t["freqs"])


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    af, bf = a.float(), b.float()
    return {"bit_equal": float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean()) if a.dtype == b.dtype
            else float("nan"), "max_abs_diff": float((af - bf).abs().max()),
            "max_rel_diff": float((af - bf).abs().max() / bf.abs().max().clamp_min(1e-30))}


def traffic_bytes(kind: str, t: dict[str, Any]) -> int:
    x = t["x"]
    out = x.numel() * (1 if kind.startswith("rope_e4m3") else x.element_size())
    tables = t["freqs"].numel() * 4 if kind == "rope_pairs" else 2 * t["cos"].numel() * 4
    return x.numel() * x.element_size() + out + tables


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def command_line(doc: str) -> tuple[argparse.Namespace, torch.device, ModuleType | None, TimingSettings]:
    """The RoPE benches' arguments (this one's and rope_variants'): (args, device, the --before module or None,
    timing settings for the device)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--before", help="another tree's lowbit_pipe/kernels/norm_rope.py, timed beside this tree's")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="small shapes (the CPU smoke)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    before = load_tree_module(args.before) if args.before else None
    settings = TimingSettings(warmup=3, reps=50) if device.type == "cuda" else TimingSettings(warmup=0, reps=1)
    return args, device, before, settings


def main() -> None:
    args, device, before, settings = command_line(__doc__)
    rows: list[dict[str, Any]] = []
    for name, kind, b, s, h, d in SMALL if args.small else SHAPES:
        t = inputs(kind, b, s, h, d, device)
        mine = call(norm_rope, kind, t)
        got = mine()
        row: dict[str, Any] = {"shape": name, "kernel": kind, "x": [b, s, h, d] if kind != "rope_pairs" else [b, h, s, d],
                               "vs_reference": compare(got, reference(kind, t))}
        row["after_ms"] = time_ms(mine, device, settings)
        moved = traffic_bytes(kind, t)
        row["after_gb_s"] = moved / row["after_ms"] / 1e6
        if before is not None:
            theirs = call(before, kind, t)
            row["vs_before"] = compare(got, theirs())
            row["before_ms"] = time_ms(theirs, device, settings)
            row["before_gb_s"] = moved / row["before_ms"] / 1e6
            row["speedup"] = row["before_ms"] / row["after_ms"]
        rows.append(row)
        print(row, flush=True)
        del t
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"`python3 {' '.join(sys.argv)}`", "",
             f"device: {dev} | torch {torch.__version__} | bf16 x, fp32 tables; CUDA events over {settings.reps} calls",
             "", "| shape | kernel | x | before ms | after ms | speedup | before GB/s | after GB/s | bit-equal to before"
             " | max rel diff to the torch form |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['kernel']} | {r['x']} | {_cell(r, 'before_ms', '.4f')} | {r['after_ms']:.4f} | "
                     f"{_cell(r, 'speedup', '.2f')} | {_cell(r, 'before_gb_s', '.0f')} | {r['after_gb_s']:.0f} | "
                     f"{r['vs_before']['bit_equal'] if 'vs_before' in r else '-'} | "
                     f"{r['vs_reference']['max_rel_diff']:.2e} |")
    print_and_save(args.out, lines, {"device": dev, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
