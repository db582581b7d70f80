"""Krea 2's grouped-query attention (48 query heads, 12 key / value heads) two ways on the GPU: the key and value
heads repeated before torch's SDPA (what ComfyUI 0.29.0's Krea 2 Attention and diffusers' Krea2AttnProcessor do)
against SDPA's own `enable_gqa`, per backend, with and without a text padding mask; plus what follows each call:
the output's [B, H, L, D] -> [B, L, H*D] copy times sigmoid(gate), against one pass reading the output transposed.

    python3 bench/gqa_attention.py --out bench/results/gqa_attention_h100
    python bench/gqa_attention.py --device cpu --small --out /tmp/gqa   # smoke (math backend)

Inputs are laid out as both callers hold them: q / k / v views [B, H, L, D] of projections [B, L, H*D]. Each row is
timed with CUDA events over the same inputs, checked against the repeated form (largest difference), and names the
kernels the profiler saw for one call. A backend that refuses the call is a row with its error, not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import print_and_save

from lowbit_pipe.measure.timing import TimingSettings, time_ms

# (name, batch, tokens, query heads, key / value heads, head dim, valid text tokens of 512 or None: no mask)
SHAPES = [("krea2 1024²", 1, 4608, 48, 12, 128, None), ("krea2 1024², text mask 77/512", 1, 4608, 48, 12, 128, 77),
          ("krea2 2048²", 1, 16896, 48, 12, 128, None)]
SMALL = [("small", 1, 96, 4, 2, 64, None), ("small, text mask", 1, 96, 4, 2, 64, 5)]
TEXT = 512
BACKENDS = {"default pick": None, "cuDNN": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def inputs(b: int, s: int, hq: int, hkv: int, d: int, valid: int | None, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)

    def heads(h: int) -> torch.Tensor:  # a projection's output viewed as [B, H, L, D], as both callers hold it
        return torch.randn(b, s, h * d, generator=gen).to(torch.bfloat16).to(device).view(b, s, h, d).transpose(1, 2)

    t = {"q": heads(hq), "k": heads(hkv), "v": heads(hkv), "mask": None}
    if valid is not None:  # text first (ComfyUI's and diffusers' Krea 2 order), padding after the valid tokens
        keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
        keep[..., valid:min(TEXT, s)] = False
        t["mask"] = keep.to(device)
    return t


def _sdpa(backend: SDPBackend | None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch's SDPA with its own pick (backend None) or only `backend`."""
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(*args, **kwargs)


def repeated(t: dict[str, Any], backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
    rep = t["q"].shape[1] // t["k"].shape[1]
    return lambda: _sdpa(backend, t["q"], t["k"].repeat_interleave(rep, dim=1), t["v"].repeat_interleave(rep, dim=1),
                         attn_mask=t["mask"])


def grouped(t: dict[str, Any], backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
    return lambda: _sdpa(backend, t["q"], t["k"], t["v"], attn_mask=t["mask"], enable_gqa=True)


def gated_output(name: str, out: torch.Tensor, device: torch.device, settings: TimingSettings) -> list[dict[str, Any]]:
    """Krea 2's step after attention, two ways: the output's [B, H, L, D] -> [B, L, H*D] copy times sigmoid(gate)
    (the stock code), against one pass that reads the output transposed with the gate's layout leading
    (TensorIterator follows the first operand's order where the operands' differ)."""
    b, h, s, d = out.shape
    gate = torch.randn(b, s, h * d, device=device, dtype=out.dtype)
    forms = {"output copy, then * sigmoid(gate)": lambda: out.transpose(1, 2).reshape(b, s, h * d) * torch.sigmoid(gate),
             "sigmoid(gate) * output read transposed":
                 lambda: (torch.sigmoid(gate).unflatten(-1, (h, d)) * out.transpose(1, 2)).flatten(2)}
    want = next(iter(forms.values()))()
    rows = []
    for form, fn in forms.items():
        got = fn()
        rows.append({"shape": name, "form": form, "backend": "-", "ms": time_ms(fn, device, settings),
                     "max_abs_diff": float((got.float() - want.float()).abs().max()), "contiguous": got.is_contiguous()})
        print(rows[-1], flush=True)
    return rows


def kernels(fn: Callable[[], Any], device: torch.device) -> list[str]:
    """The device kernels of one call, longest first (names cut to 60 characters)."""
    if device.type != "cuda":
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    return [f"{e.key[:60]} ({e.device_time_total / 1e3:.3f} ms)" for e in events[:3]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="small shapes (the CPU smoke)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    settings = TimingSettings(warmup=3, reps=30) if device.type == "cuda" else TimingSettings(warmup=0, reps=1)
    backends = BACKENDS if device.type == "cuda" else {"default pick": None}
    rows: list[dict[str, Any]] = []
    for name, b, s, hq, hkv, d, valid in SMALL if args.small else SHAPES:
        t = inputs(b, s, hq, hkv, d, valid, device)
        reference = repeated(t, None)()
        base_ms = None
        for form, build in (("repeat k, v + SDPA", repeated), ("SDPA enable_gqa", grouped)):
            for label, backend in backends.items():
                row: dict[str, Any] = {"shape": name, "form": form, "backend": label}
                fn = build(t, backend)
                try:
                    got = fn()
                except RuntimeError as e:  # the backend refuses this call: a row saying so
                    row["error"] = str(e).splitlines()[0][:120]
                    rows.append(row)
                    print(row, flush=True)
                    continue
                row["max_abs_diff"] = float((got.float() - reference.float()).abs().max())
                row["ms"] = time_ms(fn, device, settings)
                row["kernels"] = kernels(fn, device)
                if form.startswith("repeat") and label == "default pick":
                    base_ms = row["ms"]
                row["x_repeat_default"] = base_ms / row["ms"] if base_ms else None
                rows.append(row)
                print(row, flush=True)
        # what Krea 2 does with the output next: [B, H, L, D] -> [B, L, H*D] (a copy), times sigmoid(gate); against
        # one pass that reads the output transposed, the gate's layout leading (TensorIterator follows the first
        # operand's order where they differ)
        rows += gated_output(name, reference, device, settings)
        del t, reference
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    lines = [f"`python3 {' '.join(sys.argv)}`", "",
             f"device: {dev} | torch {torch.__version__} | bf16; CUDA events over {settings.reps} calls; ratio to the "
             "repeated form with SDPA's default pick in the same shape", "",
             "| shape | form | backend | ms | x repeat (default) | max abs diff | kernels (one call) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['form']} | {r['backend']} | refused: {r['error']} | | | |")
            continue
        ratio = f"{r['x_repeat_default']:.2f}" if r.get("x_repeat_default") else "-"
        extra = f"contiguous: {r['contiguous']}" if "contiguous" in r else "; ".join(r.get("kernels", []))
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
        lines.append(f"| {r['shape']} | {r['form']} | {r['backend']} | {r['ms']:.4f} | {ratio} | {diff} | {extra} |")
    print_and_save(args.out, lines, {"device": dev, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
