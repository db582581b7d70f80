"""Quantized linear speed vs bf16 at Krea 2 shapes, each output checked against the reference.

GPU (the committed table):  python bench/linear_speed.py --out bench/results/linear_speed_h200.json
CPU smoke run (seconds):     python bench/linear_speed.py --device cpu --small

Per shape (M tokens, K in, N out) and format: QuantLinear.forward time INCLUDING the
activation quantization (and rotation), the bf16 F.linear baseline measured in the same
run, their ratio (bf16 ms / format ms: > 1 is faster than bf16), and two relative errors
||y - r|| / ||r||: against the format's reference math (the torch oracle, evaluated in fp32 on
the same device: checks the kernels) and against the unquantized fp32 product (the format's
quantization error). The path column says which dispatch path ran (lowbit_pipe.kernels.dispatch).
Timing: triton.testing.do_bench (L2 flushed between calls, mean ms) on CUDA; wall clock on CPU.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import save_outputs

from lowbit_pipe.formats import FormatSpec, common, get_format
from lowbit_pipe.formats.nvfp4 import computes_weight_only
from lowbit_pipe.formats.w4a8 import decode_int8_grid
from lowbit_pipe.kernels import dispatch, reference, rotation
from lowbit_pipe.quant.nn import QuantLinear

KREA2_KN = ((6144, 6144), (6144, 16384), (16384, 6144), (6144, 1536))
FULL_SHAPES = [(4608, k, n) for k, n in KREA2_KN] + [(256, k, n) for k, n in KREA2_KN]
SMALL_SHAPES = [(64, 256, 256), (64, 256, 512), (64, 512, 256), (64, 256, 128)]
# (label, format, spec, QuantLinear run-time settings (quantize.prepack / quantize.nvfp4_compute), comfy-kitchen
# layout and its from_float kwargs or None)
ROWS = (
    ("int8", "int8", FormatSpec("int8"), {}, ("TensorWiseINT8Layout", {})),
    ("int8+convrot", "int8", FormatSpec("int8", rotation="convrot"), {},
     ("TensorWiseINT8Layout", {"convrot": True, "per_channel": True})),
    ("fp8", "fp8", FormatSpec("fp8"), {}, ("TensorCoreFP8Layout", {})),
    ("nvfp4", "nvfp4", FormatSpec("nvfp4"), {"compute": "nvfp4"}, None),  # NVFP4 activations emulated
    ("nvfp4 weight-only", "nvfp4", FormatSpec("nvfp4", activations="none"), {}, ("TensorCoreNVFP4Layout", {})),
    ("nvfp4 fp8-compute", "nvfp4", FormatSpec("nvfp4"), {"compute": "fp8"}, None),
    ("convrot_w4a4", "convrot_w4a4", FormatSpec("convrot_w4a4", rotation="convrot"), {},
     ("TensorCoreConvRotW4A4Layout", {})),
    ("convrot_w4a4 prepacked", "convrot_w4a4", FormatSpec("convrot_w4a4", rotation="convrot"), {"prepack": True},
     None),
    ("w4a8", "w4a8", FormatSpec("w4a8", rotation="convrot"), {}, ("AsymW4A8Int8Layout", {})),
    ("w4a8 prepacked", "w4a8", FormatSpec("w4a8", rotation="convrot"), {"prepack": True}, None),
    ("w6a8", "w6a8", FormatSpec("w6a8", rotation="convrot"), {}, ("AsymW4A8Int8Layout", {"bits": 6})),
    ("w6a8 prepacked", "w6a8", FormatSpec("w6a8", rotation="convrot"), {"prepack": True}, None),
    # weight-only: the Triton decode into bf16 + cuBLAS (comfy-kitchen's AWQ layout is load-only: no from_float)
    ("awq_w4a16", "awq_w4a16", FormatSpec("awq_w4a16"), {}, None),
    ("mxfp8 weight-only", "mxfp8", FormatSpec("mxfp8", activations="none"), {}, ("TensorCoreMXFP8Layout", {})),
    ("mxfp8", "mxfp8", FormatSpec("mxfp8"), {}, None),  # dynamic MXFP8 activations, emulated in bf16 (no MX on sm90)
    ("svdquant_w4a4", "svdquant_w4a4", FormatSpec("svdquant_w4a4"), {}, None),  # rank 32, round-to-nearest
)


COMPILED_ROWS = ("int8", "int8+convrot", "fp8", "convrot_w4a4", "convrot_w4a4 prepacked")  # --compiled: where Inductor generates the quantization


def emulate(name: str, x: torch.Tensor, q, bias: torch.Tensor | None) -> torch.Tensor:
    """The format's reference math in fp32 on any device (int products summed in fp32: exact
    below 2^24, ~1e-7 relative above; CUDA has no int64 matmul for the CPU reference's path)."""
    fmt = get_format(name)
    t = q.tensors
    kind, group = common.record_rotation(q.record, q.format)
    if name == "convrot_w4a4":
        kind, group = "convrot", int(q.record.get("convrot_groupsize", 256))
    if name in ("w4a8", "w6a8"):
        kind, group = "convrot", int(q.record.get("convrot_groupsize", 256))
    assert kind != "hadanorm", "hadanorm is not benchmarked"
    # rotated as the GPU paths rotate: in x's dtype, each value rounded once (dispatch.rotate)
    xr = rotation.rotate_groups(x.double(), kind, group).to(x.dtype).float() if kind != "none" else x.float()
    if name == "fp8":
        y = reference.fp8_linear(xr, t["weight"], t["weight_scale"], t.get("input_scale"))
    elif name == "nvfp4" and q.compute == "fp8":  # fp8 compute: e4m3 weight per row, fp8 activations per token
        rs = fmt.fp8_row_scale(q)
        y = reference.fp8_linear(xr, reference.fp8_quantize(fmt._dequantize_rotated(q), rs.reshape(-1, 1)), rs)
    elif (name == "nvfp4" and computes_weight_only(fmt.activation_mode(q), q.compute, x)) or \
            fmt.activation_mode(q) == "none" or name == "awq_w4a16":  # weight-only
        y = x.float() @ fmt.dequantize(q).t()
    elif name == "nvfp4":
        y = reference.nvfp4_fake_quant(xr, t.get("input_scale")) @ fmt._dequantize_rotated(q).t()
    elif name == "mxfp8":
        from lowbit_pipe.formats.mxfp8 import fake_quant

        y = fake_quant(xr) @ fmt._dequantize_rotated(q).t()
    elif name == "svdquant_w4a4":  # both operands dequantized in fp32 (exact: small integers times bf16 scales)
        x2 = x.reshape(-1, x.shape[-1]).to(t["weight_scale"].dtype)
        codes, scales = reference.svdquant_quantize_activations(x2, t["weight_smooth_factor"])
        act = (codes.float().view(codes.shape[0], -1, reference.SVDQUANT_GROUP) * scales.float().unsqueeze(-1)).view(codes.shape)
        y = act @ fmt._residual(q, torch.float32).t() + \
            (x2.float() @ t["weight_proj_down"].float()) @ t["weight_proj_up"].float().t()
    else:
        if name == "convrot_w4a4":
            xq, xs = reference.quantize_rows_int4(xr)
            w, ws = fmt.codes(q), t["weight_scale"]
        elif name in ("w4a8", "w6a8"):
            k = q.shape[1]
            xq, xs = reference.quantize_rows_int8(xr)
            w, ws = decode_int8_grid(t, k, fmt.bits, 16), t["weight_s_channel"]
        else:
            xq, xs = reference.quantize_rows_int8(xr)
            w, ws = t["weight"], t["weight_scale"]
        acc = xq.float() @ w.float().t()
        y = acc * xs * (ws.float().reshape(1, -1) if ws.numel() > 1 else ws.float().reshape(()))
    if bias is not None:
        y = y + bias.float()
    return y


