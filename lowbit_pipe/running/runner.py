"""Runner: the stages of one recipe over one Context, with timing, memory, report and teardown."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from lowbit_pipe.errors import StageError, WriteError
from lowbit_pipe.files.tempfiles import atomic_write_text
from lowbit_pipe.plan.stream_choice import decide_stream
from lowbit_pipe.progress import Console
from lowbit_pipe.recipe import Recipe
from lowbit_pipe.running.device_record import device_record
from lowbit_pipe.running.interrupts import OrderlyStop, as_interrupted
from lowbit_pipe.stages import STAGES
from lowbit_pipe.stages.compile import dynamo_counters
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.teardown import teardown
from lowbit_pipe.summary import format_summary


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

    from lowbit_pipe.version import __version__

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
    atomic_write_text(path, json.dumps(data, indent=2, default=str))


class Runner:
    def __init__(self, recipe: Recipe, run_dir: str | Path, model: Any = None, console: Console | None = None,
                 calibrate: Callable[[], None] | None = None, hands_back: bool = True):
        """`hands_back`: the caller gets the model back (RunResult.model), so model.stream=auto loads it unless
        the pipeline tears it down; the CLI, which keeps nothing, passes False."""
        self.recipe = recipe
        self.run_dir = Path(run_dir)
        self.model = model
        self.console = console or Console()
        self.calibrate = calibrate
        self.hands_back = hands_back

    def run(self) -> RunResult:
        """Run the pipeline. SIGINT / SIGTERM (main thread) stop it in order: the stage is cut, the run torn down,
        report.json says `interrupted: {stage, signal}`, and `Interrupted` is raised (lowbit_pipe.running.interrupts)."""
        stop = OrderlyStop()
        stop.install()
        try:
            return self._run(stop)
        finally:
            stop.restore()  # also when something escaped before the report was written

    def _run(self, stop: OrderlyStop) -> RunResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ctx = Context(recipe=self.recipe, run_dir=self.run_dir, console=self.console, calibrate=self.calibrate)
        if self.model is not None:
            ctx.set_model(self.model, owned=False)
        ctx.ledger.capture_baseline()  # device memory before load: teardown proves it returns here
        recipe_dict = OmegaConf.to_container(OmegaConf.structured(self.recipe), resolve=True)
        atomic_write_text(self.run_dir / "recipe.yaml", OmegaConf.to_yaml(recipe_dict))
        _write_json(self.run_dir / "environment.json", environment(self.recipe.seed))
        report: dict[str, Any] = {"status": "running", "stage": None, "recipe": recipe_dict, "stages": {},
                                  "warnings": []}
        report["device"] = device_record(self.recipe.model.device, self.model)
        ctx.report = report
        ctx.stream_choice = decide_stream(self.recipe, model_given=self.model is not None, hands_back=self.hands_back)
        report["stream"] = ctx.stream_choice.as_dict()  # the load stage may still load a file streaming cannot read
        compiles = "compile" in self.recipe.pipeline
        dynamo_start = dynamo_counters() if compiles else None
        torch.manual_seed(self.recipe.seed)
        name, failure = self._run_stages(ctx, report, stop)
        handled = self._close(ctx, report, stop, name, failure, dynamo_start)
        interrupted = isinstance(failure, KeyboardInterrupt)
        report["signals"] = {"handled": handled, "restored": stop.restore(),
                             "received": [signal.Signals(s).name for s in stop.received]}
        _write_json(self.run_dir / "report.json", report)
        summary = format_summary(report)
        atomic_write_text(self.run_dir / "summary.txt", summary + "\n")
        result = RunResult(report["status"], report, self.run_dir,
                           model=ctx.model, context=ctx)
        if failure:
            if interrupted:
                failure.run_report = report  # what the command line's one line says (teardown, export)
            raise failure
        return result

    def _run_stages(self, ctx: Context, report: dict[str, Any], stop: OrderlyStop
                    ) -> tuple[str, BaseException | None]:
        """The pipeline's stages in order, until one fails or a signal stops the run. Returns the stage it ended in
        and the failure (a StageError or Interrupted), None when every stage ran."""
        failure: BaseException | None = None
        name = "startup"
        try:
            for name in self.recipe.pipeline:
                # report.json names the stage under way before it starts: a run killed outright (SIGKILL, OOM)
                # leaves `status: running` and where it was.
                stop.stage = report["stage"] = name
                self._trace(ctx, report)
                stop.raise_pending()
                try:
                    if name == "teardown":
                        with stop.deferred():
                            report["stages"][name] = self._run_stage(name, ctx)
                    else:
                        report["stages"][name] = self._run_stage(name, ctx)
                except KeyboardInterrupt:
                    raise
                except Exception as err:  # noqa: BLE001 - any failure: name the stage, tear down, record, re-raise as StageError
                    failure = err if isinstance(err, StageError) else StageError(name, err)
                    report["stages"].setdefault(name, {})["error"] = str(failure)
                    break
            stop.raise_pending()  # a signal during the teardown stage: the run is stopped there, torn down
        except KeyboardInterrupt as err:  # SIGINT / SIGTERM (Ctrl-C, Slurm, timeout): tear down, then stop
            failure = as_interrupted(err, name)
            if failure is not err:  # Python's own SIGINT handler: its frames are the ones to release
                report["traceback"] = release_traceback(err)
            entry = report["stages"].setdefault(name, {})
            if "seconds" not in entry:  # cut mid-stage (a stage that had finished keeps its figures)
                entry["error"] = f"interrupted by {failure.signal_name}"
            report["interrupted"] = {"stage": name, "signal": failure.signal_name}
        return name, failure

    def _close(self, ctx: Context, report: dict[str, Any], stop: OrderlyStop, name: str,
               failure: BaseException | None, dynamo_start: dict[str, int] | None) -> list[str]:
        """After the stages, signals deferred: tear a failed run down, and fill in the report's dynamo counts,
        status, stage and error. Returns the signals the orderly stop handled (stop.handled)."""
        with stop.deferred():
            if failure is not None and "teardown" not in report["stages"]:
                # its frames would keep the stage's tensors alive
                report["traceback"] = report.get("traceback") or release_traceback(failure)
                try:
                    report["stages"]["teardown"] = self._run_stage("teardown", ctx)
                except Exception as err:  # noqa: BLE001 - teardown's own failure is reported beside the stage's
                    report["stages"]["teardown"] = {"error": f"{type(err).__name__}: {err}"}
            if dynamo_start is not None:  # graphs compiled and graph breaks during this run (lazy: at first calls)
                report["dynamo"] = {k: v - dynamo_start[k] for k, v in dynamo_counters().items()}
            interrupted = isinstance(failure, KeyboardInterrupt)
            report["status"] = "interrupted" if interrupted else "failed" if failure else "ok"
            report["stage"] = name if failure else None
            if interrupted:
                report["error"] = f"interrupted by {failure.signal_name} during stage '{name}'"
            elif failure:
                report["error"] = report["stages"][name]["error"]
            return stop.handled

    def _trace(self, ctx: Context, report: dict[str, Any]) -> None:
        """report.json as a stage starts. A trace, not the result: when the run dir's disk is full the run goes on
        (and is torn down) with a warning; the final report.json write then says what failed."""
        try:
            _write_json(self.run_dir / "report.json", report)
        except WriteError as err:
            record_warning(ctx, report["stage"] or "startup", f"report.json not updated: {err}")

    def _run_stage(self, name: str, ctx: Context) -> dict[str, Any]:
        stage = STAGES[name]()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with PeakHostMemory() as mem, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # torch's own modules calling its deprecated APIs (the first inductor compile imports torch.utils.mkldnn:
            # 14 `torch.jit.script_method is deprecated`): nothing a user can act on; Python's default filters hide
            # them as well. Ours and the user's code are still shown (a warning names its caller's module).
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch(\.|$)")
            try:
                figures = teardown(ctx) if name == "teardown" else stage.run(ctx)
            finally:  # warnings of a failing stage are shown too
                for w in caught:
                    record_warning(ctx, name, str(w.message))
        entry = {"seconds": round(time.perf_counter() - start, 4), "peak_host_bytes": mem.peak}
        if cuda:
            entry["peak_device_bytes"] = torch.cuda.max_memory_allocated()
        entry.update(figures or {})
        return entry


def record_warning(ctx: Context, stage: str, message: str) -> None:
    """Show a stage's warning (once per text: the console) and keep it in the report, once per stage and text with
    its `count` when repeated (a warning per layer or per call would otherwise fill the summary)."""
    ctx.console.warn(message)
    entries = ctx.report.setdefault("warnings", [])
    same = next((w for w in entries if w["stage"] == stage and w["message"] == message), None)
    if same is None:
        entries.append({"stage": stage, "message": message})
    else:
        same["count"] = same.get("count", 1) + 1


def release_traceback(err: BaseException) -> str:
    """The formatted traceback of `err` (and its causes), then the live tracebacks dropped.

    A traceback keeps its frames alive, and a frame keeps its function, whose closure can hold the model
    (clearing the frames' locals is not enough), so teardown could not free what the failed stage held.
    The text goes to report.json instead: the same lines, no objects."""
    import traceback

    root = getattr(err, "cause", None) or err
    text = "".join(traceback.format_exception(root))
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
        stack.extend([e.__cause__, e.__context__, getattr(e, "cause", None)])
    return text
