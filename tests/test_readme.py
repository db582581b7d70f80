"""Every command in README.md runs here (slow: about two minutes).

The README's code blocks are parsed, each command line is classified, and an unknown kind of line fails
the test, so a command added to the README needs a test here. Commands that need a GPU or a model file
this machine does not have run too: they must be refused before any work (exit 2, naming the key).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _blocks() -> tuple[list[str], list[str]]:
    """(shell command lines from indented blocks, python fenced blocks) of the README."""
    lines = README.read_text().split("\n")
    commands, python, fence, body = [], [], None, []
    for line in lines:
        if fence is not None:
            if line.startswith("```"):
                if fence == "python":
                    python.append("\n".join(body))
                fence, body = None, []
            else:
                body.append(line)
        elif line.startswith("```"):
            fence = line[3:].strip()
        elif line.startswith("    ") and line.strip():
            commands.append(re.sub(r"\s+#\s.*$", "", line.strip()))  # drop the trailing comment
    return commands, python


COMMANDS, PYTHON_BLOCKS = _blocks()
CI = (ROOT / ".ci" / "run").read_text().split("\n")


def _kind(command: str) -> str:
    if command.startswith("python -m lowbit_pipe.comfy") or command.startswith("/path/to/ComfyUI/"):
        return "comfyui"
    if command.startswith("python -m lowbit_pipe"):
        return "cli"
    if command.startswith("python -m pytest") or command.startswith("ruff check"):
        return "pytest"  # the test commands: CI runs each
    if command.startswith("pip install"):
        return "pip"
    raise AssertionError(f"README command of no known kind (add a test for it in {__file__}): {command}")


def _of_kind(kind: str) -> list[str]:
    return [c for c in COMMANDS if _kind(c) == kind]


def test_every_readme_command_is_of_a_kind_tested_here():
    assert COMMANDS and PYTHON_BLOCKS
    kinds = {_kind(c) for c in COMMANDS}
    assert kinds == {"comfyui", "cli", "pytest", "pip"}


def test_the_test_commands_are_what_ci_runs():
    for command in _of_kind("pytest"):
        assert command in CI, command


def _cli_id(command: str) -> str:
    return command.removeprefix("python -m lowbit_pipe").strip() or "(default)"


@pytest.mark.parametrize("command", _of_kind("cli"), ids=_cli_id)
def test_cli_command_runs(command, tmp_path):
    argv = shlex.split(command)
    # A target's speed table goes to ~/.cache/lowbit_pipe: here a HOME of the test's own, never the user's.
    env = {**os.environ, "HOME": str(tmp_path)} if "quantize.target" in command else None
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env=env)
    wants_gpu = "model.device=cuda" in command
    if wants_gpu and not torch.cuda.is_available():
        # Needs a GPU and a real checkpoint: refused before any work, naming what is missing.
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "model.path" in proc.stderr or "model.device" in proc.stderr, proc.stderr
        assert not (tmp_path / "runs").exists()
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "--help" in argv or "--cfg" in argv:
        assert not (tmp_path / "runs").exists()
    else:
        reports = list((tmp_path / "runs").rglob("report.json"))
        assert reports, proc.stdout
        expected = 3 if "-m" in argv[3:] else 1  # the sweep: int8, fp8, nvfp4
        assert len(reports) == expected, reports


def test_python_block_runs_and_prints_what_it_says(tmp_path):
    code = PYTHON_BLOCKS[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # the block's comment states the first print's output
    claimed = re.search(r"print\(stats.*?#\s*(\{.*?\}\s*\{.*?\})", code).group(1)
    assert claimed in proc.stdout, proc.stdout
    cosine, export = proc.stdout.strip().split("\n")[-1].split()
    assert 0.999 < float(cosine) <= 1.0
    assert (tmp_path / export).is_file()


def _pip_dry_run(*requirements: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", *requirements],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_setup_commands_resolve_and_ci_runs_the_development_one():
    pips = _of_kind("pip")
    assert len(pips) == 2, pips
    lean, dev = pips
    assert dev in CI, f"CI must run the README's development set-up: {dev}"
    for command in (lean, dev):
        for part in command.split("&&"):
            args = shlex.split(part)
            assert args[:2] == ["pip", "install"], part
            _pip_dry_run(*args[2:])  # every requirement resolves from what is installed, nothing downloaded
    _pip_dry_run(".[comfy]")  # the lean line's comment


def test_comfyui_commands_install_the_pack(tmp_path):
    pip_line, install_line = _of_kind("comfyui")
    # `<ComfyUI's python> -m pip install "<checkout>[comfy]"`: resolved here; tests/comfy/test_comfyui_server.py
    # runs it for real in a venv with ComfyUI 0.29.0's own requirements
    assert shlex.split(pip_line)[1:] == ["install", "/path/to/lowbit_pipe[comfy]"]
    _pip_dry_run(f"{ROOT}[comfy]")
    args = shlex.split(install_line)
    assert args[1:4] == ["-m", "lowbit_pipe.comfy", "install"] and args[4] == "/path/to/ComfyUI"
    comfyui = tmp_path / "ComfyUI"
    (comfyui / "comfy").mkdir(parents=True)
    (comfyui / "custom_nodes").mkdir()
    proc = subprocess.run([sys.executable, *args[1:4], str(comfyui)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pack = comfyui / "custom_nodes" / "lowbit_pipe_nodes"
    assert (pack / "__init__.py").is_file()
    assert list((pack / "example_workflows").glob("*.json"))
