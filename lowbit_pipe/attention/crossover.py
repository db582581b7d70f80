"""Which attention serves a call on the GPU: cuDNN's FP8 kernel, the Triton 8-bit kernel or the model's own, by
speed at the call's shape (batch, heads, tokens, head dim, masked or not, dtype), so that 8-bit attention never
makes a model slower than its own attention.

Paths (the names `AppliedAttention.calls` counts them by): "cudnn_fp8" (lowbit_pipe.kernels.cudnn_fp8_attention,
attention.format=fp8 only), the Triton kernel under its Q·Kᵀ format ("fp8" / "int8", lowbit_pipe.kernels.
attention8), and the model's own attention ("stock: <why>").

The choice, per shape, once (then remembered):
1. The paths that can serve the call (cuDNN: installed, Hopper or newer, a head dim it takes, a graph it builds;
   Triton: Hopper or newer, head dim 64 / 128).
2. Their times and the model's own attention's (torch SDPA in the model's dtype, with the call's mask, standing
   for it), from the measured table when it has them all. The fastest is taken; an 8-bit path only when it takes
   at most MARGIN of the stock time (timing noise must not make a model slower).
3. Times the table lacks are measured on the spot -- random q, k, v of the call's shape, a tenth of the keys
   masked for a masked call (Krea 2 pads its text), each path's whole call timed by lowbit_pipe.measure.timing -- and
   saved, unless the call is being captured into a CUDA graph or measuring is off.
4. Otherwise the default rule (DEFAULT_MIN_TOKENS), from the figures measured on an H100 (issue 43, one run):
   cuDNN's kernel alone ran 0.84x torch's bf16 attention at 24 heads x 1280 tokens, 1.17-1.23x at 4608 and 1.42x
   at 16896 (48 heads x 128). Its q, k, v quantization is estimated, not measured, at about a fifth of the bf16
   attention's time at 4608 tokens (three tensors read twice and written once in 8 bits, the output read and
   written once, at ~3 TB/s), falling as 1/tokens: hence 8192 tokens, not 4608. The Triton kernel's whole call:
   0.22x at 1280, 0.77-0.85x at 4608, 1.13-1.16x at 16896. torch's masked SDPA is the slower: 8-bit attention
   gained 4 % on the whole Krea 2 forward with the text mask and lost 2 % without it, so masked calls take 8-bit
   paths from fewer tokens. bench/attention_route_gpu.py says where this rule's choice would be slower.
   The folded cuDNN path ("cudnn_fp8_folded", lowbit_pipe.attention.fold: q and k in e4m3 from their RoPE, only
   v's two passes left) is taken from 4096 tokens: with its norms and RoPE it ran 1.05x of bf16's at 4608
   tokens (48 heads), 1.02x at 4608 (24 heads), 1.50x at 16896 and 0.39x at 1280 on an H100
   (bench/results/attention_fold_h100.md). It serves only calls whose RoPE can fold (CallShape.folded), and is measured without the producer
   (its RoPE writes half the bytes the bf16 RoPE writes: the measured time is an upper bound of its cost).

Under torch.compile a routed call is one custom op (`lowbit_pipe::routed_attention`, a fake impl giving q's
layout) whose implementation picks, counts and runs the path when the graph runs: the choice needs no constant
shapes (a recompile with dynamic shapes keeps working), calls are counted one by one as in eager, and measuring
happens at the first real call of a shape, never while tracing. Inside it the model's own attention is torch's
SDPA (what diffusers' native backend calls, and what the times compare against).

The table is the speed table's mechanism (lowbit_pipe.plan.speed_table: one JSON file per device and torch / triton /
lowbit_pipe versions, written atomically), in its own file under the cache directory's `attention/`; an entry
names the path with its software (cuDNN's frontend and library versions for cuDNN's kernel).
"""

from __future__ import annotations

import itertools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lowbit_pipe.attention.route import NO_KERNEL
from lowbit_pipe.measure.timing import TimingSettings, time_ms
from lowbit_pipe.plan import speed_table

