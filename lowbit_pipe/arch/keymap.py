"""Diffusers <-> native (ComfyUI / BFL) key mapping from declarative rules.

A `KeyMap` converts key->shape maps and state dicts (tensors) both ways, and
single module names (for LoRA and export). Rules are templates where `{i}` is
a block index. Keys no rule matches pass through unchanged (identity).

Values may be tensors, lazy tensors (lowbit_pipe.files.lazy: streaming reads) or shape tuples:
the same code converts all three, so shape maps (detection), real weights (load / export)
and a checkpoint streamed tensor by tensor share one mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from lowbit_pipe.errors import FormatError


@dataclass(frozen=True)
class Rename:
    """One module (or, with param=True, one parameter) renamed between layouts."""

    diff: str
    native: str
    norm: bool = False  # native parameter is `.scale` where diffusers has `.weight`
    param: bool = False  # templates are full parameter names (no suffix appended)
    flat: bool = False  # native stores the tensor flattened (diffusers: [n, hidden])
    swap: bool = False  # native rows are (shift, scale), diffusers (scale, shift)


@dataclass(frozen=True)
class Fused:
    """One native module = diffusers modules stacked along output rows.

    sizes: "h" = hidden (the fused weight's in_features), "*" = the remainder.
    """

    native: str
    parts: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class SwapHalves:
    """The "rows" a LoRA factor takes for a native module whose output rows are its diffusers module's
    with the two halves swapped ((shift, scale) against (scale, shift), `Rename(swap=True)`): the same rows,
    halves exchanged. As the key map's own swap, only a tensor of 2 x in_features rows is swapped (SD3 runs
    one rule over 6h- and 2h-row modulations); `take` is its own inverse."""

    def take(self, t: torch.Tensor, in_features: int) -> torch.Tensor:
        if t.shape[0] != 2 * in_features:
            return t
        a, b = t.chunk(2, dim=0)
        return torch.cat([b, a], dim=0)


SWAP_HALVES = SwapHalves()


def take_rows(t: torch.Tensor, rows: slice | SwapHalves | None, in_features: int) -> torch.Tensor:
    """A LoRA factor's rows for one target: all (None), a slice of a fused module, or swapped halves."""
    if rows is None:
        return t
    if isinstance(rows, SwapHalves):
        return rows.take(t, in_features)
    return t[rows]


def _rx(template: str) -> str:
    return re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)")


def _fill(template: str, i: str | None) -> str:
    return template.replace("{i}", i) if i is not None else template


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if hasattr(v, "shape") else tuple(v)


def _rows(v: Any) -> int:
    return int(_shape(v)[0])


def _in_features(v: Any) -> int | None:
    shape = _shape(v)
    return int(shape[1]) if len(shape) >= 2 else None


def split_sizes(sizes: tuple[str, ...], total: int, hidden: int) -> list[int]:
    """Row counts of the parts of a fused tensor with `total` rows."""
    fixed = sum(hidden for s in sizes if s == "h")
    rest = total - fixed
    if rest < 0 or ("*" not in sizes and rest != 0):
        raise ValueError(f"fused rows {total} do not split as {sizes} with hidden {hidden}")
    return [hidden if s == "h" else rest for s in sizes]


def _split(v: Any, rows: list[int]) -> list[Any]:
    if isinstance(v, torch.Tensor):
        return list(torch.split(v, rows, dim=0))
    if hasattr(v, "split_rows"):
        return v.split_rows(rows)
    return [(r, *tuple(v)[1:]) for r in rows]


def _cat(vs: list[Any]) -> Any:
    if isinstance(vs[0], torch.Tensor):
        return torch.cat(vs, dim=0)
    if hasattr(vs[0], "cat_rows"):
        return type(vs[0]).cat_rows(vs)
    return (sum(v[0] for v in vs), *tuple(vs[0])[1:])


