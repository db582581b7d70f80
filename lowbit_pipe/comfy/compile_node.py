"""Compile (lowbit_pipe): torch.compile of the repeated blocks of a ComfyUI MODEL (regional compile), on a clone.

How it is applied, the way ComfyUI's own TorchCompileModel node applies its compile (comfy_api.torch_helpers,
`set_torch_compile_wrapper`): a clone of the MODEL carries an APPLY_MODEL wrapper (ComfyUI's patcher
extensions; every clone ComfyUI or a later node makes of it carries it too). The MODEL given carries none, so it
samples eagerly as before. Where ComfyUI's node swaps the whole diffusion model for an `OptimizedModule` while
the wrapper runs, this one compiles each repeated block in place for the duration of the call: before the
model runs, each block of the BaseModel being run gets `_compiled_call_impl` (what `nn.Module.compile()` sets),
and it is taken off again when the call ends, error or not. The blocks are looked up on the BaseModel that
runs, by path, at each call, so a MODEL ComfyUI rebuilt (a non-dynamic delegate, a copy per GPU) compiles its
own blocks, never those of the tree the node saw.

The blocks: the ModuleLists of the MODEL's diffusion model whose first block maps, through the architecture's
key map (native ComfyUI names -> diffusers names), into one of the architecture's repeated-block lists
(`Arch.policy.block_paths`, the diffusers compile stage's targets): Krea 2 `blocks`, FLUX.1 `double_blocks` and
`single_blocks`, Qwen-Image `transformer_blocks`. For an architecture the pack does not know, every top-level
ModuleList of two or more blocks of one class.

What is compiled: one `torch.compile` per block class of its `forward` (a block with hooks of its own, or with
global module hooks set, gets `nn.Module._call_impl` compiled instead, which runs them), so dynamo's cache of
each block class is its own code object and every block of a class shares its graphs: one graph per block
class, not per block. Compiled graphs read every parameter and buffer at each call (no weights are frozen into
a graph), so ComfyUI moving or swapping the weights (loading, unloading, partial loading) needs no recompile on
the same device, and guards check each tensor's device, dtype and shape, never its identity.

Guards: no guard filter (ComfyUI's node skips every guard under `transformer_options`; with attention overrides
and patches living there, that can serve a stale graph). What the blocks read of `transformer_options` is
guarded by type, key presence, length and function code: `block_index` by type only (each block's index is
no recompile), a wrapper or override by its code (a new node run's closure matches), so a LoRA strength change
or a same-rank LoRA swap ("LoRA residual (lowbit_pipe)" re-runs: new branch tensors of the same shapes, a
new tree of the same classes) runs the graphs already compiled. Another LoRA rank, a LoRA where there was
none, another resolution or batch recompiles once (then torch's automatic dynamic shapes take over).

Dynamic VRAM: like ComfyUI's node, the clone is a non-dynamic one (`clone(disable_dynamic=True)`): dynamic
VRAM's per-layer weight streaming of ComfyUI's own layers happens in ComfyUI code the graph cannot hold. For a
MODEL of the pack's nodes that rebuilds the MODEL through its `cached_patcher_init` (a structural copy of the
tree the run adopts: a Purge seals it too); on a CPU it is a plain clone.

Teardown: the compile is recorded in the ledger of the run behind the MODEL (the Quantize / LoRA node's run;
for a MODEL no pack node made, a run of this node's own around a structural copy of the tree, which Purge
tears down the same way): the compiled callables are dropped and proven freed, no block is left compiled,
and dynamo's caches are reset (`torch.compiler.reset()`, as the diffusers compile stage's teardown does:
process-wide). A Purge of any MODEL of the run gives everything back; the compiled MODEL then refuses to run.

The first call's time (compile included), the graphs it compiled and the graph breaks are reported when the
first call ends: in ComfyUI's log, as progress text on the node (ComfyUI's `send_progress_text`), and by
`compile_report(model)`; later calls that compile again are counted as recompiles.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.comfy import node_runs
from lowbit_pipe.comfy.node_runs import PURGES, NodeRun, NodeState, PurgedModelError
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.stages.compile import DYNAMO_CAVEAT, dynamo_counters, dynamo_empty_check, reset_compile_state

CATEGORY = "lowbit_pipe"
WRAPPER_KEY = "lowbit_pipe_compile"  # the APPLY_MODEL wrapper key on the MODEL
STOCK_COMPILE_KEY = "torch.compile"  # ComfyUI's TorchCompileModel wrapper key (comfy_api.torch_helpers)
CACHE_NAME = "torch.compile (dynamo caches, process-wide reset)"
BACKENDS = ("inductor", "aot_eager", "eager")
MODES = ("default", "max-autotune-no-cudagraphs")
log = logging.getLogger("lowbit_pipe.comfy")


# ============================================================================================== which blocks
def block_lists(tree: nn.Module) -> tuple[str | None, tuple[str, ...]]:
    """(architecture id or None, paths of the ModuleLists of repeated blocks) of a ComfyUI diffusion model (native
    names) or a diffusers transformer."""
    from lowbit_pipe.arch import detect_module

    lists = [(name, m) for name, m in tree.named_modules()
             if name and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
    found = detect_module(tree)
    if found is not None and found.arch.policy.block_paths:
        arch = found.arch
        wanted = tuple(f"{p}.0." for p in arch.policy.block_paths)
        paths: list[str] = []
        for name, blocks in lists:  # parents before children: a list inside a block is part of that block
            if not any(name.startswith(p + ".") for p in paths) and \
                    any(d.startswith(wanted) for d in _diffusers_names(arch, name, blocks[0])):
                paths.append(name)
        if paths:
            return arch.id, tuple(paths)
    return (found.arch.id if found is not None else None), _repeated(lists)


def _diffusers_names(arch: Any, path: str, block: nn.Module) -> list[str]:
    """Diffusers names of the layers (modules with `in_features`) inside `block` (`path`.0 of the native tree)."""
    out = []
    for sub, module in block.named_modules():
        if not sub or not hasattr(module, "in_features"):
            continue
        native = f"{path}.0.{sub}"
        if arch.keymap is None:
            out.append(native)
            continue
        try:
            out.extend(name for name, _ in arch.keymap.module_from_native(native, hidden=int(module.in_features)))
        except ValueError:  # a fused part the map cannot address: the other layers decide
            continue
    return out


def _repeated(lists: list[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """Top-level ModuleLists of 2+ blocks of one class that hold layers: an unknown architecture's blocks."""
    paths: list[str] = []
    for name, blocks in lists:
        if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
            continue
        if not any(hasattr(m, "in_features") for m in blocks[0].modules()):
            continue
        if any(name.startswith(p + ".") for p in paths):
            continue
        paths.append(name)
    return tuple(paths)


