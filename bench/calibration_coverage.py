"""What the calibration's coverage buys (issue 44 item 3), on the CPU, on the embedded tiny Krea 2 (random weights).

Run:  python bench/calibration_coverage.py [--formats int8 nvfp4 w4a8 svdquant_w4a4 awq_w4a16] [--out FILE]

For each format, GPTQ is calibrated on
  - "one kind": the earlier default, 2 seeded samples at evaluate's token counts (64 image, 8 text tokens);
  - "default set": the default calibration, 8 samples of `quantize.calibration.kinds` in turn (token counts x1,
    x4/x4, x0.25 image with 64 text tokens 25 % padded, x2.25/x2 half padded), 2 of them held out;
and its gain (the model's output error over the plainly rounded model's, lower is better, 1 = no gain) is measured
on evaluation sets that neither saw (seeds 40000..), each of 8 samples denoised by 4 Euler steps:
  - "kind 0": evaluate's token counts (what "one kind" calibrated on);
  - "default kinds": the default set's kinds;
  - "other": 16x the image tokens and 12 text tokens, 9 of them attended (no calibration saw it).
The report's own held-out gain (`quantize.calibration_check.model.held_out_gain`) is listed beside. Prints a table
and writes JSON (and a .md of the table) next to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lowbit_pipe
from lowbit_pipe.plan.calibration_inputs import _sample_units
from lowbit_pipe.plan.held_out import capture_outputs, output_error, swapped
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.recipe import CalibrationKind

ONE_KIND = ["quantize.calibration_samples=2", "quantize.calibration.kinds=[{}]", "quantize.calibration.held_out_fraction=0"]
EVAL_SETS = {"kind 0": [CalibrationKind()], "default kinds": None,
             "other": [CalibrationKind(image_scale=16.0, text_scale=1.5, text_valid=0.75)]}


def eval_error(result, kinds: list[CalibrationKind] | None, seed: int = 40_000, samples: int = 8) -> float:
    """The run's model against its float originals on `samples` fresh samples of `kinds` (None: the recipe's)."""
    ctx = result.context
    q = ctx.recipe.quantize
    cal = q.calibration if kinds is None else dataclasses.replace(q.calibration, kinds=kinds)
    ctx.recipe = dataclasses.replace(ctx.recipe, quantize=dataclasses.replace(q, calibration_seed=seed,
                                                                               calibration=cal))
    try:
        units = _sample_units(ctx, 0, samples)
        got = capture_outputs(ctx.transformer, units)
        originals = {n: ctx.ledger.original(n) for n, m in ctx.transformer.named_modules() if isinstance(m, QuantLinear)}
        with swapped(ctx.transformer, originals):
            reference = capture_outputs(ctx.transformer, units)
    finally:
        ctx.recipe = dataclasses.replace(ctx.recipe, quantize=q)
    return output_error(reference, got)


def run(fmt: str, overrides: list[str], tmp: Path, name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", f"quantize.default.format={fmt}",
                                           *overrides], run_dir=tmp / f"{fmt}_{name}")


def measure(fmt: str, tmp: Path) -> list[dict]:
    rtn = run(fmt, [], tmp, "rtn")
    base = {k: eval_error(rtn, kinds) for k, kinds in EVAL_SETS.items()}
    rows = []
    for label, extra in (("one kind", ONE_KIND), ("default set", [])):
        t0 = time.perf_counter()
        g = run(fmt, ["quantize.gptq.enabled=true", *extra], tmp, label.replace(" ", "_"))
        seconds = time.perf_counter() - t0
        check = g.report["quantize"].get("calibration_check") or {}
        row = {"format": fmt, "calibration": label, "seconds": round(seconds, 1),
               "held_out_gain_report": (check.get("model") or {}).get("held_out_gain"),
               "fit_gain_layers": (check.get("by_format") or {}).get(fmt, {}).get("fit_gain")}
        row.update({f"gain on {k}": round(eval_error(g, kinds) / base[k], 4) for k, kinds in EVAL_SETS.items()})
        rows.append(row)
        print(row, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    keys = ["format", "calibration", "fit_gain_layers", "held_out_gain_report", *[f"gain on {k}" for k in EVAL_SETS]]
    def cell(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=["int8", "nvfp4", "w4a8", "svdquant_w4a4", "awq_w4a16"])
    ap.add_argument("--out", default="bench/results/calibration_coverage.json")
    ap.add_argument("--tmp", default="/tmp/calibration_coverage")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [r for fmt in args.formats for r in measure(fmt, Path(args.tmp))]
    text = table(rows)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
            "command": "python bench/calibration_coverage.py " + " ".join(sys.argv[1:])}
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(out)
    md = out.with_suffix(".md")
    md.with_suffix(".md.tmp").write_text(f"# Calibration coverage (CPU, tiny Krea 2)\n\n`{meta['command']}` "
                                         f"(torch {meta['torch']}, {meta['threads']} threads)\n\n{text}\n")
    md.with_suffix(".md.tmp").replace(md)


if __name__ == "__main__":
    main()
