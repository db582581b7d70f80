"""Residual LoRA overhead at Krea 2 shapes: rank-32 branch time relative to the quantized linear's own time.

    python bench/lora_overhead.py --device cuda --out bench/results/lora_overhead_h200.json   # GPU (lead, H200)
    python bench/lora_overhead.py --device cpu --small                                          # smoke test, < 60 s

Per shape (M tokens, K in, N out) and format, in one run on one device:
- t_q:     the QuantLinear forward without LoRA (this package's kernels for that format);
- t_q+lora: the same layer with a rank-32 LoraStack (one concatenated pair, strength folded in);
- t_lora:  the branch alone, (x @ A^T) @ B^T in the activation dtype;
- t_bf16:  a dense F.linear of the same shape in the activation dtype (what a fast quantized kernel
           approaches; the branch's cost against it is the overhead to expect once kernels are fast).
Overhead = (t_q+lora - t_q) / t_q. GPU timing: triton.testing.do_bench (median), else CUDA events.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe.formats import FormatSpec  # noqa: E402
from lowbit_pipe.lora.branches import LoraBranch, LoraStack  # noqa: E402
from lowbit_pipe.nn import QuantLinear  # noqa: E402

KREA2 = (4608, [(6144, 6144), (6144, 16384), (16384, 6144), (6144, 1536)])
SMALL = (128, [(512, 512), (512, 1024), (1024, 512), (512, 128)])


def bench(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        try:
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, reps * 10), return_mode="median"))
        except ImportError:
            pass
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(m: int, k: int, n: int, fmt: str, rank: int, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    q = QuantLinear.from_linear(linear, FormatSpec(fmt)).to(device)
    w = linear.weight.detach().to(device, dtype)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    stack = LoraStack(k, n)
    stack.branches = (LoraBranch("a", torch.randn(rank // 2, k, generator=gen) * 0.01,
                                 torch.randn(n, rank // 2, generator=gen) * 0.01, alpha=16.0, strength=0.8),
                      LoraBranch("b", torch.randn(rank - rank // 2, k, generator=gen) * 0.01,
                                 torch.randn(n, rank - rank // 2, generator=gen) * 0.01, alpha=16.0, strength=0.5))
    stack.to(device, dtype)
    with torch.inference_mode():
        t_q = bench(lambda: q(x), device, reps)
        q.add_module("lora", stack)
        t_ql = bench(lambda: q(x), device, reps)
        t_lora = bench(lambda: stack(x), device, reps)
        t_bf16 = bench(lambda: nn.functional.linear(x, w), device, reps)
    return {"M": m, "K": k, "N": n, "format": fmt, "rank": rank, "t_q_ms": t_q, "t_q_lora_ms": t_ql,
            "t_lora_ms": t_lora, "t_dense_ms": t_bf16, "overhead_vs_q": (t_ql - t_q) / t_q,
            "lora_vs_q": t_lora / t_q, "lora_vs_dense": t_lora / t_bf16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--formats", default="int8,fp8,nvfp4")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype if device.type == "cuda" or args.dtype != "bfloat16" else "float32")
    m, shapes = SMALL if args.small else KREA2
    reps = args.reps or (3 if device.type == "cpu" else 20)
    start = time.time()
    rows = [measure(m, k, n, fmt, args.rank, device, dtype, reps) for fmt in args.formats.split(",") for k, n in shapes]
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}, "
          f"{dtype}, rank {args.rank}, M={m}")
    print(f"{'format':<8} {'K':>6} {'N':>6} {'t_q ms':>9} {'t_q+lora':>9} {'t_lora':>8} {'t_dense':>8} "
          f"{'overhead':>9} {'lora/dense':>10}")
    for r in rows:
        print(f"{r['format']:<8} {r['K']:>6} {r['N']:>6} {r['t_q_ms']:>9.3f} {r['t_q_lora_ms']:>9.3f} {r['t_lora_ms']:>8.3f} "
              f"{r['t_dense_ms']:>8.3f} {r['overhead_vs_q'] * 100:>8.1f}% {r['lora_vs_dense'] * 100:>9.1f}%")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": " ".join(["python"] + sys.argv), "torch": torch.__version__,
                                              "device": str(device), "dtype": str(dtype), "seconds": round(time.time() - start, 1),
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
