"""Shared fixtures: tiny models built once per session, run dirs under tmp_path."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from lowbit_pipe.stages.load import build_tiny


def tiny_config(arch: str) -> dict:
    from importlib.resources import files

    data = OmegaConf.to_container(OmegaConf.load(files("lowbit_pipe.conf").joinpath(f"model/tiny_{arch}.yaml")))
    return data["tiny_config"]


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
    import sys
    from pathlib import Path

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run([sys.executable, "-m", "lowbit_pipe", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)
