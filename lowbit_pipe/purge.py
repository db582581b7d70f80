"""Purge: the Python API for live runs, and a CLI for run directories.

Python (the ComfyUI adapter's purge node calls this): `purge(result_or_ctx)`
tears a live run down in this process -- unwind its ledger, drop what it owns,
clear the caches it filled -- and returns the proof (same as
`lowbit_pipe.teardown`).

CLI: `python -m lowbit_pipe.purge RUN_DIR [RUN_DIR ...] [--dry-run] [--json] [--min-age S]`
cleans what a crashed or killed run left on disk: the temporary files of
atomic writes (`.<name>.tmp-<pid>-<host>-<random>`, lowbit_pipe.files.tempfiles, whose
writer is gone; `.<name>.tmp` from an earlier version's report write older than
--min-age seconds), searched under each run dir (sweep dirs included) and beside
the export target each run's recipe.yaml names. It then reports, per run,
the teardown that run recorded in its report.json (proven or not, what it
could not free), or that it recorded none.

What the CLI cannot do: reach live objects of another process. A model,
patch, hook, compiled graph or CUDA memory belongs to the process that made
it; only that process can tear it down (through this module's `purge`, or
`lowbit_pipe.teardown`), and the operating system reclaims all of it when that
process exits. The CLI says so in its output rather than pretend otherwise.
A folder with no run under it (no recipe.yaml or report.json anywhere below: every run dir starts with its
recipe.yaml) is not searched or cleaned: the CLI says "not a run folder" instead of "removed 0".
Exit status: 0 when done; 1 when a run dir is missing or is not a run folder.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from lowbit_pipe.files import tempfiles

_PLAIN_TMP = re.compile(r"^\..+\.tmp$")  # report writes of earlier versions (no pid in the name)


def purge(target: Any) -> dict[str, Any]:
    """Tear down a live run (RunResult, Context or Ledger) in this process and return the proof."""
    from lowbit_pipe.api import teardown

    return teardown(target)


def export_folders(run_dir: Path) -> list[Path]:
    """Folders outside `run_dir` that its runs exported to (`export.path` of each recipe.yaml under it): a killed
    export leaves its temporary file beside the export target, wherever that is."""
    import yaml

    folders = []
    for recipe_path in sorted(run_dir.rglob("recipe.yaml")):
        try:
            recipe = yaml.safe_load(recipe_path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue  # not a recipe this package wrote; the run dir itself is searched all the same
        target = ((recipe.get("export") or {}) if isinstance(recipe, dict) else {}).get("path")
        if not target:
            continue
        folder = Path(target).expanduser().parent
        if not folder.is_absolute():
            folder = Path.cwd() / folder
        if folder.is_dir() and run_dir.resolve() not in (folder.resolve(), *folder.resolve().parents) \
                and folder not in folders:
            folders.append(folder)
    return folders


def leftover_files(run_dir: Path, min_age: float = 60.0) -> list[tuple[Path, str]]:
    """Temporary files of interrupted atomic writes under `run_dir`, and beside the export targets its recipes
    name, with why each one is stale."""
    found = []
    now = time.time()
    for path in sorted(run_dir.rglob(".*.tmp*")):
        if not path.is_file():
            continue
        temp = tempfiles.parse(path)
        if temp is not None:
            why = tempfiles.why_stale(temp, now=now)
            if why is not None:
                found.append((path, why))
        elif _PLAIN_TMP.match(path.name):
            age = now - path.stat().st_mtime
            if age >= min_age:
                found.append((path, f"{age:.0f} s old"))
    for folder in export_folders(run_dir):
        found.extend(tempfiles.stale_temps(folder))
    return found


def recorded_teardown(run_dir: Path) -> list[dict[str, Any]]:
    """The teardown each run under `run_dir` recorded in its report.json."""
    runs = []
    for report_path in sorted(run_dir.rglob("report.json")):
        try:
            report = json.loads(report_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            runs.append({"run_dir": str(report_path.parent), "error": f"unreadable report.json: {err}"})
            continue
        td = report.get("teardown")
        entry: dict[str, Any] = {"run_dir": str(report_path.parent), "status": report.get("status")}
        if td is None:
            stage = (report.get("stages") or {}).get("teardown") or {}
            entry["teardown"] = None
            entry["note"] = ("teardown failed: " + stage["error"]) if "error" in stage else \
                "no teardown recorded (the pipeline had none, or the process died first)"
        else:
            entry["teardown"] = {k: td.get(k) for k in ("bytes_freed", "retained_bytes", "patches_restored",
                                                        "unfreed", "proven", "unproven")}
        runs.append(entry)
    return runs


class NotARunFolder(ValueError):
    """A folder with no run under it: nothing of this package's to clean there."""


