"""GPTQ at full size: the 12.8B Krea 2 (diffusers' default config, seeded random weights, bf16) quantized with
`quantize.gptq.enabled` on the GPU through the recipe, per format: wall seconds of the quantize stage (calibration
passes, Hessians, rounding), passes, peak device memory, and the mean relative output loss of GPTQ against
round-to-nearest on the same Hessians (tr((W-Q) H (W-Q)^T) / tr(W H W^T), from the report). Random weights have no
outliers: the loss ratio here checks the machinery, not the quality gain (bench/gptq_bench.py measures that).

    python bench/gptq_full.py --out bench/results/gptq_full_h200.json                    # H200
    python bench/gptq_full.py --device cpu --small --out /tmp/gptq_full.json             # smoke run: tiny config
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headline import build_krea2
from outputs import save_outputs

import lowbit_pipe


def run_format(model: torch.nn.Module, fmt: str, hessian_gb: float, samples: int, steps: int, run_dir: Path,
               device: torch.device) -> dict[str, Any]:
    overrides = ["pipeline=[load,detect,quantize]", f"quantize.default.format={fmt}", "quantize.gptq.enabled=true",
                 f"quantize.gptq.hessian_bytes={int(hessian_gb * 2**30)}", f"quantize.calibration_samples={samples}",
                 f"quantize.calibration_steps={steps}"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    result = lowbit_pipe.run("default", overrides, model=model, run_dir=run_dir)
    wall = time.perf_counter() - t
    try:
        q = result.report["quantize"]
        g = q.get("gptq") or {}
        ratios = [v["gptq_loss"] / v["rtn_loss"] for v in g.get("layers", {}).values() if v["rtn_loss"] > 0]
        row = {"format": fmt, "wall_s": wall, "quantize_stage_s": result.report["stages"]["quantize"].get("seconds"),
               "passes": g.get("passes"), "gptq_layers": len(g.get("layers", {})),
               "rtn_fallback_layers": len(g.get("rtn_fallback", {})),
               "gptq_over_rtn_loss_mean": statistics.fmean(ratios) if ratios else None,
               "gptq_over_rtn_loss_worst": max(ratios) if ratios else None,
               "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
               "overrides": overrides}
    finally:
        td = lowbit_pipe.teardown(result)
    row["teardown_retained_bytes"] = td.get("retained_bytes")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny config (a smoke run)")
    p.add_argument("--formats", nargs="+", default=["int8", "nvfp4"])
    p.add_argument("--hessian-gb", type=float, default=48.0, help="quantize.gptq.hessian_bytes, GiB (fewer passes)")
    p.add_argument("--samples", type=int, default=2, help="quantize.calibration_samples")
    p.add_argument("--steps", type=int, default=4, help="quantize.calibration_steps")
    p.add_argument("--out", default="bench/results/gptq_full_h200.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = build_krea2(device, args.small)
    params = sum(t.numel() for t in model.parameters())
    print(f"Krea 2 {params / 1e9:.2f}B params on {device}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats:
            try:
                rows.append(run_format(model, fmt, args.hessian_gb, args.samples, args.steps, Path(scratch) / fmt, device))
            except Exception as e:  # noqa: BLE001 -- one format that fails is reported; the others still run
                rows.append({"format": fmt, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"  {json.dumps(rows[-1])}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write(rows, args, device, params)
    return 0


def write(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device, params: int) -> None:
    cmd = "python bench/gptq_full.py " + " ".join(sys.argv[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    lines = [f"`{cmd}`", "", f"device: {name} | torch {torch.__version__} | Krea 2 {params / 1e9:.2f}B params, bf16, "
             f"random weights | calibration: {args.samples} seeded samples x {args.steps} Euler steps (the arch's "
             "example inputs)", "",
             "| format | quantize stage s | passes | GPTQ layers | RTN fallback | GPTQ / RTN loss (mean / worst) | "
             "peak device GB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['format']} | failed: {r['error'][:200]} | | | | | |")
            continue
        loss = (f"{r['gptq_over_rtn_loss_mean']:.3f} / {r['gptq_over_rtn_loss_worst']:.3f}"
                if r["gptq_over_rtn_loss_mean"] is not None else "-")
        peak = f"{r['peak_device_bytes'] / 1e9:.1f}" if r["peak_device_bytes"] else "-"
        lines.append(f"| {r['format']} | {r['quantize_stage_s']:.1f} | {r['passes']} | {r['gptq_layers']} | "
                     f"{r['rtn_fallback_layers']} | {loss} | {peak} |")
    table = "\n".join(lines) + "\n"
    print(table)
    save_outputs(args.out, table, {"command": cmd, "device": name, "torch": torch.__version__, "params": params,
                                   "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
