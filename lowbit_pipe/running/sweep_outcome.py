"""A sweep goes on past a failed job and still ends with exit code 1: the Hydra callback that says so.

A job whose stage fails returns NaN to the launcher instead of exiting (`__main__`): an exit inside a job
ends the basic launcher's whole sweep at that job, and NaN is what Optuna's sweeper records as a failed
trial. When the sweep is over, this callback reads every job's report.json under the sweep dir (the same
files whichever launcher ran the jobs, local or remote workers alike), lists the failed ones and exits 1.
Always on (conf/config.yaml).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def failed_jobs(sweep_dir: Path) -> list[tuple[Path, str]]:
    """(run dir, error) of every job under `sweep_dir` whose report.json says it failed."""
    out = []
    for path in sorted(sweep_dir.rglob("report.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not a lowbit_pipe report (an artifact copy being written, a foreign file)
        if isinstance(report, dict) and report.get("status") == "failed":
            out.append((path.parent, str(report.get("error") or "")))
    return out


def print_failed(failed: list[tuple[Path, str]]) -> None:
    """The failed jobs (failed_jobs), one stderr line each under a count."""
    print(f"lowbit_pipe: {len(failed)} job(s) of the sweep failed:", file=sys.stderr)
    for run_dir, error in failed:
        print(f"  {run_dir}: {error.splitlines()[0] if error else 'see its report.json'}", file=sys.stderr)


class SweepOutcome(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        failed = failed_jobs(Path(config.hydra.sweep.dir))
        if not failed:
            return
        print_failed(failed)
        # SystemExit, not an exception: Hydra turns an exception in a callback into a warning.
        sys.exit(1)