# ============================================================================================== the report
@dataclass
class CompileReport:
    """What the compile cost, filled at the MODEL's first calls."""

    made_by: str
    backend: str
    mode: str
    arch: str | None
    paths: tuple[str, ...]
    blocks: int
    classes: tuple[str, ...]
    calls: int = 0
    first_call_s: float | None = None
    second_call_s: float | None = None
    graphs: int = 0  # graphs compiled by the first call
    graph_breaks: int = 0  # graph breaks, all calls
    recompiles: int = 0  # graphs compiled by later calls
    uncompiled: list[str] = field(default_factory=list)  # block classes met at run time that were not compiled
    notes: list[str] = field(default_factory=list)

    def plan(self) -> str:
        mode = "" if self.mode == "default" else f" ({self.mode})"
        return "; ".join([f"{self.made_by}: {self.blocks} blocks ({', '.join(self.paths)}; {', '.join(self.classes)}) "
                          f"of {self.arch or 'an unknown architecture'} compiled with {self.backend}{mode} at the "
                          "first model call", *self.notes])

    def text(self) -> str:
        if self.first_call_s is None:
            return self.plan() + "; not run yet"
        line = (f"{self.made_by}: first model call {self.first_call_s:.2f} s (compile included: {self.graphs} graphs, "
                f"{self.graph_breaks} graph breaks)")
        if self.second_call_s is not None:
            line += f"; second {self.second_call_s:.3f} s"
        line += f"; {self.calls} calls, {self.recompiles} recompiles after the first"
        if self.uncompiled:
            line += f"; not compiled: {', '.join(self.uncompiled)}"
        return line

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()} | {"text": self.text()}


