"""Issue 46: one sweep over every GPU of one host. A 2 x N-job sweep (fp8 and int8, N seeds each, compiled, full-size
Krea 2) through `hydra/launcher=gpus` (or `--launcher ray`) on N GPUs, against the same jobs on one GPU, and the proof
that each job ran on its own GPU and tore down clean.

    python bench/sweep_gpus.py --out bench/results/sweep_gpus_h100x8.json                  # every GPU of the host
    python bench/sweep_gpus.py --launcher ray --out bench/results/sweep_gpus_ray_h100x8.json
    python bench/sweep_gpus.py --cpu-smoke --out /tmp/sweep_gpus_smoke.json                # CPU, 2 simulated GPUs

The model: `--checkpoint PATH`, else a full-size synthetic Krea 2 written once by bench/make_checkpoint.py (the
released config, seeded random weights, bf16, 25.6 GB) under --scratch. Each job runs the CLI's pipeline
[load, detect, quantize, compile, evaluate, teardown] with model.device=cuda (no export: 2N x 13 GB of disk).

The one-GPU time (`--baseline`): `sample` (default) runs one fp8 and one int8 job back to back on the first GPU and
takes one_gpu = N x (their two job times) + the driver's own overhead of that run once (the sweep minus its jobs);
`full` runs all 2N jobs on the first GPU (about N times the sweep: past one 10-minute device call at N = 8);
`none` estimates one_gpu as the sum of the sweep's own job times (jobs that shared the host's CPUs and disk, so
it flatters the sweep). The issue's target: sweep wall <= 1.15 x one_gpu / N + the slowest job's start-up (its
process start, imports and Hydra, before its first stage: launcher.json's seconds minus its stages' seconds).

Checked per job, from its run dir: report.json's `device` (what the job's process saw) against the GPU the launcher
gave it (launcher.json; Ray: the one GPU its CUDA_VISIBLE_DEVICES names), exactly one GPU visible, no two jobs on one
GPU at once (launcher.json's start/end; Ray: .hydra/config.yaml's mtime to report.json's), the peak device memory of
its stages, and its teardown (proven, 0 bytes retained, nothing unfreed). `--cpu-smoke`: the tiny Krea 2 on the CPU,
2 simulated GPUs (names the jobs get as CUDA_VISIBLE_DEVICES), compile.backend=eager; the same checks, no memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from outputs import save_outputs  # noqa: E402 - bench/ on the path first

FORMATS = ("fp8", "int8")
PIPELINE = "pipeline=[load,detect,quantize,compile,evaluate,teardown]"
GPU_JOB = [PIPELINE, "model.device=cuda", "model.dtype=bfloat16", "model.stream=false", "evaluate.samples=1",
           "evaluate.trajectory_seeds=0", "evaluate.layers=false", "evaluate.image_tokens=4096",
           "evaluate.text_tokens=512", "evaluate.latency_iters=5"]
SMOKE_JOB = [PIPELINE, "model.device=cpu", "compile.backend=eager", "evaluate.samples=1",
             "evaluate.trajectory_seeds=0", "evaluate.latency=false"]
SMOKE_GPUS = ("GPU-smoke-0", "GPU-smoke-1")
TARGET_FACTOR = 1.15


def launcher_args(launcher: str, gpus: tuple[str, ...]) -> list[str]:
    if launcher == "gpus":
        return ["hydra/launcher=gpus", f"hydra.launcher.gpus=[{','.join(gpus)}]"]
    return ["hydra/launcher=ray", f"hydra.launcher.num_gpus={len(gpus)}", "hydra.launcher.object_store_memory=200000000"]


def run_sweep(label: str, launcher: str, gpus: tuple[str, ...], seeds: int, job: list[str], scratch: Path,
              smoke: bool) -> dict[str, Any]:
    """One CLI sweep, fp8 and int8 x `seeds`; its wall seconds and the sweep dir."""
    sweep = scratch / f"sweep_{label}"
    if launcher == "ray" and smoke:  # Ray cannot pretend to have GPUs: the CPU jobs run with Ray's CPUs
        chosen = ["hydra/launcher=ray", "hydra.launcher.num_cpus=2", "hydra.launcher.object_store_memory=100000000"]
    else:
        chosen = launcher_args(launcher, gpus)
    seed_values = ",".join(str(s) for s in range(seeds))
    cmd = [sys.executable, "-m", "lowbit_pipe", "-m", *chosen, f"quantize.default.format={','.join(FORMATS)}",
           f"seed={seed_values}", f"hydra.sweep.dir={sweep}", *job]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0")
    if smoke:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    print(f"[{label}] {shlex.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (scratch / f"sweep_{label}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    print(f"[{label}] exit {proc.returncode} in {wall:.1f} s (log: {scratch / f'sweep_{label}.log'})", flush=True)
    return {"label": label, "launcher": launcher, "gpus": list(gpus), "jobs": 2 * seeds, "wall_s": round(wall, 2),
            "returncode": proc.returncode, "sweep_dir": str(sweep), "command": shlex.join(cmd[1:]),
            "stderr_tail": proc.stderr[-1500:] if proc.returncode else ""}


def _read(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def job_row(run_dir: Path) -> dict[str, Any]:
    """What one job's run dir proves: its GPU, span, start-up, peak memory, teardown."""
    report, launched = _read(run_dir / "report.json") or {}, _read(run_dir / "launcher.json")
    device = report.get("device") or {}
    stages = report.get("stages") or {}
    stage_s = sum(s.get("seconds", 0) for s in stages.values())
    peaks = [s["peak_device_bytes"] for s in stages.values() if s.get("peak_device_bytes") is not None]
    teardown = stages.get("teardown") or {}
    if launched is not None:
        span = (launched["started_unix"], launched["ended_unix"])
        assigned, job_s = launched["gpu"], launched["seconds"]
    else:  # Ray: from the run dir's files, and the GPU Ray named in the job's CUDA_VISIBLE_DEVICES
        config = run_dir / ".hydra" / "config.yaml"
        span = (config.stat().st_mtime, (run_dir / "report.json").stat().st_mtime) if config.is_file() else None
        assigned, job_s = device.get("cuda_visible_devices"), None
    recipe = report.get("recipe") or {}
    return {
        "job": run_dir.name, "format": ((recipe.get("quantize") or {}).get("default") or {}).get("format"),
        "seed": recipe.get("seed"), "status": report.get("status"), "assigned_gpu": assigned,
        "cuda_visible_devices": device.get("cuda_visible_devices"), "device_type": device.get("type"),
        "visible_count": device.get("count"), "uuid": device.get("uuid"), "name": device.get("name"),
        "physical_index": device.get("physical_index"), "span": span, "job_s": job_s, "stages_s": round(stage_s, 2),
        "startup_s": round(job_s - stage_s, 2) if job_s is not None else None,
        "peak_device_bytes": max(peaks) if peaks else None,
        "latency_ms": ((report.get("evaluate") or {}).get("latency_ms") or {}).get("quantized"),
        "teardown_proven": bool(teardown.get("proven")), "retained_bytes": teardown.get("retained_bytes"),
        "unfreed": teardown.get("unfreed") or [],
    }


