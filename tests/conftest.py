"""Shared fixtures: tiny models built once per session, run dirs under tmp_path."""

from __future__ import annotations

import copy
import signal
import sys
from pathlib import Path

import pytest
import torch

from lowbit_pipe.arch.tiny import build_tiny
from lowbit_pipe.arch.tiny import tiny_model_config as tiny_config

# The checkout, for tests in any folder of tests/ (`from conftest import ROOT`).
ROOT = Path(__file__).resolve().parents[1]

# tests/ mirrors the package's folders (docs/layout.md, "Tests"). Test modules and helpers keep unique basenames and
# import one another by them (`from test_comfy_nodes import Patcher`, `from hostile_files import ...`), as pytest's
# default (prepend) import mode puts each test file's folder on sys.path only once it reaches that file: every
# folder goes on it here, before any test module is imported, so such an import works in any order and in a run of
# one file.
for _folder in sorted(p for p in Path(__file__).resolve().parent.iterdir() if p.is_dir() and p.name[0] not in "._"):
    if str(_folder) not in sys.path:
        sys.path.insert(1, str(_folder))

# A shell's background job (`pytest ... &`) starts with SIGINT ignored, and a process inherits an ignored signal
# through exec: the tests that stop runs with Ctrl-C (tests/running/test_signals.py, the sweeps') would send it to
# children that ignore it. Python's own handler is put back here (each xdist worker loads this file too), so the
# processes the tests start get the default at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# How a pytest-xdist run spreads the files over its workers, and torch's threads in each (tests/xdist_plan.py).
pytest_plugins = ["xdist_plan"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--comfy-soak-cycles", type=int, default=40,
                     help="cycles of the ComfyUI server soak (slow set; 40 in CI, about 1-2 s each on 2 cores)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `comfyui` need the real ComfyUI's source archive: without it they are skipped here, before
    their fixtures do any work, all with the same line (pytest -ra folds them into one) saying how to get it."""
    if item.get_closest_marker("comfyui") is not None:
        from comfyui_harness import require_archive

        require_archive()


@pytest.fixture(scope="session")
def comfyui_src():
    """The ComfyUI 0.29.0 folder every real-ComfyUI test of the session shares (comfyui_harness.shared_comfyui:
    unpacked once per archive, read-only; skipped without the archive). At the session's end it must still be as
    unpacked: a test that wrote into it fails here, naming the files."""
    from comfyui_harness import changes, shared_comfyui, tree_of

    src = shared_comfyui()
    yield src
    home = tree_of(src)
    wrote = changes(home)
    if wrote:
        pytest.fail(f"a test wrote into the shared ComfyUI tree {home} (tests must use it read-only; unpack(dest) "
                    f"gives a test its own copy): {wrote[:20]}", pytrace=False)


@pytest.fixture(scope="session")
def server_python(request, tmp_path_factory, comfyui_src):
    """The Python every ComfyUI server of the session runs in (comfyui_harness.shared_server_python), made once
    per session: under pytest-xdist in the folder above the workers' own temp folders, which they all share."""
    from comfyui_harness import shared_server_python

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base  # a worker's is <session>/popen-gwN
    return shared_server_python(comfyui_src, shared / "comfyui-server-python")


def has_module(name: str) -> bool:
    """Whether `name` can be imported; False (not an error) when a parent package is missing, e.g.
    `hydra_plugins.hydra_joblib_launcher` without any Hydra plugin installed."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="session")
def _tiny_models() -> dict:
    return {}


@pytest.fixture
def tiny_model(_tiny_models):
    """tiny_model("krea2") -> a fresh deep copy of the seeded tiny diffusers model."""

    def make(arch: str, dtype: torch.dtype = torch.float32):
        key = (arch, dtype)
        if key not in _tiny_models:
            _tiny_models[key] = build_tiny(arch, tiny_config(arch), 0, dtype)
        return copy.deepcopy(_tiny_models[key])

    return make


def cli(args: list[str], cwd, timeout: int = 600):
    """Run `python -m lowbit_pipe ARGS` from another directory, on this checkout's code."""
    import os
    import subprocess

    env = dict(os.environ)
    root = str(ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "lowbit_pipe", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def native_module(state: dict) -> torch.nn.Module:
    """A module tree named as a native (ComfyUI / BFL) state dict, as ComfyUI's diffusion models are:
    every 2-D `<name>.weight` is an nn.Linear (with its bias), other tensors plain parameters. No forward
    of its own: what ComfyUI's model classes give the pipeline is their module names and Linears."""
    root = torch.nn.Module()

    def owner(path: str) -> torch.nn.Module:
        mod = root
        for part in path.split(".") if path else []:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]
        return mod

    linears = {k[: -len(".weight")] for k, v in state.items() if k.endswith(".weight") and v.dim() == 2}
    for name in sorted(linears):
        w = state[f"{name}.weight"]
        parent, _, attr = name.rpartition(".")
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=f"{name}.bias" in state)
        with torch.no_grad():
            lin.weight.copy_(w)
            if lin.bias is not None:
                lin.bias.copy_(state[f"{name}.bias"])
        owner(parent).add_module(attr, lin)
    for key, value in state.items():
        if key.rsplit(".", 1)[0] in linears:
            continue
        parent, _, attr = key.rpartition(".")
        owner(parent).register_parameter(attr, torch.nn.Parameter(value.clone(), requires_grad=False))
    return root.eval()


def one_line_refusal(proc, *needles: str) -> str:
    """Assert a CLI run was refused before any work: exit 2, one stderr line holding every needle; returns it."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
