"""The ledger: every side effect the pipeline causes, recorded when caused, with its undo.

Nothing is found by search. A stage that swaps a module, patches an attribute
or a library function, adds a hook, fills a cache, captures a CUDA graph or
allocates a tensor tells the ledger at that moment; teardown unwinds the
entries in reverse order and then proves the result:

- every patched attribute / function / swapped module `is` its original again
  (or the report names it, with the reason);
- every object the pipeline created and let go is really gone: its weakref is
  dead after a garbage collection (a live one is named, with its bytes);
- on CUDA, allocated device memory is back to the baseline captured before
  `load` (`capture_baseline`), or the excess is reported.

Recording API (all return nothing useful unless said):

    swap_module(root, name, new, keep_original=)  -> original module
    record(kind, name, undo, check=, held=)          any other side effect (LoRA stacks, bakes)
    original(name) / swapped()                       what evaluate needs
    patch_attr(obj, attr, value, name=)              setattr with undo
    patch_function(owner, attr, new)                 a function on another library (module or class)
    set_item(mapping, key, value, name)              an entry in another library's table (registry dict)
    hook(handle, name)                               a torch RemovableHandle
    cache(name, clear, nbytes=, is_empty=)           a cache the pipeline filled
    cuda_graph(graph, name, tensors=)                a captured torch.cuda.CUDAGraph (+ its static tensors)
    tensor(name, t, own=False) / own(name, obj)      an allocation: watched; `own` also holds it until teardown
    hold(name, holder, key)                          a tensor/container parked in holder[key]
    watch(name, obj)                                 expect `obj` dead after teardown
    capture_baseline()                               device memory before load

Teardown: `unwind()` = `undo_all()` + `prove()`; the teardown stage drops the
model it owns between the two so the proof covers it.
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

    kind: str  # "module_swap", "attr_patch", "function_patch", "hook", "cache", "cuda_graph", "object", or a
    # kind given to `record` by another module (e.g. "lora_stack", "lora_bake")
    name: str  # where, for the report
    undo: Callable[[], None]
    nbytes: int = 0  # bytes the undo itself frees when no weakref can prove it (caches); else 0
    check: Callable[[], Any] | None = None  # after undo: True/None when verifiably restored, False or a reason str if not
    held: dict[str, Any] = field(default_factory=dict)  # what the undo needs (e.g. the original module)
    done: bool = False


@dataclass
class TeardownReport:
    bytes_freed: int = 0  # bytes proven freed: dead watched storages (deduplicated) + cleared caches
    retained_bytes: int = 0  # bytes still held by named objects, plus device bytes above baseline; 0 when clean
    patches_restored: int = 0  # swaps, patches, hooks and other checked entries whose check passed
    unfreed: list[str] = field(default_factory=list)  # names of what could not be freed or restored
    errors: list[str] = field(default_factory=list)  # undo failures, with the exception
    proven: bool = True  # False when some part of the proof could not be made (see `unproven`)
    unproven: list[str] = field(default_factory=list)  # why the proof is incomplete
    # Known limits outside what the ledger can free or prove (torch's host-only tracing state after a
    # compile): said, but they do not make a clean run read unproven.
    caveats: list[str] = field(default_factory=list)
    objects_freed: int = 0  # watched objects whose weakref is dead
    objects_watched: int = 0
    undone: dict[str, int] = field(default_factory=dict)  # entries undone, per kind
    caches: list[dict[str, Any]] = field(default_factory=list)  # caches cleared: name, bytes (None = unknown), verified
    device: dict[str, Any] | None = None  # CUDA: baseline / after / retained bytes (None on a CPU-only process)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_freed": self.bytes_freed,
            "retained_bytes": self.retained_bytes,
            "patches_restored": self.patches_restored,
            "unfreed": list(self.unfreed),
            "errors": list(self.errors),
            "proven": self.proven,
            "unproven": list(self.unproven),
            "caveats": list(self.caveats),
            "objects_freed": self.objects_freed,
            "objects_watched": self.objects_watched,
            "undone": dict(self.undone),
            "caches": [dict(c) for c in self.caches],
            "device": dict(self.device) if self.device is not None else None,
            "notes": list(self.notes),
        }


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr()) if storage.nbytes() else None


def tensor_storages(obj: Any) -> dict[tuple[str, int], int]:
    """Storage key -> bytes of the tensors in a module, tensor or nested container (each storage once)."""
    found: dict[tuple[str, int], int] = {}
    seen_ids: set[int] = set()

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            key = _storage_key(x)
            if key is not None:
                found[key] = x.untyped_storage().nbytes()
        elif isinstance(x, nn.Module):
            for t in list(x.parameters(recurse=True)) + list(x.buffers(recurse=True)):
                visit(t)
        elif isinstance(x, (dict, list, tuple, set, frozenset)):
            if id(x) in seen_ids:
                return
            seen_ids.add(id(x))
            for v in (x.values() if isinstance(x, dict) else x):
                visit(v)

    visit(obj)
    return found


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a module, tensor or nested container (shared storages counted once)."""
    return sum(tensor_storages(obj).values())


