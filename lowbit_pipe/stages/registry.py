"""The stage registry: name -> Stage class. Stage modules register themselves on import
(lowbit_pipe.stages imports them all); a recipe's `pipeline:` names these, never a Python callable."""

from __future__ import annotations

from lowbit_pipe.recipe import PIPELINE_STAGES
from lowbit_pipe.stages.base import Stage

STAGES: dict[str, type[Stage]] = {}


def register(cls: type[Stage]) -> type[Stage]:
    """Register a stage under its name, one of recipe.PIPELINE_STAGES (the names validate lets a pipeline list)."""
    if cls.name not in PIPELINE_STAGES:
        raise ValueError(f"stage class {cls.__name__} is named '{cls.name}', not one of recipe.PIPELINE_STAGES "
                         f"{list(PIPELINE_STAGES)}: add it there so recipes may name it")
    STAGES[cls.name] = cls
    return cls
