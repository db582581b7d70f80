"""A real ComfyUI for slow tests: the source archive unpacked once per session, imported in a child process.

CI keeps ComfyUI 0.29.0's source as `../shared/comfyui-0.29.0.tar.xz` beside the checkout (GPL-3: a test
fixture, unpacked into a scratch folder, nothing of it copied into the project); `LOWBIT_COMFYUI_ARCHIVE`
names another copy. Without one, every test that needs it is skipped with one line saying how to get it
(`require_archive`); CI sets LOWBIT_COMFYUI_REQUIRED=1, which fails them instead, so a lost archive cannot turn
CI's real-ComfyUI tests into silent skips. ComfyUI keeps global state (its ops, QUANT_ALGOS, model management), so each check
runs in its own Python process: `run_child(script, job)` writes the job as JSON, runs the script with this
checkout first on PYTHONPATH and returns the JSON the script wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from comfyui_server import find_archive  # noqa: E402 - the one lookup of the archive, shared with the benches

REQUIRED_ENV = "LOWBIT_COMFYUI_REQUIRED"


def require_archive() -> Path:
    """The ComfyUI source archive; else the calling test (or fixture) is skipped with one line saying where it was
    looked for and how to provide it (the same line for every such test: pytest -ra folds them into one), or
    failed where LOWBIT_COMFYUI_REQUIRED=1."""
    try:
        return find_archive()
    except FileNotFoundError as err:
        if os.environ.get(REQUIRED_ENV) == "1":
            pytest.fail(f"{err} ({REQUIRED_ENV}=1: the real-ComfyUI tests must run here)", pytrace=False)
        pytest.skip(str(err))


def unpack(dest: Path) -> Path:
    """Unpack the archive into `dest` (skipping the test without one: `require_archive`); the ComfyUI folder (the
    one holding `comfy/`)."""
    archive = require_archive()
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    found = [p.parent for p in dest.glob("*/comfy") if p.is_dir()] + ([dest] if (dest / "comfy").is_dir() else [])
    if not found:
        raise FileNotFoundError(f"{archive} holds no ComfyUI folder (no comfy/ under {dest})")
    return found[0]


def run_child(script: Path, job: dict[str, Any], work: Path, timeout: int = 900) -> dict[str, Any]:
    """Run `python script job.json result.json` with this checkout first on the path; the result."""
    work.mkdir(parents=True, exist_ok=True)
    job_file, out_file = work / "job.json", work / "result.json"
    job_file.write_text(json.dumps(job, default=str))
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "bench")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.run([sys.executable, str(script), str(job_file), str(out_file)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=work)
    if proc.returncode != 0 or not out_file.is_file():
        raise RuntimeError(f"{script.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())
