"""Residual LoRA overhead at Krea 2 shapes: rank-32 branch time relative to the quantized linear's own time.

    python bench/lora_overhead.py --device cuda --out bench/results/lora_overhead_h200.json   # GPU (lead, H200)
    python bench/lora_overhead.py --device cpu --small                                          # smoke test, < 60 s

Per shape (M tokens, K in, N out) and format, in one run on one device:
- t_q:     the QuantLinear forward without LoRA (this package's kernels for that format);
- t_q+lora: the same layer with a rank-32 LoraStack (one concatenated pair, strength folded in): on
           CUDA int8 / fp8 the FUSED path (xa = x @ down^T from the quantize's read of x; int8:
           xa @ up^T in the GEMM epilogue; fp8 on Hopper: the Triton fp8 GEMM's initial
           accumulator, elsewhere an in-place addmm_ into the _scaled_mm output);
- variants_ms (int8 / fp8): the pieces (quantize, quantize with the down projection, cuBLAS
           x @ down^T, GEMM, GEMM with the epilogue, GEMM + addmm_) and the previous wiring
           (plain quantize + cuBLAS x @ down^T) end to end;
- t_unfused: the old path in the same run, format.linear(x) + stack(x) (two extra matmuls and an add);
- err_vs_unfused: ||fused - unfused|| / ||unfused|| (bf16 rounding level expected);
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

from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.lora.branches import LoraBranch, LoraStack
from lowbit_pipe.quant.nn import QuantLinear

KREA2 = (4608, [(6144, 6144), (6144, 16384), (16384, 6144), (6144, 1536)])
SMALL = (128, [(512, 512), (512, 1024), (1024, 512), (512, 128)])


EAGER_FALLBACKS: list[str] = []


def bench(fn, device: torch.device, reps: int) -> float:
    """Median milliseconds of fn(); on CUDA replayed from a CUDA graph (GPU time only: the
    Python launch overhead of a ~0.1 ms call otherwise dominates and varies run to run)."""
    if device.type == "cuda":
        import triton.testing

        fn()  # autotune / caches before capture
        torch.cuda.synchronize()
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=max(100, reps * 10), return_mode="median"))
        except RuntimeError as e:  # a path that cannot be captured: eager timing, recorded as such
            EAGER_FALLBACKS.append(repr(e)[:200])
            print(f"warning: CUDA-graph capture failed, eager timing: {e!r:.200}")
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, reps * 10), return_mode="median"))
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
        t_unf = bench(lambda: q.format.linear(x, q.qweight, q.bias) + stack(x), device, reps)
        y_f = q(x).float()
        y_u = (q.format.linear(x, q.qweight, q.bias) + stack(x)).float()
        err = float((y_f - y_u).norm() / y_u.norm())
        t_lora = bench(lambda: stack(x), device, reps)
        variants = variant_times(q, stack, x, device, reps) if device.type == "cuda" and fmt in ("int8", "fp8") else {}
        t_bf16 = bench(lambda: nn.functional.linear(x, w), device, reps)
    return {"M": m, "K": k, "N": n, "format": fmt, "rank": rank, "t_q_ms": t_q, "t_q_lora_ms": t_ql,
            "t_unfused_ms": t_unf, "overhead_unfused": (t_unf - t_q) / t_q, "err_vs_unfused": err,
            "t_lora_ms": t_lora, "t_dense_ms": t_bf16, "overhead_vs_q": (t_ql - t_q) / t_q,
            "lora_vs_q": t_lora / t_q, "lora_vs_dense": t_lora / t_bf16, "variants_ms": variants}


def variant_times(q: QuantLinear, stack: LoraStack, x: torch.Tensor, device: torch.device, reps: int) -> dict:
    """Pieces and alternative fusions (rotation none): where the LoRA time goes."""
    from torch.nn import functional as F

    from lowbit_pipe.kernels.int8_gemm import int8_gemm_op
    from lowbit_pipe.kernels.quantize_act import quantize_act

    t = q.qweight.tensors
    down, up = stack.down, stack.up
    mode = "int8" if q.format.name == "int8" else "fp8"
    out = {"quant": bench(lambda: quantize_act(x, mode), device, reps),
           "quant_down": bench(lambda: quantize_act(x, mode, down=down), device, reps),
           "xa_cublas": bench(lambda: F.linear(x, down), device, reps)}
    if mode == "int8":
        w, ws = t["weight"], t["weight_scale"]
        q0, s0 = quantize_act(x, "int8")
        xa = F.linear(x, down)
        out["gemm"] = bench(lambda: int8_gemm_op(q0, w, s0, ws, None, x.dtype, 0), device, reps)
        out["gemm_epilogue"] = bench(lambda: int8_gemm_op(q0, w, s0, ws, None, x.dtype, 0, xa, up.t()), device, reps)
        out["gemm_then_addmm"] = bench(lambda: int8_gemm_op(q0, w, s0, ws, None, x.dtype, 0).addmm_(xa, up.t()), device, reps)
        # the previous wiring, for comparison: plain quantize + a cuBLAS x @ down^T + the epilogue GEMM
        def cublas_down() -> torch.Tensor:
            q1, s1 = quantize_act(x, "int8")
            return int8_gemm_op(q1, w, s1, ws, None, x.dtype, 0, F.linear(x, down), up.t())

        out["full_cublas_down_epilogue"] = bench(cublas_down, device, reps)
    else:  # the Triton fp8 GEMM with / without the branch, and cuBLAS (+ the in-place up-projection) beside it
        from lowbit_pipe.kernels.fp8_gemm import fp8_gemm_op

        w, ws = t["weight"], t["weight_scale"]
        q0, s0 = quantize_act(x, "fp8")
        xa = F.linear(x, down)
        wrow = ws.float().reshape(1, -1).expand(1, w.shape[0]).contiguous()
        out["gemm"] = bench(lambda: fp8_gemm_op(q0, w, s0, ws, None, x.dtype), device, reps)
        out["gemm_branch"] = bench(lambda: fp8_gemm_op(q0, w, s0, ws, None, x.dtype, xa, up.t()), device, reps)
        out["cublas_gemm"] = bench(lambda: torch._scaled_mm(q0, w.t(), scale_a=s0, scale_b=wrow, out_dtype=torch.bfloat16),
                                   device, reps)
        out["cublas_gemm_then_addmm"] = bench(lambda: torch._scaled_mm(q0, w.t(), scale_a=s0, scale_b=wrow,
                                                                       out_dtype=torch.bfloat16).addmm_(xa, up.t()), device, reps)
    return out


def check_variants(device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Fused vs unfused output on the GPU for rotations / granularities / bias / fp16 / static fp8 scale."""
    gen = torch.Generator().manual_seed(1)
    m, k, n, rank = 300, 1024, 768, 24
    out = []
    for fmt, rot, gran, dt, bias, static in (("int8", "none", "row", dtype, True, False),
                                             ("int8", "convrot", "row", dtype, False, False),
                                             ("int8", "quarot", "tensor", torch.float16, True, False),
                                             ("fp8", "none", "tensor", dtype, True, False),
                                             ("fp8", "convrot", "row", dtype, False, False),
                                             ("fp8", "none", "tensor", dtype, False, True)):
        linear = nn.Linear(k, n, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        q = QuantLinear.from_linear(linear, FormatSpec(fmt, rotation=rot, granularity=gran))
        if static:
            qw = q.format.attach_input_scale(q.qweight, 4.0)
            q.register_buffer("input_scale", qw.tensors["input_scale"])
            q._quant_names = q._quant_names + ("input_scale",)
        q = q.to(device, dt)
        stack = LoraStack(k, n)
        stack.branches = (LoraBranch("a", torch.randn(rank, k, generator=gen) * 0.05, torch.randn(n, rank, generator=gen) * 0.05,
                                     alpha=8.0, strength=0.7),)
        stack.to(device, dt)
        x = torch.randn(2, m // 2, k, generator=gen).to(device, dt)
        with torch.inference_mode():
            y_u = (q.format.linear(x, q.qweight, q.bias) + stack(x)).float()
            q.add_module("lora", stack)
            y_f = q(x).float()
        out.append({"format": fmt, "rotation": rot, "granularity": gran, "dtype": str(dt), "bias": bias, "static": static,
                    "err": float((y_f - y_u).norm() / y_u.norm())})
    return out


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
    rows = []
    for fmt in args.formats.split(","):
        for k, n in shapes:
            rows.append(measure(m, k, n, fmt, args.rank, device, dtype, reps))
            r = rows[-1]
            print(f"measured {fmt} K={k} N={n}: t_q {r['t_q_ms']:.3f} ms, +lora {r['t_q_lora_ms']:.3f} ms "
                  f"({r['overhead_vs_q'] * 100:.1f}%)", flush=True)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}, "
          f"{dtype}, rank {args.rank}, M={m}")
    print(f"{'format':<8} {'K':>6} {'N':>6} {'t_q ms':>9} {'t_q+lora':>9} {'t_unfused':>9} {'t_lora':>8} {'t_dense':>8} "
          f"{'overhead':>9} {'ovh_unf':>8} {'err':>8}")
    for r in rows:
        print(f"{r['format']:<8} {r['K']:>6} {r['N']:>6} {r['t_q_ms']:>9.3f} {r['t_q_lora_ms']:>9.3f} {r['t_unfused_ms']:>9.3f} "
              f"{r['t_lora_ms']:>8.3f} {r['t_dense_ms']:>8.3f} {r['overhead_vs_q'] * 100:>8.1f}% "
              f"{r['overhead_unfused'] * 100:>7.1f}% {r['err_vs_unfused']:>8.1e}")
    for r in rows:
        if r["variants_ms"]:
            print(f"{r['format']:<8} {r['K']:>6} {r['N']:>6} pieces ms: "
                  + ", ".join(f"{k_} {v:.3f}" for k_, v in r["variants_ms"].items()), flush=True)

    def write(checks: list[dict]) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({
                "command": " ".join(["python"] + sys.argv), "torch": torch.__version__, "device": str(device),
                "dtype": str(dtype), "seconds": round(time.time() - start, 1),
                "timer": "triton.testing.do_bench_cudagraph (median)" if device.type == "cuda" else "perf_counter",
                "eager_fallbacks": EAGER_FALLBACKS, "rows": rows, "checks": checks}, indent=2))

    write([])  # the timings survive a run cut short during the checks
    checks = check_variants(device, dtype) if device.type == "cuda" else []
    for c in checks:
        print(f"check {c['format']:<5} {c['rotation']:<8} {c['granularity']:<6} {c['dtype']:<15} bias={c['bias']!s:<5} "
              f"3-D: rel err fused vs unfused {c['err']:.2e}")
    write(checks)

if __name__ == "__main__":
    main()
