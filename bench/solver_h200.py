"""quantize.target on the full-size Krea 2 (device part of issue 28) and the tiny-model trajectory error (CPU part).

Device phases, each one call of under 9 minutes on an H100 / H200 (`--only` picks one; all write into --out):

    python bench/solver_h200.py --only speed   --out bench/results/solver_h200.json   # target.speedup 1.6 and 1.15
    python bench/solver_h200.py --only ratio   --out bench/results/solver_h200.json   # target.ratio 0.3 vs krea2_nvfp4
    python bench/solver_h200.py --only singles --out bench/results/solver_h200.json   # single-format recipes
    python bench/solver_h200.py --only targets --out bench/results/solver_h200.json   # speedup 1.15 and ratio 0.3
    python bench/solver_h200.py --only speed_singles --out ...  # speedup 1.15, int8, int8+convrot, fp8 in one call
    python bench/solver_h200.py --only ratio_nvfp4 --out ...    # krea2_nvfp4 and a target at its bytes, NVFP4 a candidate

CPU phase (the plans found on the device, applied by layer role to the tiny Krea 2, trajectory error there):

    python bench/solver_h200.py --only tiny --from bench/results/solver_h200.json --out bench/results/solver_h200.json

Smoke run on a CPU (tiny config; the speedup phase asks for target.ratio 0.45 there, no format being faster
than float on a CPU):  python bench/solver_h200.py --small --device cpu --only speed --out /tmp/solver_smoke.json

The model: bench/headline.py's (diffusers' Krea2Transformer2DModel, the released 12.8B shape, seeded random
weights, bf16, 4096 image + 512 text tokens, the first 77 attended under the text padding mask Krea2Pipeline
passes). Each variant is one `lowbit_pipe.run(recipe, overrides, model=m)`
(pipeline load, detect, quantize; evaluate's token counts set to the forward's), measured eager by
bench/headline.measure (CUDA events, mean of --iters) against bf16 measured in the same call, and torn down.
A target variant also keeps the solver's report: the plan, the prediction, the whole-forward check, the frontier.
The speed table goes to --cache (a fresh machine times it in the first phase; later phases on the same warm
machine reuse it) and is copied beside --out.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from headline import build_krea2, krea2_inputs, measure, model_bytes, rel_err
from outputs import save_outputs

import lowbit_pipe
from lowbit_pipe.arch import get_arch
from lowbit_pipe.errors import LowbitError

SINGLES = {  # label -> overrides of recipe `default` (the Krea 2 keep-float list applies)
    "int8": ["quantize.default.format=int8"],
    "int8+convrot": ["quantize.default.format=int8", "quantize.default.rotation=convrot"],
    "fp8": ["quantize.default.format=fp8"],
    "convrot_w4a4 prepacked": ["quantize.default.format=convrot_w4a4", "quantize.default.rotation=convrot",
                               "quantize.prepack=true"],
    "nvfp4 (weight-only on Hopper)": ["quantize.default.format=nvfp4"],
}

# krea2_auto_speed's candidates and krea2_nvfp4's formats (nvfp4 + ConvRot/256; int8 is among them already)
NVFP4_CANDIDATES = ("[{format: int8}, {format: int8, rotation: convrot}, {format: fp8}, "
                    "{format: convrot_w4a4, rotation: convrot}, {format: nvfp4, rotation: convrot, rotation_group: 256}]")
# krea2_nvfp4's bytes over bf16's at full size (9.87 GB / 25.64 GB, bench/results/solver_h100_ratio.md)
KREA2_NVFP4_RATIO = 0.385


def base_overrides(small: bool, device: torch.device) -> list[str]:
    image, text, valid = (64, 8, 3) if small else (4096, 512, 77)
    return ["pipeline=[load,detect,quantize]", "model.dtype=bfloat16", f"model.device={device.type}",
            f"evaluate.image_tokens={image}", f"evaluate.text_tokens={text}", f"evaluate.text_valid={valid}"]


def variants(phase: str, small: bool, cache: Path, ratio: float) -> list[tuple[str, str, list[str]]]:
    target = [f"quantize.speed_cache={cache}"]
    if phase == "speed":
        goal = ["quantize.target.speedup=null", "quantize.target.ratio=0.6"] if small else []
        if small:
            return [("auto: target.speedup 1.6", "krea2_auto_speed", target + goal)]
        # The 1.6 (refused on an H100 at a predicted 1.216x best) and the recipe's own, reachable, 1.15,
        # whose whole-forward check says how far the prediction lands from the measured time.
        return [("auto: target.speedup 1.6", "krea2_auto_speed", target + ["quantize.target.speedup=1.6"]),
                ("auto: target.speedup 1.15", "krea2_auto_speed", target + ["quantize.target.speedup=1.15"])]
    if phase == "ratio":
        return [(f"auto: target.ratio {ratio:g}", "krea2_auto_speed",
                 target + ["quantize.target.speedup=null", f"quantize.target.ratio={ratio}"]),
                ("krea2_nvfp4", "krea2_nvfp4", [])]
    if phase == "targets":  # the two reachable targets in one call (the speed table built once)
        return [("auto: target.speedup 1.15", "krea2_auto_speed", target + ["quantize.target.speedup=1.15"]),
                (f"auto: target.ratio {ratio:g}", "krea2_auto_speed",
                 target + ["quantize.target.speedup=null", f"quantize.target.ratio={ratio}"])]
    if phase == "speed_singles":  # speedup 1.15 beside the single formats of about its speed, one bf16 baseline
        return [("auto: target.speedup 1.15", "krea2_auto_speed", target + ["quantize.target.speedup=1.15"])] + \
            [(label, "default", SINGLES[label]) for label in ("int8", "int8+convrot", "fp8")]
    if phase == "ratio_nvfp4":  # the hand-written recipe against the solver at its bytes, with its formats offered
        # both with NVFP4 computed in FP8 (Hopper has no FP4 tensor cores; the faster of the two NVFP4 paths there)
        return [("krea2_nvfp4, fp8 compute", "krea2_nvfp4", ["quantize.nvfp4_compute=fp8"]),
                (f"auto: target.ratio {ratio:g}, NVFP4 candidates", "krea2_auto_speed",
                 target + ["quantize.target.speedup=null", f"quantize.target.ratio={ratio}", "quantize.nvfp4_compute=fp8",
                           f"quantize.target.candidates={NVFP4_CANDIDATES}"])]
    if phase == "singles":
        return [(label, "default", o) for label, o in SINGLES.items()]
    raise ValueError(phase)


def run_one(label: str, recipe: str, overrides: list[str], model: torch.nn.Module, forward, ref: torch.Tensor,
            device: torch.device, iters: int, run_dir: Path, float_ms: float) -> dict[str, Any]:
    t = time.perf_counter()
    result = lowbit_pipe.run(recipe, overrides, model=model, run_dir=run_dir)
    run_s = time.perf_counter() - t
    try:
        row = measure(label, forward, device, iters, ref, False)
        row.update(recipe=recipe, overrides=overrides, run_s=run_s, speedup=float_ms / row["ms"],
                   weight_bytes=model_bytes(model))
        target = (result.report.get("quantize") or {}).get("target")
        if target:
            target.pop("sensitivity", None)
            row["plan"] = target.pop("choice")
            row["target"] = target
    finally:
        lowbit_pipe.teardown(result)
    row["restored_rel_err"] = rel_err(forward(), ref)
    return row


def table(payload: dict[str, Any]) -> str:
    lines = [f"`{payload['command']}`", "", f"device: {payload['device']} | torch {payload['torch']}", "",
             "| variant | ms | x bf16 (measured) | predicted x | off | weight GB | rel err vs bf16 | layers |",
             "|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if "error" in r:
            lines.append(f"| {r['variant']} | refused: {r['error']} | | | | | | |")
            continue
        t = r.get("target") or {}
        fc = t.get("forward_check") or {}
        layers = " ".join(f"{k}:{v}" for k, v in (t.get("layers") or {}).items())
        if (t.get("selection") or {}).get("chosen", "solver") != "solver":  # a uniform plan won on measured figures
            layers += f" (uniform {t['selection']['chosen']} over the solver's plan)"
        if (t.get("attention") or {}).get("chosen", "bf16") != "bf16":
            layers += f" attention:{t['attention']['chosen']}"
        lines.append(f"| {r['variant']} | {r['ms']:.2f} | {r.get('speedup', 1.0):.3f} | "
                     f"{t['predicted']['speedup']:.3f}" if t else f"| {r['variant']} | {r['ms']:.2f} | {r.get('speedup', 1.0):.3f} | -")
        lines[-1] += (f" | {fc['off']:+.1%}" if fc else " | -") + \
            f" | {r.get('weight_bytes', 0) / 1e9:.2f} | {r.get('rel_err_vs_bf16', 0):.3e} | {layers} |"
    if payload.get("tiny"):
        lines += ["", "Tiny Krea 2 (CPU), the device plans applied by layer role; trajectory figures from evaluate:", "",
                  "| variant | measured x bf16 (device) | rel_error | trajectory min cosine |", "|---|---|---|---|"]
        for r in payload["tiny"]:
            lines.append(f"| {r['variant']} | {r.get('device_speedup', float('nan')):.3f} | {r['rel_error']:.5f} | "
                         f"{r['trajectory_min_cosine']:.6f} |")
    return "\n".join(lines) + "\n"


def role(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def label_rule(match: str, label: str) -> str:
    if label == "float":
        return f"{{match: '{match}', keep: true}}"
    fmt, _, rot = label.partition("+")
    rot, _, group = rot.partition("/")
    extra = (f", rotation: {rot}" if rot else "") + (f", rotation_group: {group}" if group else "")
    return f"{{match: '{match}', format: {fmt}{extra}}}"


def tiny_phase(source: dict[str, Any]) -> list[dict[str, Any]]:
    """Each device variant on the tiny Krea 2 (CPU): target plans by layer role (the majority label of a role's
    layers), singles by their overrides; evaluate's trajectory figures."""
    out = []
    for row in source["rows"]:
        if row["variant"] == "bf16" or "error" in row:
            continue
        if row.get("plan"):
            by_role: dict[str, Counter] = {}
            for name, label in row["plan"].items():
                by_role.setdefault(role(name), Counter())[label] += 1
            rules = ", ".join(label_rule(r, c.most_common(1)[0][0]) for r, c in sorted(by_role.items()))
            recipe, overrides = "default", [f"quantize.rules=[{rules}]"]
            attention = ((row.get("target") or {}).get("attention") or {}).get("chosen", "bf16")
            if attention != "bf16":  # the solver's attention choice goes along with its layer plan
                overrides.append(f"attention.format={attention}")
        else:
            recipe = row["recipe"]
            overrides = [o for o in row["overrides"] if o.startswith("quantize.") and "speed_cache" not in o]
        r = lowbit_pipe.run(recipe, overrides + ["pipeline=[load,detect,quantize,evaluate]"],
                            run_dir=Path("/tmp/solver_tiny") / re.sub(r"\W+", "_", row["variant"]))
        ev = r.report["evaluate"]
        out.append({"variant": row["variant"], "device_speedup": row.get("speedup"), "rel_error": ev["rel_error"],
                    "trajectory_min_cosine": ev["trajectory"]["min_cosine"], "overrides": overrides})
        print(f"  tiny {row['variant']}: rel_error {ev['rel_error']:.5f}, trajectory min cos "
              f"{ev['trajectory']['min_cosine']:.6f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="the tiny config (a smoke run)")
    p.add_argument("--only", required=True, choices=["speed", "ratio", "targets", "speed_singles", "ratio_nvfp4", "singles", "tiny"])
    p.add_argument("--variants", nargs="+", help="only the phase's variants whose label starts with one of these")
    p.add_argument("--from", dest="source", help="--only tiny: the JSON the device phases wrote")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ratio", type=float, help="quantize.target.ratio (default 0.3; ratio_nvfp4: "
                   f"{KREA2_NVFP4_RATIO}; small: 0.6)")
    p.add_argument("--cache", default="/tmp/lowbit_speed_cache", help="quantize.speed_cache for the target variants")
    p.add_argument("--out", default="bench/results/solver_h200.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    payload: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    payload["command"] = "python bench/solver_h200.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.only == "tiny":
        source = json.loads(Path(args.source or out).read_text())
        payload = {**source, **payload} if not out.is_file() else payload  # a new --out: the device rows with them
        payload["tiny"] = tiny_phase(source)
        save_outputs(out, table(payload), payload)
        return 0
    device = torch.device(args.device)
    model = build_krea2(device, args.small)
    inputs = krea2_inputs(model, device, args.small, 3 if args.small else 77)  # base_overrides' text mask
    arch = get_arch("krea2")

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return arch.output_tensor(model(**inputs))

    ref = forward()
    base = measure("bf16", forward, device, args.iters, ref, False)
    payload.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   torch=torch.__version__)
    payload["rows"] = [r for r in payload["rows"] if r["variant"] != "bf16"] + [{**base, "speedup": 1.0,
                                                                              "weight_bytes": model_bytes(model)}]
    cache = Path(args.cache)
    ratio = 0.6 if args.small else args.ratio or (KREA2_NVFP4_RATIO if args.only == "ratio_nvfp4" else 0.3)
    for label, recipe, overrides in variants(args.only, args.small, cache, ratio):
        if args.variants and not any(label.startswith(v) for v in args.variants):
            continue
        try:
            row = run_one(label, recipe, base_overrides(args.small, device) + overrides, model, forward, ref, device,
                          args.iters, Path("/tmp/solver_runs") / re.sub(r"\W+", "_", label), base["ms"])
        except LowbitError as err:  # an unreachable target names the value the candidates reach: keep it
            row = {"variant": label, "recipe": recipe, "overrides": overrides, "error": str(err)}
            print(f"  {label}: {err}", flush=True)
        payload["rows"] = [r for r in payload["rows"] if r["variant"] != label] + [row]
        save_outputs(out, table(payload), payload)
    for table_file in cache.glob("speed_*.json"):
        shutil.copy(table_file, out.with_name(f"{out.stem}_{table_file.name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
