"""Per-layer plan: which Linear gets which format, and why. First matching rule wins."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from lowbit_pipe.arch.base import LayerPolicy
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.recipe import FormatChoice, LayerRule, QuantizeConfig


def matches(pattern: str, name: str) -> bool:
    """`re:<regex>` (full match) or a shell glob on a module name."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


@dataclass(frozen=True)
class LayerPlan:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    spec: FormatSpec | None  # None: stays float
    reason: str

    @property
    def quantized(self) -> bool:
        return self.spec is not None


def _spec(choice: FormatChoice, rule: LayerRule | None = None) -> FormatSpec:
    def pick(key: str):
        value = getattr(rule, key) if rule is not None else None
        return value if value is not None else getattr(choice, key)

    return FormatSpec(pick("format"), pick("rotation"), pick("rotation_group"), pick("granularity"), pick("activations"))


def plan_layers(linears: dict[str, tuple[int, int]], cfg: QuantizeConfig, policy: LayerPolicy) -> list[LayerPlan]:
    """Decide every Linear's fate: recipe rules, then recipe keep list, then arch keep-float, then sensitive, then default."""
    plans = []
    for name, shape in linears.items():
        spec, reason = None, ""
        for i, rule in enumerate(cfg.rules):
            if matches(rule.match, name):
                spec, reason = (None, f"rule {i} keep") if rule.keep else (_spec(cfg.default, rule), f"rule {i}")
                break
        else:
            if any(matches(p, name) for p in cfg.keep):
                reason = "quantize.keep"
            elif cfg.arch_keep_float and any(matches(p, name) for p in policy.keep_float):
                reason = "arch keep-float"
            elif cfg.sensitive is not None and any(matches(p, name) for p in policy.sensitive):
                spec, reason = _spec(cfg.sensitive), "arch sensitive"
            else:
                spec, reason = _spec(cfg.default), "default"
        if spec is not None and not get_format(spec.format).supports_shape(*shape):
            spec, reason = None, f"{spec.format} cannot store shape {shape[0]}x{shape[1]}"
        plans.append(LayerPlan(name, shape, spec, reason))
    return plans
