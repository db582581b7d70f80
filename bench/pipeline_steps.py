"""The whole image: 28 sampling steps of a 1024x1024 Krea 2 image through diffusers' Krea2Pipeline (text encoder,
transformer, VAE decode), the transformer quantized by a recipe, beside the same pipeline in bf16, in one process.

    python bench/pipeline_steps.py --out bench/results/pipeline_steps_h200.json            # GPU, full size
    python bench/pipeline_steps.py --only "fp8, compiled" --out ...                         # some rows (same JSON)
    python bench/pipeline_steps.py --device cpu --small --out /tmp/pipeline_steps.json      # smoke run: tiny parts

The pipeline is built offline with seeded random weights at the released shapes: the transformer is
bench/headline.py's (Krea2Transformer2DModel's default config, 12.8B), the text encoder a Qwen3-VL text model of the
4B shape Krea 2 reads (hidden 2560, 36 layers, its 12 tapped layers; a one-layer vision tower the prompt never
uses), the VAE AutoencoderKLQwenImage's default config, the scheduler FlowMatchEulerDiscreteScheduler. The
tokenizer is a word-level one over the prompt's words: the pipeline pads every prompt to 512 text tokens, so the
transformer sees the released token counts (4096 image + 512 text) and the text padding mask it always passes.
Text encoder and VAE stay bf16, as the pipeline has them. Each row is `lowbit_pipe.run(recipe, overrides,
model=pipe)` (bench/headline.py's recipe variants: the transformer quantized, its attention set, compiled or
not), one warm-up image (compiles), then --iters timed images (wall clock around a synchronized call, seconds
per image), then teardown. Ratios are to the bf16 row of the same kind (compiled or eager) measured in the same
process, and are set beside the per-forward ratios of bench/headline.py's rows when --headline names its JSON.
The output image's relative error against the bf16 eager image is a regression figure (random weights).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from headline import SMALL_CONFIG, VARIANTS, build_krea2, sync
from outputs import save_outputs

import lowbit_pipe

PROMPT = "a red fox sitting in tall autumn grass at sunrise, soft light, film photograph"
BASELINES = (("bf16, eager", "default", ["pipeline=[load,detect]"], False),)
# Run first in every call, in this order: the ratios' bases (eager, compiled) and the error's reference (eager).
ALWAYS = ("bf16, eager", "bf16, compile stage (regional)")
# headline rows whose figures are per forward (LoRA recompile counts, Blackwell emulation): not run here
FORWARD_ONLY = ("LoRA", "NVFP4 activations emulated")
# The text model Krea 2 taps (Qwen3-VL 4B's shape) and a tiny one for the smoke run.
TEXT_FULL = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=5e6,
                 rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True})
TEXT_SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32,
                  rope_scaling={"rope_type": "default", "mrope_section": [8, 4, 4], "mrope_interleaved": True})


def build_pipeline(device: torch.device, small: bool) -> Any:
    """diffusers' Krea2Pipeline around seeded random parts (see the module doc), bf16, on `device`."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Pipeline
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig, Qwen3VLModel

    text = TEXT_SMALL if small else TEXT_FULL
    vocab = {"[PAD]": 0, "[UNK]": 1}
    for word in PROMPT.split():
        vocab.setdefault(word, len(vocab))
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  patch_size=14, num_position_embeddings=16, deepstack_visual_indexes=[])
    transformer = build_krea2(device, small)
    torch.manual_seed(1)
    with torch.device(device):
        encoder = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision)).to(torch.bfloat16).eval()
        z = SMALL_CONFIG["in_channels"] // 4  # the transformer packs 2x2 latent patches
        vae_config = dict(base_dim=16, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1, latents_mean=[0.0] * z,
                          latents_std=[1.0] * z) if small else {}
        vae = AutoencoderKLQwenImage(**vae_config).to(torch.bfloat16).eval()
    # the text-encoder layers the transformer taps: Krea 2's 12 (every third from 2), or the tiny config's first ones
    select = tuple(range(1, SMALL_CONFIG["num_text_layers"] + 1)) if small else \
        tuple(range(2, text["num_hidden_layers"], 3))
    pipe = Krea2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder,
                         tokenizer=tokenizer, transformer=transformer, text_encoder_select_layers=select)
    # the chat template's token counts for this tokenizer (the pipeline's constants are the Qwen tokenizer's)
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.prompt_template_encode_prefix).input_ids)
    pipe.prompt_template_encode_num_suffix_tokens = len(tokenizer(pipe.prompt_template_encode_suffix).input_ids)
    return pipe


