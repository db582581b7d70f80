"""8-bit attention on a diffusers model: its own attention processors, with only the attention call swapped.

A diffusers attention processor (Krea2AttnProcessor, FluxAttnProcessor, ...) projects, norms, applies RoPE,
concatenates text and image tokens, calls `dispatch_attention_fn` (a global of its module), then splits and
projects back. The processor put in its place is an instance of a subclass of the stock class whose `__call__`
is the stock `__call__`'s own code object, with one global rebound: `dispatch_attention_fn` is `Dispatch8`,
which runs sdpa8 where it applies (lowbit_pipe.attention.route) and the stock dispatch elsewhere. Nothing of
the processor's code is copied, so everything but the attention call is diffusers' own, and the module's
global is untouched (other models, and this one after teardown, see the stock function).

Every swap goes through the ledger (undo: the stock processor back, checked by identity). `AppliedAttention`
also lets evaluate run the model with the stock processors for a moment (`stock()`), to compare against.
Processors that do not call `dispatch_attention_fn`, or hold weights (nn.Module processors: IP adapters), keep
their stock processor; the report names them with the reason.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe.attention.crossover import (
    CUDNN,
    AttentionRouter,
    CallShape,
    Path8,
    load_table,
    route_problem,
    routed_attention_op,
)
from lowbit_pipe.attention.fold import CUDNN_FOLDED, QKFold, fold_form, measure_codes, measured_run
from lowbit_pipe.attention.route import (
    NO_KERNEL,
    STOCK,
    attend8,
    call_form,
    count_call,
    format_problem,
    kernel_head_dims,
    traced_counting,
)
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.plan.policy import matches

DISPATCH_GLOBAL = "dispatch_attention_fn"
ROPE_GLOBAL = "apply_rotary_emb"


class Dispatch8:
    """`dispatch_attention_fn`'s signature ([B, N, H, D] tensors, as diffusers' dispatch takes them): 8-bit attention
    where it serves the call, the stock dispatch otherwise; `calls` counts each path (the Triton kernel's format,
    "cudnn_fp8", or the stock reason). On a GPU `router` (lowbit_pipe.attention.crossover) picks the path per call
    shape; without one the Triton kernel serves wherever it runs."""

    def __init__(self, qk_format: str, stock: Callable[..., torch.Tensor], calls: Counter,
                 head_dims: tuple[int, ...] | None = None, router: Any = None, cudnn: Any = None,
                 fold: Any = None) -> None:
        self.qk_format = qk_format
        self.stock = stock
        self.calls = calls
        self.head_dims = head_dims  # what the kernel serves on the model's GPU, looked up once (not in traced code)
        self.router = router
        self.cudnn = cudnn  # lowbit_pipe.kernels.cudnn_fp8_attention.CudnnFP8Attention, when the router may pick it
        self.fold = fold  # lowbit_pipe.attention.fold.QKFold: e4m3 q and k from the processor's RoPE
        self.cudnn_attend = None
        if cudnn is not None:
            from lowbit_pipe.kernels.cudnn_fp8_attention import attend

            self.cudnn_attend = attend
        self.count_key = traced_counting(calls)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None,
                 parallel_config: Any = None) -> torch.Tensor:
        if self.fold is not None and query.dtype == torch.float8_e4m3fn:  # q (and k) folded by the RoPE: cuDNN
            if key.dtype == torch.float8_e4m3fn:
                return self.fold.attend(query, key, value, scale)
            query = self.fold.decode_q(query, value.dtype)  # k did not fold: the unfolded paths
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if enable_gqa and k.dim() == 4 and q.shape[1] != k.shape[1] and q.shape[1] % k.shape[1] == 0:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        why, key_mask = call_form(q, k, v, mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)
        if why is None and attention_kwargs:
            why = "backend-specific attention_kwargs"
        if why is None and parallel_config is not None:
            why = "context parallelism"
        path = self.qk_format
        if why is None and q.is_cuda:
            if self.router is not None:
                if torch.compiler.is_compiling():  # one op: picked, counted and run when the graph runs
                    return routed_attention_op(q, k, v, scale, key_mask, self.router.key).transpose(1, 2)
                path, why = self.router.pick(q, key_mask is not None)
            elif q.shape[-1] not in (self.head_dims if self.head_dims is not None else kernel_head_dims(q.device)):
                why = NO_KERNEL
        if why is not None:
            count_call(self.calls, f"stock: {why}", self.count_key)
            return self.stock(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa, attention_kwargs=attention_kwargs, backend=backend,
                              parallel_config=parallel_config)
        count_call(self.calls, path, self.count_key)
        if path == CUDNN:
            return self.cudnn_attend(self.cudnn, q, k, v, scale, key_mask).transpose(1, 2)
        return attend8(q, k, v, self.qk_format, scale, key_mask).transpose(1, 2)


def supports(processor: Any) -> str | None:
    """Why `processor` cannot take 8-bit attention; None when it can."""
    if isinstance(processor, nn.Module):
        return f"{type(processor).__name__} holds weights (an nn.Module processor)"
    call = getattr(type(processor), "__call__", None)
    code = getattr(call, "__code__", None)
    if code is None or DISPATCH_GLOBAL not in code.co_names:
        return f"{type(processor).__name__} does not call {DISPATCH_GLOBAL}"
    return None


def processor_class(stock_cls: type, dispatch: Dispatch8) -> type:
    """A subclass of `stock_cls` whose __call__ is the stock code with `dispatch_attention_fn` bound to `dispatch`
    (same parameters: diffusers filters the kwargs it passes by the processor's signature). With the dispatch's
    fold and a processor class it knows (fold.FOLD_FORMS), `apply_rotary_emb` is bound to the fold's RoPE too, and
    each call notes its module and mask for it."""
    rebinds: dict[str, Any] = {DISPATCH_GLOBAL: dispatch}
    form = fold_form(stock_cls) if dispatch.fold is not None else None
    if form is not None and ROPE_GLOBAL in stock_cls.__call__.__globals__:
        rebinds[ROPE_GLOBAL] = dispatch.fold.rope(stock_cls.__call__.__globals__[ROPE_GLOBAL])
    else:
        form = None
    cls = rebound_class(stock_cls, rebinds, "8bit",
                        f"with its attention call in 8-bit ({dispatch.qk_format} Q·Kᵀ, fp8 P·V)")
    if form is not None:
        cls.__call__ = dispatch.fold.wrap_call(cls.__call__, form)
    cls.lowbit_qk_format = dispatch.qk_format
    return cls


def rebound_class(stock_cls: type, rebinds: dict[str, Any], suffix: str, what: str) -> type:
    """A subclass of `stock_cls` named <stock>`suffix` whose __call__ is the stock __call__'s code object run
    against a copy of its globals with `rebinds` applied: nothing of the processor's code is copied, and its
    module's globals stay as they were. A class made by this function can be the stock class of another (the
    copy carries the first one's rebinds)."""
    rebound = rebound_function(stock_cls.__call__, rebinds, f"{stock_cls.__name__}{suffix}.__call__")
    return type(f"{stock_cls.__name__}{suffix}", (stock_cls,), {
        "__call__": rebound, "__module__": __name__, "__doc__": f"{stock_cls.__name__} {what}."})


def rebound_function(func: Callable[..., Any], rebinds: dict[str, Any], qualname: str) -> Callable[..., Any]:
    """A new function of `func`'s code object, defaults and closure, run against a copy of its globals with
    `rebinds` applied (the module's own globals stay as they were)."""
    scope = dict(func.__globals__)
    scope.update(rebinds)
    # Without a module name torch.compile guards these globals as this very dict; with the module's name it would
    # look them up on the module (sys.modules), where they are the stock functions.
    scope.pop("__name__", None)
    rebound = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    rebound.__kwdefaults__ = func.__kwdefaults__
    rebound.__qualname__ = qualname
    rebound.__doc__ = func.__doc__
    return rebound


def processor_for(stock: Any, cls: type) -> Any:
    """An instance of `cls` carrying the stock processor's own settings (attention backend, parallel config)."""
    proc = cls.__new__(cls)
    proc.__dict__.update(vars(stock))
    return proc


@dataclass
class AppliedAttention:
    """8-bit attention as applied to one model: what got it, what kept its stock processor and why, the calls."""

    format: str
    modules: dict[str, tuple[nn.Module, Any, Any]] = field(default_factory=dict)  # name -> (module, stock, 8-bit)
    kept: dict[str, str] = field(default_factory=dict)  # attention module name -> why it keeps its own attention
    calls: Counter = field(default_factory=Counter)
    router: AttentionRouter | None = None  # on a GPU: the path per call shape (lowbit_pipe.attention.crossover)
    fold: Any = None  # lowbit_pipe.attention.fold.QKFold, with cuDNN: q and k in e4m3 from known processors' RoPE
    cudnn: Any = None  # lowbit_pipe.kernels.cudnn_fp8_attention.CudnnFP8Attention: its graphs, handles, workspaces
    notes: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def stock(self) -> Iterator[None]:
        """The stock processors for the duration (evaluate's float reference); the 8-bit ones back after."""
        done = []
        try:
            for module, stock, proc in self.modules.values():
                if module.processor is proc:
                    module.set_processor(stock)
                    done.append((module, proc))
            yield
        finally:
            for module, proc in reversed(done):
                module.set_processor(proc)

    def as_dict(self) -> dict[str, Any]:
        out = {"format": self.format, "modules": len(self.modules), "kept": dict(self.kept),
               "calls": dict(sorted(self.calls.items()))}
        if self.router is not None:
            out["route"] = self.router.as_dict()
        if self.cudnn is not None:
            out["cudnn"] = self.cudnn.as_dict()
        if self.fold is not None:
            out["fold"] = self.fold.as_dict()
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def attention_modules(root: nn.Module) -> dict[str, nn.Module]:
    """The modules that run an attention processor (diffusers' AttentionModuleMixin and older Attention)."""
    return {name: m for name, m in root.named_modules() if hasattr(m, "set_processor") and hasattr(m, "processor")}


def arch_keep(arch: Any, enabled: bool) -> tuple[str, ...]:
    """The architecture's attention modules that keep the model's own attention (its policy's attention_keep),
    when the recipe's attention.arch_keep is on; () without a known architecture."""
    return tuple(arch.policy.attention_keep) if enabled and arch is not None else ()


def apply_attention(root: nn.Module, attention_format: str, ledger: Ledger, layers: list[str] | tuple[str, ...] = ("*",),
                    path: str = "attention", keep: tuple[str, ...] = (), route: str = "auto",
                    speed_cache: str | None = None, measure: bool = True, fold_qk: bool = True
                    ) -> AppliedAttention | None:
    """Give every attention module of `root` whose name matches `layers` (globs, or `re:` regexes) and not `keep`
    (the arch's attention_keep) an 8-bit processor, each swap recorded in `ledger`. "bf16" changes nothing (None).
    `path`: the recipe key, in errors. On a GPU, `route` picks the kernel per call: "auto" by speed at the call's
    shape (cuDNN's FP8 attention, the Triton kernel, or the model's own attention where it is faster; measured
    times cached under `speed_cache`, see lowbit_pipe.attention.crossover; `measure`: time shapes the cache
    lacks), "cudnn" / "triton" that kernel wherever it serves. `fold_qk` (recipe attention.fold_qk): with cuDNN, q and
    k in e4m3 from known processors' RoPE (lowbit_pipe.attention.fold)."""
    problem = format_problem(attention_format)
    if problem is not None:
        raise ValueError(f"{path}.format {problem}")
    problem = route_problem(route)
    if problem is not None:
        raise ValueError(f"{path}.route {problem}")
    if attention_format == STOCK:
        return None
    try:
        import lowbit_pipe.kernels.attention8  # noqa: F401 - Triton's import: the kernel and its torch reference
    except ImportError as err:
        raise ImportError(f"{path}.format={attention_format} needs triton (lowbit_pipe.kernels.attention8): {err}") from None
    applied = AppliedAttention(attention_format)
    device = next((t.device for t in root.parameters()), torch.device("cpu"))
    head_dims = kernel_head_dims(device) if device.type == "cuda" else None
    if device.type == "cuda":
        applied.router, applied.cudnn = device_router(attention_format, device, route, speed_cache, measure, path,
                                                      applied.notes, applied.calls)
        if applied.cudnn is not None and fold_qk:
            applied.fold = QKFold(applied.router, applied.cudnn, applied.calls, traced_counting(applied.calls))
    classes: dict[type, type] = {}
    for name, module in attention_modules(root).items():
        if not any(matches(p, name) for p in layers):
            applied.kept[name] = f"not in {path}.layers"
            continue
        if any(matches(p, name) for p in keep):
            applied.kept[name] = f"the architecture keeps its own attention here ({path}.arch_keep)"
            continue
        stock = module.processor
        why = supports(stock)
        if why is not None:
            applied.kept[name] = why
            continue
        stock_cls = type(stock)
        if stock_cls not in classes:
            dispatch = Dispatch8(attention_format, stock_cls.__call__.__globals__[DISPATCH_GLOBAL], applied.calls,
                                 head_dims, applied.router, applied.cudnn, applied.fold)
            classes[stock_cls] = processor_class(stock_cls, dispatch)
        proc = processor_for(stock, classes[stock_cls])
        swap_processor(ledger, name, module, stock, proc)
        applied.modules[name] = (module, stock, proc)
    ledger.record("attention8", f"8-bit attention ({attention_format}) on {len(applied.modules)} modules",
                  lambda: _forget(applied), check=lambda: True if not applied.modules else "8-bit processors still held")
    return applied


def _forget(applied: AppliedAttention) -> None:
    """After the swaps are undone (they were recorded before this entry, so unwind reaches them after it): drop
    the references to the modules and processors, so nothing of the run is kept alive by this object; release
    cuDNN's graphs, workspaces and handles."""
    applied.modules.clear()
    if applied.fold is not None:
        applied.fold.bounds.clear()
    if applied.cudnn is not None:
        applied.cudnn.close()


def device_router(attention_format: str, device: torch.device, route: str = "auto", speed_cache: str | None = None,
                  measure: bool = True, path: str = "attention", notes: list[str] | None = None,
                  calls: Counter | None = None) -> tuple[AttentionRouter, Any]:
    """The per-shape router of one CUDA device and cuDNN's FP8 runner it holds (None where cuDNN does not serve:
    why in `notes`); `path`: the recipe key, in errors. apply_attention's, and the ComfyUI override's."""
    notes = notes if notes is not None else []
    cudnn = _cudnn_runner(attention_format, device, route, path, notes)
    router = _router(attention_format, device, kernel_head_dims(device), cudnn, route, speed_cache, measure, notes,
                     calls if calls is not None else Counter())
    return router, cudnn


def _cudnn_runner(attention_format: str, device: torch.device, route: str, path: str, notes: list[str]) -> Any:
    """cuDNN's FP8 attention for attention.format=fp8 on Hopper or newer, or None (why in `notes`). Missing, the
    Triton kernel serves instead; with route "cudnn" it is an error."""
    if attention_format != "fp8" or route == "triton":
        return None
    if torch.cuda.get_device_capability(device) < (9, 0):
        notes.append("cuDNN's FP8 attention not used: it needs Hopper or newer")
        return None
    try:
        from lowbit_pipe.kernels.cudnn_fp8_attention import CudnnFP8Attention

        return CudnnFP8Attention()
    except ImportError as err:
        if route == "cudnn":
            raise ImportError(f"{path}.route=cudnn: {err}") from None
        notes.append(f"cuDNN's FP8 attention not used ({err}); the Triton kernel and the model's own attention serve")
        return None


def _router(attention_format: str, device: torch.device, head_dims: tuple[int, ...] | None, cudnn: Any, route: str,
            speed_cache: str | None, measure: bool, notes: list[str], calls: Counter) -> AttentionRouter:
    """The per-shape choice among cuDNN's kernel (when `cudnn`), the Triton kernel and the model's own attention."""
    paths = []
    if cudnn is not None:
        from lowbit_pipe.kernels.cudnn_fp8_attention import plan_key

        index = device.index if device.index is not None else torch.cuda.current_device()

        def cudnn_why_not(s: CallShape) -> str | None:
            return cudnn.why_not(plan_key(index, s.batch, s.heads, s.tokens, s.head_dim, s.masked))

        paths.append(Path8(CUDNN_FOLDED, "cudnn_folded", f"{CUDNN_FOLDED} ({cudnn.version})", cudnn_why_not,
                           measured_run(cudnn), measure_codes))
        paths.append(Path8(CUDNN, "cudnn", f"{CUDNN} ({cudnn.version})", cudnn_why_not, cudnn))
    served = head_dims or ()

    def triton_why_not(s: CallShape) -> str | None:
        return None if s.head_dim in served else NO_KERNEL

    def triton_run(q, k, v, sm_scale, key_mask):
        return attend8(q, k, v, attention_format, sm_scale, key_mask)

    paths.append(Path8(attention_format, "triton", f"triton_{attention_format}", triton_why_not, triton_run))
    table = None
    try:
        table = load_table(device, speed_cache)
    except Exception as err:  # noqa: BLE001 - the user's cache file, unreadable: not ours to replace
        notes.append(f"attention speed table not used ({err}); the default rule decides, nothing is saved")
    return AttentionRouter(paths, device, table, route=route, measure=measure, calls=calls)


def swap_processor(ledger: Ledger, name: str, module: nn.Module, stock: Any, proc: Any) -> None:
    """module.processor = proc, with an undo that puts `stock` back (refusing if someone replaced proc since)."""
    module.set_processor(proc)

    def undo() -> None:
        if module.processor is not proc:
            raise RuntimeError(f"{name}.processor was replaced by someone else after the 8-bit one; left as is")
        module.set_processor(stock)

    ledger.record("attention_processor", f"{name}.processor", undo,
                  check=lambda: True if module.processor is stock else "not the stock processor")
    ledger.watch(f"{name}.processor ({type(proc).__name__})", proc)