CUDNN = "cudnn_fp8"
STOCK = "stock"
MARGIN = 0.98  # an 8-bit path is chosen only at <= 98 % of the stock time
MASKED_FRACTION = 0.1  # keys masked in a measured masked call
ROUTES = ("auto", "cudnn", "triton")  # apply_attention(route=...): by speed, or that kernel wherever it serves


def route_problem(route: object) -> str | None:
    """What is wrong with an attention route (attention.route, apply_attention's route), or None: its one check."""
    return None if route in ROUTES else f"must be one of {', '.join(ROUTES)}, got {route!r}"

# default rule: (path kind, masked) -> fewest tokens from which the path is taken without a measurement
DEFAULT_MIN_TOKENS = {("cudnn_folded", False): 4096, ("cudnn_folded", True): 4096,
                      ("cudnn", False): 8192, ("cudnn", True): 4096,
                      ("triton", False): 16384, ("triton", True): 4096}
KINDS = ("cudnn_folded", "cudnn", "triton")  # the default rule's order of preference

@dataclass(frozen=True)
class CallShape:
    """What an attention call's speed depends on."""

    batch: int
    heads: int
    tokens: int
    head_dim: int
    masked: bool
    dtype: str  # torch dtype name: "bfloat16"
    folded: bool = False  # q and k can come in e4m3 from their RoPE (lowbit_pipe.attention.fold)

    def label(self) -> str:
        return (f"{self.batch}x{self.heads}x{self.tokens}x{self.head_dim}{' masked' if self.masked else ''} "
                f"{self.dtype}{' folded' if self.folded else ''}")

    def entry(self, path_label: str) -> str:
        """The table key of `path_label`'s time at this shape (a path's time does not depend on `folded`)."""
        return (f"attention|{path_label}|{self.batch}x{self.heads}x{self.tokens}x{self.head_dim}|{self.dtype}"
                f"|{'masked' if self.masked else 'full'}")


@dataclass
class Path8:
    """An 8-bit path: its name (as counted), kind ("cudnn_folded" / "cudnn" / "triton"), table label (with its
    software), why it cannot serve a shape (None: it can), and the call itself (q, k, v [B, H, N, D], sm_scale,
    key_mask [B, N]). `prepare(q, k, v, sm_scale, key_mask)`: what the timed call takes instead, made once before
    timing (the folded path's q and k codes: its producer writes them, not the call)."""

    name: str
    kind: str
    label: str
    why_not: Callable[[CallShape], str | None]
    run: Callable[..., torch.Tensor]
    prepare: Callable[..., tuple] | None = None


@dataclass(frozen=True)
class Choice:
    path: str  # a Path8 name, or STOCK
    why: str | None  # for STOCK: why the model's own attention runs
    by: str  # "measured", "default rule", "route=<forced>", "only path"
    ms: dict[str, float] = field(default_factory=dict)


def stock_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None,
                    key_mask: torch.Tensor | None) -> torch.Tensor:
    """The model's own attention as timed: torch SDPA with the call's boolean key mask."""
    mask = key_mask[:, None, None, :] if key_mask is not None else None
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)


def default_choice(shape: CallShape, serving: list[Path8]) -> Choice:
    """The rule without a measurement: the first serving path (cuDNN before Triton) past its token threshold."""
    for kind in KINDS:
        for p in serving:
            if p.kind == kind and shape.tokens >= DEFAULT_MIN_TOKENS[(kind, shape.masked)]:
                return Choice(p.name, None, "default rule")
    return Choice(STOCK, "faster at this shape (default rule, not measured)", "default rule")