def release(obj: Any) -> None:
    """Empty a pipeline-owned container and the containers nested in it (so the tensors inside are
    freed even if someone still holds the outer container). Tensors and modules are left as is."""
    stack, seen = [obj], set()
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            stack.extend(x.values())
            x.clear()
        elif isinstance(x, (list, set)):
            stack.extend(x)
            x.clear()
        elif isinstance(x, tuple):
            stack.extend(x)


@dataclass
class _Watched:
    name: str
    ref: Callable[[], Any]
    storages: dict[tuple[str, int], int]

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def _restore_check(obj_ref: Callable[[], Any], attr: str, original: Any, in_dict: bool) -> Callable[[], Any]:
    def check() -> Any:
        obj = obj_ref()
        if obj is None:
            return True  # the patched object itself is gone: nothing left patched
        if original is _MISSING:
            return True if attr not in _own_dict(obj) else f"attribute '{attr}' still set (should be absent)"
        if in_dict and _own_dict(obj).get(attr, _MISSING) is not original:
            return "not the original object"
        return True if getattr(obj, attr, _MISSING) is original else "not the original object"

    return check


def _own_dict(obj: Any) -> Any:
    try:
        return vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return {}


def _ref(obj: Any) -> Callable[[], Any]:
    """A weakref when the object takes one, else a strong reference (returned by a lambda)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


class Ledger:
    """Records side effects in order; `unwind()` undoes them in reverse, once, and proves it."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._watch: list[_Watched] = []  # objects that must die after teardown
        self._unwatchable: list[str] = []  # recorded objects whose death cannot be proved (no weakref)
        self.baseline: dict[int, int] | None = None  # CUDA device index -> memory_allocated before load
        self.torn_down = 0  # how many times undo_all ran

    # -- baseline --------------------------------------------------------
    def capture_baseline(self) -> dict[int, int]:
        """Device memory allocated now, per CUDA device (before `load`). {} without CUDA."""
        self.baseline = device_allocated()
        return self.baseline

    # -- recording -------------------------------------------------------
    def swap_module(self, root: nn.Module, name: str, new: nn.Module, *, keep_original: str = "keep") -> nn.Module:
        """Replace submodule `name` of `root` by `new`; undo puts the original back.

        keep_original: "keep" holds the original as is; "cpu" moves its tensors to
        the CPU (undo moves them back); "drop" releases it (undo is then impossible,
        and teardown reports the layer as not restored). The parent is held by
        weakref: if the user dropped the model, the undo has nothing to restore and
        just releases the original.
        """
        parent, attr = parent_of(root, name)
        original = getattr(parent, attr)
        device = next((t.device for t in original.parameters()), None)
        setattr(parent, attr, new)
        held: dict[str, Any] = {"module": original}
        if keep_original == "cpu":
            original.to("cpu")
        elif keep_original == "drop":
            held["module"] = None
        parent_ref = weakref.ref(parent)
        original_ref = weakref.ref(original) if keep_original != "drop" else (lambda: None)
        del parent  # only the weakref from here on

        def undo() -> None:
            module = held.pop("module", None)
            owner = parent_ref()
            if owner is None:
                return  # the model is gone: nothing to restore; the original is released with `held`
            if module is None:
                raise RuntimeError(f"original of '{name}' was dropped (quantize.originals=drop); cannot restore it")
            if keep_original == "cpu" and device is not None:
                module.to(device)
            setattr(owner, attr, module)

        def check() -> Any:
            owner = parent_ref()
            if owner is None:
                return True
            orig = original_ref()
            if orig is None:
                return "original module is gone"
            return True if getattr(owner, attr) is orig else "another module is in its place"

        self.entries.append(Entry("module_swap", name, undo, 0, check, held))
        self.watch(f"{name} ({type(new).__name__})", new)
        return original

    def record(self, kind: str, name: str, undo: Callable[[], None], check: Callable[[], Any] | None = None,
               held: dict[str, Any] | None = None, nbytes: int = 0) -> Entry:
        """A side effect with its own undo that no method above fits (LoRA: a child module added to a
        layer, a branch attached or re-weighted, a weight baked in place): `undo` reverts it, `check`
        (after undo) returns True or a reason string; `held` keeps what undo needs, released after it."""
        entry = Entry(kind, name, undo, nbytes, check, dict(held or {}))
        self.entries.append(entry)
        return entry

    def original(self, name: str) -> nn.Module | None:
        """The module a swap replaced (None if dropped or never swapped)."""
        for entry in reversed(self.entries):
            if entry.kind == "module_swap" and entry.name == name and not entry.done:
                return entry.held.get("module")
        return None

    def swapped(self) -> list[str]:
        """Names of the modules currently swapped, in swap order."""
        return [e.name for e in self.entries if e.kind == "module_swap" and not e.done]

    def patch_attr(self, obj: Any, attr: str, value: Any, name: str | None = None, *, kind: str = "attr_patch") -> None:
        """setattr with a recorded undo (restores the exact original object, or deletes the attr).

        If someone else re-patched the attribute after us, the undo leaves their value in
        place and reports it (blindly restoring would silently undo their patch).
        Submodules, parameters and buffers of an nn.Module go through `swap_module`.
        """
        if isinstance(obj, nn.Module) and (attr in obj._modules or attr in obj._parameters or attr in obj._buffers):
            raise TypeError(f"'{attr}' is a submodule/parameter/buffer of {type(obj).__name__}: use swap_module "
                            "or hold/tensor, not patch_attr")
        label = name or f"{getattr(obj, '__name__', type(obj).__name__)}.{attr}"
        own = _own_dict(obj)
        in_dict = attr in own
        original = own[attr] if in_dict else _MISSING
        if not in_dict and not isinstance(obj, type) and hasattr(obj, attr) and not hasattr(obj, "__dict__"):
            original = getattr(obj, attr)  # slots: the value lives on the object itself
            in_dict = False
        setattr(obj, attr, value)
        obj_ref = _ref(obj)

        def undo() -> None:
            target = obj_ref()
            if target is None:
                return
            current = _own_dict(target).get(attr, _MISSING) if in_dict or original is _MISSING else getattr(target, attr, _MISSING)
            if current is not value:
                raise RuntimeError(f"{label} was changed by someone else after our patch; left as is")
            if original is _MISSING:
                delattr(target, attr)
            else:
                setattr(target, attr, original)

        self.entries.append(Entry(kind, label, undo, 0, _restore_check(obj_ref, attr, original, in_dict),
                                  {"original": original}))

    def set_item(self, mapping: dict, key: Any, value: Any, name: str) -> None:
        """`mapping[key] = value` in another library's table (a registry dict), with an undo restoring what
        was there, or removing the key; if someone else changed the entry since, it is left and reported."""
        before = mapping.get(key, _MISSING)
        mapping[key] = value

        def undo() -> None:
            if mapping.get(key, _MISSING) is not value:
                raise RuntimeError(f"{name} was changed by someone else after our entry; left as is")
            if before is _MISSING:
                del mapping[key]
            else:
                mapping[key] = before

        def check() -> Any:
            return True if mapping.get(key, _MISSING) is before else "not restored"

        self.entries.append(Entry("dict_entry", name, undo, 0, check, {"before": before}))

    def patch_function(self, owner: Any, attr: str, new: Callable[..., Any]) -> Callable[..., Any]:
        """Replace a function on another library (a module or class) with a recorded undo.

        Only callers that look the function up on `owner` see the patch (a `from x import f`
        done earlier keeps the old one): patch where the function is looked up. Returns the original.
        """
        original = getattr(owner, attr)
        label = f"{getattr(owner, '__module__', '') + '.' if isinstance(owner, type) else ''}" \
                f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"
        self.patch_attr(owner, attr, new, label, kind="function_patch")
        return original

    def hook(self, handle: Any, name: str) -> None:
        """A torch RemovableHandle (forward hook etc.); the check proves it left its hooks dict."""
        def check() -> Any:
            refs = getattr(handle, "hooks_dict_ref", None)
            hooks = refs() if callable(refs) else None
            if hooks is None:
                return True
            return True if handle.id not in hooks else "hook still registered"

        self.entries.append(Entry("hook", name, handle.remove, 0, check))

    def cache(self, name: str, clear: Callable[[], None], nbytes: int | None = 0,
              is_empty: Callable[[], bool] | None = None, caveat: str | None = None) -> None:
        """A cache the pipeline filled (Hadamard matrices, compile caches, pools).

        nbytes: what clearing frees (None: unknown; said in the report). is_empty: proves the clear.
        caveat: what the clear is known not to free; goes to the report's `caveats` when undone.
        """
        check = (lambda: True if is_empty() else "cache not empty after clear") if is_empty is not None else None
        self.entries.append(Entry("cache", name, clear, nbytes if nbytes is not None else -1, check,
                                  {"verifiable": is_empty is not None, "caveat": caveat}))

    def cuda_graph(self, graph: Any, name: str, tensors: Any = None) -> Any:
        """A captured torch.cuda.CUDAGraph and its static inputs/outputs (`tensors`, any container).

        The ledger holds them until teardown; the undo resets the graph (releasing its
        private memory pool) and drops the tensors; weakrefs prove both are gone.
        """
        held: dict[str, Any] = {"graph": graph, "tensors": tensors}

        def undo() -> None:
            g = held.pop("graph", None)
            if g is not None:
                g.reset()
            release(held.pop("tensors", None))

        self.entries.append(Entry("cuda_graph", name, undo, 0, None, held))
        self.watch(f"{name} (CUDA graph)", graph)
        if tensors is not None:
            self.watch(f"{name} (static tensors)", tensors)
        return graph

    def tensor(self, name: str, t: Any, *, own: bool = False) -> Any:
        """A tensor (or container of tensors) the pipeline allocated; it must be gone after teardown.

        own=True: the ledger also holds it (strongly) until teardown, then releases it.
        """
        if own:
            return self.own(name, t)
        self.watch(name, t)
        return t

    def own(self, name: str, obj: Any) -> Any:
        """Hold `obj` (calibration statistics, buffer pools...) until teardown, then release it
        (nested containers emptied) and prove it gone."""
        held = {"obj": obj}

        def undo() -> None:
            release(held.pop("obj", None))

        self.entries.append(Entry("object", name, undo, 0, None, held))
        self.watch(name, obj)
        return obj

    def hold(self, name: str, holder: dict, key: str) -> None:
        """A tensor or container the pipeline allocated and parked in `holder[key]`; undo pops and
        empties it (nested containers too)."""
        self.watch(name, holder[key])

        def undo() -> None:
            release(holder.pop(key, None))

        self.entries.append(Entry("object", name, undo, 0))

    def watch(self, name: str, obj: Any) -> None:
        """Expect `obj` to be garbage after teardown (proved by weakref)."""
        if obj is None:
            return
        try:
            ref = weakref.ref(obj)
        except TypeError:
            # Containers (dict, list, tuple) take no weakref: watch what they hold instead.
            if isinstance(obj, dict):
                for k, item in obj.items():
                    self.watch(f"{name}[{k!r}]", item)
            elif isinstance(obj, (list, tuple, set, frozenset)):
                for i, item in enumerate(obj):
                    self.watch(f"{name}[{i}]", item)
            elif not isinstance(obj, (int, float, str, bytes, bool)):
                self._unwatchable.append(f"{name} ({type(obj).__name__} takes no weakref)")
            return  # scalars, strings: nothing to free
        self._watch.append(_Watched(name, ref, tensor_storages(obj)))

    # -- teardown --------------------------------------------------------
    def undo_all(self, report: TeardownReport | None = None) -> TeardownReport:
        """Undo every entry in reverse order (failures are named, unwinding goes on). Idempotent."""
        report = report if report is not None else TeardownReport()
        if self.torn_down and not self.entries:
            report.notes.append("already torn down: nothing left to undo")
        self.torn_down += 1
        for entry in reversed(self.entries):
            if entry.done:
                continue
            entry.done = True
            try:
                entry.undo()
            except Exception as err:  # noqa: BLE001 - keep unwinding; the failure is named in the report
                report.errors.append(f"{entry.kind} {entry.name}: {type(err).__name__}: {err}")
                report.unfreed.append(f"{entry.name} ({entry.kind}: undo failed)")
                continue
            report.undone[entry.kind] = report.undone.get(entry.kind, 0) + 1
            if entry.kind == "cache":
                verified = entry.check is not None
                result = entry.check() if verified else None
                ok = result is True or result is None
                if not ok:
                    report.unfreed.append(f"{entry.name} (cache: {result})")
                report.caches.append({"name": entry.name, "bytes": entry.nbytes if entry.nbytes >= 0 else None,
                                      "verified": verified and ok})
                if ok and entry.nbytes > 0:
                    report.bytes_freed += entry.nbytes
                if not verified:
                    report.notes.append(f"cache {entry.name}: cleared, but it offers no way to check it is empty")
                if entry.held.get("caveat"):
                    report.caveats.append(f"{entry.name}: {entry.held['caveat']}")
                entry.held.clear()
                continue
            if entry.check is not None:
                result = entry.check()
                if result is True or result is None:
                    report.patches_restored += 1
                else:
                    reason = result if isinstance(result, str) else "not restored"
                    report.unfreed.append(f"{entry.name} ({entry.kind}: {reason})")
            entry.held.clear()
        self.entries.clear()
        return report

    def prove(self, report: TeardownReport, *, device_slack: int = 0) -> TeardownReport:
        """After undo (and after the owner dropped what it owns): collect garbage, then prove every
        watched object dead and device memory back at the baseline. Fills bytes_freed / retained / unfreed.

        A full collection walks every object of the process (~0.25 s beside torch, diffusers and Hydra): it runs
        only where it can change the verdict, when a watched object is still alive (a reference cycle may be all
        that holds it) or device memory is checked (cyclic garbage the ledger does not know may hold some)."""
        def any_alive() -> bool:
            return any(w.ref() is not None for w in self._watch)

        if (torch.cuda.is_available() and torch.cuda.is_initialized()) or any_alive():
            gc.collect()
            if any_alive():
                gc.collect()  # a second pass frees what the first pass's finalizers released
        alive = [w for w in self._watch if w.ref() is not None]
        dead = [w for w in self._watch if w.ref() is None]
        alive_keys: set[tuple[str, int]] = set()
        for w in alive:
            alive_keys.update(w.storages)
            report.unfreed.append(f"{w.name} (still referenced, {w.nbytes} bytes)")
            report.retained_bytes += w.nbytes
        freed: dict[tuple[str, int], int] = {}
        for w in dead:
            freed.update({k: b for k, b in w.storages.items() if k not in alive_keys})
        report.bytes_freed += sum(freed.values())
        report.objects_freed += len(dead)
        report.objects_watched += len(self._watch)
        report.unproven.extend(f"cannot prove {u} is freed" for u in self._unwatchable)
        self._watch = alive  # a later teardown re-checks these (the leak may have been dropped since)
        self._prove_device(report, alive, device_slack)
        report.proven = report.proven and not report.unproven
        return report

    def _prove_device(self, report: TeardownReport, alive: list[_Watched], slack: int) -> None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        if self.baseline is None:
            report.unproven.append("no device memory baseline was captured before load")
            return
        torch.cuda.synchronize()
        after = device_allocated()
        excess = sum(max(0, after.get(i, 0) - self.baseline.get(i, 0)) for i in after)
        named_on_device = sum(b for w in alive for (dev, _), b in w.storages.items() if dev.startswith("cuda"))
        unexplained = max(0, excess - named_on_device)
        report.device = {"baseline_bytes": sum(self.baseline.values()), "after_bytes": sum(after.values()),
                         "excess_bytes": excess, "per_device": {str(i): {"baseline": self.baseline.get(i, 0),
                                                                         "after": a} for i, a in after.items()}}
        if unexplained > slack:
            report.unfreed.append(f"device memory: {unexplained} bytes above the pre-load baseline held by "
                                  "objects the ledger does not know")
            report.retained_bytes += unexplained

    def unwind(self) -> TeardownReport:
        """Undo everything in reverse order, then prove it. Idempotent."""
        return self.prove(self.undo_all())


def device_allocated() -> dict[int, int]:
    """torch.cuda.memory_allocated per device; {} when CUDA was never initialized (nothing allocated)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {i: torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())}


def parent_of(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(parent module, attribute) of the submodule `name` of `root`."""
    if "." not in name:
        return root, name
    path, attr = name.rsplit(".", 1)
    return root.get_submodule(path), attr
