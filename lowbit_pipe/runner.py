"""Runner: the stages of one recipe over one Context, with timing, memory, report and teardown."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lowbit_pipe.context import Context
from lowbit_pipe.errors import StageError
from lowbit_pipe.recipe import Recipe
from lowbit_pipe.stages import STAGES
from lowbit_pipe.stages.teardown import teardown


@dataclass
class RunResult:
    status: str  # "ok" | "failed"
    report: dict[str, Any]
    run_dir: Path
    model: Any = None  # the (quantized) model, when the pipeline did not tear it down
    context: Context | None = None

    @property
    def export_path(self) -> str | None:
        return (self.report.get("export") or {}).get("path")


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: fall back to the process-lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakHostMemory:
    """Samples resident memory in a thread; `.peak` is the maximum seen while active."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakHostMemory:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def environment(seed: int) -> dict[str, Any]:
    import diffusers
    import hydra
    import safetensors

    from lowbit_pipe import __version__

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        sha = None
    env = {
        "lowbit_pipe": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "torch": torch.__version__, "diffusers": diffusers.__version__, "hydra": hydra.__version__,
        "safetensors": safetensors.__version__, "git_sha": sha, "seed": seed,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return env


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


class Runner:
    def __init__(self, recipe: Recipe, run_dir: str | Path, model: Any = None):
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.model = model

    def run(self) -> RunResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ctx = Context(recipe=self.recipe, run_dir=self.run_dir)
        if self.model is not None:
            ctx.set_model(self.model, owned=False)
        ctx.ledger.capture_baseline()  # device memory before load: teardown proves it returns here
        recipe_dict = OmegaConf.to_container(OmegaConf.structured(self.recipe), resolve=True)
        (self.run_dir / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe_dict))
        _write_json(self.run_dir / "environment.json", environment(self.recipe.seed))
        report: dict[str, Any] = {"status": "running", "recipe": recipe_dict, "stages": {}}
        ctx.report = report
        failure: StageError | None = None
        torch.manual_seed(self.recipe.seed)
        for name in self.recipe.pipeline:
            try:
                report["stages"][name] = self._run_stage(name, ctx)
            except Exception as err:  # any failure: name the stage, tear down, record, re-raise as StageError
                failure = err if isinstance(err, StageError) else StageError(name, err)
                report["stages"].setdefault(name, {})["error"] = str(failure)
                break
        if failure is not None and "teardown" not in report["stages"]:
            _drop_frame_locals(failure)  # the traceback's frames would keep the failed stage's tensors alive
            try:
                report["stages"]["teardown"] = self._run_stage("teardown", ctx)
            except Exception as err:  # teardown's own failure is reported beside the stage's
                report["stages"]["teardown"] = {"error": f"{type(err).__name__}: {err}"}
        report["status"] = "failed" if failure else "ok"
        if failure:
            report["error"] = str(failure)
        _write_json(self.run_dir / "report.json", report)
        summary = format_summary(report)
        (self.run_dir / "summary.txt").write_text(summary + "\n")
        result = RunResult(report["status"], report, self.run_dir,
                           model=ctx.model, context=ctx)
        if failure:
            raise failure
        return result

    def _run_stage(self, name: str, ctx: Context) -> dict[str, Any]:
        stage = STAGES[name]()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with PeakHostMemory() as mem:
            figures = teardown(ctx) if name == "teardown" else stage.run(ctx)
        entry = {"seconds": round(time.perf_counter() - start, 4), "peak_host_bytes": mem.peak}
        if cuda:
            entry["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        entry.update(figures or {})
        return entry


def _drop_frame_locals(err: BaseException) -> None:
    """Clear the local variables of the finished frames in an exception's tracebacks (and its causes),
    so teardown can free what the failed stage held. Line numbers and messages are kept."""
    import traceback

    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_summary(report: dict[str, Any]) -> str:
    """Short human summary: stage times and memory, quality, export path, size and compression."""
    lines = [f"lowbit_pipe run: {report['status']}  recipe={report['recipe'].get('name')}"]
    lines.append(f"{'stage':<10} {'seconds':>8} {'peak host':>11} {'peak device':>12}")
    for name, s in report["stages"].items():
        lines.append(f"{name:<10} {s.get('seconds', float('nan')):>8.3f} {_fmt_bytes(s.get('peak_host_bytes')):>11} "
                     f"{_fmt_bytes(s.get('peak_device_bytes')):>12}" + (f"  ERROR: {s['error']}" if "error" in s else ""))
    det = report.get("detect")
    if det:
        lines.append(f"arch: {det['arch']}  layers: {det['plan']['layers']}")
    ev = report.get("evaluate")
    if ev and "rel_error" in ev:
        lines.append(f"quality: rel_error={ev['rel_error']:.5f}  cosine={ev['cosine']:.6f}")
    elif ev:
        lines.append(f"quality: skipped ({ev.get('skipped')})")
    ex = report.get("export")
    q = report.get("quantize")
    if ex:
        ratio = ""
        if q and q.get("bytes_after"):
            ratio = f"  quantized layers {_fmt_bytes(q['bytes_before'])} -> {_fmt_bytes(q['bytes_after'])} " \
                    f"({q['bytes_before'] / q['bytes_after']:.2f}x)"
        lines.append(f"export: {ex['path']}  {_fmt_bytes(ex['bytes'])}{ratio}")
    td = report.get("teardown")
    if td:
        lines.append(f"teardown: freed {_fmt_bytes(td['bytes_freed'])}, retained {_fmt_bytes(td['retained_bytes'])}, "
                     f"unfreed {td['unfreed'] or 'none'}")
    if report.get("error"):
        lines.append(f"error: {report['error']}")
    return "\n".join(lines)
