"""8-bit attention's error where it matters: per attention layer on the activations of the tiny DiTs' sampling
trajectories, and on the trajectories of the whole model. Runs on the CPU (sdpa8's torch reference, the kernel's
arithmetic); --device cuda runs the Triton kernel where it serves (Hopper, head dims 64 / 128).

    python bench/attention8_error.py [--device cpu] [--out bench/results/attention8_error_cpu] [--smoke] [--full]

1. Per layer: each attention call of the tiny Krea 2 / FLUX.1 during float Euler sampling (--seeds seeds x
   --steps steps, --image-tokens image tokens) is captured (q, k, v as the stock processor attends over them:
   joint text + image, RoPE applied) and computed again by sdpa8 (int8 and fp8 Q·Kᵀ), by torch's SDPA on the
   inputs rounded to bf16, and by `sageattention` where it is installed and runs (a CUDA device), each against
   float64 softmax attention (`exact_attention`): cosine and relative error (|out - exact| / |exact|), the
   worst call of the layer and the mean over its calls.
2. Trajectories: the whole model's final latent after --steps Euler steps against the float model's, with the
   weights float / int8 / fp8 (W8A8, the arch's keep-float list) and the attention bf16 (the model's own) /
   int8 / fp8: cosine and relative error, mean over seeds. The attention's own share is the float-weights row.
3. --full: full-size Krea 2 (random weights, bf16), one forward at 1024 x 1024: 1. for its 48 + 4 attention
   layers, and the output with 8-bit attention against the stock forward's (the "full size" rows).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from outputs import save_outputs  # noqa: E402

import lowbit_pipe  # noqa: E402
from lowbit_pipe.arch.registry import get_arch  # noqa: E402
from lowbit_pipe.arch.tiny import build_tiny, tiny_model_config  # noqa: E402
from lowbit_pipe.attention import apply_attention  # noqa: E402
from lowbit_pipe.attention.processors import Dispatch8, attention_modules, processor_class, processor_for  # noqa: E402
from lowbit_pipe.kernels.attention8 import exact_attention, sdpa8  # noqa: E402
from lowbit_pipe.ledger import Ledger  # noqa: E402
from lowbit_pipe.measure import sampler  # noqa: E402

ARCHS = ("krea2", "flux1")
QK_FORMATS = ("int8", "fp8")
WEIGHTS = ("float", "int8", "fp8")
ATTENTIONS = ("bf16", "int8", "fp8")


class CaptureDispatch(Dispatch8):
    """The stock dispatch (the model computes as it always does); each unmasked call's q, k, v ([B, H, N, D]) go
    to `measure(layer, q, k, v)` first, on their device, and are not kept."""

    def __init__(self, stock: Any, measure: Any, layer: str) -> None:
        super().__init__("int8", stock, Counter())
        self.measure = measure
        self.layer = layer

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is None:
            self.measure(self.layer, *(t.transpose(1, 2).detach() for t in (query, key, value)))
        return self.stock(query, key, value, attn_mask, *args, **kwargs)


def capture_calls(model: torch.nn.Module, run: Any, measure: Any) -> None:
    """measure(layer, q, k, v) on every unmasked attention call while `run()` runs; the stock processors back after."""
    swapped = []
    for name, module in attention_modules(model).items():
        stock = module.processor
        cls = type(stock)
        proc = processor_for(stock, processor_class(cls, CaptureDispatch(cls.__call__.__globals__["dispatch_attention_fn"],
                                                                         measure, name)))
        module.set_processor(proc)
        swapped.append((module, stock))
    try:
        run()
    finally:
        for module, stock in swapped:
            module.set_processor(stock)


def _cos_rel(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    out, ref = out.double().flatten(), ref.double().flatten()
    return float(out @ ref / (out.norm() * ref.norm())), float((out - ref).norm() / ref.norm())


def exact_by_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int = 8) -> torch.Tensor:
    """float64 softmax attention a few heads at a time (the full-size scores would not fit at once)."""
    return torch.cat([exact_attention(q[:, i:i + heads], k[:, i:i + heads], v[:, i:i + heads])
                      for i in range(0, q.shape[1], heads)], dim=1)


def _sage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | str:
    """sageattention's output, or why there is none."""
    if q.device.type != "cuda":
        return "needs CUDA"
    try:
        from sageattention import sageattn
    except ImportError:
        return "not installed"
    try:
        return sageattn(q, k, v, tensor_layout="HND", is_causal=False)
    except Exception as err:  # noqa: BLE001 - a shape or GPU it does not take: said in the table's column, the rest goes on
        return f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"