RUN_FILES = ("recipe.yaml", "report.json")  # what every run dir holds (recipe.yaml first, as the run starts)


def is_run_folder(path: Path) -> bool:
    """Whether `path` is a run dir or holds one (a sweep's root, runs/): a RUN_FILES file in it or below."""
    return any(next(path.rglob(name), None) is not None for name in RUN_FILES)


def purge_run_dir(run_dir: str | Path, *, dry_run: bool = False, min_age: float = 60.0) -> dict[str, Any]:
    """Remove stale temporary files under `run_dir`; report them and the teardown each run recorded.
    FileNotFoundError when it does not exist; NotARunFolder when no run is under it (nothing is touched)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not is_run_folder(run_dir):
        raise NotARunFolder(f"{run_dir}: not a run folder (no {' or '.join(RUN_FILES)} in it or below; a run dir is "
                            "runs/<date>/<time>/, or a sweep's folder): nothing removed")
    removed, nbytes = [], 0
    for path, why in leftover_files(run_dir, min_age):
        size = path.stat().st_size
        if not dry_run:
            path.unlink()
        removed.append({"path": str(path), "bytes": size, "why": why})
        nbytes += size
    return {"run_dir": str(run_dir), "dry_run": dry_run, "removed": removed, "bytes_removed": nbytes,
            "runs": recorded_teardown(run_dir),
            "live_objects": "not reachable from another process: only the run's own process can purge its models, "
                            "patches, graphs and device memory (lowbit_pipe.purge.purge / lowbit_pipe.teardown); "
                            "the OS reclaims them when it exits"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit_pipe.purge",
                                     description="Clean what crashed runs left on disk and show their recorded teardown. "
                                                 "Cannot reach another process's live objects.")
    parser.add_argument("run_dirs", nargs="+", help="run directories (sweep roots are searched recursively)")
    parser.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--min-age", type=float, default=60.0, help="age in s before a pid-less .tmp file is stale")
    args = parser.parse_args(argv)
    results, rc = [], 0
    for d in args.run_dirs:
        try:
            results.append(purge_run_dir(d, dry_run=args.dry_run, min_age=args.min_age))
        except (FileNotFoundError, NotARunFolder) as err:
            print(f"lowbit_pipe.purge: {err}", file=sys.stderr)
            rc = 1
    if args.json:
        print(json.dumps(results, indent=2))
        return rc
    for res in results:
        verb = "would remove" if res["dry_run"] else "removed"
        print(f"{res['run_dir']}: {verb} {len(res['removed'])} stale temp file(s), {res['bytes_removed']} bytes")
        for item in res["removed"]:
            print(f"  {item['path']}  ({item['bytes']} bytes; {item['why']})")
        for run in res["runs"]:
            td = run.get("teardown")
            if td is None:
                print(f"  run {run['run_dir']} [{run.get('status')}]: {run.get('note') or run.get('error')}")
            else:
                clean = td.get("proven") and not td.get("unfreed") and not td.get("retained_bytes")
                print(f"  run {run['run_dir']} [{run.get('status')}]: teardown {'proven clean' if clean else 'NOT clean'}, "
                      f"freed {td.get('bytes_freed')} B, retained {td.get('retained_bytes')} B"
                      + (f", unfreed {td['unfreed']}" if td.get("unfreed") else "")
                      + (f", unproven {td['unproven']}" if td.get("unproven") else ""))
        print(f"  live objects: {res['live_objects']}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
