"""8-bit attention against torch SDPA (cuDNN, flash) and sageattention, at the shapes of a DiT's joint attention.

For each shape (batch, heads, tokens, head dim): every variant's time (median of CUDA-event timings after a
warm-up; the same inputs, one run), its TFLOPS (4 B H N² D / t) and its speed as a ratio to torch SDPA in bf16
on its default backend, measured in the same run; the 8-bit variants' accuracy on the same inputs (cosine and
relative error against float64 and against bf16 SDPA, and the kernel against its torch reference on a head
subset). `--sweep` also times every tile config of the attention kernel (the fixed configs in
kernels/attention8.py come from that table).

    python3 bench/attention8_bench.py --out bench/results/attention8_h200.json [--sweep]
    python bench/attention8_bench.py --device cpu --small        # smoke run: the reference path only

Masked shapes (diffusers' Krea 2 passes a text key-padding mask to every attention) time only what takes a
boolean mask: torch SDPA (its default backend picks cuDNN or falls back) and ours; flash and sageattention
take none.

Inputs: normal q, k, v plus per-channel offsets (keys 2, values 1, as DiT activations carry after norms and
RoPE), q and k scaled so the softmax is peaky (score std 3). Shapes: Krea 2 / FLUX.1 at 1024² (4096 image +
512 text tokens, 48 or 24 heads of 128), at 2048² (16384 + 512) and at 512² (1024 + 512), head dim 64.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import save_outputs

from lowbit_pipe.kernels import attention8 as A


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    tokens: int
    dim: int
    text_valid: int = 0  # > 0: a key-padding mask, the first `text` tokens text of which this many attend
    text: int = 512


SHAPES = [Shape("krea2_1024", 1, 48, 4608, 128), Shape("krea2_2048", 1, 48, 16896, 128),
          Shape("flux1_1024", 1, 24, 4608, 128), Shape("krea2_512", 1, 48, 1536, 128),
          Shape("d64_1024", 1, 48, 4608, 64),
          # diffusers' Krea 2 always passes its text padding mask: 512 text tokens, here 128 of them a prompt
          Shape("krea2_1024_masked", 1, 48, 4608, 128, 128)]
SMALL = [Shape("small", 1, 2, 300, 64), Shape("small_masked", 1, 2, 300, 64, 40, 100)]


def inputs(s: Shape, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16 if device == "cuda" else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.float32)

    peak = math.sqrt(3.0)  # score std 3 at sm_scale 1/sqrt(d)
    q = rnd(s.batch, s.heads, s.tokens, s.dim) * peak
    k = rnd(s.batch, s.heads, s.tokens, s.dim) * peak + rnd(1, s.heads, 1, s.dim) * 2
    v = rnd(s.batch, s.heads, s.tokens, s.dim) + rnd(1, s.heads, 1, s.dim)
    return q.to(dt), k.to(dt), v.to(dt)


def time_ms(fn, device: str, rep: int) -> float:
    """Median of `rep` timings after 3 warm-up calls (CUDA events on the GPU)."""
    for _ in range(3):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(rep):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(rep):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def variants(device: str) -> dict:
    """name -> f(q, k, v) for every attention this run times (those whose package is missing left out)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {"sdpa_bf16": lambda q, k, v, m=None: F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if m is None else m[:, None, None, :])}
    if device == "cuda":
        def backend(b):
            def f(q, k, v, m=None):
                with sdpa_kernel([b]):
                    return F.scaled_dot_product_attention(q, k, v)
            return f
        out["sdpa_flash"] = backend(SDPBackend.FLASH_ATTENTION)
        try:
            from sageattention import sageattn
            out["sageattention"] = lambda q, k, v, m=None: sageattn(q, k, v, tensor_layout="HND", is_causal=False)
        except ImportError as exc:
            print(f"sageattention not importable ({exc}): its rows are left out", flush=True)
    for fmt in A.QK_FORMATS:
        out[f"ours_{fmt}"] = lambda q, k, v, m=None, fmt=fmt: A.sdpa8(q, k, v, fmt, key_mask=m)
        if device == "cuda":
            out[f"ours_{fmt}_kernel_only"] = None  # filled per shape: the attention kernel on quantized operands
    return out