def layer_figures() -> tuple[dict[str, dict[str, list]], Any]:
    """(figures per layer, measure(layer, q, k, v)): each call against float64 attention on its own q, k, v."""
    rows: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))

    def measure(layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        exact = exact_by_heads(q, k, v)
        figures = rows[layer]
        figures["shape"] = [list(q.shape)]
        for fmt in QK_FORMATS:
            figures[fmt].append(_cos_rel(sdpa8(q, k, v, fmt), exact))
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        figures["bf16_sdpa"].append(_cos_rel(F.scaled_dot_product_attention(qb, kb, vb), exact))
        sage = _sage(qb, kb, vb)
        if isinstance(sage, str):
            figures["sage_note"] = [sage]
        else:
            figures["sageattention"].append(_cos_rel(sage, exact))

    return rows, measure


def per_layer(arch_id: str, model: torch.nn.Module, inputs_for: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    scale = sampler.TIME_SCALE.get(arch_id, 1.0)
    arch = get_arch(arch_id)

    def run() -> None:
        with torch.no_grad():
            for seed in range(args.seeds):
                sampler.euler_sample(lambda kw: arch.output_tensor(model(**kw)), inputs_for(seed), args.steps, scale)

    rows, measure = layer_figures()
    capture_calls(model, run, measure)
    return summarize(arch_id, rows)


def summarize(arch_id: str, rows: dict[str, dict[str, list]]) -> list[dict[str, Any]]:
    out = []
    for layer, figures in rows.items():
        row: dict[str, Any] = {"arch": arch_id, "layer": layer, "calls": len(figures["bf16_sdpa"]),
                               "shape": figures["shape"][0]}
        for key in (*QK_FORMATS, "bf16_sdpa", "sageattention"):
            pairs = figures.get(key) or []
            if pairs:
                row[key] = {"min_cosine": min(c for c, _ in pairs), "mean_cosine": sum(c for c, _ in pairs) / len(pairs),
                            "max_rel": max(r for _, r in pairs), "mean_rel": sum(r for _, r in pairs) / len(pairs)}
            else:
                row[key] = None
        row["sageattention_note"] = (figures.get("sage_note") or [None])[0]
        out.append(row)
    return out


def trajectories(arch_id: str, base: torch.nn.Module, inputs_for: Any, args: argparse.Namespace) -> list[dict]:
    import copy

    arch = get_arch(arch_id)
    scale = sampler.TIME_SCALE.get(arch_id, 1.0)

    def finals(model: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [sampler.flatten_latent(sampler.euler_sample(lambda kw: arch.output_tensor(model(**kw)),
                                                                inputs_for(seed), args.steps, scale)).float().cpu()
                    for seed in range(args.seeds)]

    reference = finals(base)
    rows = []
    for weights in WEIGHTS:
        model = copy.deepcopy(base)
        ledger = Ledger()
        if weights != "float":
            lowbit_pipe.quantize(model, {"default": {"format": weights}}, ledger=ledger)
        for attention in ATTENTIONS:
            if weights == "float" and attention == "bf16":
                continue  # the reference itself
            applied = apply_attention(model, attention, ledger) if attention != "bf16" else None
            pairs = [_cos_rel(out, ref) for out, ref in zip(finals(model), reference)]
            rows.append({"arch": arch_id, "weights": weights, "attention": attention,
                         "mean_cosine": sum(c for c, _ in pairs) / len(pairs), "min_cosine": min(c for c, _ in pairs),
                         "mean_rel": sum(r for _, r in pairs) / len(pairs),
                         "calls": dict(applied.calls) if applied is not None else None})
            if applied is not None:  # the 8-bit processors off again, the quantized weights kept
                for module, stock, _ in applied.modules.values():
                    module.set_processor(stock)
                applied.modules.clear()
        ledger.unwind()
        del model
    return rows


def full_size(args: argparse.Namespace, device: torch.device) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Full-size Krea 2 (the released 12.82B shape, random weights from seed 0, bf16; --smoke: headline's small
    config), one forward at 1024 x 1024 (4096 image + 512 text tokens): every attention call against float64
    attention, and the forward's output with 8-bit attention against the stock one's."""
    from headline import build_krea2, krea2_inputs

    arch = get_arch("krea2")
    model = build_krea2(device, args.smoke)
    inputs = krea2_inputs(model, device, args.smoke)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return arch.output_tensor(model(**inputs))  # noqa: F821 - a cell variable, deleted only after the last call

    rows, measure = layer_figures()
    capture_calls(model, forward, measure)
    layers = summarize("krea2 (full size)", rows)
    reference = forward()
    outputs = []
    for fmt in QK_FORMATS:
        ledger = Ledger()
        applied = apply_attention(model, fmt, ledger)
        cos, rel = _cos_rel(forward(), reference)
        outputs.append({"arch": "krea2 (full size)", "weights": "bf16", "attention": fmt, "mean_cosine": cos,
                        "min_cosine": cos, "mean_rel": rel, "calls": dict(applied.calls), "forward": "one, 1024 x 1024"})
        ledger.unwind()
    del model
    return layers, outputs


def _fmt(fig: dict | None, key: str) -> str:
    if fig is None:
        return "-"
    return f"{fig[key]:.6f}" if "cosine" in key else f"{fig[key]:.2e}"


def table(payload: dict[str, Any]) -> str:
    lines = [f"# 8-bit attention's error ({payload['device']})", "", f"`{payload['command']}`", "",
             f"Tiny models in {payload['dtype']}, {payload['seeds']} seeds x {payload['steps']} Euler steps, {payload['image_tokens']} image "
             f"tokens + {payload['text_tokens']} text tokens; torch {payload['torch']}. Against float64 softmax "
             "attention on each call's own q, k, v (as the stock processor attends over them). "
             "rel = |out - exact| / |exact|.", "",
             "## Per attention layer (worst call / mean over the layer's calls)", "",
             "| arch | layer | calls | q shape | int8 min cos | int8 max rel | fp8 min cos | fp8 max rel | bf16 SDPA max rel "
             "| sageattention max rel |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["layers"]:
        sage = _fmt(r["sageattention"], "max_rel") if r["sageattention"] else f"n/a ({r['sageattention_note']})"
        lines.append(f"| {r['arch']} | {r['layer']} | {r['calls']} | {r['shape']} | {_fmt(r['int8'], 'min_cosine')} | "
                     f"{_fmt(r['int8'], 'max_rel')} | {_fmt(r['fp8'], 'min_cosine')} | {_fmt(r['fp8'], 'max_rel')} | "
                     f"{_fmt(r['bf16_sdpa'], 'max_rel')} | {sage} |")
    lines += ["", "## Trajectories (final latent against the float model's; the float-weights rows are the attention's "
              "own share; full-size rows: one forward's output against the stock forward's)", "", "| arch | weights | attention | 1 - mean cosine | 1 - min cosine | mean rel |", "|---|---|---|---|---|---|"]
    for r in payload["trajectories"]:
        lines.append(f"| {r['arch']} | {r['weights']} | {r['attention']} | {1 - r['mean_cosine']:.2e} | "
                     f"{1 - r['min_cosine']:.2e} | {r['mean_rel']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the Triton kernel where it serves)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="the tiny models' weights and activations (the float reference runs in it too); default "
                        "float32 on the CPU, bfloat16 on CUDA (what the kernel takes)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--image-tokens", type=int, default=1024)
    p.add_argument("--text-tokens", type=int, default=16)
    p.add_argument("--out", default=None, help="output stem (default bench/results/attention8_error_<device>)")
    p.add_argument("--smoke", action="store_true", help="1 seed, 2 steps, 64 image tokens: a quick check")
    p.add_argument("--full", action="store_true", help="also full-size Krea 2, one forward at 1024 x 1024 (a GPU with "
                   "40 GB; with --smoke: a small config)")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.image_tokens, args.text_tokens = 1, 2, 64, 8
    device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"attention8_error_{device.type}"
    payload: dict[str, Any] = {"command": " ".join(["python bench/attention8_error.py", *sys.argv[1:]]),
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
                               f"cpu ({platform.processor() or platform.machine()})", "torch": torch.__version__,
                               "dtype": args.dtype, "seeds": args.seeds, "steps": args.steps, "image_tokens": args.image_tokens,
                               "text_tokens": args.text_tokens, "layers": [], "trajectories": []}
    start = time.time()
    for arch_id in args.archs:
        arch = get_arch(arch_id)
        dtype = getattr(torch, args.dtype)  # the float reference runs in it too: the rows compare attention alone
        base = build_tiny(arch_id, tiny_model_config(arch_id), 0, dtype).to(device)

        def inputs_for(seed: int, _arch=arch, _base=base) -> dict[str, Any]:
            return _arch.example_inputs(dict(_base.config), batch=1, image_tokens=args.image_tokens,
                                        text_tokens=args.text_tokens, generator=torch.Generator().manual_seed(10_000 + seed),
                                        dtype=dtype, device=device)

        payload["layers"] += per_layer(arch_id, base, inputs_for, args)
        save_outputs(out, table(payload), payload)
        payload["trajectories"] += trajectories(arch_id, base, inputs_for, args)
        payload["seconds"] = round(time.time() - start, 1)
        save_outputs(out, table(payload), payload)
        print(f"{arch_id}: done ({payload['seconds']} s)", flush=True)
    if args.full:
        layers, outputs = full_size(args, device)
        payload["layers"] += layers
        payload["trajectories"] += outputs
        payload["seconds"] = round(time.time() - start, 1)
        save_outputs(out, table(payload), payload)
    print(table(payload))


if __name__ == "__main__":
    main()
