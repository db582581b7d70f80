"""The speed table: each candidate format's linear time on the shapes and token counts of the model at hand,
measured on the device the run uses and cached per device and software versions.

One entry is a QuantLinear (or, for float, an nn.Linear) of shape (out N, in K) called on an input of M rows
in the run's dtype: activation preparation (rotation, quantization) included, as the model runs it; the
compiled path is the layer under torch.compile (the recipe's compile backend) and is a separate entry.
The file lives under the user's cache directory (~/.cache/lowbit_pipe, or quantize.speed_cache), one file
per (device name, torch, triton, lowbit_pipe versions), so a new driver stack or release never reuses old
times; quantize.speed_refresh rebuilds it. Entries a run needs and the file lacks are measured and added.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.measure.timing import TimingSettings, time_ms
from lowbit_pipe.plan.candidates import FLOAT, Candidate


@dataclass(frozen=True)
class TableKey:
    """What makes measured times comparable: the device and the software that ran them."""

    device: str  # torch.cuda.get_device_name, or the CPU's name
    torch: str
    triton: str | None
    lowbit_pipe: str

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Entry:
    """One measurement: candidate label, M rows x K in -> N out, dtype, compiled or not."""

    label: str
    rows: int
    in_features: int
    out_features: int
    dtype: str
    compiled: bool
    prepack: bool = False  # quantize.prepack: the runtime form (w4a8's int8 grid, convrot_w4a4's unpacked codes)

    def key(self) -> str:
        return (f"{self.label}|{self.rows}x{self.in_features}x{self.out_features}|{self.dtype}"
                f"|{'compiled' if self.compiled else 'eager'}{'|prepacked' if self.prepack else ''}")


@dataclass
class SpeedTable:
    key: TableKey
    path: Path
    times_ms: dict[str, float] = field(default_factory=dict)  # Entry.key() -> ms
    measured: int = 0  # entries timed in this run (the rest came from the file)

    def get(self, entry: Entry) -> float:
        return self.times_ms[entry.key()]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()} (1 thread)"  # timing.time_ms: 1 thread


def table_key(device: torch.device) -> TableKey:
    from lowbit_pipe.version import __version__

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # no Triton (not Linux): the CPU reference paths only
        triton_version = None
    return TableKey(device_name(device), torch.__version__, triton_version, __version__)


def cache_dir(configured: str | None) -> Path:
    """quantize.speed_cache, else ~/.cache/lowbit_pipe (the user's cache directory)."""
    if configured is not None:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "lowbit_pipe"


def table_path(directory: Path, key: TableKey) -> Path:
    return directory / f"speed_{key.digest()}.json"


def load(directory: Path, key: TableKey, refresh: bool = False) -> SpeedTable:
    """The cached table for `key` ({} when there is none, when `refresh`, or when the file was written for another
    key). A file that cannot be read is refused naming it: it is the user's cache, not ours to discard silently."""
    path = table_path(directory, key)
    table = SpeedTable(key, path)
    if refresh or not path.is_file():
        return table
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RecipeError("quantize.speed_cache", f"cannot read the speed table {path} ({err}); delete it or set "
                                                  "quantize.speed_refresh=true to rebuild it") from None
    if data.get("key") == asdict(key):
        table.times_ms = {str(k): float(v) for k, v in data.get("times_ms", {}).items()}
    return table


def save(table: SpeedTable) -> None:
    """Write the table atomically (temp file + rename): a reader never sees half a file."""
    table.path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"key": asdict(table.key), "times_ms": dict(sorted(table.times_ms.items()))}, indent=1)
    fd, tmp = tempfile.mkstemp(dir=table.path.parent, prefix=table.path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, table.path)


def _layer(candidate: Candidate, entry: Entry, device: torch.device, dtype: torch.dtype) -> nn.Module:
    from lowbit_pipe.quant.nn import QuantLinear

    # Drawn on the device: a full-size layer's fp32 weight drawn on the host took about a second each.
    gen = torch.Generator(device=device).manual_seed(entry.in_features * 7919 + entry.out_features)
    with torch.device(device):
        linear = nn.Linear(entry.in_features, entry.out_features, bias=True, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(entry.out_features, entry.in_features, generator=gen, device=device)
                            / entry.in_features ** 0.5)
        linear.bias.zero_()
    if candidate.spec is None:
        return linear
    # A static input scale's value does not change the time; this input's amax (randn rows) is about 4-5.
    amax = 4.0 if candidate.spec.activations == "static" else None
    layer = QuantLinear.from_linear(linear, candidate.spec, amax, candidate.label).to(device)
    if entry.prepack:
        runtime = layer.prepack()
        if runtime:
            layer.prepacked = runtime  # a throwaway layer: no ledger, nothing of the user's is touched
    return layer


def measure(candidate: Candidate, entry: Entry, device: torch.device, dtype: torch.dtype, *,
            compile_backend: str = "inductor", timing: TimingSettings | None = None) -> float:
    """Milliseconds of one call of the candidate's linear on an [M, K] input (activation prep included)."""
    layer = _layer(candidate, entry, device, dtype)
    x = torch.randn(entry.rows, entry.in_features, generator=torch.Generator(device=device).manual_seed(entry.rows),
                    device=device).to(dtype)
    fn = torch.compile(layer, backend=compile_backend) if entry.compiled else layer
    return time_ms(lambda: fn(x), device, timing or TimingSettings.for_device(device))


def ensure(table: SpeedTable, needed: Iterable[tuple[Candidate, Entry]], device: torch.device, dtype: torch.dtype, *,
           compile_backend: str = "inductor",
           timing: TimingSettings | None = None) -> SpeedTable:
    """Measure every needed entry the table lacks, then save it (only when something was added)."""
    added = 0
    for candidate, entry in needed:
        if entry.key() in table.times_ms:
            continue
        table.times_ms[entry.key()] = measure(candidate, entry, device, dtype,
                                              compile_backend=compile_backend, timing=timing)
        added += 1
    table.measured += added
    if added:
        save(table)
    return table


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


__all__ = ["FLOAT", "Entry", "SpeedTable", "TableKey", "cache_dir", "ensure", "load", "measure", "save", "table_key"]
