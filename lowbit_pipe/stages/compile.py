"""compile: torch.compile the repeated blocks (regional) or the whole transformer (full), through the ledger.

How: each target module's call is compiled in place, as `nn.Module.compile()`
(and diffusers' `compile_repeated_blocks`) do: `module._compiled_call_impl =
torch.compile(module._call_impl, ...)`, recorded with `ledger.patch_attr`, so
the undo puts the eager call back and the check proves the attribute is gone.
In-place rather than a module swap for an `OptimizedModule`: the module tree,
its names and `state_dict()` keys stay as they were (a swap inserts
`._orig_mod.` into every name, which export, LoRA key mapping and evaluate's
float reference would all have to know about), and a diffusers pipeline or a
ComfyUI model keeps the very object the user holds.

Regional targets: every module of the architecture's repeated-block ModuleLists
(`ctx.policy.block_paths`); for an unknown architecture, the ModuleLists whose
modules are of a class named in the model's own `_repeated_blocks` (diffusers'
declarative attribute). "full" compiles the transformer itself.

Dynamo state: compiled code is cached on Python code objects (e.g.
`Krea2TransformerBlock.forward`), shared by every instance of the class in the
process, and its guards, graphs and (mode="reduce-overhead") CUDA-graph pools
can keep this run's modules and memory alive and serve stale graphs to the next
model. torch offers no per-module eviction, so the ledger records a cache entry
(before the patches: it is undone after them) whose undo is
`torch.compiler.reset()` -- the public reset, which also releases cudagraph
trees. It is process-global: any other model compiled in the same process
recompiles on its next call (a cost, never a wrong result). It is recorded only
when this run compiled something.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowbit_pipe.ledger import Ledger
from lowbit_pipe.recipe import COMPILE_MODES, CompileConfig
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register

MODES = COMPILE_MODES  # compile.mode (recipe.COMPILE_MODES, which config.validate checks it against)
# Measured (torch 2.13 CPU, tests/running/test_teardown.py): per compiled graph, dynamo keeps a FakeTensorMode +
# ShapeEnv + the traced inputs' fake tensors alive after torch.compiler.reset(), held from C++ (no Python
# referrer). Fake tensors own no storage: host memory only, no device memory. We cannot free or verify it.
DYNAMO_CAVEAT = ("torch keeps per-graph tracing state (FakeTensorMode/ShapeEnv, fake tensors: host memory only, "
                 "no tensor storage) after torch.compiler.reset(); it cannot be freed or verified from outside torch")


def dynamo_counters() -> dict[str, int]:
    """dynamo's process-wide counters that say what compiling cost: graphs compiled (a recompile is one
    more) and graph breaks. The runner reports their change over a run."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "frames": int(counters["frames"].get("total", 0))}


def block_targets(root: nn.Module, block_paths: tuple[str, ...] | list[str]) -> list[str]:
    """Names of the modules to compile regionally: the children of each repeated-block ModuleList."""
    paths = list(block_paths)
    if not paths:
        classes = set(getattr(type(root), "_repeated_blocks", ()) or ())
        paths = [name for name, m in root.named_modules()
                 if isinstance(m, nn.ModuleList) and len(m) and all(type(c).__name__ in classes for c in m)]
    names = []
    for path in paths:
        try:
            blocks = root.get_submodule(path)
        except AttributeError:
            raise ValueError(f"compile: block path '{path}' is not a submodule of {type(root).__name__}") from None
        if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"compile: block path '{path}' is a {type(blocks).__name__}, expected a ModuleList")
        names.extend(f"{path}.{i}" for i in range(len(blocks)))
    return names


def reset_compile_state() -> None:
    """torch.compiler.reset(), plus inductor's in-memory module cache (torch.compiler.reset() leaves the
    loaded compiled modules, and whatever constants they hold, in it).
    On-disk caches are kept (purge=False): they hold no memory and make the next compile fast."""
    torch.compiler.reset()
    code_cache = getattr(getattr(torch._inductor, "codecache", None), "PyCodeCache", None)
    if code_cache is not None:
        code_cache.cache_clear(purge=False)


def dynamo_empty_check() -> Any:
    """A check that dynamo's code tracker is empty after the reset, or None where this torch lacks it."""
    from torch._dynamo import convert_frame

    tracker = getattr(convert_frame, "input_codes", None)
    if tracker is None or not hasattr(tracker, "seen"):
        return None
    return lambda: len(tracker.seen) == 0


def compile_modules(root: nn.Module, names: list[str], cfg: CompileConfig, ledger: Ledger) -> list[str]:
    """Compile `root`'s submodules `names` ("" = root itself) in place; every patch through the ledger."""
    if cfg.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile.backend: unknown backend '{cfg.backend}' "
                         f"(known: {', '.join(torch._dynamo.list_backends(exclude_tags=()))})")
    kwargs: dict[str, Any] = {"backend": cfg.backend, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.inductor_mode is not None:
        kwargs["mode"] = cfg.inductor_mode
    modules = [(n, root.get_submodule(n) if n else root) for n in names]
    for name, module in modules:
        if module._compiled_call_impl is not None:
            raise ValueError(f"compile: '{name or type(root).__name__}' is already compiled")
    if modules:
        ledger.cache("torch.compile (dynamo caches, process-wide reset)", reset_compile_state, nbytes=None,
                     is_empty=dynamo_empty_check(), caveat=DYNAMO_CAVEAT)
    for name, module in modules:
        compiled = torch.compile(module._call_impl, **kwargs)
        label = f"{name or type(root).__name__} (torch.compile)"
        ledger.patch_attr(module, "_compiled_call_impl", compiled, label)
        ledger.watch(f"{label} compiled callable", compiled)
    return [n for n, _ in modules]


@register
class Compile(Stage):
    name = "compile"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.compile
        root = ctx.transformer
        names = [""] if cfg.mode == "full" else block_targets(root, ctx.policy.block_paths)
        if not names:
            raise ValueError(f"compile: no repeated blocks known for {type(root).__name__}; use compile.mode=full")
        compiled = compile_modules(root, names, cfg, ctx.ledger)
        result = {"mode": cfg.mode, "backend": cfg.backend, "modules": len(compiled)}
        ctx.report["compile"] = {**result, "names": compiled}
        return result
