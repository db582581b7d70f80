"""cuDNN's FP8 attention and the attention router on the GPU: checks, times, choices, in one run.

    python3 bench/attention_route_gpu.py --out $OUT/attention_route.json      # ~2-3 minutes on an H100

For each shape (batch x heads x tokens x head dim, Krea 2 / FLUX.1 at 1024², 2048² and 512², and the 1024² call
with Krea 2's text padding mask: 77 of 512 text tokens attend):

- checks (a failed one makes the exit status 1): the cuDNN path's output (lowbit_pipe.kernels.cudnn_fp8_attention:
  per-tensor e4m3 quantization with K / V smoothing, cuDNN's sdpa_fp8, e4m3 output plus v's mean) against torch
  SDPA in bf16 on the same inputs, cosine >= --min-cos (0.999); against the torch model of the kernel
  (reference_from_codes, same codes, 2 heads) relative error <= 0.05 (a layout or scale bug is ~1); no NaN; and
  the router's choice (measured on the spot into a fresh table) not slower than torch's bf16 attention by more
  than 5 % in this run's own times ("never slower");
- times (ms, lowbit_pipe.measure.timing.time_ms: CUDA events around 20 back-to-back calls after 3): torch SDPA bf16 (with
  the mask where there is one), cuDNN's whole call, its quantization alone, its kernel alone, its kernel plus the
  output conversion, the Triton 8-bit attention (fp8 and int8) whole and its fp8 kernel alone; each as a ratio to
  torch SDPA bf16 of the same run;
- the choices: the router's (measured) and the default rule's (what a run without a measurement would take).

A device-time profile of one cuDNN call at the first shape says where its time goes (--no-profile skips it).
Table to stdout and beside --out as .md; everything in --out (JSON). Needs `pip install 'lowbit_pipe[cudnn]'`.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import save_outputs

MIN_REL_MODEL = 0.05
NEVER_SLOWER = 1.05  # the chosen path's time over torch's bf16 attention's, at most (timing noise)
TEXT, TEXT_VALID = 512, 77


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    tokens: int
    dim: int
    masked: bool = False


SHAPES = [Shape("krea2_1024", 1, 48, 4608, 128), Shape("krea2_2048", 1, 48, 16896, 128),
          Shape("flux1_1024", 1, 24, 4608, 128), Shape("flux1_512", 1, 24, 1280, 128),
          Shape("krea2_1024_masked", 1, 48, 4608, 128, True)]


def inputs(s: Shape, seed: int = 0):
    """q, k, v [B, H, N, D] bf16 (views of [B, N, H, D], diffusers' layout): peaky scores (std 3), per-channel
    offsets on k (2) and v (1), as DiT activations after norms and RoPE; the text padding mask when masked."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, s.batch, s.tokens, s.heads, s.dim, device="cuda", generator=gen)
    x[:2] *= math.sqrt(3.0)
    x[1] += torch.randn(1, 1, s.heads, s.dim, device="cuda", generator=gen) * 2
    x[2] += torch.randn(1, 1, s.heads, s.dim, device="cuda", generator=gen)
    q, k, v = (t.to(torch.bfloat16).transpose(1, 2) for t in x)
    mask = None
    if s.masked:
        mask = torch.ones(s.batch, s.tokens, dtype=torch.bool, device="cuda")
        mask[:, TEXT_VALID:TEXT] = False
    return q, k, v, mask


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def exact_heads(q, k, v, mask, heads: slice, rows: int = 1024) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v in float64 for `heads`, query rows a chunk at a time."""
    qh, kh, vh = (t[:, heads].double() for t in (q, k, v))
    out = torch.empty_like(qh)
    sm = 1.0 / math.sqrt(q.shape[-1])
    for r0 in range(0, qh.shape[2], rows):
        s = (qh[:, :, r0:r0 + rows] @ kh.transpose(-1, -2)) * sm
        if mask is not None:
            s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        out[:, :, r0:r0 + rows] = torch.softmax(s, dim=-1) @ vh
    return out


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :] if mask is not None else None)


def bench_shape(s: Shape, runner, args, timing) -> dict:
    from lowbit_pipe.attention import crossover as X
    from lowbit_pipe.kernels import attention8 as A
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.cudnn_fp8_attention import plan_key, reference_from_codes
    from lowbit_pipe.measure.timing import time_ms

    row: dict = {"shape": s.name, **asdict(s), "checks": {}, "ms": {}, "x_sdpa": {}, "failures": [], "notes": []}
    q, k, v, mask = inputs(s)
    sm = 1.0 / math.sqrt(s.dim)
    key = plan_key(torch.cuda.current_device(), s.batch, s.heads, s.tokens, s.dim, s.masked)
    t0 = time.perf_counter()
    why = runner.why_not(key)
    row["graph_build_s"] = round(time.perf_counter() - t0, 3)
    if why is not None:
        row["failures"].append(f"cuDNN refused this form ({why}); the router sends such calls to the Triton kernel")
    # ---------------------------------------------------------------------------------------------- checks
    stock = sdpa(q, k, v, mask)
    if why is None:
        out = runner(q, k, v, None, mask)
        c = row["checks"]
        c["cos_vs_sdpa_bf16"] = cos(out, stock)
        c["rel_vs_sdpa_bf16"] = rel(out, stock)
        c["nan"] = int(torch.isnan(out).sum())
        c["layout_is_q"] = out.stride() == q.stride()
        heads = slice(0, 2)
        exact = exact_heads(q, k, v, mask, heads)
        c["cos_vs_exact_2heads"] = cos(out[:, heads], exact)
        c["sdpa_bf16_cos_vs_exact_2heads"] = cos(stock[:, heads], exact)
        qkv = Q.quantize_qkv_fp8(q, k, v, mask)
        model = reference_from_codes(qkv, sm, torch.float32, heads=heads)
        c["rel_vs_torch_model_2heads"] = rel(out[:, heads], model)
        c["torch_model_cos_vs_exact_2heads"] = cos(model, exact)
        if c["cos_vs_sdpa_bf16"] < args.min_cos:
            row["failures"].append(f"cosine vs bf16 SDPA {c['cos_vs_sdpa_bf16']:.6f} < {args.min_cos}")
        if c["rel_vs_torch_model_2heads"] > MIN_REL_MODEL:
            row["failures"].append(f"rel error vs the torch model {c['rel_vs_torch_model_2heads']:.4f} > {MIN_REL_MODEL}")
        if c["nan"]:
            row["failures"].append(f"{c['nan']} NaN in the output")
        if not c["layout_is_q"]:
            row["failures"].append(f"output strides {out.stride()} are not q's {q.stride()}")
        trit = A.sdpa8(q, k, v, "fp8", key_mask=mask)
        c["triton_fp8_cos_vs_sdpa_bf16"] = cos(trit, stock)
        del out, trit, exact, model
    # ---------------------------------------------------------------------------------------------- times
    ms = row["ms"]
    ms["sdpa_bf16"] = time_ms(lambda: sdpa(q, k, v, mask), q.device, timing)
    if why is None:
        ms["cudnn_fp8"] = time_ms(lambda: runner(q, k, v, None, mask), q.device, timing)
        ms["cudnn_quantize"] = time_ms(lambda: Q.quantize_qkv_fp8(q, k, v, mask), q.device, timing)
        qkv = Q.quantize_qkv_fp8(q, k, v, mask)
        o8 = torch.empty(s.batch, s.tokens, s.heads, s.dim, dtype=torch.float8_e4m3fn, device="cuda")
        out = torch.empty_like(q)
        ms["cudnn_kernel"] = time_ms(lambda: runner.execute(key, qkv, o8), q.device, timing)
        ms["cudnn_kernel_finish"] = time_ms(lambda: Q.finish_output(runner.execute(key, qkv, o8), qkv, out), q.device,
                                            timing)
        del qkv, o8, out
    if s.dim in A.GPU_CONFIGS:
        for fmt in ("fp8", "int8"):
            ms[f"triton_{fmt}"] = time_ms(lambda fmt=fmt: A.sdpa8(q, k, v, fmt, key_mask=mask), q.device, timing)
        qkv8 = A.quantize_qkv(q, k, v, "fp8", key_mask=mask)
        out = torch.empty_like(q)
        ms["triton_fp8_kernel"] = time_ms(lambda: A.attention8_quantized(qkv8, out), q.device, timing)
        del qkv8, out
    flops = 4 * s.batch * s.heads * s.tokens ** 2 * s.dim
    row["tflops"] = {name: flops / t / 1e9 for name, t in ms.items()}
    row["x_sdpa"] = {name: ms["sdpa_bf16"] / t for name, t in ms.items()}
    # ---------------------------------------------------------------------------------------------- choices
    cache = tempfile.mkdtemp(prefix="attention_route_")
    router = make_router(runner, args, X.load_table(q.device, cache), measure=True)
    shape = X.CallShape(s.batch, s.heads, s.tokens, s.dim, s.masked, "bfloat16")
    choice = router.choose(shape)
    default = make_router(runner, args, None, measure=False).choose(shape)
    bench_name = {X.CUDNN: "cudnn_fp8", "fp8": "triton_fp8", X.STOCK: "sdpa_bf16"}
    row["route"] = {"measured": {"path": choice.path, "by": choice.by, "ms": choice.ms},
                    "default_rule": {"path": default.path}}
    if router.measure_errors:
        row["failures"].append(f"the router's measurement failed: {router.measure_errors}")
    chosen = ms.get(bench_name.get(choice.path, ""), None)
    if chosen is not None:
        row["route"]["chosen_x_sdpa_this_run"] = ms["sdpa_bf16"] / chosen
        if chosen > NEVER_SLOWER * ms["sdpa_bf16"]:
            row["failures"].append(f"the router chose {choice.path}, {chosen:.3f} ms here vs torch bf16 "
                                   f"{ms['sdpa_bf16']:.3f} ms: slower")
    default_ms = ms.get(bench_name.get(default.path, ""), None)
    if default_ms is not None:
        row["route"]["default_rule"]["x_sdpa_this_run"] = ms["sdpa_bf16"] / default_ms
        if default_ms > NEVER_SLOWER * ms["sdpa_bf16"]:
            row["notes"].append(f"the default rule's choice ({default.path}) is slower than bf16 here: adjust "
                                "DEFAULT_MIN_TOKENS")
    return row


def make_router(runner, args, table, measure: bool):
    """The router as apply_attention builds it for attention.format=fp8 (lowbit_pipe.attention.processors._router),
    on this runner."""
    from lowbit_pipe.attention import crossover as X
    from lowbit_pipe.attention.route import NO_KERNEL, attend8
    from lowbit_pipe.kernels.attention8 import GPU_CONFIGS
    from lowbit_pipe.kernels.cudnn_fp8_attention import plan_key

    dev = torch.cuda.current_device()

    def cudnn_why_not(s):
        return runner.why_not(plan_key(dev, s.batch, s.heads, s.tokens, s.head_dim, s.masked))

    paths = [X.Path8(X.CUDNN, "cudnn", f"{X.CUDNN} ({runner.version})", cudnn_why_not, runner),
             X.Path8("fp8", "triton", "triton_fp8", lambda s: None if s.head_dim in GPU_CONFIGS else NO_KERNEL,
                     lambda q, k, v, sm, m: attend8(q, k, v, "fp8", sm, m))]
    return X.AttentionRouter(paths, torch.device("cuda", dev), table, measure=measure)


def profile_call(s: Shape, runner, iters: int = 10) -> list[dict]:
    """Device time per kernel of one cuDNN call (quantization, attention, output) at shape `s`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    q, k, v, mask = inputs(s)
    for _ in range(3):
        runner(q, k, v, None, mask)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            runner(q, k, v, None, mask)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev > 0:
            rows.append({"shape": s.name, "kernel": e.key[:90], "calls_per_call": e.count / iters,
                         "ms_per_call": dev / iters / 1e3})
    return sorted(rows, key=lambda r: -r["ms_per_call"])


def table(payload: dict) -> str:
    cols = ["sdpa_bf16", "cudnn_fp8", "cudnn_quantize", "cudnn_kernel", "cudnn_kernel_finish", "triton_fp8",
            "triton_int8", "triton_fp8_kernel"]
    lines = [f"device: {payload['device_name']}; {payload['versions']}", "",
             "| shape | " + " | ".join(f"{c} ms (x bf16)" for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for r in payload["rows"]:
        cells = [f"{r['ms'][c]:.3f} ({r['x_sdpa'][c]:.2f}x)" if c in r["ms"] else "" for c in cols]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    lines += ["", "| shape | cos vs bf16 SDPA | rel vs torch model | cos vs fp64 (2 heads) | bf16 SDPA cos vs fp64 | "
                  "Triton fp8 cos vs bf16 | graph build s | route (measured) | x bf16 | default rule | failures |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        c, rt = r["checks"], r.get("route", {})

        def f(key, fmt):
            return format(c[key], fmt) if key in c else ""
        lines.append(f"| {r['shape']} | {f('cos_vs_sdpa_bf16', '.6f')} | {f('rel_vs_torch_model_2heads', '.2e')} | "
                     f"{f('cos_vs_exact_2heads', '.6f')} | {f('sdpa_bf16_cos_vs_exact_2heads', '.6f')} | "
                     f"{f('triton_fp8_cos_vs_sdpa_bf16', '.6f')} | {r.get('graph_build_s', '')} | "
                     f"{rt.get('measured', {}).get('path', '')} | "
                     f"{rt.get('chosen_x_sdpa_this_run', float('nan')):.2f} | {rt.get('default_rule', {}).get('path', '')} | "
                     f"{'; '.join(r['failures']) or 'ok'} |")
    if payload.get("profile"):
        lines += ["", "| kernel (one cuDNN call, first shape) | calls | device ms |", "|---|---|---|"]
        for p in payload["profile"]:
            lines.append(f"| {p['kernel']} | {p['calls_per_call']:.0f} | {p['ms_per_call']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/attention_route_h100.json")
    ap.add_argument("--shapes", nargs="*", help="names from SHAPES (default: all)")
    ap.add_argument("--min-cos", type=float, default=0.999)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a Hopper (or newer) GPU", file=sys.stderr)
        return 2
    from lowbit_pipe.kernels.cudnn_fp8_attention import CudnnFP8Attention
    from lowbit_pipe.measure.timing import TimingSettings

    try:
        runner = CudnnFP8Attention()
    except ImportError as err:
        print(f"FAIL: {err}", file=sys.stderr)
        return 2
    import triton

    payload = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(),
               "versions": f"torch {torch.__version__}, triton {triton.__version__}, {runner.version}, "
                           f"torch's cuDNN {torch.backends.cudnn.version()}, python {platform.python_version()}",
               "min_cos": args.min_cos, "rows": [], "profile": []}
    timing = TimingSettings(warmup=3, reps=args.reps)
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes]
    failed = []
    start = time.perf_counter()
    for s in shapes:
        try:
            row = bench_shape(s, runner, args, timing)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            row = {"shape": s.name, **asdict(s), "checks": {}, "ms": {}, "x_sdpa": {}, "notes": [],
                   "failures": [f"error: {type(err).__name__}: {str(err)[:400]}"]}
        payload["rows"].append(row)
        failed += [f"{s.name}: {f}" for f in row["failures"]]
        print(f"{s.name}: {time.perf_counter() - start:.0f} s; ms {({k: round(v, 4) for k, v in row['ms'].items()})}; "
              f"checks {row['checks']}; route {row.get('route')}; failures {row['failures']}", flush=True)
        save_outputs(args.out, table(payload), payload)
        torch.cuda.empty_cache()
    if not args.no_profile and shapes:
        try:
            payload["profile"] = profile_call(shapes[0], runner)
        except Exception as err:  # noqa: BLE001
            payload["profile_error"] = f"{type(err).__name__}: {err}"
    payload["failures"] = failed
    payload["seconds"] = round(time.perf_counter() - start, 1)
    save_outputs(args.out, table(payload), payload)
    print(table(payload))
    print("FAILED:\n  " + "\n  ".join(failed) if failed else "all checks passed")
    runner.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
