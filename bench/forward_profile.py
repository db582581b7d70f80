"""Where a Krea 2 forward's time goes: GEMMs, attention, activation quantization, fused elementwise work, other.

    python bench/forward_profile.py --variants bf16 fp8 int8 --out bench/results/forward_profile_h200.json   # H200
    python bench/forward_profile.py --eager --variants bf16 fp8 int8 --out bench/results/forward_profile_eager_h200.json
    python bench/forward_profile.py --device cpu --small --out /tmp/forward_profile.json                     # smoke run

The model and inputs are bench/headline.py's (diffusers' default Krea 2, seeded random weights, bf16, 4096 image + 512
text tokens; --small: the tiny config). Each variant runs the recipe with the compile stage (`pipeline=[load, detect,
quantize, compile]`; bf16: no quantize; --eager: no compile stage, as ComfyUI runs a model without a compile node),
is warmed up, then --iters forwards run under torch.profiler. Every
device kernel (CPU: every operator's own time) is put in one category by its name (`category`), and the table gives
each category's ms per forward and share. It answers how much of a forward the quantized GEMMs can still speed up,
and how much sits in work no weight format touches (attention). On a GPU each variant's wall time per forward is
measured too (CUDA events, outside the profiler): wall - kernel time is how long the GPU waited on the host, the
launch cost an eager forward pays and a compiled one mostly does not.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import save_outputs

import lowbit_pipe
from lowbit_pipe.arch import get_arch

# First match wins. Inductor's generated Triton kernels first (triton_poi_ / triton_red_ / triton_per_: norms,
# modulation, RoPE, and the activation quantization Inductor fuses into them under compile): their names list the
# ops they fused, and the custom op a quantization feeds is one of them ("..._fp8_gemm_..."), which must not make
# them GEMMs (the first H200 run counted ~14 ms of fp8's and int8's fused kernels as GEMM time that way). Then
# cuBLAS / CUTLASS GEMMs (sm90_xmma, nvjet, cutlass), this project's Triton GEMMs (_int8_*_kernel,
# _fp8_gemm_kernel, which float_gemm shares, _nvfp4_gemm_kernel), aten's matmuls on the CPU; flash /
# memory-efficient / cuDNN attention and aten's SDPA; this project's activation quantization, rotation and weight
# decodes. The rotations' x @ H is a cuBLAS matmul on the GPU: it counts as a GEMM.
CATEGORIES = (
    ("fused elementwise (Inductor)", r"^triton_(poi|red|per)_"),
    # 8-bit attention's own operand statistics and quantization (_kv_stats*, _quant_*_kernel) count as attention
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|cudnn.*(sdpa|mha)|_kv_stats|_quant_blocks_kernel|_quant_v_kernel"),
    ("gemm", r"gemm|xmma|nvjet|cutlass|_int8_.*kernel|_fp8_.*kernel|_nvfp4_gemm|aten::(mm|addmm|bmm|matmul|linear|_int_mm|"
             r"_scaled_mm)$|lowbit_pipe::(int8|fp8|nvfp4|float)_gemm"),
    ("quantize / rotate / decode", r"quantize|_quant|_act_kernel|_amax_down|rotate|hadamard|decode|lowbit_pipe::"),
    # aten's own kernels: what Inductor fuses under compile runs as one kernel per op in eager (norms, modulation,
    # RoPE, gelu, residual adds, layout copies)
    ("elementwise (aten, eager)", r"elementwise|reduce_kernel|norm|CatArray|copy|index|gelu|silu|softmax"),
)
VARIANTS = {  # recipe, overrides, whether it quantizes
    "bf16": ("default", [], False),
    "fp8": ("default", ["quantize.default.format=fp8"], True),
    "int8": ("default", ["quantize.default.format=int8"], True),
    "nvfp4": ("default", ["quantize.default.format=nvfp4", "quantize.default.activations=none"], True),
}


def variant_overrides(name: str, eager: bool) -> tuple[str, list[str]]:
    recipe, overrides, quantizes = VARIANTS[name]
    stages = ["load", "detect"] + (["quantize"] if quantizes else []) + ([] if eager else ["compile"])
    return recipe, [f"pipeline=[{','.join(stages)}]", *overrides]


def category(name: str) -> str:
    """The category of a kernel or operator name (CATEGORIES, first match), or "other"."""
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def _self_time_us(event: Any, device: bool) -> float:
    """An averaged profiler event's own time: device time (torch >= 2.4 names it self_device_time_total) or CPU."""
    if not device:
        return float(event.self_cpu_time_total)
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def split(prof: torch.profiler.profile, on_device: bool, iters: int) -> dict[str, Any]:
    """{category: ms per forward}, the total, and the five largest names per category."""
    ms: dict[str, float] = defaultdict(float)
    top: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for event in prof.key_averages():
        if on_device and not str(getattr(event, "device_type", "")).endswith("CUDA"):
            continue  # kernels only: an operator's device time is its kernels', which are events of their own
        t = _self_time_us(event, on_device)
        if t <= 0:
            continue
        if not on_device and event.key.startswith(("ProfilerStep", "forward")):
            continue
        label = category(event.key)
        ms[label] += t / 1e3 / iters
        top[label].append((t / 1e3 / iters, event.key))
    total = sum(ms.values())
    return {"ms": dict(ms), "total_ms": total,
            "top": {k: [(round(t, 4), n[:120]) for t, n in sorted(v, reverse=True)[:5]] for k, v in top.items()}}


