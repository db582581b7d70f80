"""File to file: a checkpoint streamed through quantization into an export, per format: wall time,
peak host memory (a fresh process each), output size, next to the disk's own read and write rate.

    python bench/stream_bench.py --set num_layers=4                         # ~2B-param Krea 2 at full width, CPU
    python bench/stream_bench.py --source /data/krea2.safetensors --device cuda --formats int8 fp8 nvfp4

Without --source it first writes a synthetic checkpoint (bench/make_checkpoint.py; bf16, native names)
and removes it after. Prints a table, writes JSON (and the table as .md) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_checkpoint import make_checkpoint  # noqa: E402
from outputs import save_outputs  # noqa: E402

CHILD = """
import resource, sys, time, json, torch, lowbit_pipe
start = time.perf_counter()
r = lowbit_pipe.run("default", sys.argv[2:], run_dir=sys.argv[1])
seconds = time.perf_counter() - start
device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
print("RESULT", json.dumps({"seconds": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                            "peak_device": device_peak, "export": r.report["export"],
                            "stages": {k: v.get("seconds") for k, v in r.report["stages"].items()}}))
"""


PROBE_BYTES = 4 << 30  # enough for a steady rate; the whole 25.6 GB source twice more would cost minutes


def disk_rates(path: Path, scratch: Path) -> dict[str, float]:
    """MB/s reading up to PROBE_BYTES of `path` with the page cache dropped for it, and writing (+ fsync) as many."""
    size = min(path.stat().st_size, PROBE_BYTES)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buf = bytearray(64 << 20)
    start = time.perf_counter()
    with os.fdopen(fd, "rb", buffering=0) as f:
        left = size
        while left > 0:
            got = f.readinto(buf)
            if not got:
                break
            left -= got
    read = size / (time.perf_counter() - start) / 1e6
    target = scratch / "disk_write_probe"
    start = time.perf_counter()
    with open(target, "wb") as f:
        left = size
        while left > 0:
            f.write(memoryview(buf)[: min(left, len(buf))])
            left -= len(buf)
        f.flush()
        os.fsync(f.fileno())
    write = size / (time.perf_counter() - start) / 1e6
    target.unlink()
    return {"read_MBps": round(read, 1), "write_MBps": round(write, 1), "probe_bytes": size, "bytes": path.stat().st_size}


def run_stream(source: Path, fmt: str, device: str, dtype: str, config: list[str], out_dir: Path) -> dict:
    out = out_dir / f"{fmt}.safetensors"
    args = [str(out_dir / f"run_{fmt}"), f"model.path={source}", "model.stream=true", f"model.device={device}",
            f"model.dtype={dtype}", "pipeline=[load,detect,quantize,export]", f"quantize.default.format={fmt}",
            f"export.path={out}", *config]
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"format": fmt, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    result = json.loads(re.search(r"RESULT (.*)", proc.stdout).group(1))
    figures = {"format": fmt, "seconds": round(result["seconds"], 2), "export_seconds": result["stages"]["export"],
               "peak_rss_bytes": result["peak_rss"], "peak_device_bytes": result["peak_device"],
               "export_bytes": result["export"]["bytes"],
               "quantized_layers": result["export"]["quantized_layers"]}
    out.unlink(missing_ok=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", help="a float checkpoint; default: a synthetic one (see --set)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="constructor overrides of the synthetic "
                   "Krea 2 (and model.config of the run)")
    p.add_argument("--formats", nargs="+", default=["int8", "fp8", "nvfp4"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="model.dtype: the export's float tensors")
    p.add_argument("--scratch", default=None, help="folder for the synthetic checkpoint and the exports")
    p.add_argument("--out", default="bench/results/stream_cpu")
    args = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, _, v in (s.partition("=") for s in args.set)}
    config = [f"+model.config.{k}={json.dumps(v)}" for k, v in overrides.items()]
    if args.scratch:
        Path(args.scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        tmp = Path(tmp)
        made = None
        source = Path(args.source) if args.source else tmp / "source.safetensors"
        if not args.source:
            made = make_checkpoint(source, "krea2", overrides)
            print(f"source: {made['bytes'] / 1e9:.2f} GB written in {made['seconds']:.1f} s", flush=True)
        disk = disk_rates(source, tmp)
        print(f"disk: read {disk['read_MBps']:.0f} MB/s, write {disk['write_MBps']:.0f} MB/s", flush=True)
        rows: list[dict] = []
        for fmt in args.formats:  # one line each as it ends, so a run cut short still says what it measured
            rows.append(run_stream(source, fmt, args.device, args.dtype, config, tmp))
            print(f"{fmt}: {json.dumps(rows[-1])}", flush=True)
            write(rows, argv, args, made, overrides, disk, quiet=True)
    write(rows, argv, args, made, overrides, disk)
    return 0


def write(rows: list[dict], argv: list[str], args: argparse.Namespace, made: dict | None, overrides: dict,
          disk: dict, quiet: bool = False) -> None:
    """The table (printed unless quiet) as .md and the figures as .json beside --out."""
    src_gb = disk["bytes"] / 1e9
    head = ((f"Source: {made['params'] / 1e9:.2f}B params, " if made else "Source: ")
            + f"{src_gb:.2f} GB ({'synthetic Krea 2 ' + json.dumps(overrides) if made else args.source}); device "
            f"{args.device}; disk read {disk['read_MBps']:.0f} MB/s, write {disk['write_MBps']:.0f} MB/s "
            f"(reading the source alone: {disk['bytes'] / disk['read_MBps'] / 1e6:.1f} s)")
    lines = [head, "", "| format | wall s (process) | export stage s | peak host memory | peak device memory | export size |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['format']} | failed: {r['error']} | | | | |")
            continue
        dev = f"{r['peak_device_bytes'] / 2**30:.2f} GiB" if r.get("peak_device_bytes") is not None else "-"
        lines.append(f"| {r['format']} | {r['seconds']:.1f} | {r['export_seconds']:.1f} | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB | {dev} | {r['export_bytes'] / 1e9:.2f} GB |")
    table = "\n".join(lines)
    if not quiet:
        print(table)
    command = "python bench/stream_bench.py " + " ".join(argv)
    save_outputs(args.out, f"`{command}`\n\n{table}\n", {"command": command, "machine": platform.platform(),
                                                        "cpus": os.cpu_count(), "synthetic": made, "disk": disk,
                                                        "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