# ============================================================================================== the compile
class RegionalCompile:
    """The compiled callables of one node run, what puts them on the blocks of the model that runs, and the
    report. Held by the MODEL's wrapper (a closure); closed by the run's teardown."""

    def __init__(self, paths: tuple[str, ...], classes: list[type], options: dict[str, Any], report: CompileReport,
                 node_id: str | None) -> None:
        self.paths = paths
        self.node_id = node_id
        self.report = report
        self.compiled: dict[Any, Callable[..., Any]] = {cls: torch.compile(cls.forward, **options) for cls in classes}
        self.compiled["_call_impl"] = torch.compile(nn.Module._call_impl, **options)  # blocks with hooks
        self.installed: weakref.WeakSet = weakref.WeakSet()  # every block this ever compiled (the teardown's check)
        self.closed: str | None = None

    def _callable(self, block: nn.Module) -> Callable[..., Any] | None:
        if _has_hooks(block):
            return functools.partial(self.compiled["_call_impl"], block)
        fn = self.compiled.get(type(block))
        return functools.partial(fn, block) if fn is not None else None

    def run(self, executor: Any, args: tuple, kwargs: dict) -> Any:
        if self.closed is not None:
            raise PurgedModelError(f"this MODEL carries the compile of {self.report.made_by}, {self.closed}. Queue the "
                                   "workflow again: the nodes re-run by themselves")
        tree = executor.class_obj.diffusion_model
        put: list[nn.Module] = []
        try:
            for path in self.paths:
                for block in tree.get_submodule(path):
                    if block.__dict__.get("_compiled_call_impl") is not None:
                        continue  # compiled in place by someone else (lowbit_pipe.run's compile stage): theirs
                    fn = self._callable(block)
                    if fn is None:
                        name = type(block).__name__
                        if name not in self.report.uncompiled:
                            self.report.uncompiled.append(name)
                        continue
                    block.__dict__["_compiled_call_impl"] = fn
                    put.append(block)
                    self.installed.add(block)
            return self._timed(executor, args, kwargs)
        finally:
            for block in put:
                block.__dict__["_compiled_call_impl"] = None

    def _timed(self, executor: Any, args: tuple, kwargs: dict) -> Any:
        report = self.report
        before = dynamo_counters()
        start = time.perf_counter()
        out = executor(*args, **kwargs)  # a call that fails is no call: the next one is still the first
        report.calls += 1
        seconds = 0.0
        if report.calls <= 2:
            if isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.synchronize(out.device)
            seconds = time.perf_counter() - start
        after = dynamo_counters()
        graphs = after["graphs"] - before["graphs"]
        report.graph_breaks += after["graph_breaks"] - before["graph_breaks"]
        if report.calls == 1:
            report.first_call_s, report.graphs = seconds, graphs
            self._tell(f"{report.made_by}: first model call {seconds:.2f} s (compile included: {graphs} graphs, "
                       f"{report.graph_breaks} graph breaks)")
            return out
        report.recompiles += graphs
        if report.calls == 2:
            report.second_call_s = seconds
            self._tell(f"{report.made_by}: second model call {seconds:.3f} s ({graphs} graphs compiled)")
        return out

    def _tell(self, text: str) -> None:
        log.info("lowbit_pipe compile: %s", text)
        if self.node_id is None:
            return
        try:
            from server import PromptServer  # ComfyUI's; shown on the node in the browser
        except ImportError:
            return
        server = getattr(PromptServer, "instance", None)
        if server is not None and hasattr(server, "send_progress_text"):
            try:
                server.send_progress_text(text, self.node_id)
            except Exception as err:  # noqa: BLE001 - a display message must never fail the sampling
                log.debug("lowbit_pipe compile: progress text not sent: %s", err)

    def close(self, reason: str) -> None:
        """The teardown's undo: the compiled callables dropped (the ledger proves them freed), the MODEL refused."""
        self.closed = reason
        self.compiled.clear()

    def check(self) -> bool | str:
        if self.compiled:
            return "compiled callables still held"
        left = [type(b).__name__ for b in self.installed if b.__dict__.get("_compiled_call_impl") is not None]
        return True if not left else f"{len(left)} blocks still compiled ({left[0]})"


def _has_hooks(block: nn.Module) -> bool:
    """What makes `nn.Module._call_impl` run more than `forward` (its own fast-path test)."""
    from torch.nn.modules import module as m

    return bool(block._backward_hooks or block._backward_pre_hooks or block._forward_hooks
                or block._forward_pre_hooks or getattr(m, "_global_backward_pre_hooks", None)
                or getattr(m, "_global_backward_hooks", None) or getattr(m, "_global_forward_hooks", None)
                or getattr(m, "_global_forward_pre_hooks", None))