def wrong_gpu(row: dict[str, Any], smoke: bool) -> str | None:
    """Why a job did not run on exactly the GPU it was given (None: it did)."""
    if row["status"] != "ok":
        return f"status {row['status']}"
    if row["cuda_visible_devices"] != row["assigned_gpu"]:
        return f"saw CUDA_VISIBLE_DEVICES={row['cuda_visible_devices']!r}, was given {row['assigned_gpu']!r}"
    if not smoke and (row["cuda_visible_devices"] is None or row["device_type"] != "cuda" or row["visible_count"] != 1):
        return f"ran on {row['device_type']} seeing {row['visible_count']} GPU(s) (CUDA_VISIBLE_DEVICES " \
               f"{row['cuda_visible_devices']!r})"
    return None


def shared_gpus(rows: list[dict[str, Any]]) -> list[str]:
    """Pairs of jobs whose spans overlap on one GPU (by UUID where the job read it, else its CUDA_VISIBLE_DEVICES)."""
    by_gpu: dict[str, list[tuple[float, float, str]]] = {}
    for r in rows:
        if r["span"] is not None:
            by_gpu.setdefault(r["uuid"] or r["cuda_visible_devices"] or "?", []).append((*r["span"], r["job"]))
    clashes = []
    for gpu, spans in by_gpu.items():
        spans.sort()
        clashes += [f"{gpu}: jobs {a[2]} and {b[2]}" for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    return clashes


def job_rows(sweep: dict[str, Any]) -> list[dict[str, Any]]:
    folder = Path(sweep["sweep_dir"])
    dirs = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)) \
        if folder.is_dir() else []
    return [job_row(d) for d in dirs]


