"""The solver against a hand-written recipe at the recipe's own bytes, on inputs the solver never probed (CPU, tiny).

    python bench/solver_vs_recipe.py --out bench/results/solver_vs_krea2_nvfp4_cpu.json

1. The recipe (`--recipe`, default krea2_nvfp4) quantizes the tiny Krea 2; its bytes over the float model's are
   the ratio the solver gets (`quantize.target.ratio`), with the recipe's own formats among its candidates.
2. The solver plans on its example input (256 image + 64 text tokens, 20 attended, the calibration seed).
3. Both plans are then evaluated on other shapes and seeds (evaluate: relative output error over samples and an
   Euler trajectory): the table gives each pair and the spread of solver / recipe, not only the best case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import save_outputs
from solver_h200 import label_rule

import lowbit_pipe
from lowbit_pipe.ledger import tensor_bytes

PLAN_TOKENS = ["evaluate.image_tokens=256", "evaluate.text_tokens=64", "evaluate.text_valid=20"]
CANDIDATES = ("[{format: int8}, {format: int8, rotation: convrot}, {format: fp8}, {format: nvfp4}, "
              "{format: nvfp4, rotation: convrot, rotation_group: 256}]")
# (image tokens, text tokens, attended text tokens): the planning shape and three it never saw
SHAPES = ((64, 8, 8), (256, 64, 20), (1024, 128, 100), (1024, 32, 5))


def run_bytes(recipe: str, overrides: list[str], run_dir: Path) -> tuple[int, dict[str, Any]]:
    result = lowbit_pipe.run(recipe, overrides, run_dir=run_dir)
    try:
        return tensor_bytes(result.model), result.report
    finally:
        lowbit_pipe.teardown(result)


def solver_rules(recipe: str, scratch: Path) -> tuple[list[str], dict[str, Any]]:
    """The solver's plan at `recipe`'s bytes, as exact-name rules, and what it was planned against."""
    hand_bytes, _ = run_bytes(recipe, PLAN_TOKENS + ["pipeline=[load,detect,quantize]"], scratch / "hand")
    float_bytes, _ = run_bytes("default", ["pipeline=[load,detect]", "model=tiny_krea2"], scratch / "float")
    ratio = hand_bytes / float_bytes
    _, report = run_bytes("krea2_auto_speed_tiny", PLAN_TOKENS + [
        "pipeline=[load,detect,quantize]", f"quantize.target.ratio={ratio:.6f}", f"quantize.speed_cache={scratch / 'speed'}",
        "quantize.target.loads_in=comfyui_pack", f"quantize.target.candidates={CANDIDATES}"], scratch / "solver")
    chosen = report["quantize"]["target"]["choice"]
    rules = [f"quantize.rules=[{', '.join(label_rule(name, label) for name, label in chosen.items())}]"]
    layers = report["quantize"]["target"]["layers"]
    return rules, {"ratio": ratio, "recipe_bytes": hand_bytes, "float_bytes": float_bytes, "solver_layers": layers}


def table(payload: dict[str, Any]) -> str:
    p = payload["planned"]
    lines = [f"`{payload['command']}`", "",
             f"Tiny Krea 2, CPU. The solver planned at {payload['recipe']}'s bytes (ratio {p['ratio']:.4f}; its plan: "
             f"{', '.join(f'{k} {v}' for k, v in sorted(p['solver_layers'].items()))}) on 256 image + 64 text tokens "
             "(20 attended) and the calibration seed; evaluated here on other seeds and shapes.", "",
             f"| image tokens | text tokens (attended) | evaluate seed | {payload['recipe']} rel error | solver rel error "
             "| solver / recipe |", "|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['image_tokens']} | {r['text_tokens']} ({r['text_valid']}) | {r['seed']} | "
                     f"{r['recipe_error']:.5f} | {r['solver_error']:.5f} | {r['ratio']:.3f} |")
    s = payload["spread"]
    lines += ["", f"solver / recipe: min {s['min']:.3f}, median {s['median']:.3f}, max {s['max']:.3f}; the solver's "
                  f"plan has less error in {s['better']} of {s['n']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="krea2_nvfp4")
    p.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13], help="evaluate.seed values")
    p.add_argument("--scratch", default="/tmp/solver_vs_recipe")
    p.add_argument("--out", default="bench/results/solver_vs_krea2_nvfp4_cpu.json")
    args = p.parse_args(argv)
    scratch = Path(args.scratch)
    rules, planned = solver_rules(args.recipe, scratch)
    payload: dict[str, Any] = {"command": ("python bench/solver_vs_recipe.py " + " ".join(argv or sys.argv[1:])).strip(),
                               "recipe": args.recipe, "planned": planned, "rules": rules, "rows": []}
    for image, text, valid in SHAPES:
        for seed in args.seeds:
            ev = [f"evaluate.image_tokens={image}", f"evaluate.text_tokens={text}", f"evaluate.text_valid={valid}",
                  f"evaluate.seed={seed}", "evaluate.samples=2", "evaluate.trajectory_seeds=1", "evaluate.layers=false",
                  "pipeline=[load,detect,quantize,evaluate]"]
            hand_bytes, hand = run_bytes(args.recipe, ev, scratch / "eval_recipe")
            solver_bytes, solver = run_bytes("default", ev + ["model=tiny_krea2"] + rules, scratch / "eval_solver")
            if solver_bytes > hand_bytes:
                raise RuntimeError(f"the solver's plan holds {solver_bytes} bytes, over the recipe's {hand_bytes}")
            row = {"image_tokens": image, "text_tokens": text, "text_valid": valid, "seed": seed,
                   "recipe_error": hand["evaluate"]["rel_error"], "solver_error": solver["evaluate"]["rel_error"]}
            row["ratio"] = row["solver_error"] / row["recipe_error"]
            payload["rows"].append(row)
            print(f"  {image} + {text} ({valid}) seed {seed}: recipe {row['recipe_error']:.5f}, solver "
                  f"{row['solver_error']:.5f} ({row['ratio']:.3f})", flush=True)
    ratios = [r["ratio"] for r in payload["rows"]]
    payload["spread"] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
                         "better": sum(r < 1 for r in ratios), "n": len(ratios)}
    save_outputs(args.out, table(payload), payload)
    print(table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
