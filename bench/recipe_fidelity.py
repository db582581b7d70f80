"""Fidelity of packaged recipes against their float model, on the CPU (the tiny models, seeded):
model-output cosine and relative error, worst per-layer SQNR, Euler trajectory cosines, and whether
stock ComfyUI loads the export as it is.

    python bench/recipe_fidelity.py [--recipes krea2_nvfp4 krea2_nvfp4_stock] [--out bench/results/recipe_fidelity.json]

Random tiny weights have no outliers: these figures compare recipes with each other, they do not
predict a trained model's quality.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import lowbit_pipe

OVERRIDES = ["evaluate.samples=4", "evaluate.trajectory_seeds=4", "evaluate.steps=8"]


def measure(recipe: str, run_dir: Path) -> dict:
    result = lowbit_pipe.run(recipe, OVERRIDES, run_dir=run_dir)
    ev, ex = result.report["evaluate"], result.report["export"]
    return {"recipe": recipe, "cosine": ev["cosine"], "rel_error": ev["rel_error"], "sqnr_min_db": ev["sqnr_min_db"],
            "sqnr_worst_layer": ev["sqnr_worst_layer"], "trajectory_mean_cosine": ev["trajectory"]["mean_cosine"],
            "trajectory_min_cosine": ev["trajectory"]["min_cosine"], "weight_bytes": ev["weight_bytes"],
            "stock_comfyui_loads": not ex["not_stock_comfy"], "layers": result.report["quantize"]["layers"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["krea2_nvfp4", "krea2_nvfp4_stock", "default", "flux1_fp8"])
    p.add_argument("--out", default="bench/results/recipe_fidelity.json")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.recipes:
            rows.append(measure(name, Path(tmp) / name))
    print("| recipe | 1 - output cosine | rel error | worst layer SQNR dB | 1 - trajectory cosine (mean / worst) "
          "| stock ComfyUI loads |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {1 - r['cosine']:.2e} | {r['rel_error']:.4f} | {r['sqnr_min_db']:.1f} | "
              f"{1 - r['trajectory_mean_cosine']:.2e} / {1 - r['trajectory_min_cosine']:.2e} | "
              f"{'yes' if r['stock_comfyui_loads'] else 'no (node pack)'} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/recipe_fidelity.py " + " ".join(argv or []),
                               "overrides": OVERRIDES, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