def one_gpu_seconds(mode: str, baseline: dict[str, Any] | None, rows_base: list[dict[str, Any]],
                    rows: list[dict[str, Any]], n: int) -> tuple[float | None, str]:
    if mode == "full" and baseline is not None:
        return baseline["wall_s"], "measured: all 2N jobs on one GPU"
    if mode == "sample" and baseline is not None and all(r["job_s"] is not None for r in rows_base):
        jobs_s = sum(r["job_s"] for r in rows_base)
        return n * jobs_s + (baseline["wall_s"] - jobs_s), "N x (one fp8 + one int8 job on one GPU) + driver overhead once"
    times = [r["job_s"] if r["job_s"] is not None else r["stages_s"] for r in rows]
    return (sum(times) if times else None), "sum of the sweep's own job times (shared host: flatters the sweep)"


def peaks_per_gpu(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for r in rows:
        key = r["uuid"] or r["cuda_visible_devices"] or "?"
        value = r["peak_device_bytes"]
        out[key] = value if out.get(key) is None else max(out[key], value or 0)
    return out


def summarize(sweep: dict[str, Any], baseline: dict[str, Any] | None, mode: str, n: int, smoke: bool) -> dict[str, Any]:
    rows = job_rows(sweep)
    rows_base = job_rows(baseline) if baseline is not None else []
    one_gpu, how = one_gpu_seconds(mode, baseline, rows_base, rows, n)
    startups = [r["startup_s"] for r in rows if r["startup_s"] is not None]
    startup = max(startups) if startups else 0.0
    limit = TARGET_FACTOR * one_gpu / n + startup if one_gpu is not None else None
    wrong = {r["job"]: why for r in rows if (why := wrong_gpu(r, smoke)) is not None}
    torn = [r["job"] for r in rows + rows_base
            if not (r["teardown_proven"] and not r["retained_bytes"] and not r["unfreed"])]
    return {
        "jobs": rows, "baseline_jobs": rows_base, "one_gpu_s": round(one_gpu, 2) if one_gpu is not None else None,
        "one_gpu_how": how, "slowest_startup_s": startup, "sweep_s": sweep["wall_s"],
        "target_s": round(limit, 2) if limit is not None else None,
        "speedup": round(one_gpu / sweep["wall_s"], 3) if one_gpu else None,
        "target_met": limit is not None and sweep["wall_s"] <= limit and sweep["returncode"] == 0,
        "wrong_gpu": wrong, "shared_gpu": shared_gpus(rows), "teardown_not_proven": torn,
        "jobs_expected": sweep["jobs"], "jobs_found": len(rows), "peak_device_bytes_per_gpu": peaks_per_gpu(rows),
    }


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def table(result: dict[str, Any], n: int, launcher: str, device: str) -> str:
    s = result["summary"]
    lines = [f"# Sweep over {n} GPU(s) of one host: hydra/launcher={launcher} ({device})", "",
             f"`{result['command']}`", "",
             f"- sweep: {s['jobs_found']}/{s['jobs_expected']} jobs in {s['sweep_s']:.1f} s; one GPU: "
             f"{s['one_gpu_s']} s ({s['one_gpu_how']}); speedup {s['speedup']}x",
             f"- target: sweep <= {TARGET_FACTOR} x one_gpu / {n} + slowest start-up ({s['slowest_startup_s']} s) = "
             f"{s['target_s']} s: {'MET' if s['target_met'] else 'NOT met'}",
             f"- jobs on the wrong GPU: {len(s['wrong_gpu'])} {s['wrong_gpu'] or ''}; jobs sharing a GPU at once: "
             f"{len(s['shared_gpu'])} {s['shared_gpu'] or ''}",
             f"- teardown not proven clean (0 bytes retained, nothing unfreed): {s['teardown_not_proven'] or 'none'}",
             "", "| job | format | seed | status | given GPU | CUDA_VISIBLE_DEVICES | GPU seen (uuid) | name | "
                 "job s | start-up s | peak GiB | latency ms | teardown |", "|" + "---|" * 13]
    for r in s["jobs"]:
        torn = "proven, 0 B" if r["teardown_proven"] and not r["retained_bytes"] and not r["unfreed"] else \
            f"NOT clean ({r['retained_bytes']} B, {len(r['unfreed'])} unfreed)"
        lines.append(f"| {r['job']} | {r['format']} | {r['seed']} | {r['status']} | {r['assigned_gpu']} | "
                     f"{r['cuda_visible_devices']} | {r['uuid'] or r['device_type']} | {r['name'] or '-'} | "
                     f"{r['job_s'] if r['job_s'] is not None else '-'} | {r['startup_s'] if r['startup_s'] is not None else '-'} | "
                     f"{_gib(r['peak_device_bytes'])} | {r['latency_ms'] if r['latency_ms'] is not None else '-'} | {torn} |")
    lines += ["", "| GPU | peak device GiB (max over its jobs) |", "|---|---|"]
    lines += [f"| {gpu} | {_gib(peak)} |" for gpu, peak in s["peak_device_bytes_per_gpu"].items()]
    return "\n".join(lines) + "\n"


def host_gpus(count: int | None) -> tuple[str, ...]:
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise SystemExit("sweep_gpus: no CUDA device here; --cpu-smoke runs the CPU smoke mode")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [e.strip() for e in visible.split(",")][:available] if visible else [str(i) for i in range(available)]
    return tuple(names[: count or available])


def checkpoint(args: argparse.Namespace, scratch: Path) -> str:
    if args.checkpoint:
        return args.checkpoint
    path = scratch / "krea2_full.safetensors"
    if not path.is_file():
        from make_checkpoint import make_checkpoint

        print(f"writing a full-size synthetic Krea 2 to {path} (bench/make_checkpoint.py)", flush=True)
        print(json.dumps(make_checkpoint(path, "krea2")), flush=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON path; the Markdown table goes beside it (.md)")
    p.add_argument("--launcher", choices=["gpus", "ray"], default="gpus")
    p.add_argument("--gpus", type=int, default=None, help="use the first N visible GPUs (default: all)")
    p.add_argument("--checkpoint", default=None, help="a Krea 2 .safetensors (default: a synthetic one in --scratch)")
    p.add_argument("--scratch", default="/tmp/sweep_gpus", help="sweep dirs, logs and the synthetic checkpoint")
    p.add_argument("--baseline", choices=["sample", "full", "none"], default="sample", help="how one-GPU time is had")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, 2 simulated GPUs")
    args = p.parse_args(argv)
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        gpus, job, device = SMOKE_GPUS[: args.gpus or 2], SMOKE_JOB, f"CPU smoke, simulated GPUs, {platform.node()}"
    else:
        gpus = host_gpus(args.gpus)
        job = [f"model.path={checkpoint(args, scratch)}", *GPU_JOB]
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip().splitlines()[0] + f" x {len(gpus)}"
    n = len(gpus)
    sweep = run_sweep("sweep", args.launcher, gpus, n, job, scratch, args.cpu_smoke)
    baseline = None
    if args.baseline != "none":
        seeds = n if args.baseline == "full" else 1
        baseline = run_sweep(f"one_gpu_{args.baseline}", args.launcher, gpus[:1], seeds, job, scratch, args.cpu_smoke)
    result = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench/sweep_gpus.py", *argv]),
              "device": device, "launcher": args.launcher, "gpus": list(gpus), "baseline_mode": args.baseline,
              "sweep": sweep, "baseline": baseline}
    result["summary"] = summarize(sweep, baseline, args.baseline, n, args.cpu_smoke)
    text = table(result, n, args.launcher, device)
    save_outputs(args.out, text, result)
    print(text)
    s = result["summary"]
    clean = sweep["returncode"] == 0 and not s["wrong_gpu"] and not s["shared_gpu"] and not s["teardown_not_proven"] \
        and s["jobs_found"] == s["jobs_expected"]
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
