"""Soak: many cycles of quantize -> LoRA attach -> strength change -> LoRA swap -> forward -> teardown on ONE model
in ONE process; after every teardown the proof, the output bit-equal to the float model's, and memory back.

    python bench/soak.py --device cuda --out bench/results/soak_h200          # 50 cycles on the GPU
    python bench/soak.py --device cpu --cycles 3 --out /tmp/soak_cpu           # smoke test (seconds)

Per cycle, on the embedded tiny Krea 2 (float32, so "bit-equal to float" is exact): a Ledger; every block Linear
quantized through it (`--format`, default fp8: its reference path is a float matmul that CUDA also runs); a
peft-style LoRA file attached from disk (the LoRA file reader, every cycle), re-weighted, removed, a kohya-style
file attached instead (the swap); one forward; the ledger unwound and its proof checked (no errors, nothing
unfreed or retained, proven); one forward that must equal the float reference bit for bit. Measured after
each teardown: host RSS (/proc/self/status, after gc), open file descriptors (/proc/self/fd) and, on CUDA,
`torch.cuda.memory_allocated()` / `memory_reserved()` (after empty_cache) and nvidia-smi's free memory, each
against its value before the first cycle. `soak()` is what tests/running/test_soak.py runs (200 cycles on the CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.arch.tiny import build_tiny, tiny_model_config
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.make_example import example_lora


def host_rss() -> int:
    """Resident bytes of this process (VmRSS), after a full garbage collection."""
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def smi_free(device: torch.device) -> int | None:
    """nvidia-smi's free memory of the device in bytes (None without nvidia-smi)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out.stdout.strip()) * 2**20 if out.returncode == 0 and out.stdout.strip().isdigit() else None


@dataclass
class Memory:
    rss: int
    fds: int
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    smi_free: int | None = None


def memory(device: torch.device, smi: bool) -> Memory:
    m = Memory(host_rss(), open_fds())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        m.cuda_allocated = torch.cuda.memory_allocated(device)
        m.cuda_reserved = torch.cuda.memory_reserved(device)
        m.smi_free = smi_free(device) if smi else None
    return m


@dataclass
class Cycle:
    index: int
    seconds: float
    proven: bool
    errors: list[str]
    unfreed: list[str]
    retained_bytes: int
    bit_equal: bool
    memory: Memory | None = None  # measured every `measure_every` cycles (a gc costs)


@dataclass
class SoakResult:
    device: str
    format: str
    cycles: list[Cycle] = field(default_factory=list)
    baseline: Memory | None = None  # before the first cycle (after one warm-up cycle when warmup=1)

    def growth(self, attr: str) -> int | None:
        """Largest increase of a memory figure over the baseline across the measured cycles."""
        values = [getattr(c.memory, attr) for c in self.cycles if c.memory is not None]
        base = getattr(self.baseline, attr)
        values = [v for v in values if v is not None]
        return max(v - base for v in values) if values and base is not None else None

    def failures(self) -> list[str]:
        return [f"cycle {c.index}: " + "; ".join(filter(None, [
            "" if c.proven else "teardown not proven", f"errors {c.errors}" if c.errors else "",
            f"unfreed {c.unfreed[:3]}" if c.unfreed else "", f"retained {c.retained_bytes} B" if c.retained_bytes else "",
            "" if c.bit_equal else "output after teardown differs from float"]))
            for c in self.cycles if not (c.proven and not c.errors and not c.unfreed and not c.retained_bytes and c.bit_equal)]


def soak(cycles: int, device: str = "cpu", *, fmt: str = "fp8", warmup: int = 2, measure_every: int = 10,
         smi: bool = True, work: Path | None = None, on_cycle: Any = None, threads: int | None = 1) -> SoakResult:
    """Run `cycles` soak cycles after `warmup` unmeasured ones (first-call caches: kernels, dispatch tables, the
    allocator's pools); memory is measured before the first measured cycle (the baseline), then every
    `measure_every` cycles and after the last. `on_cycle(result)` after each (for writing as it goes).

    Two things keep a cycle at ~0.1 s on a busy 2-core machine (3 s without them): `threads` (torch's intra-op
    threads for the run, restored after; the tiny model's ops are microseconds, and a second thread only waits
    for a core) and `gc.freeze()` after the warm-up: every teardown proof runs full garbage collections, which
    otherwise walk every object of torch, diffusers and Hydra each time. Objects made by the cycles are not
    frozen, so the proof (weakrefs dead after gc) covers all of them."""
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _soak(cycles, device, fmt, warmup, measure_every, smi, work, on_cycle)
    finally:
        gc.unfreeze()
        torch.set_num_threads(old_threads)