def _wrapper(compiled: RegionalCompile) -> Callable[..., Any]:
    """The APPLY_MODEL wrapper: a plain closure, so dynamo guards it (it sits in the transformer_options the
    blocks read) by its code, the same for every node run."""

    def apply_model_compiled(executor: Any, *args: Any, **kwargs: Any) -> Any:
        return compiled.run(executor, args, kwargs)

    apply_model_compiled.lowbit_compile = compiled  # compile_report() reads it
    return apply_model_compiled


def compile_of(model: Any) -> RegionalCompile | None:
    """The pack's compile a MODEL carries (None: none)."""
    getter = getattr(model, "get_wrappers", None)
    if getter is None:
        return None
    from comfy.patcher_extension import WrappersMP

    for fn in getter(WrappersMP.APPLY_MODEL, WRAPPER_KEY):
        found = getattr(fn, "lowbit_compile", None)
        if isinstance(found, RegionalCompile):
            return found
    return None


def compile_report(model: Any) -> dict[str, Any] | None:
    """What the compile on a MODEL has cost so far (first call's seconds, graphs, graph breaks, recompiles)."""
    found = compile_of(model)
    return found.report.as_dict() if found is not None else None


def compile_model(model: Any, backend: str = "inductor", mode: str = "default", made_by: str = "Compile (lowbit_pipe)",
                  node_id: str | None = None) -> tuple[Any, CompileReport]:
    """A clone of a ComfyUI MODEL whose repeated blocks run compiled; the MODEL given is unchanged. The compile is
    recorded in the ledger of the run behind the MODEL (one of this call's own for a MODEL no pack node made)."""
    from comfy.patcher_extension import WrappersMP

    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"{made_by}: unknown torch.compile backend '{backend}' "
                         f"(known: {', '.join(torch._dynamo.list_backends(exclude_tags=()))})")
    if mode not in MODES:
        raise ValueError(f"{made_by}: mode '{mode}' is not one of {', '.join(MODES)}")
    source = model.get_model_object("diffusion_model")
    node_runs.check_usable(source, made_by)
    arch, paths = block_lists(source)
    if not paths:
        raise ValueError(f"{made_by}: no repeated blocks found in {type(source).__name__} (no ModuleList of blocks): "
                         "compile the whole model with ComfyUI's TorchCompileModel instead")
    rotated = _rotated_file_layers(source, paths)
    if rotated:
        raise ValueError(f"{made_by}: {len(rotated)} layers of the blocks are lowbit_pipe kinds with a rotation loaded "
                         f"from a file (e.g. '{rotated[0]}'): torch.compile cannot trace them yet (their rotation "
                         "matrix is made inside the layout's dispatch). Quantize the float model with Quantize "
                         "(lowbit_pipe) in the graph and compile that, or sample this MODEL uncompiled")
    state = node_runs.state_of(source)
    if state is None:  # a MODEL no pack node made: a run of this node's own, around a copy of its tree
        model, state = _own_run(model, source, made_by, node_id)
    out = _non_dynamic_clone(model)
    notes = []
    if out.get_wrappers(WrappersMP.APPLY_MODEL, STOCK_COMPILE_KEY):  # one compile of the blocks, not two
        out.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, STOCK_COMPILE_KEY)
        notes.append("replaces ComfyUI's TorchCompileModel on this MODEL")
    out.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)  # this node on its own MODEL: replaced
    tree = out.get_model_object("diffusion_model")
    blocks = [b for p in paths for b in tree.get_submodule(p)]
    classes = list(dict.fromkeys(type(b) for b in blocks))
    options: dict[str, Any] = {"backend": backend}
    if mode != "default":
        if backend == "inductor":
            options["mode"] = mode
        else:
            notes.append(f"mode {mode} is inductor's: {backend} ignores it")
    report = CompileReport(made_by, backend, mode, arch, paths, len(blocks), tuple(c.__name__ for c in classes),
                           notes=notes)
    compiled = RegionalCompile(paths, classes, options, report, node_id)
    _record(state.run, compiled, report)
    out.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, _wrapper(compiled))
    return out, report