def accuracy(y: torch.Tensor, exact: torch.Tensor, bf16: torch.Tensor) -> dict:
    def cos(a, b):
        return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    return {"cos_exact": cos(y, exact), "rel_exact": rel(y, exact), "cos_bf16": cos(y, bf16), "rel_bf16": rel(y, bf16)}


def bench_shape(s: Shape, device: str, rep: int) -> list[dict]:
    q, k, v = inputs(s, device)
    mask = None
    if s.text_valid:
        mask = torch.ones(s.batch, s.tokens, dtype=torch.bool, device=device)
        mask[:, s.text_valid:s.text] = False
    flops = 4 * s.batch * s.heads * s.tokens ** 2 * s.dim
    heads = slice(0, min(4, s.heads))  # the float64 oracle and the torch reference on a head subset
    qs, ks, vs = q[:, heads], k[:, heads], v[:, heads]
    exact = A.exact_attention(qs, ks, vs, key_mask=mask)
    bf16 = variants("cpu")["sdpa_bf16"](qs, ks, vs, mask)
    rows, base = [], None
    for name, fn in variants(device).items():
        if mask is not None and name in ("sdpa_flash", "sageattention"):
            continue  # they take no mask
        if name.endswith("_kernel_only"):
            fmt = name.split("_")[1]
            qkv = A.quantize_qkv(q, k, v, fmt, key_mask=mask)
            o = torch.empty_like(q)
            fn = lambda q_, k_, v_, m_=None, qkv=qkv, o=o: A.attention8_quantized(qkv, o)  # noqa: E731
        ms = time_ms(lambda: fn(q, k, v, mask), device, rep)
        row = {"shape": s.name, **asdict(s), "variant": name, "ms": ms, "tflops": flops / ms / 1e9}
        if name == "sdpa_bf16":
            base = ms
        row["speedup_vs_sdpa"] = base / ms
        if not name.endswith("_kernel_only"):
            y = fn(qs, ks, vs, mask)
            row.update(accuracy(y, exact, bf16))
            if name.startswith("ours_") and device == "cuda":
                fmt = name.split("_")[1]
                ref = A.reference_attention8(qs, ks, vs, fmt, config=A.config_for(s.dim, True), key_mask=mask)
                row["rel_vs_reference"] = float((y.double() - ref.double()).norm() / ref.double().norm())
        rows.append(row)
        print(f"{s.name:12s} {name:26s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOPS x{row['speedup_vs_sdpa']:.2f}"
              + (f" cos_bf16 {row['cos_bf16']:.6f} cos_exact {row['cos_exact']:.6f}" if "cos_bf16" in row else ""),
              flush=True)
    return rows


def configs() -> list:
    """The tile configs --sweep times: every block / warps / stages choice, and warp specialization for the
    128-wide key blocks."""
    out = [A.Attention8Config(bm, bn, w, st) for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (2, 3, 4)]
    return out + [A.Attention8Config(bm, 128, w, st, True) for bm in (64, 128) for w in (4, 8) for st in (2, 3)]


def sweep(s: Shape, rep: int) -> list[dict]:
    """Every tile config of the attention kernel (operands quantized once per block shape)."""
    q, k, v = inputs(s, "cuda")
    flops = 4 * s.batch * s.heads * s.tokens ** 2 * s.dim
    rows = []
    for fmt in A.QK_FORMATS:
        for cfg in configs():
            try:
                qkv = A.quantize_qkv(q, k, v, fmt, config=cfg)
                o = torch.empty_like(q)
                ms = time_ms(lambda: A.attention8_quantized(qkv, o), "cuda", rep)
            except Exception as exc:  # noqa: BLE001 - a config the compiler or the SM's shared memory refuses
                rows.append({"shape": s.name, "fmt": fmt, **asdict(cfg), "error": str(exc)[:200]})
                continue
            rows.append({"shape": s.name, "fmt": fmt, **asdict(cfg), "ms": ms, "tflops": flops / ms / 1e9})
            print(f"sweep {s.name} {fmt} {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOPS", flush=True)
    return rows


