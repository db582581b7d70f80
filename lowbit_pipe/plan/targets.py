"""quantize.target: which one of speedup / bytes / ratio / error a recipe asks for, checked and typed."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.recipe import QuantizeConfig

KINDS = ("speedup", "bytes", "ratio", "error")


@dataclass(frozen=True)
class Target:
    kind: str  # one of KINDS
    value: float
    key: str  # the recipe path it came from (quantize.target.speedup ...)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "key": self.key}


def resolve_target(cfg: QuantizeConfig) -> Target | None:
    """The one target quantize.target sets, or None. Refuses two, or a value out of range, naming the key.
    (quantize.budget_bytes / budget_ratio are the older greedy byte planner: validate refuses them beside a target.)"""
    t = cfg.target
    set_keys = [k for k in KINDS if getattr(t, k) is not None]
    if not set_keys:
        return None
    if len(set_keys) > 1:
        raise RecipeError(f"quantize.target.{set_keys[1]}", f"set one target, got {', '.join(set_keys)}: the solver "
                                                            "meets one and reports the others")
    kind = set_keys[0]
    value = float(getattr(t, kind))
    key = f"quantize.target.{kind}"
    if kind == "speedup" and value <= 0:
        raise RecipeError(key, f"must be > 0 (forward time of the float model over the quantized one's), got {value}")
    if kind == "bytes" and value <= 0:
        raise RecipeError(key, "must be > 0")
    if kind == "ratio" and not 0 < value <= 1:
        raise RecipeError(key, f"must be in (0, 1], got {value}")
    if kind == "error" and value < 0:
        raise RecipeError(key, f"must be >= 0 (relative output error), got {value}")
    return Target(kind, value, key)