def measure_inputs(shape: CallShape, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random q, k, v [B, H, N, D] (views of [B, N, H, D], diffusers' layout) and, for a masked shape, a key mask
    leaving out a block of a tenth of the keys."""
    b, h, n, d = shape.batch, shape.heads, shape.tokens, shape.head_dim
    gen = torch.Generator(device=device).manual_seed(n * 31 + h)
    x = torch.randn(3, b, n, h, d, device=device, generator=gen).to(getattr(torch, shape.dtype))
    key_mask = None
    if shape.masked:
        key_mask = torch.ones(b, n, dtype=torch.bool, device=device)
        start = n // 32
        key_mask[:, start:start + max(1, int(n * MASKED_FRACTION))] = False
    return x[0].transpose(1, 2), x[1].transpose(1, 2), x[2].transpose(1, 2), key_mask


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}


def dtype_name(dtype: torch.dtype) -> str:
    """A CallShape's dtype field."""
    return _DTYPE_NAMES.get(dtype, "other")
_KEYS = itertools.count(1)
_ROUTERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> AttentionRouter, for the custom op


class AttentionRouter:
    """The choice of path per call shape for one applied attention (see the module's doc).

    `paths`: the 8-bit paths, preferred first; `table`: the measured table (None: defaults only, nothing saved);
    `route`: "auto" (by speed) or a kind forced wherever it serves; `measure`: time shapes the table lacks;
    `calls`: where `run` counts the calls it routes; `timer(fn, device) -> ms` and `inputs(shape, device)`: the
    clock and the inputs (tests replace them)."""

    def __init__(self, paths: list[Path8], device: torch.device, table: speed_table.SpeedTable | None = None,
                 route: str = "auto", measure: bool = True, calls: Counter | None = None,
                 timer: Callable[[Callable[[], Any], torch.device], float] | None = None,
                 inputs: Callable[[CallShape, torch.device], tuple] = measure_inputs) -> None:
        problem = route_problem(route)
        if problem is not None:
            raise ValueError(f"attention route {problem}")
        self.paths = list(paths)
        self.device = device
        self.table = table
        self.route = route
        self.measure = measure
        self.timer = timer or (lambda fn, dev: time_ms(fn, dev, TimingSettings.for_device(dev)))
        self.inputs = inputs
        self.calls = calls if calls is not None else Counter()
        self.choices: dict[CallShape, Choice] = {}
        self.measure_errors: dict[str, str] = {}
        self.shapes_report: dict[str, dict[str, Any]] = {}  # live: as_dict hands out this very dict
        self.key = next(_KEYS)
        _ROUTERS[self.key] = self

    # ------------------------------------------------------------------------------------------------- choice
    def choose(self, shape: CallShape, allow_measure: bool = True) -> Choice:
        """The path for `shape` (remembered once made; a default-rule choice is made again when measuring has
        become possible)."""
        known = self.choices.get(shape)
        if known is not None and not (known.by == "default rule" and allow_measure and self._can_measure()):
            return known
        choice = self._choose(shape, allow_measure)
        self.choices[shape] = choice
        self.shapes_report[shape.label()] = {"path": choice.path, "by": choice.by,
                                             **({"ms": {k: round(v, 4) for k, v in choice.ms.items()}}
                                                if choice.ms else {})}
        return choice

    def _can_measure(self) -> bool:
        return self.measure and self.device.type == "cuda"

    def _choose(self, shape: CallShape, allow_measure: bool) -> Choice:
        paths = [p for p in self.paths if shape.folded or p.kind != "cudnn_folded"]  # folded: q, k from their RoPE
        why_not = {p.name: p.why_not(shape) for p in paths}
        serving = [p for p in paths if why_not[p.name] is None]
        if not serving:
            reasons = [w for w in why_not.values() if w]
            return Choice(STOCK, NO_KERNEL if reasons in ([], [NO_KERNEL]) else "; ".join(reasons), "only path")
        if self.route != "auto":
            forced = [p for p in serving if p.kind.split("_")[0] == self.route] or serving
            return Choice(forced[0].name, None, f"route={self.route}")
        labels = {p.name: p.label for p in serving}
        labels[STOCK] = STOCK
        times = self._times(shape, labels)
        if len(times) < len(labels) and allow_measure and self._can_measure():
            times = self._measure(shape, serving, labels, times)
        if len(times) < len(labels):
            return default_choice(shape, serving)
        best = min((p.name for p in serving), key=lambda name: times[name])
        if times[best] <= MARGIN * times[STOCK]:
            return Choice(best, None, "measured", dict(times))
        return Choice(STOCK, "faster at this shape (measured)", "measured", dict(times))

    def _times(self, shape: CallShape, labels: dict[str, str]) -> dict[str, float]:
        if self.table is None:
            return {}
        got = {name: self.table.times_ms.get(shape.entry(label)) for name, label in labels.items()}
        return {name: ms for name, ms in got.items() if ms is not None}

    def _measure(self, shape: CallShape, serving: list[Path8], labels: dict[str, str],
                 times: dict[str, float]) -> dict[str, float]:
        """Time the paths `times` lacks, add them to the table and save it. A failure leaves the times as they
        were (the default rule then decides) and is reported in `measure_errors`."""
        runs = {p.name: (p.run, p.prepare) for p in serving}
        runs[STOCK] = (stock_attention, None)
        times = dict(times)
        try:
            x = self.inputs(shape, self.device)  # q, k, v, key_mask
            for name, (run, prepare) in runs.items():
                if name not in times:
                    args = prepare(x[0], x[1], x[2], None, x[3]) if prepare is not None else (x[0], x[1], x[2], None,
                                                                                             x[3])
                    times[name] = float(self.timer(lambda run=run, args=args: run(*args), self.device))
                    del args
            del x
        except Exception as err:  # noqa: BLE001 - a failed measurement must not fail the model's call
            self.measure_errors[shape.label()] = f"{type(err).__name__}: {str(err)[:300]}"
            return times
        if self.table is not None:
            for name, ms in times.items():
                self.table.times_ms[shape.entry(labels[name])] = ms
            self.table.measured += 1
            speed_table.save(self.table)
        return times

    # ------------------------------------------------------------------------------------------------- calls
    def pick(self, q: torch.Tensor, masked: bool) -> tuple[str, str | None]:
        """(path, why the model's own attention runs or None) for a [B, H, N, D] call (eager: not traced)."""
        b, h, n, d = q.shape
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()  # a CUDA graph being captured
        choice = self.choose(CallShape(int(b), int(h), int(n), int(d), bool(masked), dtype_name(q.dtype)),
                             allow_measure=not capturing)
        return choice.path, choice.why

    def runner(self, path: str) -> Callable[..., torch.Tensor]:
        """The call of the 8-bit path named `path` (a name `pick` returned): (q, k, v, sm_scale, key_mask)."""
        return next(p.run for p in self.paths if p.name == path)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None,
            key_mask: torch.Tensor | None) -> torch.Tensor:
        """Pick, count and run the path of a [B, H, N, D] call (the custom op's body): the output in q's layout,
        the model's own attention as torch SDPA."""
        path, why = self.pick(q, key_mask is not None)
        self.calls[path if why is None else f"stock: {why}"] += 1
        out = (stock_attention if path == STOCK else self.runner(path))(q, k, v, sm_scale, key_mask)
        if out.stride() != q.stride():  # the fake impl promised q's layout
            out = torch.empty_like(q).copy_(out)
        return out

    def as_dict(self) -> dict[str, Any]:
        """report.json's attention.route: the choice per shape, how it was made, and the times behind it. Its
        `shapes` and `measure_errors` are this router's own dicts, filled as calls come: a report made when the
        attention was applied (before any call) shows every choice when it is written out after the run."""
        return {"route": self.route, "paths": [p.label for p in self.paths],
                "table": str(self.table.path) if self.table is not None else None,
                "shapes": self.shapes_report, "measure_errors": self.measure_errors}


@torch.library.custom_op("lowbit_pipe::routed_attention", mutates_args=())
def routed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: Optional[float],
                        key_mask: Optional[torch.Tensor], router: int) -> torch.Tensor:
    """A routed call inside a compiled graph: the router `router` (a number: `AttentionRouter.key`) picks, counts
    and runs it when the graph runs."""
    owner = _ROUTERS.get(router)
    if owner is None:
        raise RuntimeError("lowbit_pipe: this compiled graph calls an 8-bit attention that was released (teardown); "
                           "compile the model again")
    return owner.run(q, k, v, sm_scale, key_mask)


@routed_attention_op.register_fake
def _(q, k, v, sm_scale, key_mask, router):
    return torch.empty_like(q)


def load_table(device: torch.device, cache: str | None = None, refresh: bool = False) -> speed_table.SpeedTable:
    """The measured attention table for `device` (the speed table's file mechanism, in `<cache>/attention/`)."""
    directory: Path = speed_table.cache_dir(cache) / "attention"
    return speed_table.load(directory, speed_table.table_key(device), refresh)
