"""GPTQ's CPU time against torch's thread count, alone and beside a competing CPU-bound process.

GPTQ's inner loop is some 10-25 tiny torch ops per weight column; with 2 intra-op threads each op is a
parallel region whose threads must all run before it ends, so when another process holds a core every op
waits for the descheduled thread (oversubscription). Times one layer's `gptq_quantize` per (shape, format)
with torch at 1 and at 2 threads for all of it (as before the policy), and as the policy runs it
(the Cholesky and block updates on `gptq_threads()`, the column loop on one thread), first with nothing of ours competing, then beside `--competitors` (1)
busy-looping processes (`python -c "while True: pass"`, started here and ended by their pids). The machine's load average is recorded: other users' processes
compete too, so "alone" means "nothing started by this script".

    python bench/gptq_threads.py [--repeats 3] [--threads 1 2] [--competitors 1] [--out bench/results/gptq_threads.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lowbit_pipe.formats import FormatSpec
from lowbit_pipe.quant import gptq as gptq_mod
from lowbit_pipe.quant.gptq import GPTQSettings, gptq_quantize

_torch_threads = gptq_mod.torch_threads
SHAPES = [(384, 1536), (1536, 384), (1024, 1024)]
FORMATS = ["int8", "nvfp4"]


def layer(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(4 * k, k, generator=g)
    return torch.randn(n, k, generator=g) * 0.02, x.t() @ x / x.shape[0]


@contextlib.contextmanager
def _unchanged(_n):
    yield


def timed(w: torch.Tensor, h: torch.Tensor, fmt: str, threads: int | None, repeats: int) -> float:
    """Median seconds of one gptq_quantize: everything (the column loop too) on torch at `threads`, as before
    the policy; None: the policy (matrix work on gptq_threads(), the column loop on one)."""
    before = torch.get_num_threads()
    times = []
    try:
        if threads is not None:
            torch.set_num_threads(threads)
            gptq_mod.torch_threads = _unchanged
        settings = GPTQSettings(act_order=True)
        gptq_quantize(w, FormatSpec(fmt), h, settings)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            gptq_quantize(w, FormatSpec(fmt), h, settings)
            times.append(time.perf_counter() - start)
    finally:
        gptq_mod.torch_threads = _torch_threads
        torch.set_num_threads(before)
    return statistics.median(times)


def measure(repeats: int, competitors: int, counts: list[int]) -> list[dict]:
    rows = []
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        time.sleep(0.5)
        for n, k in SHAPES:
            w, h = layer(n, k)
            for fmt in FORMATS:
                row = {"shape": [n, k], "format": fmt, "competing_processes": competitors,
                       "load_average_1min": os.getloadavg()[0], "policy_threads": gptq_mod.gptq_threads(),
                       "seconds": {str(t): timed(w, h, fmt, t, repeats) for t in counts}}
                row["seconds"]["policy"] = timed(w, h, fmt, None, repeats)
                rows.append(row)
                print(f"competing {competitors} {n}x{k} {fmt:>6}  " + "  ".join(
                    f"{t}: {s:.3f} s" for t, s in row["seconds"].items()) +
                    f"  (policy {row['policy_threads']})  load {row['load_average_1min']:.2f}", flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    return rows


def table(rows: list[dict]) -> str:
    counts = [t for t in rows[0]["seconds"] if t != "policy"]
    out = ["| competing processes | shape (out x in) | format | " + " | ".join(
        f"{t} thread{'s' if t != '1' else ''} s" for t in counts) + " | policy s (its threads) | load avg |",
        "|---|---|---|" + "---|" * len(counts) + "---|---|"]
    for r in rows:
        s = r["seconds"]
        out.append(f"| {r['competing_processes']} | {r['shape'][0]}x{r['shape'][1]} | {r['format']} | " +
                   " | ".join(f"{s[t]:.3f}" for t in counts) +
                   f" | {s['policy']:.3f} ({r['policy_threads']}) | {r['load_average_1min']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/gptq_threads.json")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts for all of GPTQ")
    p.add_argument("--competitors", type=int, default=1, help="busy-looping processes in the second round")
    args = p.parse_args(argv)
    rows = measure(args.repeats, 0, args.threads) + measure(args.repeats, args.competitors, args.threads)
    text = table(rows)
    print(text)
    command = "python bench/gptq_threads.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.write_text(json.dumps({"command": command.strip(), "torch": torch.__version__, "cpus": len(os.sched_getaffinity(0)),
                               "torch_threads": torch.get_num_threads(), "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{command.strip()}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
