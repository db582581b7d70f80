"""Stages, found by name. A recipe's `pipeline:` lists these names; recipes never name Python callables."""

from __future__ import annotations

from lowbit_pipe.stages.base import Stage

STAGES: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    STAGES[cls.name] = cls
    return cls


from lowbit_pipe.stages import compile, detect, evaluate, export, load, lora, quantize, teardown  # noqa: E402,F401

__all__ = ["STAGES", "Stage", "register"]