def profile(s: Shape, iters: int = 10) -> list[dict]:
    """Device time of each kernel that one sdpa8 call launches (torch.profiler), per format."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, v = inputs(s, "cuda")
    rows = []
    for fmt in A.QK_FORMATS:
        for _ in range(3):
            A.sdpa8(q, k, v, fmt)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                A.sdpa8(q, k, v, fmt)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if dev > 0 and e.count >= iters:
                rows.append({"shape": s.name, "fmt": fmt, "kernel": e.key, "calls": e.count // iters,
                             "ms_per_call": dev / iters / 1e3})
        for r in rows:
            if r["fmt"] == fmt:
                print(f"profile {s.name} {fmt} {r['kernel'][:60]:60s} x{r['calls']} {r['ms_per_call']:.4f} ms", flush=True)
    return rows


def table(rows: list[dict], sweep_rows: list[dict], profile_rows: list[dict] = ()) -> str:
    lines = ["| shape | variant | ms | TFLOPS | x SDPA bf16 | cos vs bf16 | cos vs fp64 | rel vs fp64 | kernel vs ref |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else ""
        lines.append(f"| {r['shape']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['speedup_vs_sdpa']:.2f} "
                     f"| {f('cos_bf16', '.6f')} | {f('cos_exact', '.6f')} | {f('rel_exact', '.4f')} "
                     f"| {f('rel_vs_reference', '.1e')} |")
    if sweep_rows:
        lines += ["", "| shape | fmt | block_m | block_n | warps | stages | warp spec. | ms | TFLOPS |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sweep_rows, key=lambda r: (r["shape"], r["fmt"], r.get("ms", 1e9))):
            lines.append(f"| {r['shape']} | {r['fmt']} | {r['block_m']} | {r['block_n']} | {r['num_warps']} | "
                         f"{r['num_stages']} | {r['warp_specialize']} | {r.get('ms', float('nan')):.3f} | "
                         f"{r.get('tflops', 0):.0f} |" + (f" {r['error'][:60]}" if "error" in r else ""))
    if profile_rows:
        lines += ["", "| shape | fmt | kernel | calls | device ms per call of sdpa8 |", "|---|---|---|---|---|"]
        for r in profile_rows:
            lines.append(f"| {r['shape']} | {r['fmt']} | {r['kernel'][:70]} | {r['calls']} | {r['ms_per_call']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/attention8_h200.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="one small shape (a CPU smoke run)")
    ap.add_argument("--shapes", nargs="*", help="names from SHAPES (default: all)")
    ap.add_argument("--sweep", nargs="*", help="time every tile config at these shapes (none named: the first)")
    ap.add_argument("--profile", action="store_true", help="each kernel's device time in one sdpa8 call")
    ap.add_argument("--rep", type=int, default=30)
    args = ap.parse_args()
    shapes = SMALL if args.small else [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    payload = {"command": " ".join(sys.argv), "torch": torch.__version__, "device": args.device,
               "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "configs": {d: asdict(c) for d, c in A.GPU_CONFIGS.items()}, "rows": [], "sweep": [], "profile": []}

    def save():
        save_outputs(args.out, table(payload["rows"], payload["sweep"], payload["profile"]), payload)

    if args.profile:
        payload["profile"] = profile(shapes[0])
        save()
    if args.sweep is not None:
        for s in [s for s in SHAPES if s.name in args.sweep] or shapes[:1]:
            payload["sweep"] += sweep(s, args.rep)
            save()
    for s in shapes:
        payload["rows"] += bench_shape(s, args.device, args.rep if args.device == "cuda" else 2)
        save()
    print(table(payload["rows"], payload["sweep"], payload["profile"]))


if __name__ == "__main__":
    main()