def _soak(cycles: int, device: str, fmt: str, warmup: int, measure_every: int, smi: bool, work: Path | None,
          on_cycle: Any) -> SoakResult:
    dev = torch.device(device)
    arch = get_arch("krea2")
    model = build_tiny("krea2", tiny_model_config("krea2"), 0, torch.float32).to(dev)
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=4, text_tokens=2,
                                 generator=torch.Generator().manual_seed(1), dtype=torch.float32, device=dev)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return arch.output_tensor(model(**inputs)).detach().clone()

    reference = forward()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        files = []
        for i, style in enumerate(("peft", "kohya")):
            state, meta = example_lora(model, arch, style=style, rank=4, seed=i, rel=0.01)
            path = Path(tmp) / f"{style}.safetensors"
            from safetensors.torch import save_file

            save_file({k: v.cpu() for k, v in state.items()}, str(path), metadata=meta or None)
            files.append(str(path))
            del state
        result = SoakResult(str(dev), fmt)

        def cycle(index: int) -> Cycle:
            start = time.perf_counter()
            ledger = Ledger()
            if dev.type == "cuda":
                ledger.capture_baseline()
            api.quantize(model, {"default": {"format": fmt}}, ledger=ledger)
            first = lora.attach(model, files[0], name="a", strength=1.0, ledger=ledger)
            first.set_strength(0.5)  # strength change
            first.remove()  # swap: a off, b on
            lora.attach(model, files[1], name="b", strength=0.8, ledger=ledger)  # handle kept past the teardown
            forward()
            report = ledger.unwind()
            del ledger
            equal = torch.equal(forward(), reference)
            return Cycle(index, time.perf_counter() - start, report.proven, list(report.errors), list(report.unfreed),
                         report.retained_bytes, equal)

        for i in range(warmup):
            cycle(-1 - i)
        gc.collect()
        gc.freeze()
        result.baseline = memory(dev, smi)
        for i in range(cycles):
            c = cycle(i)
            if i % measure_every == measure_every - 1 or i == cycles - 1:
                c.memory = memory(dev, smi)
            result.cycles.append(c)
            if on_cycle is not None:
                on_cycle(result)
    return result


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:+.2f}"


def _delta(now: int | None, base: int | None) -> str:
    return "-" if now is None or base is None else f"{now - base:+d}"


def table(result: SoakResult, command: str) -> str:
    base = result.baseline
    lines = [f"# Soak: quantize -> LoRA attach -> strength -> swap -> forward -> teardown ({result.device}, "
             f"{result.format})", "", f"`{command}`", "",
             f"{len(result.cycles)} cycles after warm-up; baseline RSS {base.rss / 2**20:.1f} MiB, {base.fds} fds"
             + (f", CUDA allocated {base.cuda_allocated} B, reserved {base.cuda_reserved} B" if base.cuda_allocated
                is not None else "") + ". Failed cycles: " + str(len(result.failures())), "",
             "| cycle | s | proven | bit-equal | RSS MiB vs baseline | fds vs baseline | CUDA allocated B | "
             "CUDA reserved B | nvidia-smi free MiB vs baseline |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result.cycles:
        if c.memory is None:
            continue
        m = c.memory
        lines.append(f"| {c.index} | {c.seconds:.3f} | {c.proven and not c.unfreed and not c.errors} | {c.bit_equal} | "
                     f"{_mb(m.rss - base.rss)} | {m.fds - base.fds:+d} | {_delta(m.cuda_allocated, base.cuda_allocated)} | "
                     f"{_delta(m.cuda_reserved, base.cuda_reserved)} | "
                     f"{_mb(m.smi_free - base.smi_free) if m.smi_free is not None and base.smi_free is not None else '-'} |")
    mean = sum(c.seconds for c in result.cycles) / max(1, len(result.cycles))
    lines += ["", f"Mean cycle {mean * 1000:.1f} ms; largest RSS growth {_mb(result.growth('rss'))} MiB, fds "
              f"{result.growth('fds')}, CUDA allocated {result.growth('cuda_allocated')} B."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cycles", type=int, default=50)
    p.add_argument("--format", default="fp8", help="quantization format of every block Linear (default fp8)")
    p.add_argument("--measure-every", type=int, default=1, help="measure memory every N cycles (default: every)")
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md (bench/outputs.py)")
    args = p.parse_args(argv)
    from outputs import save_outputs

    command = "python bench/soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"command": command, "torch": torch.__version__, "python": platform.python_version(),
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()}

    def write(result: SoakResult) -> None:
        if args.out:
            save_outputs(args.out, table(result, command), {**meta, **asdict(result), "failures": result.failures()})

    result = soak(args.cycles, args.device, fmt=args.format, measure_every=args.measure_every, on_cycle=write)
    write(result)
    print(table(result, command))
    failures = result.failures()
    device_back = result.device.startswith("cpu") or result.growth("cuda_allocated") == 0
    print(json.dumps({"failures": failures[:5], "cuda_allocated_growth": result.growth("cuda_allocated"),
                      "rss_growth": result.growth("rss"), "fds_growth": result.growth("fds")}))
    return 0 if not failures and device_back else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