def main(argv: list[str] | None = None) -> int:
    from headline import build_krea2, krea2_inputs, timed_ms

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny config (a smoke run)")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8", "int8"], choices=list(VARIANTS))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="no compile stage (the uncompiled path)")
    p.add_argument("--out", default="bench/results/forward_profile_h200.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    on_device = device.type == "cuda"
    model = build_krea2(device, args.small)
    arch = get_arch("krea2")
    inputs = krea2_inputs(model, device, args.small)

    def forward() -> None:
        with torch.inference_mode():
            arch.output_tensor(model(**inputs))

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_device else [])
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.variants:
            recipe, overrides = variant_overrides(name, args.eager)
            result = lowbit_pipe.run(recipe, overrides, model=model, run_dir=Path(scratch) / name)
            try:
                for _ in range(2):  # compile, then a steady call
                    forward()
                wall = timed_ms(forward, device, args.iters) if on_device else None
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(args.iters):
                        forward()
                    if on_device:
                        torch.cuda.synchronize(device)
                rows.append({"variant": name, **split(prof, on_device, args.iters), "wall_ms": wall})
            finally:
                lowbit_pipe.teardown(result)
                torch._dynamo.reset()
            print(f"  {name}: {rows[-1]['total_ms']:.2f} ms {({k: round(v, 2) for k, v in rows[-1]['ms'].items()})}",
                  flush=True)
            write(rows, args, device)
    return 0


def write(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device) -> None:
    cmd = "python bench/forward_profile.py " + " ".join(sys.argv[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    labels = [c for c, _ in CATEGORIES] + ["other"]
    time_kind = "device kernel time" if device.type == "cuda" else "CPU operator self time"
    lines = [f"`{cmd}`", "", f"device: {name} | torch {torch.__version__} | Krea 2 {'tiny' if args.small else 'full size'}, "
             f"bf16, {'eager (no compile)' if args.eager else 'compiled'} | {time_kind} per forward, mean of "
             f"{args.iters}; wall: CUDA events around {args.iters} forwards outside the profiler, GPU idle = wall - "
             "kernel total", "",
             "| variant | wall ms | kernel total ms | GPU idle ms | " + " | ".join(labels) + " |",
             "|---|---|---|---|" + "---|" * len(labels)]
    for r in rows:
        cells = [f"{r['ms'].get(c, 0.0):.2f} ({100 * r['ms'].get(c, 0.0) / r['total_ms']:.0f} %)" for c in labels]
        wall = r.get("wall_ms")
        walls = f"{wall:.2f} | {r['total_ms']:.2f} | {max(wall - r['total_ms'], 0.0):.2f}" if wall else \
            f"- | {r['total_ms']:.2f} | -"
        lines.append(f"| {r['variant']} | {walls} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    save_outputs(args.out, table, {"command": cmd, "device": name, "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
