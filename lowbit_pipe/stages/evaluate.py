"""evaluate: the quantized model against its own float originals, on seeded inputs.

Figures (report.json `evaluate`): model-output rel_error / cosine / max_abs_error / psnr_db; per-layer
SQNR (each quantized layer on the float layer's own input); sampling-trajectory fidelity (Euler
flow-matching from N seeds, both models); optional decoded images (PSNR, SSIM, PNG grid); weight
bytes; peak device memory and forward latency on CUDA only (null on CPU, where timing means little).

With 8-bit attention (the recipe's `attention:`), the float reference runs the model's own attention too, and
`attention` reports the 8-bit attention's own share: the float weights with 8-bit attention against the float
model (output and trajectories), beside the whole run's figures, and the attention calls per path.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lowbit_pipe.ledger import parent_of, tensor_bytes
from lowbit_pipe.measure import metrics, sampler
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register

TRAJECTORY_SEED_OFFSET = 10_000  # trajectory seeds differ from the output-sample seeds


@contextlib.contextmanager
def float_reference(ctx: Context, eager: bool = True, attention8: bool = False) -> Iterator[None]:
    """Temporarily put the float originals of every swapped layer back (exact reference, no copy), and the
    model's own attention where the run made it 8-bit (`attention8`: keep the 8-bit attention, to measure its
    own error on the float weights).

    `eager`: the float model runs eagerly even where the compile stage compiled its blocks
    (torch.compiler.set_stance("force_eager")). Compiled, every block would recompile for the float
    layers, and dynamo would trace layer_probes' hooks (a graph break per hook at each `float()`, a warning
    block on stderr, recompiles up to the cache limit): 87 s instead of 2 s on the tiny model. The float
    reference is eager float, as the model the user started from; the quantized model runs as compiled."""
    root = ctx.transformer
    swapped = []
    stack = contextlib.ExitStack()
    try:
        if eager:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        if ctx.attention is not None and not attention8:
            stack.enter_context(ctx.attention.stock())
        for name in ctx.ledger.swapped():
            original = ctx.ledger.original(name)
            if original is None:
                raise RuntimeError(f"no float original of '{name}' (quantize.originals=drop): cannot evaluate")
            parent, attr = parent_of(root, name)
            quantized = getattr(parent, attr)
            device = next(quantized.buffers()).device
            original_device = next(original.parameters()).device
            setattr(parent, attr, original.to(device))
            swapped.append((parent, attr, quantized, original, original_device))
        yield
    finally:
        for parent, attr, quantized, original, original_device in reversed(swapped):
            original.to(original_device)
            setattr(parent, attr, quantized)
        stack.close()


@contextlib.contextmanager
def layer_probes(ctx: Context, sums: dict[str, list[float]]) -> Iterator[dict[str, list[float]]]:
    """Forward hooks on the float originals: each runs its quantized twin on the very same input and
    adds [sum ref^2, sum (q - ref)^2] into `sums[name]`. Enter it BEFORE float_reference (it reads the
    quantized modules from the tree). The hooks live only inside the `with`: removed in `finally`."""
    handles = []

    def probe(name: str, quantized: nn.Module) -> Callable:
        def hook(_module: nn.Module, args: tuple, out: Any) -> None:
            signal, noise = metrics.noise_power(out, quantized(*args))
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += signal
            acc[1] += noise
        return hook

    try:
        root = ctx.transformer
        for name in ctx.ledger.swapped():
            original = ctx.ledger.original(name)
            if original is not None:
                handles.append(original.register_forward_hook(probe(name, root.get_submodule(name))))
        yield sums
    finally:
        for handle in handles:
            handle.remove()


def _format_name(module: nn.Module) -> str:
    fmt = getattr(module, "format", None)
    return getattr(fmt, "name", None) or type(module).__name__


def cuda_latency_ms(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Mean milliseconds of `fn()` on the current CUDA stream (CUDA events, after warm-up)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@register
class Evaluate(Stage):
    name = "evaluate"

    def run(self, ctx: Context) -> dict[str, Any]:
        if ctx.arch is None:
            result = {"skipped": "no example inputs for an unknown architecture"}
        elif ctx.native:
            result = {"skipped": "the model has native (ComfyUI) module names: the arch's example inputs fit its "
                                 "diffusers class, not this model's forward"}
        elif not ctx.ledger.swapped() and ctx.attention is None:
            result = {"skipped": "nothing was quantized in this run (no float reference to compare against)"}
        else:
            result = self._measure(ctx)
        ctx.report["evaluate"] = result
        return result

    def _inputs(self, ctx: Context, seed: int, batch: int) -> dict[str, Any]:
        return ctx.example_inputs(seed, batch)

    def _forward(self, ctx: Context) -> Callable[[dict[str, Any]], torch.Tensor]:
        model, arch = ctx.transformer, ctx.arch
        return lambda kwargs: arch.output_tensor(model(**kwargs))

    def _measure(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.evaluate
        runs = 3 if ctx.attention is not None else 2  # quantized, float (and float with 8-bit attention)
        with ctx.console.task("evaluate: forwards", runs * (cfg.samples + cfg.trajectory_seeds * cfg.steps)) as task:
            return self._measured(ctx, self._counted(self._forward(ctx), task))

    @staticmethod
    def _counted(forward: Callable[[dict[str, Any]], torch.Tensor], task: Any) -> Callable:
        """`forward`, advancing the progress task once per model forward (quantized or float): a full-size
        model's evaluate is minutes of forwards, each sample and trajectory step a few of them."""
        def counted(kwargs: dict[str, Any]) -> torch.Tensor:
            out = forward(kwargs)
            task.advance()
            return out
        counted.uncounted = forward
        return counted

    def _measured(self, ctx: Context, forward: Callable) -> dict[str, Any]:
        cfg = ctx.recipe.evaluate
        cuda = ctx.device.type == "cuda"
        result: dict[str, Any] = {}
        refs, outs, attention_outs = [], [], []
        sums: dict[str, list[float]] = {}
        with torch.inference_mode():
            for i in range(cfg.samples):
                inputs = self._inputs(ctx, cfg.seed + i, cfg.batch)
                if cuda and i == 0:  # peak of one quantized forward (the runner reset the stats at stage start)
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                outs.append(forward(inputs).float().cpu())
                if cuda and i == 0:
                    result["peak_device_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
                with layer_probes(ctx, sums) if cfg.layers else contextlib.nullcontext(), float_reference(ctx):
                    refs.append(forward(inputs).float().cpu())
                if ctx.attention is not None:
                    with float_reference(ctx, attention8=True):
                        attention_outs.append(forward(inputs).float().cpu())
            result.update(metrics.compare(torch.cat([r.flatten() for r in refs]), torch.cat([o.flatten() for o in outs])))
            result["samples"] = cfg.samples
            result["psnr_db"] = metrics.finite(result["psnr_db"])
            if cfg.layers:
                result.update(self._layers(ctx, sums))
            finals = []
            if cfg.trajectory_seeds:
                result["trajectory"], finals = self._trajectory(ctx, forward)
            if cfg.images:
                from lowbit_pipe.measure.images import compare_images

                result["images"] = compare_images(ctx, finals, ctx.run_dir / "images.png",
                                                  seeds=result["trajectory"]["seeds"], steps=cfg.steps)
            if ctx.attention is not None:
                result["attention"] = self._attention_share(ctx, forward, refs, attention_outs, result, finals)
            result.update(self._bytes(ctx))
            result["peak_device_bytes"] = result.get("peak_device_bytes")
            result["latency_ms"] = self._latency(ctx, forward.uncounted) if cfg.latency and cuda else None
        result["objective"] = objective(result, cfg.objective, cfg.budget_bytes)
        return result

    def _layers(self, ctx: Context, sums: dict[str, list[float]]) -> dict[str, Any]:
        root = ctx.transformer
        layers = {}
        for name, (signal, noise) in sums.items():
            # To 1e-4 dB: the sums' last bits follow the CPU thread count (a float matmul's reduction
            # order), and a rerun on another machine must report the very same figures.
            sqnr = metrics.finite(metrics.sqnr_db(signal, noise))
            layers[name] = {"format": _format_name(root.get_submodule(name)),
                            "sqnr_db": None if sqnr is None else round(sqnr, 4)}
        finite = [(v["sqnr_db"], n) for n, v in layers.items() if v["sqnr_db"] is not None]
        worst = min(finite) if finite else (None, None)
        return {"layers": layers, "sqnr_min_db": worst[0], "sqnr_worst_layer": worst[1]}

    def _attention_share(self, ctx: Context, forward: Callable, refs: list[torch.Tensor],
                         attention_outs: list[torch.Tensor], whole: dict[str, Any], finals: list) -> dict[str, Any]:
        """The 8-bit attention's own error: the float weights with 8-bit attention against the float model,
        beside the whole run's (quantized weights and 8-bit attention) figures."""
        own = metrics.compare(torch.cat([r.flatten() for r in refs]), torch.cat([o.flatten() for o in attention_outs]))
        out: dict[str, Any] = {"format": ctx.attention.format, "rel_error": own["rel_error"], "cosine": own["cosine"],
                               "psnr_db": metrics.finite(own["psnr_db"]),
                               "share_of_rel_error": own["rel_error"] / whole["rel_error"] if whole["rel_error"] else None}
        if ctx.recipe.evaluate.trajectory_seeds:
            traj, _ = self._trajectory(ctx, forward, attention_only=True, refs=[r for r, _ in finals])
            out["trajectory"] = {k: traj[k] for k in ("cosines", "mean_cosine", "min_cosine", "diverged")}
        out["calls"] = dict(sorted(ctx.attention.calls.items()))
        ctx.report.setdefault("attention", {})["calls"] = out["calls"]
        return out

    def _trajectory(self, ctx: Context, forward: Callable, attention_only: bool = False,
                    refs: list | None = None) -> tuple[dict[str, Any], list]:
        """Euler trajectories of the run's model against the float model's (`attention_only`: of the float weights
        with the 8-bit attention instead; `refs`: the float trajectories' final latents, already sampled)."""
        cfg = ctx.recipe.evaluate
        scale = sampler.TIME_SCALE.get(ctx.arch.id, 1.0)
        seeds = [cfg.seed + TRAJECTORY_SEED_OFFSET + k for k in range(cfg.trajectory_seeds)]
        cosines, finals = [], []
        for i, seed in enumerate(seeds):
            inputs = self._inputs(ctx, seed, 1)
            with float_reference(ctx, attention8=True) if attention_only else contextlib.nullcontext():
                quant = sampler.euler_sample(forward, inputs, cfg.steps, scale)
            if refs is not None:
                ref = refs[i]
            else:
                with float_reference(ctx):
                    ref = sampler.euler_sample(forward, inputs, cfg.steps, scale)
            cosines.append(metrics.cosine(sampler.flatten_latent(ref), sampler.flatten_latent(quant)))
            finals.append((ref, quant))
        # A NaN cosine (non-finite latents) counts as diverged: `not c >= threshold` is True for NaN.
        diverged = sum(1 for c in cosines if not c >= cfg.diverge_cosine)
        clean = [c for c in cosines if math.isfinite(c)]
        return {"seeds": seeds, "steps": cfg.steps, "threshold": cfg.diverge_cosine,
                "cosines": [metrics.finite(c) for c in cosines],
                "mean_cosine": sum(clean) / len(clean) if clean and len(clean) == len(cosines) else None,
                "min_cosine": min(clean) if clean and len(clean) == len(cosines) else None,
                "diverged": diverged}, finals

    def _bytes(self, ctx: Context) -> dict[str, int]:
        """Weight bytes of the transformer as it runs, and of its float version (originals swapped in)."""
        root = ctx.transformer
        now = tensor_bytes(root)
        swapped = ctx.ledger.swapped()
        quant = sum(tensor_bytes(root.get_submodule(n)) for n in swapped)
        orig = sum(tensor_bytes(ctx.ledger.original(n)) for n in swapped if ctx.ledger.original(n) is not None)
        return {"weight_bytes": now, "float_weight_bytes": now - quant + orig}

    def _latency(self, ctx: Context, forward: Callable) -> dict[str, float]:
        cfg = ctx.recipe.evaluate
        inputs = self._inputs(ctx, cfg.seed, cfg.batch)
        quant = cuda_latency_ms(lambda: forward(inputs), cfg.latency_iters)
        with float_reference(ctx, eager=False):  # compiled like the quantized model: a like-for-like speedup
            ref = cuda_latency_ms(lambda: forward(inputs), cfg.latency_iters)
        return {"quantized": quant, "float": ref, "speedup": ref / quant}


# Objectives for sweepers (Optuna): higher is better; rel_error is negated.
OBJECTIVES = {"psnr_db": 1.0, "cosine": 1.0, "sqnr_min_db": 1.0, "rel_error": -1.0, "trajectory_min_cosine": 1.0}


def objective(result: dict[str, Any], name: str, budget_bytes: int | None) -> float | None:
    """One number to maximise. Over `budget_bytes` it is -1000 * bytes/budget: below any feasible
    figure, yet graded, so a search still moves toward the budget."""
    if budget_bytes is not None and result["weight_bytes"] > budget_bytes:
        return -1000.0 * result["weight_bytes"] / budget_bytes
    value = (result.get("trajectory") or {}).get("min_cosine") if name == "trajectory_min_cosine" else result.get(name)
    if value is None:  # null figure: an exact match (infinite PSNR / SQNR) is the best, non-finite output the worst
        return 1000.0 if result.get("rel_error") == 0 else -1000.0
    return OBJECTIVES[name] * value
