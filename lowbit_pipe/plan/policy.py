"""Per-layer plan: which Linear gets which format, and why. First matching rule wins."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable

from torch import nn

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
    unfit: str | None = None  # why the format first chosen could not store this layer (then float or fallback)
    unrotated: bool = False  # the spec's rotation does not fit in_features: quantized unrotated

    @property
    def quantized(self) -> bool:
        return self.spec is not None


def spec_of(choice: FormatChoice, rule: LayerRule | None = None) -> FormatSpec:
    """The FormatSpec a recipe's choice asks for; a rule's keys override the choice's where the rule sets them."""

    def pick(key: str):
        value = getattr(rule, key) if rule is not None else None
        return value if value is not None else getattr(choice, key)

    return FormatSpec(pick("format"), pick("rotation"), pick("rotation_group"), pick("granularity"), pick("activations"),
                      pick("rank"), pick("act_granularity"))


def rotation_note(spec: FormatSpec, in_features: int) -> str:
    """Why a layer's rotation is not applied ("" when it is, or none was asked for)."""
    if spec.rotation == "none" or spec.format in ("convrot_w4a4", "w4a8", "w6a8"):
        return ""
    from lowbit_pipe.kernels.rotation import resolve_group

    group = resolve_group(spec.rotation, spec.rotation_group)
    if in_features % group:
        return f"; {spec.rotation} skipped: in_features {in_features} is not a multiple of its group {group}"
    return ""


def linear_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of `module`: name -> (out_features, in_features), what plan_layers plans."""
    return {n: (m.out_features, m.in_features) for n, m in module.named_modules() if isinstance(m, nn.Linear)}


def plan_layers(linears: dict[str, tuple[int, int]], cfg: QuantizeConfig, policy: LayerPolicy,
                policy_name: Callable[[str], str] | None = None) -> list[LayerPlan]:
    """Decide every Linear's fate: recipe rules, then recipe keep list, then arch keep-float, then sensitive,
    then default. A format that cannot store a layer's shape hands it to `quantize.fallback` (or it stays
    float); either way the reason names the problem.

    `policy_name`: the diffusers name of a module of a natively named tree (a ComfyUI model), which the
    arch's lists use; the recipe's rules and keep patterns match either name."""
    plans = []
    for name, shape in linears.items():
        known = policy_name(name) if policy_name is not None else name
        names = (name,) if known == name else (name, known)
        spec, reason = None, ""
        for i, rule in enumerate(cfg.rules):
            if any(matches(rule.match, n) for n in names):
                spec, reason = (None, f"rule {i} keep") if rule.keep else (spec_of(cfg.default, rule), f"rule {i}")
                break
        else:
            if any(matches(p, n) for p in cfg.keep for n in names):
                reason = "quantize.keep"
            elif cfg.arch_keep_float and any(matches(p, known) for p in policy.keep_float):
                reason = "arch keep-float"
            elif cfg.sensitive is not None and any(matches(p, known) for p in policy.sensitive):
                spec, reason = spec_of(cfg.sensitive), "arch sensitive"
            else:
                spec, reason = spec_of(cfg.default), "default"
        problem = get_format(spec.format).shape_problem(*shape) if spec is not None else None
        if problem is not None:
            fallback = spec_of(cfg.fallback) if cfg.fallback is not None else None
            if fallback is not None and get_format(fallback.format).supports_shape(*shape):
                spec, reason = fallback, f"quantize.fallback: {spec.format} cannot store it ({problem})"
            else:
                spec, reason = None, f"{spec.format} cannot store it ({problem})"
        note = rotation_note(spec, shape[1]) if spec is not None else ""
        plans.append(LayerPlan(name, shape, spec, reason + note, unfit=problem, unrotated=bool(note)))
    return plans


def unfit(plans: list[LayerPlan]) -> dict[str, list[str]]:
    """Layers the asked format could not take, by outcome: "float" (stayed float), "fallback" (another
    format), "unrotated" (quantized without its rotation)."""
    out: dict[str, list[str]] = {"float": [], "fallback": [], "unrotated": []}
    for p in plans:
        if p.unfit is not None:
            out["float" if p.spec is None else "fallback"].append(p.name)
        if p.unrotated:
            out["unrotated"].append(p.name)
    return out
