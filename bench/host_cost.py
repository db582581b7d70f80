"""Host cost of one uncompiled quantized linear call: the Python and launch time the CPU spends per call.

GPU (the committed table):  python bench/host_cost.py --out bench/results/host_cost_h200.json
CPU smoke run:               python bench/host_cost.py --device cpu

Per format at Krea 2 shapes with few tokens (where the host, not the GPU, bounds an eager forward):
host ms = wall time of `calls` back-to-back calls without a synchronisation, divided by `calls` (the GPU queue
absorbs the kernels meanwhile); gpu ms = one call replayed from a CUDA graph; bf16 F.linear in the same run as
the baseline. Then the top functions of a cProfile of the calls, to say where the host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import platform
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linear_speed import save  # noqa: E402
from lowbit_pipe.formats import FormatSpec, get_format  # noqa: E402
from lowbit_pipe.nn import QuantLinear  # noqa: E402

ROWS = (("int8", FormatSpec("int8")), ("fp8", FormatSpec("fp8")), ("int8+convrot", FormatSpec("int8", rotation="convrot")),
        ("nvfp4 weight-only", FormatSpec("nvfp4", activations="none")))
SHAPES = ((256, 6144, 6144), (256, 6144, 1536))
CPU_SHAPES = ((64, 256, 256),)  # the CPU runs the torch references: a smoke run


def host_ms(fn, calls: int, sync) -> float:  # noqa: ANN001
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / calls * 1e3


def gpu_ms(fn) -> float:  # noqa: ANN001
    import triton.testing

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=50))


def profile_top(fn, calls: int, top: int = 12) -> list[str]:  # noqa: ANN001
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top:]


def run(args: argparse.Namespace) -> dict:
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    results = []
    for m, k, n in SHAPES if device == "cuda" else CPU_SHAPES:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen) * 0.02
        b = torch.randn(n, generator=gen).to(device, dtype)
        w_lp = w.to(device, dtype)
        cases = [("bf16" if dtype == torch.bfloat16 else "fp32", lambda: F.linear(x, w_lp, b))]
        for label, spec in ROWS:
            fmt = get_format(spec.format)
            layer = QuantLinear(fmt.with_activations(fmt.quantize(w, spec), spec.activations), b).to(device)
            cases.append((label, (lambda layer: lambda: layer(x))(layer)))
        for label, fn in cases:
            with torch.no_grad():
                row = {"M": m, "K": k, "N": n, "format": label, "host_ms": host_ms(fn, args.calls, sync),
                       "gpu_ms": gpu_ms(fn) if device == "cuda" else None}
                if args.profile and label != cases[0][0]:
                    row["profile"] = profile_top(fn, args.calls)
            results.append(row)
            print(f"M={m} K={k} N={n} {label:18s} host {row['host_ms']:.4f} ms  gpu {row['gpu_ms']}", flush=True)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"}
    return {"command": "python " + " ".join(sys.argv), "env": env, "results": results}


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"`{report['command']}`", "", f"device: {env['device_name']} | torch {env['torch']}", "",
             "host ms: CPU time per uncompiled call (calls back to back, no sync); gpu ms: the call replayed from a "
             "CUDA graph. An eager forward costs about max(host, gpu) per layer.", "",
             "| M | K | N | format | host ms | gpu ms |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        gpu = f"{r['gpu_ms']:.4f}" if r["gpu_ms"] is not None else "-"
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['format']} | {r['host_ms']:.4f} | {gpu} |")
    for r in report["results"]:
        if "profile" in r:
            lines += ["", f"cProfile, {r['format']} at M={r['M']} K={r['K']} N={r['N']} (top by own time):", "```",
                      *r["profile"], "```"]
            break
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="cProfile each format's calls")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here (and .md beside it)")
    args = parser.parse_args()
    report = run(args)
    save(report, markdown(report), args.out)


if __name__ == "__main__":
    main()