def _record(run: NodeRun, compiled: RegionalCompile, report: CompileReport) -> None:
    """In the run's ledger: dynamo's caches (once per run; reset after the compile entries are undone), the
    compiled callables (dropped and proven freed), no block left compiled."""
    ledger = run.ledger
    if not any(e.kind == "cache" and e.name == CACHE_NAME and not e.done for e in ledger.entries):
        ledger.cache(CACHE_NAME, reset_compile_state, nbytes=None, is_empty=dynamo_empty_check(),
                     caveat=DYNAMO_CAVEAT)
    ledger.record("comfy_compile", f"{report.made_by}: {report.blocks} blocks ({report.backend})",
                  lambda: compiled.close(f"purged by Purge (lowbit_pipe) at {time.strftime('%H:%M:%S')}"),
                  check=compiled.check)
    for key, fn in compiled.compiled.items():
        label = key if isinstance(key, str) else key.__name__
        ledger.watch(f"{report.made_by}: compiled {label}", fn)


def _own_run(model: Any, source: nn.Module, made_by: str, node_id: str | None) -> tuple[Any, NodeState]:
    """A MODEL of this node's own around a structural copy of `source` (the MODEL given stays as it was), with a
    run of its own that Purge tears down and seals."""
    from lowbit_pipe.comfy.patchers import model_with_tree, release_weights
    from lowbit_pipe.comfy.tree import structural_copy

    release_weights(model)  # the copy must take the model's own weights, not another clone's patched ones
    tree = structural_copy(source)
    run = NodeRun(Ledger(), made_by, node_id)
    state = NodeState(run, source, base=tree)
    node_runs.set_state(tree, state)
    run.ledger.record("comfy_tree", f"{made_by}: diffusion model copy (node state)",
                      lambda: node_runs.drop_state(tree), check=lambda: node_runs.state_gone(tree))
    return model_with_tree(model, tree, run.clone_id), state


def _rotated_file_layers(tree: nn.Module, paths: tuple[str, ...]) -> list[str]:
    """Layers in the blocks whose weight is the pack's LowbitLayout QuantizedTensor (a lowbit kind loaded from a
    file) with a rotation: under torch.compile its dispatch meets a rotation matrix that is no fake tensor."""
    from lowbit_pipe.formats.common import record_rotation

    found = []
    for path in paths:
        for name, module in tree.get_submodule(path).named_modules():
            weight = getattr(module, "_parameters", {}).get("weight")
            if getattr(weight, "_layout_cls", None) != "LowbitLayout":
                continue
            record = json.loads(getattr(weight._params, "record", "{}") or "{}")
            if record_rotation(record, name)[0] != "none":
                found.append(f"{path}.{name}")
    return found


def _non_dynamic_clone(model: Any) -> Any:
    if "disable_dynamic" in inspect.signature(model.clone).parameters:
        return model.clone(disable_dynamic=True)
    return model.clone()


# ============================================================================================== the node
class LowbitCompile:
    DESCRIPTION = ("Compiles the repeated blocks of the model with torch.compile (regional: each block class once), "
                   "on a clone: the MODEL given is unchanged. Compiling happens at the first sampling step, whose time "
                   "is shown on this node and in the log. A LoRA strength change or another LoRA of the same rank "
                   "(LoRA residual (lowbit_pipe)) runs without recompiling. Purge gives it all back.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("the model with its blocks compiled (a new MODEL; the input one is unchanged)",)
    FUNCTION = "compile"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802 - ComfyUI's name
        return {"required": {
            "model": ("MODEL", {"tooltip": (
                "a diffusion model: quantized by this pack, from a quantized file, or float")}),
            "backend": (list(BACKENDS), {"default": "inductor", "tooltip": (
                "torch.compile backend: inductor (fused kernels: the fast one), aot_eager / eager (no code "
                "generation: to check a model compiles)")}),
        }, "optional": {
            "mode": (list(MODES), {"default": "default", "tooltip": (
                "inductor's mode: default, or max-autotune-no-cudagraphs (tries more kernels: a longer first step)")}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def IS_CHANGED(cls, unique_id: str | None = None, **_: Any) -> str:  # noqa: N802
        return f"purges={PURGES.of(unique_id)}"

    def compile(self, model: Any, backend: str = "inductor", mode: str = "default",
                unique_id: str | None = None) -> dict[str, Any]:
        made_by = f"Compile (lowbit_pipe) node {unique_id}" if unique_id else "Compile (lowbit_pipe)"
        out, report = compile_model(model, backend, mode, made_by, unique_id)
        return {"ui": {"text": [report.plan()]}, "result": (out,)}
