"""The solver's own time: 300 layers x 10 candidates (the issue's bound: under 1 s; the timing of the layers is
separate and cached). Random problems (seeded); each target kind solved, then the frontier, repeated.

    python bench/solver_speed.py --out bench/results/solver_speed_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import save_outputs

from lowbit_pipe.plan.solver import LayerCosts, Problem, frontier, solve
from lowbit_pipe.plan.targets import Target


def problem(layers: int, candidates: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    out = [LayerCosts(f"l{i}", tuple(f"c{j}" for j in range(candidates)), tuple(rng.uniform(0.05, 2.0, candidates)),
                      tuple(int(b) for b in rng.integers(10**5, 10**8, candidates)), tuple(rng.uniform(0, 1e-2, candidates)))
           for i in range(layers)]
    return Problem(out, fixed_ms=20.0, fixed_bytes=10**9, float_ms=400.0, float_bytes=2 * 10**10, error_scale=0.05)


def targets(p: Problem) -> list[Target]:
    mean_t = p.fixed_ms + sum(np.mean(lay.time_ms) for lay in p.layers)
    mean_b = p.fixed_bytes + sum(np.mean(lay.nbytes) for lay in p.layers)
    mean_e = p.error_scale * np.sqrt(sum(np.mean(lay.err2) for lay in p.layers))
    return [Target("speedup", p.float_ms / mean_t, "quantize.target.speedup"), Target("bytes", mean_b, "quantize.target.bytes"),
            Target("ratio", mean_b / p.float_bytes, "quantize.target.ratio"), Target("error", float(mean_e), "quantize.target.error")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--candidates", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--frontier-points", type=int, default=16)
    ap.add_argument("--out", default="bench/results/solver_speed_cpu.json")
    args = ap.parse_args(argv)
    rows = []
    for kind_i, kind in enumerate(("speedup", "bytes", "ratio", "error", "frontier")):
        seconds = []
        for r in range(args.repeats):
            p = problem(args.layers, args.candidates, seed=r)
            started = time.perf_counter()
            if kind == "frontier":
                n = len(frontier(p, args.frontier_points))
            else:
                sol = solve(p, targets(p)[kind_i])
                assert sol.met, (kind, sol.prediction)
                n = None
            seconds.append(time.perf_counter() - started)
        rows.append({"what": kind, "median_s": statistics.median(seconds), "max_s": max(seconds),
                     "frontier_plans": n})
        print(f"{kind:9s} median {rows[-1]['median_s']:.4f} s  max {rows[-1]['max_s']:.4f} s", flush=True)
    total = sum(r["max_s"] for r in rows if r["what"] in ("speedup", "frontier"))
    cmd = "python bench/solver_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [f"`{cmd.strip()}`", "",
          f"{args.layers} layers x {args.candidates} candidates, {args.repeats} seeded random problems; CPU: "
          f"{platform.processor() or platform.machine()} x{os.cpu_count()}, shared with other processes; numpy {np.__version__}", "",
          "| solve | median s | max s |", "|---|---|---|"]
    md += [f"| {r['what']}{' (' + str(args.frontier_points) + '^2 multipliers, ' + str(r['frontier_plans']) + ' plans kept)' if r['what'] == 'frontier' else ''} "
           f"| {r['median_s']:.4f} | {r['max_s']:.4f} |" for r in rows]
    md += ["", f"A target run's solver time (a speedup solve + the frontier, worst of the repeats): {total:.3f} s (bound: 1 s)."]
    save_outputs(args.out, "\n".join(md) + "\n", {"command": cmd.strip(), "layers": args.layers,
                                                   "candidates": args.candidates, "rows": rows, "run_seconds_max": total,
                                                   "numpy": np.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