def path_of(name: str, x: torch.Tensor, q) -> str:
    kind, _ = common.record_rotation(q.record, q.format)
    if name == "fp8":
        if not dispatch.fp8_supported(x, q.tensors["weight"], kind):
            return "reference"
        return "triton-quant+triton-fp8" if dispatch.fp8_triton_gemm(x) else "triton-quant+cublas-fp8"
    if name == "nvfp4" and q.compute == "fp8":
        return "triton-decode-fp8+triton-quant+fp8-gemm" if dispatch.nvfp4_supported(x, kind) else "reference"
    if name == "nvfp4":
        if not dispatch.nvfp4_supported(x, kind):
            return "reference"
        act = "" if computes_weight_only(get_format(name).activation_mode(q), q.compute, x) else "triton-nvfp4-act+"
        return act + ("triton-nvfp4-gemm" if x.shape[0] < dispatch.DECODE_MIN_ROWS else "triton-decode+cublas-bf16")
    if name == "convrot_w4a4":
        if not dispatch.int8_supported(x, "convrot"):
            return "reference"
        return "int4-quant+" + ("int8 gemm(prepacked codes)" if q.runtime else "triton-gemm(int4 unpack)")
    if name in ("w4a8", "w6a8"):
        if not dispatch.int8_supported(x, "convrot"):
            return "reference"
        return ("prepacked" if q.runtime else "triton-decode") + "+triton-quant+triton-int8"
    if name == "svdquant_w4a4":
        if not dispatch.svdquant_supported(x, q.tensors["weight"]):
            return "reference"
        return "triton-act+triton-decode+" + ("triton-tma-bf16(branch)" if dispatch.fp8_triton_gemm(x)
                                              else "cublas-bf16+addmm")
    if name == "mxfp8" and get_format(name).activation_mode(q) != "none":
        if not dispatch.mxfp8_supported(x, q.tensors["weight"], kind):
            return "reference"
        return "triton-mx-act+triton-decode+" + ("triton-tma-bf16" if dispatch.fp8_triton_gemm(x) else "cublas-bf16")
    if name in ("awq_w4a16", "mxfp8"):
        return "triton-decode+cublas" if dispatch.decode_supported(x, q.tensors["weight"]) else "reference"
    return "triton-quant+triton-int8" if dispatch.int8_supported(x, kind) else "reference"


