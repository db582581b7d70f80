"""The ledger: every side effect the pipeline causes, recorded when caused, with its undo.

Teardown unwinds it in reverse and then proves the result: every patched
attribute `is` its original again, and every object the pipeline created and
released is really gone (its weakref is dead). Nothing is found by search.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

_MISSING = object()


@dataclass
class Entry:
    """One recorded side effect."""

    kind: str  # "module_swap", "attr_patch", "hook", "cache", "object"
    name: str  # where, for the report
    undo: Callable[[], None]
    nbytes: int = 0  # bytes the entry holds (freed by its undo)
    check: Callable[[], bool] | None = None  # after undo: True when verifiably restored
    held: dict[str, Any] = field(default_factory=dict)  # what the undo needs (e.g. the original module)
    done: bool = False


@dataclass
class TeardownReport:
    bytes_freed: int = 0
    retained_bytes: int = 0
    patches_restored: int = 0
    unfreed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    proven: bool = True  # False when a check could not run (said in `errors`)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_freed": self.bytes_freed,
            "retained_bytes": self.retained_bytes,
            "patches_restored": self.patches_restored,
            "unfreed": list(self.unfreed),
            "errors": list(self.errors),
            "proven": self.proven,
        }


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a module, tensor or nested container (shared storages counted once)."""
    seen: set[int] = set()
    total = 0

    def visit(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                return
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, nn.Module):
            for t in list(x.parameters(recurse=True)) + list(x.buffers(recurse=True)):
                visit(t)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                visit(v)

    visit(obj)
    return total


class Ledger:
    """Records side effects in order; `unwind()` undoes them in reverse, once."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._watch: list[tuple[str, weakref.ref, int]] = []  # objects that must die after teardown

    # -- recording -------------------------------------------------------
    def swap_module(self, root: nn.Module, name: str, new: nn.Module, *, keep_original: str = "keep") -> nn.Module:
        """Replace submodule `name` of `root` by `new`; undo puts the original back.

        keep_original: "keep" holds the original as is; "cpu" moves its tensors to
        the CPU (undo moves them back); "drop" releases it (undo is then impossible,
        and teardown reports the layer as not restored).
        """
        parent, attr = _parent(root, name)
        original = getattr(parent, attr)
        device = next((t.device for t in original.parameters()), None)
        setattr(parent, attr, new)
        held: dict[str, Any] = {"module": original}
        if keep_original == "cpu":
            original.to("cpu")
        elif keep_original == "drop":
            held["module"] = None

        def undo() -> None:
            module = held.pop("module")
            if module is None:
                raise RuntimeError(f"original of '{name}' was dropped (quantize.originals=drop); cannot restore it")
            if keep_original == "cpu" and device is not None:
                module.to(device)
            setattr(parent, attr, module)

        def check() -> bool:
            return getattr(parent, attr) is original_ref() if original_ref() is not None else False

        original_ref = weakref.ref(original) if keep_original != "drop" else (lambda: None)
        self.entries.append(Entry("module_swap", name, undo, tensor_bytes(new), check, held))
        self.watch(f"{name} (quantized)", new)
        return original

    def original(self, name: str) -> nn.Module | None:
        """The float module a swap replaced (None if dropped or never swapped)."""
        for entry in reversed(self.entries):
            if entry.kind == "module_swap" and entry.name == name and not entry.done:
                return entry.held.get("module")
        return None

    def swapped(self) -> list[str]:
        """Names of the modules currently swapped, in swap order."""
        return [e.name for e in self.entries if e.kind == "module_swap" and not e.done]

    def patch_attr(self, obj: Any, attr: str, value: Any, name: str | None = None) -> None:
        """setattr with a recorded undo (restores the exact original object, or deletes the attr)."""
        original = obj.__dict__.get(attr, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, attr, _MISSING)
        setattr(obj, attr, value)

        def undo() -> None:
            if original is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, original)

        def check() -> bool:
            if original is _MISSING:
                return attr not in getattr(obj, "__dict__", {})
            return getattr(obj, attr) is original

        self.entries.append(Entry("attr_patch", name or f"{type(obj).__name__}.{attr}", undo, 0, check))

    def hook(self, handle: Any, name: str) -> None:
        """A torch RemovableHandle (forward hook etc.)."""
        self.entries.append(Entry("hook", name, handle.remove))

    def cache(self, name: str, clear: Callable[[], None], nbytes: int = 0) -> None:
        """A cache the pipeline filled (Hadamard matrices, compile caches, pools)."""
        self.entries.append(Entry("cache", name, clear, nbytes))

    def hold(self, name: str, holder: dict, key: str) -> None:
        """A tensor or container the pipeline allocated and parked in `holder[key]`."""
        obj = holder[key]
        nbytes = tensor_bytes(obj)

        def undo() -> None:
            holder.pop(key, None)

        self.entries.append(Entry("object", name, undo, nbytes))
        self.watch(name, obj)

    def watch(self, name: str, obj: Any) -> None:
        """Expect `obj` to be garbage after teardown (proved by weakref)."""
        try:
            ref = weakref.ref(obj)
        except TypeError:
            # Containers (dict, list) take no weakref: watch their tensors instead.
            items = obj.values() if isinstance(obj, dict) else obj
            for i, item in enumerate(items):
                self.watch(f"{name}[{i}]", item)
            return
        self._watch.append((name, ref, tensor_bytes(obj)))

    # -- teardown --------------------------------------------------------
    def unwind(self) -> TeardownReport:
        """Undo everything in reverse order, then prove it. Idempotent."""
        report = TeardownReport()
        for entry in reversed(self.entries):
            if entry.done:
                continue
            try:
                entry.undo()
            except Exception as err:  # keep unwinding; the failure is named in the report
                report.errors.append(f"{entry.kind} {entry.name}: {type(err).__name__}: {err}")
                report.unfreed.append(entry.name)
                entry.done = True
                continue
            entry.done = True
            report.bytes_freed += entry.nbytes
            if entry.check is not None:
                if entry.check():
                    report.patches_restored += 1
                else:
                    report.unfreed.append(f"{entry.name} (not restored)")
        self.entries.clear()
        gc.collect()
        alive = [(name, ref, nbytes) for name, ref, nbytes in self._watch if ref() is not None]
        for name, _ref, nbytes in alive:
            report.unfreed.append(f"{name} (still referenced)")
            report.retained_bytes += nbytes
        self._watch = [(n, r, b) for n, r, b in alive]
        return report


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    if "." not in name:
        return root, name
    path, attr = name.rsplit(".", 1)
    return root.get_submodule(path), attr
