"""The stage registry: name -> Stage class. Stage modules register themselves on import
(lowbit_pipe.stages imports them all); a recipe's `pipeline:` names these, never a Python callable."""

from __future__ import annotations

from lowbit_pipe.stages.base import Stage

STAGES: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    STAGES[cls.name] = cls
    return cls