def _swap(v: Any, in_features: int | None) -> Any:
    """(shift, scale) <-> (scale, shift) halves; only for a [2 * in_features, ...] modulation (SD3 runs one
    rule over 6h-row and 2h-row tensors)."""
    if in_features is None or not hasattr(v, "shape") or v.shape[0] != 2 * in_features:
        return v
    if isinstance(v, torch.Tensor):
        a, b = v.chunk(2, dim=0)
        return torch.cat([b, a], dim=0)
    return v.halves_swapped()


def _reshape(v: Any, shape: tuple[int, ...]) -> Any:
    if isinstance(v, torch.Tensor):
        return v.reshape(shape)
    return v.reshaped(tuple(shape)) if hasattr(v, "reshaped") else tuple(shape)


def _numel(v: Any) -> int:
    n = 1
    for d in _shape(v):
        n *= int(d)
    return n


class KeyMap:
    """Rule set for one architecture. `flat_rows`: rows of a flattened native param (e.g. 6 for 6 x hidden)."""

    def __init__(self, rules: list[Rename | Fused], flat_rows: dict[str, int] | None = None):
        self.rules = rules
        self.flat_rows = flat_rows or {}
        self._diff: list = []  # (module regex, param regex, rule, part index)
        self._native: list = []
        for rule in rules:
            if isinstance(rule, Fused):
                self._native.append(self._entry(rule.native, rule, None))
                for k, (name, _) in enumerate(rule.parts):
                    self._diff.append(self._entry(name, rule, k))
            else:
                self._diff.append(self._entry(rule.diff, rule, None))
                self._native.append(self._entry(rule.native, rule, None))

    @staticmethod
    def _entry(template: str, rule, k):
        mod = re.compile(_rx(template))
        par = mod if getattr(rule, "param", False) else re.compile(_rx(template) + r"\.(?P<p>[A-Za-z0-9_]+)")
        return mod, par, rule, k

    # ---- module names ---------------------------------------------------------------------------
    @staticmethod
    def _match(table, name: str, param: bool):
        """First rule matching a parameter name (param=True) or a module name."""
        for mod, par, rule, k in table:
            if not param and getattr(rule, "param", False):
                continue
            m = (par if param else mod).fullmatch(name)
            if m:
                return m, rule, k
        return None, None, None

    def module_to_native(self, name: str, hidden: int | None = None) -> tuple[str, slice | None]:
        """Native module of a diffusers module, with its rows in a fused native module (needs hidden)."""
        m, rule, k = self._match(self._diff, name, param=False)
        if rule is None:
            return name, None
        i = m.groupdict().get("i")
        if isinstance(rule, Rename):
            return _fill(rule.native, i), None
        if hidden is None:
            raise ValueError(f"{name}: rows inside fused '{rule.native}' need the hidden size")
        sizes = tuple(s for _, s in rule.parts)
        if "*" in sizes[:k + 1] and sizes[k] != "*":
            raise ValueError(f"{name}: part after a remainder part is not addressable")
        start = hidden * k if "*" not in sizes[:k] else None
        stop = start + hidden if sizes[k] == "h" else None
        return _fill(rule.native, i), slice(start, stop)

    def module_from_native(self, name: str, hidden: int | None = None) -> list[tuple[str, slice | None]]:
        """Diffusers modules of a native module; for a fused one each with its rows (needs hidden)."""
        m, rule, _ = self._match(self._native, name, param=False)
        if rule is None:
            return [(name, None)]
        i = m.groupdict().get("i")
        if isinstance(rule, Rename):
            return [(_fill(rule.diff, i), None)]
        if hidden is None:
            raise ValueError(f"{name}: splitting fused '{rule.native}' needs the hidden size")
        out, start = [], 0
        for part, size in rule.parts:
            stop = start + hidden if size == "h" else None
            out.append((_fill(part, i), slice(start, stop)))
            start = stop if stop is not None else start
        return out

    def is_swapped(self, native_module: str) -> bool:
        """Whether a native module's output rows are (shift, scale) halves swapped against diffusers."""
        _, rule, _ = self._match(self._native, native_module, param=False)
        return isinstance(rule, Rename) and rule.swap

    # ---- whole state dicts / shape maps ---------------------------------------------------------
    def from_native(self, native: dict[str, Any]) -> dict[str, Any]:
        """Native layout -> diffusers layout (prefix already stripped). Values: tensors or shapes."""
        out: dict[str, Any] = {}
        for key, v in native.items():
            m, rule, _ = self._match(self._native, key, param=True)
            if rule is None:
                out[key] = v
                continue
            try:
                self._one_from_native(native, out, key, v, m, rule)
            except (ValueError, IndexError, TypeError, RuntimeError, ZeroDivisionError) as err:  # a damaged file's shapes
                raise FormatError(f"native key '{key}' of shape {list(_shape(v))} does not convert to the diffusers "
                                  f"layout ({err})") from None
        return out

    def _one_from_native(self, native: dict[str, Any], out: dict[str, Any], key: str, v: Any, m: Any, rule: Any) -> None:
        """One native key's diffusers entries into `out`; raises on shapes the rule cannot convert."""
        i, p = m.groupdict().get("i"), m.groupdict().get("p")
        if isinstance(rule, Fused):
            w = native.get(_fill(rule.native, i) + ".weight", v)
            hidden = _in_features(w)
            rows = split_sizes(tuple(s for _, s in rule.parts), _rows(v), hidden)
            for (part, _), piece in zip(rule.parts, _split(v, rows)):
                out[f"{_fill(part, i)}.{p}"] = piece
            return
        name = _fill(rule.diff, i) if rule.param else f"{_fill(rule.diff, i)}.{'weight' if rule.norm and p == 'scale' else p}"
        if rule.flat and len(_shape(v)) == 1:
            n = self.flat_rows.get(rule.diff, 1)
            if _numel(v) % n:  # checked now: a lazy tensor's reshape runs only when it is read
                raise ValueError(f"{_numel(v)} values are not {n} rows")
            v = _reshape(v, (n, _numel(v) // n))
        out[name] = _swap(v, _in_features(native.get(key[: -len(p)] + "weight", v))) if rule.swap and p else v

    def to_native(self, diff: dict[str, Any]) -> dict[str, Any]:
        """Diffusers layout -> native layout (no prefix). Fused parts are concatenated in order."""
        out: dict[str, Any] = {}
        pending: dict[str, dict[int, Any]] = {}
        for key, v in diff.items():
            m, rule, k = self._match(self._diff, key, param=True)
            if rule is None:
                out[key] = v
                continue
            i, p = m.groupdict().get("i"), m.groupdict().get("p")
            if isinstance(rule, Fused):
                pending.setdefault(f"{_fill(rule.native, i)}.{p}", {})[k] = (v, len(rule.parts))
                continue
            name = _fill(rule.native, i) if rule.param else f"{_fill(rule.native, i)}.{'scale' if rule.norm and p == 'weight' else p}"
            if rule.flat:
                v = _reshape(v, (_numel(v),))
            out[name] = _swap(v, _in_features(diff.get(key[: -len(p)] + "weight", v))) if rule.swap and p else v
        for name, parts in pending.items():
            n = next(iter(parts.values()))[1]
            if len(parts) != n:
                raise ValueError(f"fused native '{name}' is missing parts ({sorted(parts)} of {n})")
            out[name] = _cat([parts[k][0] for k in range(n)])
        return out


def block_renames(prefixes: tuple[str, ...], pairs: list[tuple[str, str, bool]], native_prefixes: tuple[str, ...]) -> list[Rename]:
    """Rename rules for (diffusers suffix, native suffix, is_norm) under each block prefix pair."""
    return [Rename(f"{dp}.{d}", f"{np_}.{n}", norm=norm) for dp, np_ in zip(prefixes, native_prefixes) for d, n, norm in pairs]
