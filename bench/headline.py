"""The headline: the full-size Krea 2 forward at 1024x1024 (4096 image + 512 text tokens), driven through
the recipes, every variant in one process on one model, side by side with what a user can pick today.

    python bench/headline.py --out bench/results/headline_h200.json              # H200, full size, ~5 min
    python bench/headline.py --device cpu --small --out /tmp/headline_cpu.json   # smoke run: tiny config

The model: diffusers' `Krea2Transformer2DModel` with its default config (the released 12.8B shape), seeded
random weights, bf16, built on the device. Each recipe variant runs `lowbit_pipe.run(recipe, overrides,
model=m)` with `pipeline=[load, detect, quantize, (lora,) compile]`, is timed, and is torn down (the model
is restored bit for bit before the next). torchao fp8-row (compiled the same way, regionally) runs first, on a
second model built from the same seed (it changes weights in place with no undo), which is freed before the
recipe variants run: a call cut short by its time limit still has the baseline beside what it measured.

8-bit attention rows add `attention.format` to a recipe variant (the joint blocks' attention in the Triton
kernel); sageattention runs on the bf16 model, eager and through the compile stage (`sageattention_rows`), where
the package imports (`--no-sage` leaves it out).

Per variant: ms per forward (CUDA events, mean of --iters after warm-up) and the ratio to bf16 with the
compile stage measured in the same run, weight bytes (the model's parameters and buffers, quantized layers
at their stored size), peak device memory (float originals are kept by the run for teardown: they are in
it), compile seconds (the first call, minus one steady call), dynamo's graphs and graph breaks over the
variant, and the output's relative error against bf16 eager on the same weights (random weights amplify
error through 28 blocks: a regression figure, not fidelity). The LoRA variant also counts recompiles when
the strength changes, a same-rank LoRA is swapped in, and a different-rank one replaces it.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outputs import save_outputs

import lowbit_pipe
from lowbit_pipe import lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.lora.make_example import example_lora
from lowbit_pipe.stages.compile import dynamo_counters

SMALL_CONFIG = {"in_channels": 16, "num_layers": 2, "attention_head_dim": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 512, "timestep_embed_dim": 64, "text_hidden_dim": 64,
                "num_text_layers": 2, "text_num_attention_heads": 2, "text_num_key_value_heads": 2,
                "text_intermediate_size": 128, "num_layerwise_text_blocks": 1, "num_refiner_text_blocks": 1,
                "axes_dims_rope": (16, 24, 24)}
QUANT = ["pipeline=[load,detect,quantize,compile]"]
# (label, recipe, overrides, compiled). Block linears only: the arch's keep-float list stays bf16.
VARIANTS = (
    ("bf16, compile stage (regional)", "default", ["pipeline=[load,detect,compile]"], True),
    ("fp8, compiled", "default", QUANT + ["quantize.default.format=fp8"], True),
    ("int8, compiled", "default", QUANT + ["quantize.default.format=int8"], True),
    ("nvfp4 weight-only, compiled", "default",
     QUANT + ["quantize.default.format=nvfp4", "quantize.default.activations=none"], True),
    # The 0.3x byte target: the arch keeps time_mod_proj (453 MB) and the text fusion (687 MB) float; int8 there
    # (rules win over keep-float) takes the model from 0.319x to 0.296x of bf16's bytes. On the tiny Krea 2 the
    # output's rel error stays 0.00592 (evaluate stage), the int8 layers' own error included.
    ("nvfp4 weight-only + int8 modulation and text fusion, compiled", "default",
     QUANT + ["quantize.default.format=nvfp4", "quantize.default.activations=none",
              "quantize.rules=[{match: time_mod_proj, format: int8, activations: dynamic},"
              "{match: 'text_fusion.*', format: int8, activations: dynamic}]"], True),
    ("krea2_nvfp4 (ConvRot NVFP4 + INT8), compiled", "krea2_nvfp4", QUANT, True),  # nvfp4_compute=auto
    ("krea2_nvfp4, NVFP4 activations emulated, compiled", "krea2_nvfp4", QUANT + ["quantize.nvfp4_compute=nvfp4"],
     True),
    ("krea2_nvfp4, fp8 compute, compiled", "krea2_nvfp4", QUANT + ["quantize.nvfp4_compute=fp8"], True),
    ("fp8 + LoRA rank 32 on every block, compiled", "default",
     ["pipeline=[load,detect,quantize,lora,compile]", "quantize.default.format=fp8",
      "lora.files=[{path: 'example:peft:rank=32:seed=1', name: a}]"], True),
    ("fp8, no compile", "default", ["pipeline=[load,detect,quantize]", "quantize.default.format=fp8"], False),
    ("int8, no compile", "default", ["pipeline=[load,detect,quantize]", "quantize.default.format=int8"], False),
    # 8-bit attention (attention.format): the joint blocks' attention in the Triton kernel; the text fusion keeps
    # torch's (attention.arch_keep). Weights untouched in the first row: quantize.keep holds every layer.
    ("bf16 + fp8 attention, compiled", "default",
     QUANT + ["quantize.keep=['*']", "attention.format=fp8"], True),
    ("fp8 + fp8 attention, compiled", "default", QUANT + ["quantize.default.format=fp8", "attention.format=fp8"], True),
    ("int8 + int8 attention, compiled", "default",
     QUANT + ["quantize.default.format=int8", "attention.format=int8"], True),
    ("krea2_nvfp4, fp8 compute + fp8 attention, compiled", "krea2_nvfp4",
     QUANT + ["quantize.nvfp4_compute=fp8", "attention.format=fp8"], True),
    ("fp8 + fp8 attention, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.default.format=fp8", "attention.format=fp8"], False),
    ("int8 + int8 attention, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.default.format=int8", "attention.format=int8"], False),
    ("krea2_nvfp4, fp8 compute, no compile", "krea2_nvfp4",
     ["pipeline=[load,detect,quantize]", "quantize.nvfp4_compute=fp8"], False),
    ("krea2_nvfp4, fp8 compute + fp8 attention, no compile", "krea2_nvfp4",
     ["pipeline=[load,detect,quantize]", "quantize.nvfp4_compute=fp8", "attention.format=fp8"], False),
    # The uncompiled path with the norms and RoPE as one kernel each (attention.fused_norm_rope).
    ("bf16 + fused norm/RoPE, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.keep=['*']", "attention.fused_norm_rope=true"], False),
    ("fp8 + fused norm/RoPE, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.default.format=fp8", "attention.fused_norm_rope=true"], False),
    ("int8 + fused norm/RoPE, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.default.format=int8", "attention.fused_norm_rope=true"], False),
    ("fp8 + fp8 attention + fused norm/RoPE, no compile", "default",
     ["pipeline=[load,detect,quantize]", "quantize.default.format=fp8", "attention.format=fp8",
      "attention.fused_norm_rope=true"], False),
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Mean ms of `fn` over `iters` calls (CUDA events on the GPU, wall clock on the CPU)."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def first_call_s(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def build_krea2(device: torch.device, small: bool) -> torch.nn.Module:
    """diffusers' Krea2Transformer2DModel with its default config (the released 12.8B shape; `small`: SMALL_CONFIG),
    weights from seed 0 (the same every build), bf16, built on `device`: the model every full-size bench uses."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(0)
    with torch.device(device):
        return Krea2Transformer2DModel(**(SMALL_CONFIG if small else {})).to(torch.bfloat16).eval()