def graph_timer(iters: int):
    """Time one CUDA-graph replay of fn: the GPU time alone, without Python/launch overhead
    (what a compiled / graph-captured DiT forward sees). fn must have run once (autotuning)."""
    import triton.testing

    def run(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return float(triton.testing.do_bench(graph.replay, warmup=25, rep=iters))
    return run


def components(name: str, x: torch.Tensor, q, graph) -> dict:
    """GPU time of the activation preparation (rotation + quantization, as the layer runs it) and of the GEMM
    alone (int8 family); rotated, also the tensor-core rotation alone. (The quantize kernel's former
    in-register rotation, 0.198 ms where the matmul takes 0.037: bench/results/linear_speed_h200_rotmm.md;
    a rotation fused into the quantization by recomputing x @ H in both of its passes, 0.144 ms where the
    two kernels take 0.072: bench/results/linear_speed_h200_rotquant.md.)"""
    from lowbit_pipe.kernels.int8_gemm import int8_gemm

    kind, group = common.record_rotation(q.record, q.format)
    if name == "convrot_w4a4":
        kind, group = "convrot", 256
    mode = "int4" if name == "convrot_w4a4" else "int8"
    t = q.tensors
    w = q.runtime.get("int8_codes", t["weight"])  # convrot_w4a4 prepacked: int8 codes, read as int8 weights
    w_mode = 1 if name == "convrot_w4a4" and "int8_codes" not in q.runtime else 0
    x2 = x.reshape(-1, x.shape[-1])
    a = dispatch.quantize_activations(x2, mode, kind, group, None)
    out = {"quant_ms_graph": graph(lambda: dispatch.quantize_activations(x2, mode, kind, group, None)),
           "gemm_ms_graph": graph(lambda: int8_gemm(a.codes, w, a.scale, t["weight_scale"], None, x.dtype, w_mode))}
    if kind != "none":
        g = rotation.resolve_group(kind, group)
        out["rotate_ms_graph"] = graph(lambda: rotation.rotate_groups(x2, kind, g))
    return out


def compiled_time(layer: QuantLinear, x: torch.Tensor, graph) -> dict:
    """The layer under torch.compile (Inductor: the activation quantization as generated code, the GEMM as our
    kernel), replayed from a CUDA graph, and its compile seconds."""
    fn = torch.compile(layer)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        return {"ms_compiled_graph": graph(lambda: fn(x)), "compile_s": compile_s}


def comfy_kitchen_time(layout: tuple[str, dict], x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, bench,
                       y_float: torch.Tensor) -> dict:
    """comfy-kitchen's equivalent layer (its QuantizedTensor through F.linear, the backend it picks on this GPU:
    its CUDA kernels where it has them), timed the same way: ck_ms, ck_x (bf16 ms / ck ms set by the caller), ck
    error vs float; {"ck_error": ...} where it cannot run."""
    try:
        from comfy_kitchen.tensor import QuantizedTensor

        name, kwargs = layout
        qt = QuantizedTensor.from_float(w, name, **kwargs)
        with torch.no_grad():
            y = F.linear(x, qt, b)
            ms = bench(lambda: F.linear(x, qt, b))
        return {"ck_ms": ms, "ck_rel_err_vs_float": rel(y, y_float)}
    except Exception as err:  # noqa: BLE001 -- the comparison column says why it is empty
        return {"ck_error": f"{type(err).__name__}: {err}"[:300]}


def timer(device: str, iters: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=iters))
    def cpu_time(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e3
    return cpu_time


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(args: argparse.Namespace) -> dict:
    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references must be fp32
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [s for s in (SMALL_SHAPES if args.small else FULL_SHAPES) if not args.m or s[0] in args.m]
    rows = [r for r in ROWS if not args.formats or r[0] in args.formats]
    bench = timer(device, args.rep_ms)
    graph = graph_timer(args.rep_ms) if device == "cuda" else None
    gen = torch.Generator(device="cpu").manual_seed(0)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    results: list[dict] = []
    report = {"command": "python " + " ".join(sys.argv), "env": env, "dtype": str(dtype), "results": results}
    for m, k, n in shapes:
        x = torch.randn(m, k, generator=gen)
        x[:, torch.randperm(k, generator=gen)[: k // 100]] *= 20.0  # 1% outlier channels, as DiT activations have
        w = torch.randn(n, k, generator=gen) * 0.02
        b = torch.randn(n, generator=gen) * 0.1
        x, w, b = x.to(device, dtype), w.to(device), b.to(device, dtype)
        w_lp = w.to(dtype)
        y_float = x.float() @ w.t() + b.float()
        base_ms = bench(lambda: F.linear(x, w_lp, b))
        base_graph = graph(lambda: F.linear(x, w_lp, b)) if graph else None
        y_base = F.linear(x, w_lp, b)
        results.append({"M": m, "K": k, "N": n, "format": "bf16" if dtype == torch.bfloat16 else "fp32", "path": "F.linear",
                        "ms": base_ms, "speedup_vs_bf16": 1.0, "ms_graph": base_graph, "speedup_graph": 1.0 if graph else None,
                        "rel_err_vs_reference": 0.0, "rel_err_vs_float": rel(y_base, y_float)})
        print(f"M={m} K={k} N={n}: {results[-1]['format']} {base_ms:.4f} ms, graph {base_graph}", flush=True)
        for label, name, spec, settings, ck_layout in rows:
            fmt = get_format(name)
            if not fmt.supports_shape(n, k):
                continue
            layer = QuantLinear(fmt.with_activations(fmt.quantize(w, spec), spec.activations), b).to(device)
            if settings.get("prepack"):
                layer.prepacked = layer.prepack()
            layer.compute = settings.get("compute")
            ck = comfy_kitchen_time(ck_layout, x, w_lp, b, bench, y_float) if ck_layout and device == "cuda" else {}
            try:
                with torch.no_grad():
                    y = layer(x)
                    ref = emulate(name, x, layer.qweight, b)
                    ms = bench(lambda: layer(x))
                    ms_graph = graph(lambda: layer(x)) if graph else None
                    parts = components(name, x, layer.qweight, graph) if graph and name in ("int8", "convrot_w4a4") else {}
                    if graph and args.compiled and label in COMPILED_ROWS and m >= 1024:
                        parts.update(compiled_time(layer, x, graph))
                        parts["speedup_compiled"] = base_graph / parts["ms_compiled_graph"]
            except Exception as err:  # noqa: BLE001 - a broken path is reported in the table and the run goes on
                results.append({"M": m, "K": k, "N": n, "format": label, "path": path_of(name, x, layer.qweight),
                                "error": f"{type(err).__name__}: {err}"[:500]})
                print(f"  {label:14s} ERROR {results[-1]['error']}", flush=True)
                continue
            row = {"M": m, "K": k, "N": n, "format": label, "path": path_of(name, x, layer.qweight), "ms": ms,
                   "speedup_vs_bf16": base_ms / ms, "ms_graph": ms_graph,
                   "speedup_graph": base_graph / ms_graph if graph else None,
                   # the output is x.dtype: compare with the reference rounded the same way
                   "rel_err_vs_reference": rel(y, ref.to(y.dtype)), "rel_err_vs_float": rel(y, y_float), **parts, **ck}
            if "ck_ms" in ck:
                row["speedup_vs_ck"] = ck["ck_ms"] / ms
            results.append(row)
            print(f"  {label:14s} {ms:.4f} ms  x{row['speedup_vs_bf16']:.2f}  graph {ms_graph} {parts} ref {row['rel_err_vs_reference']:.2e}  "
                  f"float {row['rel_err_vs_float']:.2e}  [{row['path']}]", flush=True)
            layer = None  # frees this layer before the next is built
        if device == "cuda":
            torch.cuda.empty_cache()
        save(report, markdown(report), args.out, quiet=True)  # a run cut short keeps the shapes it measured
    return report


def summary(report: dict) -> list[str]:
    """One line per shape, one column per format: the speed-up over bf16 in a CUDA graph replay (eager where there
    is no graph), with comfy-kitchen's eager ms over ours in brackets (> 1: ours faster), "err" for a failed cell."""
    results = [r for r in report["results"] if r["format"] not in ("bf16", "fp32")]
    labels = list(dict.fromkeys(r["format"] for r in results))
    shapes = list(dict.fromkeys((r["M"], r["K"], r["N"]) for r in results))
    cells = {(r["M"], r["K"], r["N"], r["format"]): r for r in results}

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        if "error" in r:
            return "err"
        x = r["speedup_graph"] if r.get("speedup_graph") is not None else r["speedup_vs_bf16"]
        return f"{x:.2f}x" + (f" ({r['speedup_vs_ck']:.2f})" if "speedup_vs_ck" in r else "")
    lines = ["| M | K x N | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for m, k, n in shapes:
        lines.append(f"| {m} | {k} x {n} | " + " | ".join(cell(cells.get((m, k, n, f))) for f in labels) + " |")
    return lines


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"`{report['command']}`", "",
             f"device: {env['device_name']} | torch {env['torch']} | triton {env['triton']} | activations {report['dtype']}",
             "", "Summary: x bf16 in a CUDA graph replay (eager without a graph); in brackets comfy-kitchen's eager ms "
             "over ours (> 1: ours faster)", "", *summary(report), "",
             "ms = forward incl. activation quantization; x = bf16 ms / format ms (>1 faster); "
             "err ref = vs the format's reference math; err float = vs the unquantized fp32 product", "",
             "ms graph / x graph: the same forward replayed from a CUDA graph (GPU time, no Python or launch "
             "overhead); compiled: the layer under torch.compile, replayed the same way (--compiled); quant/gemm: "
             "graph time of the activation preparation (rotation + quantization) and of the GEMM alone", "",
             "ck ms: comfy-kitchen's equivalent (QuantizedTensor + F.linear, the backend it picks), eager; "
             "vs ck = ck ms / our eager ms (> 1: ours faster)", "",
             "| M | K | N | format | ms eager | x bf16 | ms graph | x graph | compiled, graph (x bf16) | quant / gemm ms "
             "| ck ms | vs ck | err ref | err float | path |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['format']} | error | | | | | | | | | | "
                         f"{r['path']}: {r['error'][:120]} |")
            continue
        g = f"{r['ms_graph']:.4f} | {r['speedup_graph']:.2f}" if r.get("ms_graph") is not None else "- | -"
        parts = f"{r['quant_ms_graph']:.4f} / {r['gemm_ms_graph']:.4f}" if "quant_ms_graph" in r else ""
        if "rotate_ms_graph" in r:
            parts += f" (rotation {r['rotate_ms_graph']:.4f})"
        comp = f"{r['ms_compiled_graph']:.4f} ({r['speedup_compiled']:.2f}x)" if "ms_compiled_graph" in r else ""
        ck = f"{r['ck_ms']:.4f} | {r['speedup_vs_ck']:.2f}" if "ck_ms" in r else \
            (f"failed: {r['ck_error'][:60]} | " if "ck_error" in r else " | ")
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['format']} | {r['ms']:.4f} | {r['speedup_vs_bf16']:.2f} | {g} | "
                     f"{comp} | {parts} | {ck} | {r['rel_err_vs_reference']:.1e} | {r['rel_err_vs_float']:.1e} | {r['path']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--formats", nargs="*", default=None, help=f"subset of {[r[0] for r in ROWS]}")
    parser.add_argument("--m", nargs="*", type=int, default=None, help="only these token counts (M)")
    parser.add_argument("--compiled", action="store_true",
                        help=f"also time {list(COMPILED_ROWS)} under torch.compile at M >= 1024 (one compile each)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per measurement (CUDA)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here (and .md beside it)")
    args = parser.parse_args()
    report = run(args)
    save(report, markdown(report), args.out)


def save(report: dict, md: str, out: Path | None, quiet: bool = False) -> None:
    """Print the table (unless quiet); with `out`, write the JSON report there and the table as .md beside it."""
    if not quiet:
        print(md)
    if out:
        save_outputs(out, md, report)


if __name__ == "__main__":
    main()