def image(pipe: Any, device: torch.device, steps: int, resolution: int) -> torch.Tensor:
    with torch.inference_mode():
        out = pipe(prompt=PROMPT, num_inference_steps=steps, height=resolution, width=resolution,
                   generator=torch.Generator(device).manual_seed(0), output_type="pt")
    return out.images


def rows_to_run(only: list[str] | None) -> list[tuple[str, str, list[str], bool]]:
    """The ALWAYS rows, then those `only` names by label prefix (every row when it names none)."""
    every = [v for v in (*BASELINES, *VARIANTS) if not any(w in v[0] for w in FORWARD_ONLY)]
    first = sorted((v for v in every if v[0] in ALWAYS), key=lambda v: ALWAYS.index(v[0]))
    return first + [v for v in every if v[0] not in ALWAYS and (not only or any(v[0].startswith(o) for o in only))]


def table(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    base = {r["compiled"]: r["s"] for r in rows if r["label"] in ALWAYS}
    forward = payload.get("forward_ratios", {})
    lines = [f"`{payload['command']}`", "", f"device: {payload['device']} | torch {payload['torch']} | "
             f"{payload['steps']} steps at {payload['resolution']}x{payload['resolution']}, text encoder + transformer "
             f"+ VAE decode, mean of {payload['iters']} images after one warm-up", "",
             "| variant | s per image | x bf16 (same kind) | x bf16 per forward (headline) | image rel err vs bf16 eager |",
             "|---|---|---|---|---|"]
    for r in rows:
        b = base.get(r["compiled"])
        ratio = f"{b / r['s']:.3f}" if b else "-"
        fwd = forward.get(r["label"])
        lines.append(f"| {r['label']} | {r['s']:.3f} | {ratio} | {f'{fwd:.3f}' if fwd else '-'} | "
                     f"{r['rel_err']:.3e} |")
    return "\n".join(lines) + "\n"


def headline_ratios(path: str | None) -> dict[str, float]:
    """bench/headline.py's per-forward ratios, each to bf16 of its own kind (compiled or eager), by label."""
    if not path or not Path(path).is_file():
        return {}
    import json

    rows = json.loads(Path(path).read_text()).get("rows", [])
    # headline names its eager baseline "bf16 eager"
    ms = {ALWAYS[0] if r["variant"] == "bf16 eager" else r["variant"]: r["ms"] for r in rows if r.get("ms")}
    eager_base, compiled_base = ms.get(ALWAYS[0]), ms.get(ALWAYS[1])
    bases = {label: eager_base if label == ALWAYS[0] or "no compile" in label else compiled_base for label in ms}
    return {label: bases[label] / value for label, value in ms.items() if bases[label]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny parts (a smoke run)")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--only", nargs="*", help="row labels (prefixes) to run; the bf16 rows are always run")
    p.add_argument("--headline", help="bench/headline.py's JSON: its per-forward ratios beside these")
    p.add_argument("--out", default="bench/results/pipeline_steps_h200.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.small:
        args.resolution = min(args.resolution, 64)
    pipe = build_pipeline(device, args.small)
    payload: dict[str, Any] = {"command": "python bench/pipeline_steps.py " + " ".join(argv if argv is not None else
                                                                                          sys.argv[1:]),
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "steps": args.steps, "resolution": args.resolution,
                               "iters": args.iters, "rows": [], "forward_ratios": headline_ratios(args.headline)}
    reference = None
    with tempfile.TemporaryDirectory() as scratch:
        for label, recipe, overrides, compiled in rows_to_run(args.only):
            result = lowbit_pipe.run(recipe, overrides, model=pipe, run_dir=Path(scratch) / str(len(payload["rows"])))
            try:
                image(pipe, device, 2 if not args.small else args.steps, args.resolution)  # warm-up: compiles
                sync(device)
                t = time.perf_counter()
                for _ in range(args.iters):
                    out = image(pipe, device, args.steps, args.resolution)
                sync(device)
                seconds = (time.perf_counter() - t) / args.iters
            finally:
                lowbit_pipe.teardown(result)
                torch._dynamo.reset()
            if reference is None:
                reference = out.float()
            rel = float((out.float() - reference).norm() / reference.norm().clamp_min(1e-12))
            payload["rows"].append({"label": label, "recipe": recipe, "overrides": overrides, "compiled": compiled,
                                    "s": seconds, "rel_err": rel})
            print(f"  {label}: {seconds:.3f} s per image, rel err {rel:.3e}", flush=True)
            save_outputs(args.out, table(payload), payload)
    print(table(payload))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
