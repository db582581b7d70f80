"""Teardown proof on the GPU: N cycles of build -> quantize -> torch.compile -> CUDA graph -> teardown on
full-width Krea 2 blocks, device memory back to the exact pre-load baseline after every cycle.

    python bench/teardown_gpu.py --out bench/results/teardown_gpu_h200.json        # H200: 20 cycles, 2 blocks
    python bench/teardown_gpu.py --device cpu --small --out /tmp/teardown_cpu.json  # smoke test: 6 cycles, < 60 s

Per cycle: two `Krea2TransformerBlock`s at the released width (hidden 6144 = 48 heads x 128, 12 KV heads,
SwiGLU 16384), bf16, built on the device and owned by a Context (as `load` would); every Linear quantized
through the ledger (default fp8: its reference path is a float matmul and runs on CUDA; int8's reference
accumulates in int64, which CUDA matmul does not implement); both blocks compiled in place (regional
compile, the compile stage's code path, default backend inductor); one forward; then a
`torch.cuda.CUDAGraph` captured of the compiled forward (the eager quantized forward if capturing the
compiled one fails -- the table says which), recorded in the ledger with its static tensors, replayed;
then the teardown stage. Measured: `torch.cuda.memory_allocated()` before the first build (the
baseline), at the cycle's peak, and after teardown (must equal the baseline exactly), reserved memory
after `empty_cache`, and the teardown report (bytes_freed, retained_bytes, unfreed, unproven).
On the CPU, device memory has no allocator counter: the proof is the report's weakrefs and a live
tensor count (gc) that must not grow.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Imported here, before the baseline, not inside a cycle's `with torch.device(device)`: importing
# diffusers' transformer modules creates module-level tensors (mag-cache ratios, an fp4 lookup table,
# peft defaults) that would otherwise be created on the GPU once and held for the process's life.
from diffusers.models.transformers.transformer_krea2 import Krea2TransformerBlock

from lowbit_pipe.arch.base import LayerPolicy
from lowbit_pipe.plan.policy import plan_layers
from lowbit_pipe.recipe import CompileConfig, FormatChoice, QuantizeConfig, Recipe
from lowbit_pipe.stages.compile import block_targets, compile_modules
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.detect import linear_shapes
from lowbit_pipe.stages.quantize import quantize_module
from lowbit_pipe.stages.teardown import teardown

FULL = {"hidden": 6144, "heads": 48, "kv_heads": 12, "mlp": 16384, "tokens": 4608}  # 4096 image + 512 text
SMALL = {"hidden": 256, "heads": 4, "kv_heads": 2, "mlp": 512, "tokens": 32}


class Blocks(nn.Module):
    """Two Krea 2 transformer blocks under the name the arch policy uses (`transformer_blocks`)."""

    def __init__(self, dims: dict[str, int], layers: int):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            Krea2TransformerBlock(dims["hidden"], dims["mlp"], dims["heads"], dims["kv_heads"], 1e-5) for _ in range(layers))

    def forward(self, hidden: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        for block in self.transformer_blocks:
            hidden = block(hidden, temb, rope)
        return hidden


def _inputs(dims: dict[str, int], device: torch.device, dtype: torch.dtype) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    s, h, d = dims["tokens"], dims["hidden"], dims["hidden"] // dims["heads"]
    hidden = torch.randn(1, s, h, generator=gen, device=device, dtype=dtype)
    temb = torch.randn(1, 1, 6 * h, generator=gen, device=device, dtype=dtype) * 0.1
    angle = torch.rand(s, d, generator=gen, device=device) * 6.283
    return hidden, temb, (angle.cos().to(dtype), angle.sin().to(dtype))


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _live_tensors() -> int:
    from torch._subclasses.fake_tensor import FakeTensor

    return sum(1 for o in gc.get_objects()
               if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.device.type != "meta")


def _device_tensors() -> dict[int, torch.Tensor]:
    from torch._subclasses.fake_tensor import FakeTensor

    return {id(o): o for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor) and o.device.type == "cuda"}


def _describe_new(before: set[int]) -> list[str]:
    """Device tensors alive now that were not at the baseline: shape, dtype, bytes and who holds them
    (referrer types two levels up), so a residue names its owner."""
    out = []
    for key, t in _device_tensors().items():
        if key in before:
            continue
        holders = []
        for r in gc.get_referrers(t)[:4]:
            if isinstance(r, (list, dict, tuple)):
                up = [type(u).__name__ for u in gc.get_referrers(r)[:3] if u is not r]
                holders.append(f"{type(r).__name__}<-{'/'.join(up)}")
            else:
                holders.append(type(r).__name__)
        out.append(f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes()} B held by {holders}")
    return out[:20]


def _capture(model: Blocks, static: tuple, eager: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture one forward; `eager` bypasses the compiled call of each block."""
    hidden, temb, rope = static

    def run() -> torch.Tensor:
        h = hidden
        for block in model.transformer_blocks:
            h = block._call_impl(h, temb, rope) if eager else block(h, temb, rope)
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def cycle(args: argparse.Namespace, dims: dict[str, int], device: torch.device, dtype: torch.dtype,
          run_dir: Path) -> dict[str, Any]:
    row: dict[str, Any] = {}
    start = time.perf_counter()
    recipe = Recipe(pipeline=["load"], quantize=QuantizeConfig(default=FormatChoice(format=args.format)),
                    compile=CompileConfig(backend=args.backend))
    ctx = Context(recipe=recipe, run_dir=run_dir)
    ctx.ledger.capture_baseline()
    with torch.device(device):
        model = Blocks(dims, args.layers)
    model.to(dtype).eval()
    ctx.set_model(model, owned=True)  # as `load` does: the Context owns it, teardown drops it
    ctx.policy = LayerPolicy(block_paths=("transformer_blocks",))
    del model
    plans = plan_layers(linear_shapes(ctx.transformer), recipe.quantize, ctx.policy)
    q = quantize_module(ctx.transformer, plans, ctx.ledger, originals="drop" if args.drop_originals else "keep")
    row["quantized"] = sum(q["layers"].values())
    if not args.no_compile:
        compile_modules(ctx.transformer, block_targets(ctx.transformer, ctx.policy.block_paths), recipe.compile,
                        ctx.ledger)
    static = _inputs(dims, device, dtype)
    with torch.no_grad():
        out = ctx.transformer(*static)
    row["finite"] = bool(torch.isfinite(out).all())
    del out
    row["graph"] = "none"
    if device.type == "cuda" and not args.no_graph:
        try:
            graph, out = _capture(ctx.transformer, static, eager=args.no_compile)
            row["graph"] = "eager" if args.no_compile else "compiled"
        except Exception as err:  # noqa: BLE001 - capturing the compiled forward failed: say why, capture the eager one
            row["graph_error"] = f"{type(err).__name__}: {err}"[:300]
            torch.cuda.synchronize()
            graph, out = _capture(ctx.transformer, static, eager=True)
            row["graph"] = "eager (compiled capture failed)"
        ctx.ledger.cuda_graph(graph, "blocks forward", tensors={"inputs": static, "output": out})
        del graph, out
    else:
        ctx.ledger.tensor("static inputs", static)
    del static
    if device.type == "cuda":
        torch.cuda.synchronize()
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        row["before_teardown_bytes"] = _allocated(device)
    report = teardown(ctx)
    row["after_bytes"] = _allocated(device)
    if device.type == "cuda":
        row["reserved_after_bytes"] = torch.cuda.memory_reserved(device)
    row.update({k: report[k] for k in ("bytes_freed", "retained_bytes", "patches_restored", "unfreed", "unproven",
                                       "errors", "objects_freed", "objects_watched")})
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=None, help="default 20 (6 with --small)")
    p.add_argument("--layers", type=int, default=2, help="Krea 2 blocks per cycle")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny width (smoke test; fp32 on the CPU)")
    p.add_argument("--format", default="fp8", help="quantization format of every Linear (default fp8)")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph capture")
    p.add_argument("--drop-originals", action="store_true", help="quantize.originals=drop (less memory)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available (use --device cpu --small for the smoke test)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index on torch 2.11
    args.cycles = args.cycles if args.cycles is not None else (6 if args.small else 20)
    args.backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    dims = SMALL if args.small else FULL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()
    gc.collect()
    baseline = _allocated(device)
    tensors0 = _live_tensors()
    device_tensors0 = set(_device_tensors()) if device.type == "cuda" else set()
    rows = []
    print(f"device={device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'})"
          f" torch={torch.__version__} dims={dims} layers={args.layers} format={args.format} "
          f"compile={'off' if args.no_compile else args.backend} baseline_allocated={baseline}")
    header = f"{'cycle':>5} {'seconds':>8} {'peak MiB':>9} {'after-baseline B':>17} {'freed MiB':>10} " \
             f"{'retained B':>11} {'graph':>10} {'tensors':>8}  unfreed"
    print(header)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.cycles):
            row = cycle(args, dims, device, dtype, Path(tmp))
            gc.collect()
            row["cycle"] = i
            row["baseline_bytes"] = baseline
            row["delta_bytes"] = None if baseline is None else row["after_bytes"] - baseline
            row["live_tensors_delta"] = _live_tensors() - tensors0
            if device.type == "cuda" and (row["delta_bytes"] or row["live_tensors_delta"]) and i in (0, args.cycles - 1):
                row["new_device_tensors"] = _describe_new(device_tensors0)
                if row["new_device_tensors"]:
                    print("  new device tensors:", *row["new_device_tensors"], sep="\n    ")
            rows.append(row)
            peak = row.get("peak_bytes")
            print(f"{i:>5} {row['seconds']:>8.2f} {peak / 2**20 if peak else float('nan'):>9.1f} "
                  f"{row['delta_bytes'] if row['delta_bytes'] is not None else '-':>17} "
                  f"{row['bytes_freed'] / 2**20:>10.1f} {row['retained_bytes']:>11} {row['graph']:>10} "
                  f"{row['live_tensors_delta']:>8}  {row['unfreed'] or ''}", flush=True)
    deltas = [r["delta_bytes"] for r in rows]
    ok = all(r["retained_bytes"] == 0 and not r["unfreed"] and not r["errors"] and r["finite"] for r in rows) \
        and all(d == 0 for d in deltas if d is not None) and len({r["live_tensors_delta"] for r in rows[1:]}) <= 1
    summary = {"ok": ok, "device": str(device), "cycles": args.cycles,
               "baseline_bytes": baseline, "max_delta_bytes": max((d for d in deltas if d is not None), default=None),
               "bytes_freed_per_cycle": rows[-1]["bytes_freed"] if rows else None,
               "live_tensors_delta": [r["live_tensors_delta"] for r in rows]}
    print(("PASS" if ok else "FAIL") + f": memory after teardown - baseline per cycle = {deltas}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
            "torch": torch.__version__, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dims": dims, "layers": args.layers, "format": args.format, "backend": args.backend,
            "compile": not args.no_compile, "summary": summary, "cycles": rows}, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
