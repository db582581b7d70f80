"""Stages, found by name. A recipe's `pipeline:` lists these names; recipes never name Python callables."""

from __future__ import annotations

from lowbit_pipe.stages import compile, detect, evaluate, export, load, lora, quantize, teardown  # noqa: F401, A004
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.registry import STAGES, register

__all__ = ["STAGES", "Stage", "register"]