def krea2_inputs(model: torch.nn.Module, device: torch.device, small: bool, text_valid: int | None = None,
                 size: int = 1024) -> dict[str, Any]:
    """One size x size forward's inputs ((size / 16)² image + 512 text tokens: 4096 + 512 at 1024²; `small`:
    64 + 8), seed 1234, bf16.
    `text_valid`: also the text padding mask diffusers' Krea2Pipeline always passes (`encoder_attention_mask`),
    the first `text_valid` text tokens attended and the rest padding; None: no mask (every text token valid)."""
    image_tokens, text_tokens = (64, 8) if small else ((size // 16) ** 2, 512)
    arch = get_arch("krea2")
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=image_tokens, text_tokens=text_tokens,
                                 generator=torch.Generator().manual_seed(1234), dtype=torch.bfloat16, device=device)
    return inputs if text_valid is None else arch.padded_text_inputs(inputs, text_valid)


def tensor_storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass (torchao's quantized weights) by its inner tensors, whose nominal
    dtype is the float one it stands for (a row in the 2026-12-04 run counted torchao's fp8 weights as bf16)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_storage_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def model_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_storage_bytes(t)
    return total


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def measure(label: str, fn: Callable[[], torch.Tensor], device: torch.device, iters: int, ref: torch.Tensor | None,
            compiled: bool) -> dict[str, Any]:
    before = dynamo_counters()
    first = first_call_s(fn, device)
    steady = first_call_s(fn, device)
    with torch.no_grad():
        y = fn()
    ms = timed_ms(fn, device, iters)
    after = dynamo_counters()
    row = {"variant": label, "ms": ms, "first_call_s": first, "compile_s": max(first - steady, 0.0) if compiled else None,
           "graphs": after["graphs"] - before["graphs"], "graph_breaks": after["graph_breaks"] - before["graph_breaks"],
           "rel_err_vs_bf16": rel_err(y, ref) if ref is not None else 0.0}
    print(f"  {label}: {ms:.2f} ms, first call {first:.1f} s, graphs {row['graphs']}, breaks {row['graph_breaks']}, "
          f"err {row['rel_err_vs_bf16']:.3e}", flush=True)
    return row


def lora_recompiles(model: torch.nn.Module, arch: Any, forward: Callable[[], torch.Tensor], device: torch.device
                    ) -> dict[str, Any]:
    """Graphs compiled by: a strength change, a same-rank swap, a different-rank replacement (one forward each)."""
    out: dict[str, Any] = {}
    names = list(lora.attached(model))

    def graphs_after(step: Callable[[], None]) -> int:
        before = dynamo_counters()["graphs"]
        step()
        forward()
        sync(device)
        return dynamo_counters()["graphs"] - before

    out["strength_change"] = graphs_after(lambda: lora.set_strength(model, names[0], 0.5))
    same, _ = example_lora(model, arch, style="peft", rank=32, seed=2)
    out["swap_same_rank"] = graphs_after(lambda: (lora.remove(model, names[0]), lora.attach(model, same, name="b")))
    other, _ = example_lora(model, arch, style="peft", rank=16, seed=3)
    out["swap_rank_16"] = graphs_after(lambda: (lora.remove(model, "b"), lora.attach(model, other, name="c")))
    out["block_shapes"] = 1  # every Krea 2 block has the same shapes: one compiled block graph serves all 28
    lora.remove(model, "c")
    return out


def torchao_fp8_row(model: torch.nn.Module, forward: Callable[[], torch.Tensor], device: torch.device, iters: int,
                    ref: torch.Tensor) -> dict[str, Any]:
    """torchao's dynamic fp8 with row-wise scales on the 224 block linears, each block torch.compile'd."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    t = time.perf_counter()
    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn.startswith("transformer_blocks."))
    quant_s = time.perf_counter() - t
    for block in model.transformer_blocks:
        block.compile()
    row = measure("torchao fp8-row on the block linears, compiled", forward, device, iters, ref, True)
    row["quantize_s"] = quant_s
    row["weight_bytes"] = model_bytes(model)
    return row


class SageDispatch:
    """`dispatch_attention_fn`'s signature, running sageattention (bench only: the baseline users reach for)."""

    qk_format = "sageattention"

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
                 attention_kwargs: Any = None, *, backend: Any = None, parallel_config: Any = None) -> torch.Tensor:
        from sageattention import sageattn

        if attn_mask is not None or dropout_p or is_causal:
            raise ValueError("sageattention takes no mask, dropout or causal flag")
        return sageattn(query, key, value, tensor_layout="NHD", is_causal=False, sm_scale=scale)


def sageattention_rows(model: torch.nn.Module, forward: Callable[[], torch.Tensor], ref: torch.Tensor,
                       device: torch.device, iters: int, run_dir: Path) -> list[dict[str, Any]]:
    """sageattention (1.0.6, Triton: INT8 Q·Kᵀ, fp16 P·V) in the joint blocks of the bf16 model, eager and through
    the compile stage. diffusers' own "sage" backend asks for sageattention >= 2.1.1 (a CUDA build), so it goes in
    through the swap ours uses (the stock processor code, its attention call rebound); the text fusion (head dim 32,
    which sageattention refuses) keeps torch's. Processors restored after."""
    from lowbit_pipe.attention.processors import attention_modules, processor_class, processor_for

    swapped = {}
    classes: dict[type, type] = {}
    rows = []
    try:
        import sageattention  # noqa: F401
        for name, module in attention_modules(model).items():
            if name.startswith("transformer_blocks."):
                stock = module.processor
                cls = classes.setdefault(type(stock), processor_class(type(stock), SageDispatch()))
                module.set_processor(processor_for(stock, cls))
                swapped[name] = (module, stock)
        rows.append(measure("bf16 + sageattention, no compile", forward, device, iters, ref, False))
        result = lowbit_pipe.run("default", ["pipeline=[load,detect,compile]"], model=model, run_dir=run_dir)
        try:
            rows.append(measure("bf16 + sageattention, compiled", forward, device, iters, ref, True))
        finally:
            lowbit_pipe.teardown(result)
    except Exception as e:  # noqa: BLE001 -- a baseline that cannot run is reported, not fatal
        rows.append({"variant": "bf16 + sageattention", "error": f"{type(e).__name__}: {e}"})
        print(f"  sageattention: {type(e).__name__}: {e}", flush=True)
    finally:
        for module, stock in swapped.values():
            module.set_processor(stock)
    for r in rows:
        r["weight_bytes"] = model_bytes(model)
    return rows


def run_variant(label: str, recipe: str, overrides: list[str], compiled: bool, model: torch.nn.Module, arch: Any,
                forward: Callable[[], torch.Tensor], ref: torch.Tensor, float_bytes: int, device: torch.device,
                iters: int, run_dir: Path) -> dict[str, Any]:
    """One recipe variant on the model: run, measure, (LoRA recompiles,) tear down, check the restore."""
    t = time.perf_counter()
    result = lowbit_pipe.run(recipe, overrides, model=model, run_dir=run_dir)
    run_s = time.perf_counter() - t
    try:
        row = measure(label, forward, device, iters, ref, compiled)
        q = result.report.get("quantize") or {}
        row.update(run_s=run_s, weight_bytes=float_bytes - q.get("bytes_before", 0) + q.get("bytes_after", 0),
                   quantized_layers=sum((q.get("layers") or {}).values()),
                   peak_device_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        if any(o.startswith("lora.files") for o in overrides):
            row["lora_recompiles"] = lora_recompiles(model, arch, forward, device)
    finally:
        td = lowbit_pipe.teardown(result)
    row["teardown"] = {k: td.get(k) for k in ("proven", "retained_bytes", "unproven", "caveats") if k in td}
    row["restored_rel_err"] = rel_err(forward(), ref)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny config (a smoke run)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--only", nargs="*", help="labels (prefixes) of the variants to run ('torchao' for the torchao baseline); default all")
    p.add_argument("--no-torchao", action="store_true")
    p.add_argument("--no-sage", action="store_true", help="leave out the sageattention rows")
    p.add_argument("--text-valid", type=int, help="pass the pipeline's text padding mask, this many of the text "
                                                  "tokens attended (the pipeline always passes one); default: no mask")
    p.add_argument("--size", type=int, default=1024, help="image side in pixels: (size / 16)² image tokens")
    p.add_argument("--out", default="bench/results/headline_h200.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    def build() -> torch.nn.Module:
        return build_krea2(device, args.small)

    t = time.perf_counter()
    model = build()
    build_s = time.perf_counter() - t
    arch = get_arch("krea2")
    inputs = krea2_inputs(model, device, args.small, args.text_valid, args.size)
    params = sum(p.numel() for p in model.parameters())
    print(f"Krea 2 {params / 1e9:.2f}B params on {device}, built in {build_s:.1f} s", flush=True)

    def forward_of(m: torch.nn.Module) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            with torch.inference_mode():
                return arch.output_tensor(m(**inputs))
        return forward

    forward = forward_of(model)
    rows: list[dict[str, Any]] = []
    float_bytes = model_bytes(model)
    ref = forward()
    rows.append({**measure("bf16 eager", forward, device, args.iters, None, False), "weight_bytes": float_bytes})
    wanted = args.only
    if not args.no_torchao and (not wanted or any("torchao".startswith(w) for w in wanted)):
        rows.append(torchao_baseline(build, forward_of, device, args.iters, ref))
        write(rows, args, device, params, build_s, quiet=True)
    with tempfile.TemporaryDirectory() as scratch:
        if not args.no_sage and device.type == "cuda" and (not wanted or any("bf16 + sage".startswith(w) for w in wanted)):
            rows.extend(sageattention_rows(model, forward, ref, device, args.iters, Path(scratch) / "sage"))
            torch._dynamo.reset()
            write(rows, args, device, params, build_s, quiet=True)
        for i, (label, recipe, overrides, compiled) in enumerate(VARIANTS):
            if wanted and not any(label.startswith(w) for w in wanted):
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t = time.perf_counter()
            try:
                rows.append(run_variant(label, recipe, overrides, compiled, model, arch, forward, ref, float_bytes,
                                        device, args.iters, Path(scratch) / f"run{i}"))
            except Exception as e:  # noqa: BLE001 -- one variant that fails is reported; the others still run
                rows.append({"variant": label, "error": f"{type(e).__name__}: {e}"})
                print(f"  {label}: FAILED {type(e).__name__}: {e}", flush=True)
            rows[-1]["wall_s"] = time.perf_counter() - t  # run, measure and teardown: what a device call pays
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write(rows, args, device, params, build_s, quiet=True)  # a run cut short keeps what it measured
    write(rows, args, device, params, build_s)
    return 0


def torchao_baseline(build: Callable[[], torch.nn.Module], forward_of: Callable, device: torch.device, iters: int,
                     ref: torch.Tensor) -> dict[str, Any]:
    """torchao fp8-row on a second model of the same weights (checked: its bf16 output against `ref`), freed after,
    with dynamo's caches, so the recipe variants start as they would without it. torchao's quantize_ also sets
    Inductor options process-wide and never restores them (its recommended_inductor_config_setter: coordinate
    descent tuning and others; in the H200 run where they leaked, every later compile took 44-60 s instead of
    3-9 s): the options are restored here after it, and the ones it changed are named in the row."""
    import torch._inductor.config as inductor_config

    label = "torchao fp8-row on the block linears, compiled"
    t = time.perf_counter()
    twin = None
    saved = inductor_config.get_config_copy()
    changed: dict[str, Any] = {}
    try:
        twin = build()
        forward = forward_of(twin)
        twin_err = rel_err(forward(), ref)  # 0 unless a kernel is nondeterministic; weights of another seed: ~1
        if twin_err > 1e-3:
            raise RuntimeError(f"the second build's bf16 output is {twin_err:.2e} off the first's: not the same weights")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row = torchao_fp8_row(twin, forward, device, iters, ref)
        row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    except Exception as e:  # noqa: BLE001 -- a baseline that cannot run is reported, not fatal
        row = {"variant": label, "error": f"{type(e).__name__}: {e}"}
        print(f"  torchao: {type(e).__name__}: {e}", flush=True)
    finally:
        now = inductor_config.get_config_copy()
        changed = {k: repr(v) for k, v in now.items() if k in saved and v != saved[k]}
        inductor_config.load_config(saved)
        del twin
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["wall_s"] = time.perf_counter() - t
    row["inductor_options_it_set"] = changed
    return row


def write(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device, params: int, build_s: float,
          quiet: bool = False) -> None:
    base = next((r["ms"] for r in rows if r["variant"].startswith("bf16, compile")), None)
    cmd = "python bench/headline.py " + shlex.join(sys.argv[1:])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    head = (f"`{cmd}`\n\ndevice: {name} | torch {torch.__version__} | Krea 2 {params / 1e9:.2f}B params, bf16, random "
            f"weights | {'tiny config' if args.small else f'{args.size}²: {(args.size // 16) ** 2} image + 512 text tokens'} | "
            f"{'no text mask' if args.text_valid is None else f'text padding mask, {args.text_valid} text tokens valid'}"
            f" | built in {build_s:.1f} s\n\n"
            "x = bf16 compiled ms / variant ms (> 1 faster); err = ||y - y_bf16|| / ||y_bf16|| (random weights: "
            "regressions, not fidelity); compile s = first call minus a steady call; peak = max allocated while "
            "the variant ran (float originals kept for teardown included; torchao's includes the other model, kept on "
            "the device meanwhile)\n\n"
            "| variant | ms | x bf16 compiled | weight GB | peak GB | compile s | graphs | breaks | err |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        x = f"{base / r['ms']:.2f}x" if base else ""
        gb = lambda v: f"{v / 1e9:.2f}" if v else ""  # noqa: E731
        comp = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
        lines.append(f"| {r['variant']} | {r['ms']:.1f} | {x} | {gb(r.get('weight_bytes'))} | "
                     f"{gb(r.get('peak_device_bytes'))} | {comp} | {r['graphs']} | {r['graph_breaks']} | "
                     f"{r['rel_err_vs_bf16']:.2e} |")
    extra = [f"\nLoRA recompiles ({r['variant']}): {json.dumps(r['lora_recompiles'])}" for r in rows if "lora_recompiles" in r]
    table = head + "\n".join(lines) + "\n" + "\n".join(extra) + "\n"
    if not quiet:
        print(table)
    save_outputs(args.out, table, {"command": cmd, "device": name, "torch": torch.__version__, "params": params,
                                   "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
