"""Stock ComfyUI against the node pack, uncompiled and compiled, in one running server: s/step per row.

    python bench/comfyui_speed.py --work /tmp/cspeed --out bench/results/comfyui_speed_h200 [--rows ...]
    python bench/comfyui_speed.py --tiny --work /tmp/cspeed_cpu --out /tmp/comfyui_speed_cpu   # CPU smoke run

ComfyUI 0.29.0 as a server with the pack installed (bench/comfyui_gpu.py's setup: the same unpack, install,
instrumentation node and full-size synthetic Krea 2, bf16, 25.6 GB). Rows (any subset, `--rows`, in order):

- `stock_bf16`: Load Diffusion Model (the bf16 file) -> KSampler; the baseline every ratio is taken against.
- `stock_bf16_tc`: the same through ComfyUI's own TorchCompileModel (inductor).
- `stock_fp8`, `stock_fp8_tc`: an fp8 file (per-tensor scales, what stock ComfyUI loads as fp8_scaled), streamed from
  the bf16 one by the CLI, loaded by stock ComfyUI, without and with TorchCompileModel.
- `pack_<recipe>[_attn][_compile]`: the bf16 MODEL -> Quantize (lowbit_pipe) with the recipe and
  attention.fused_norm_rope=true (ComfyUI's norms and RoPE as kernels) [+ attention.format=fp8] -> [Compile
  (lowbit_pipe)] -> KSampler. Recipes: fp8 (default recipe, fp8 per-tensor), int8 (default), krea2_nvfp4 with
  quantize.nvfp4_compute=fp8 (Hopper has no FP4 tensor cores).
- `pack_file_nvfp4_fp8`: the krea2_nvfp4 file (NVFP4 + ConvRot: `lowbit_nvfp4`, streamed from the bf16 one by the
  CLI) loaded by stock Load Diffusion Model with the pack installed -> Compute (lowbit_pipe) nvfp4_compute=fp8 ->
  KSampler; next to `pack_krea2_nvfp4` (the same recipe and compute through Quantize).

Per row: a 1-step warm-up queue (file load / quantize / compile: its time is the "first queue"), a 1-step and an
N-step queue with new seeds (s/step = their difference / (N - 1), ComfyUI's execution timestamps), the device
memory in use after the timed queue, and (`--profile`) one profiled 2-step queue whose kernel table (device time by
kernel name, top 15) goes into the JSON, with the device's busy time (every kernel's own time) beside the sampler's
wall time: how much of a step the device waited on the host. Each row is then dropped (Purge for the pack's,
/free for stock) so the next starts from the float model alone. Writes <out>.json / <out>.md after every row.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfyui_gpu as cg
import comfyui_server as cs
from outputs import save_outputs

PROFILE_NODES = "lowbit_bench_profile"
# A second instrumentation node of this bench: starts torch.profiler when its `action` is "start", stops it on
# "stop" and writes the kernel table (device time per kernel name) to `path`. The profiler lives on the class
# between the two calls of one queue.
PROFILE_NODE = '''import json
import time

import torch


class AnyType(str):
    def __ne__(self, other):
        return False


class LowbitBenchProfile:
    CATEGORY = "testing"
    RETURN_TYPES = (AnyType("*"),)
    FUNCTION = "run"
    OUTPUT_NODE = True
    active = None

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (AnyType("*"),), "action": (["start", "stop"],), "path": ("STRING", {"default": ""})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def run(self, value, action, path):
        cuda = torch.cuda.is_available()
        if action == "start":
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            if cuda:
                torch.cuda.synchronize()
            type(self).active = (torch.profiler.profile(activities=acts), time.perf_counter())
            type(self).active[0].__enter__()
            return {"ui": {"text": ["started"]}, "result": (value,)}
        (prof, t0), type(self).active = type(self).active, None
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
        prof.__exit__(None, None, None)
        rows, busy_us = [], 0.0
        for e in prof.key_averages():
            dev = getattr(e, "device_time_total", None)
            if dev is None:
                dev = getattr(e, "cuda_time_total", 0)
            if str(getattr(e, "device_type", "")).endswith("CUDA"):  # a kernel / copy; an op's row repeats its kernels
                own = getattr(e, "self_device_time_total", None)
                busy_us += float(own if own is not None else getattr(e, "self_cuda_time_total", 0))
            rows.append({"name": e.key, "calls": e.count, "device_us": float(dev), "cpu_us": float(e.cpu_time_total)})
        rows.sort(key=lambda r: r["device_us"] if cuda else r["cpu_us"], reverse=True)
        with open(path, "w") as f:
            json.dump({"kernels": rows[:40], "device_busy_us": busy_us, "wall_us": wall_us}, f)
        return {"ui": {"text": ["stopped"]}, "result": (value,)}


NODE_CLASS_MAPPINGS = {"LowbitBenchProfile": LowbitBenchProfile}
'''

PACK_RECIPES = {
    "fp8": ("default", ["quantize.default.format=fp8", "quantize.default.granularity=tensor"]),
    "int8": ("default", ["quantize.default.format=int8"]),
    "krea2_nvfp4": ("krea2_nvfp4", ["quantize.nvfp4_compute=fp8"]),
}
STOCK_ROWS = ["stock_bf16", "stock_bf16_tc", "stock_fp8", "stock_fp8_tc"]
PACK_ROWS = [f"pack_{r}{a}{c}" for r in PACK_RECIPES for a in ("", "_attn") for c in ("", "_compile")]
# file rows: a file the CLI exports (comfyui_gpu.KINDS), loaded by stock Load Diffusion Model -> Compute (lowbit_pipe)
FILE_ROWS = {"pack_file_nvfp4_fp8": ("krea2_nvfp4", "fp8")}
ROWS = STOCK_ROWS + PACK_ROWS + list(FILE_ROWS)


def pack_parts(row: str) -> tuple[str, list[str], bool]:
    """`pack_<recipe>[_attn][_compile]` -> (recipe name, overrides, compiled)."""
    body = row[len("pack_"):]
    compiled = body.endswith("_compile")
    body = body.removesuffix("_compile")
    attn = body.endswith("_attn")
    recipe, overrides = PACK_RECIPES[body.removesuffix("_attn")]
    return recipe, [*overrides, "attention.fused_norm_rope=true", *(["attention.format=fp8"] if attn else [])], compiled


def model_nodes(row: str, unet: str) -> tuple[dict[str, Any], list]:
    """The nodes between Load Diffusion Model ("m") and the sampler for `row`, and the MODEL the sampler takes."""
    if row.startswith("stock_"):
        if row.endswith("_tc"):
            return {"c": {"class_type": "TorchCompileModel", "inputs": {"model": ["m", 0], "backend": "inductor"}}}, ["c", 0]
        return {}, ["m", 0]
    if row in FILE_ROWS:
        return {"q": {"class_type": "LowbitCompute", "inputs": {"model": ["m", 0],
                                                                 "nvfp4_compute": FILE_ROWS[row][1]}}}, ["q", 0]
    recipe, overrides, compiled = pack_parts(row)
    nodes: dict[str, Any] = {"q": {"class_type": "LowbitQuantize", "inputs": {
        "model": ["m", 0], "recipe": recipe, "overrides": "\n".join(overrides)}}}
    if not compiled:
        return nodes, ["q", 0]
    nodes["c"] = {"class_type": "LowbitCompile", "inputs": {"model": ["q", 0], "backend": "inductor"}}
    return nodes, ["c", 0]


def row_graph(row: str, unet: str, steps: int, seed: int, args: argparse.Namespace, tag: str,
              profile: str | None = None) -> dict[str, Any]:
    extra, model = model_nodes(row, unet)
    g = cg.graph(unet, steps, seed, args.size, args.tokens, tag, extra, model=model)
    if profile:  # around the sampler: started after the inputs exist, stopped once the latent is computed
        g["ps"] = {"class_type": "LowbitBenchProfile", "inputs": {"value": ["r", 0], "action": "start", "path": profile}}
        g["k"]["inputs"]["latent_image"] = ["ps", 0]
        g["pe"] = {"class_type": "LowbitBenchProfile", "inputs": {"value": ["k", 0], "action": "stop", "path": profile}}
        g["p"]["inputs"]["value"] = ["pe", 0]
    return g


def time_row(server: cs.ComfyUIServer, row: str, unet: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.time()
    warm = server.run(row_graph(row, unet, 1, 0, args, f"{row}_warm"))
    out: dict[str, Any] = {"first_queue_s": cg.executed_seconds(warm), "first_queue_wall_s": time.time() - t0}
    for node in ("q", "c"):
        texts = server.texts(warm, node) if node in row_graph(row, unet, 1, 0, args, "x") else []
        if texts:
            out[f"{node}_text"] = texts[0][:1500]
    one = server.run(row_graph(row, unet, 1, 1, args, f"{row}_1"))
    many = server.run(row_graph(row, unet, args.steps, 2, args, f"{row}_n"))
    t1, tn = cg.executed_seconds(one), cg.executed_seconds(many)
    latent = server.latent(many, "s")
    mem = cg.memory(server, many, "p")
    out.update({"s_per_step": (tn - t1) / (args.steps - 1), "queue_1_step_s": t1, f"queue_{args.steps}_steps_s": tn,
                "device_used_bytes": mem.get("device_used"), "allocator_peak_bytes": mem.get("peak"),
                "finite": bool(torch.isfinite(latent).all()), "latent_std": float(latent.float().std())})
    if args.profile:
        path = work / f"profile_{row}.json"
        server.run(row_graph(row, unet, 2, 3, args, f"{row}_prof", profile=str(path)))
        profiled = json.loads(path.read_text())
        out["profile"] = profiled["kernels"][:15]
        # every kernel's own time over the profiled window's: below 1, the device waited on the host in between
        out["profile_device_busy_ms"] = profiled["device_busy_us"] / 1e3
        out["profile_wall_ms"] = profiled["wall_us"] / 1e3
    return out


def drop_row(server: cs.ComfyUIServer, row: str, unet: str, args: argparse.Namespace) -> str | None:
    """Gives the row's model back: Purge (the pack's rows: proven) or ComfyUI's /free (stock)."""
    proof = None
    if row.startswith("pack_"):
        g = row_graph(row, unet, args.steps, 2, args, f"{row}_n")
        g["g"] = {"class_type": "LowbitPurge", "inputs": {"model": g["k"]["inputs"]["model"], "after": ["k", 0]}}
        proof = (server.texts(server.run(g), "g") or [""])[0][:600]
    server.free()
    cg.device_memory(server)  # a queue after /free, which ComfyUI applies before it
    return proof


def table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Stock ComfyUI and the node pack, one server, {meta['device']}", "", f"`{meta['command']}`", "",
             f"ComfyUI 0.29.0, torch {meta['torch']}, comfy-kitchen {meta.get('comfy_kitchen')}; {meta['model']}; "
             f"{meta['size']} x {meta['size']}, {meta['tokens']} text tokens, batch 1, Euler, cfg 1. s/step from "
             f"ComfyUI's execution timestamps ({meta['steps']}-step queue minus 1-step queue); ratios to stock_bf16 "
             "of this run. 'first queue': the 1-step warm-up (file load, or Quantize + the first step's compile). "
             "Memory: the device's used memory after the timed queue (the pack's rows also hold the bf16 source MODEL "
             "unless ComfyUI offloaded it).", "",
             "'1-step queue': a later queue of one step, the per-queue cost beside one step's.", "",
             "| row | s/step | x stock bf16 | first queue s | 1-step queue s | device in use GB | note |",
             "|---|---|---|---|---|---|---|"]
    base = next((r for r in rows if r["row"] == "stock_bf16" and "s_per_step" in r), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error | | | | | {r['error'][:160]} |")
            continue
        ratio = f"{base['s_per_step'] / r['s_per_step']:.2f}x" if base else "-"
        used = f"{r['device_used_bytes'] / 1e9:.1f}" if r.get("device_used_bytes") else "-"
        note = "" if r.get("finite") else "non-finite latent"
        lines.append(f"| {r['row']} | {r['s_per_step']:.4f} | {ratio} | {r['first_queue_s']:.1f} | "
                     f"{r['queue_1_step_s']:.3f} | {used} | {note} |")
    for r in rows:
        if r.get("profile"):
            key = "device_us" if meta["device"] != "CPU" else "cpu_us"
            lines += ["", f"## {r['row']}: top kernels of a profiled 2-step queue", ""]
            if r.get("profile_wall_ms") and meta["device"] != "CPU":
                busy, wall = r["profile_device_busy_ms"], r["profile_wall_ms"]
                lines += [f"Device busy {busy:.1f} ms of the sampler's {wall:.1f} ms ({busy / wall:.0%}; the rest the "
                          "device waited on the host).", ""]
            lines += ["| kernel | calls | ms |", "|---|---|---|"]
            lines += [f"| {p['name'][:90]} | {p['calls']} | {p[key] / 1e3:.2f} |" for p in r["profile"][:10]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True)
    p.add_argument("--out", default="bench/results/comfyui_speed_h200")
    p.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--profile", action="store_true", help="one profiled 2-step queue per row")
    p.add_argument("--deadline-s", type=float, default=0.0, help="start no row after this many seconds (0: none)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--archive", default=str(cs.ARCHIVE))
    args = p.parse_args(argv)
    started = time.time()
    work = Path(args.work)
    src, base = cg.prepare(work, Path(args.archive))
    (base / "custom_nodes" / PROFILE_NODES).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / PROFILE_NODES / "__init__.py").write_text(PROFILE_NODE)
    source = cg.float_file(base, args.tiny)
    cuda = torch.cuda.is_available() and not args.tiny
    (work / "no_frontend").mkdir(exist_ok=True)
    meta = {"command": "python bench/comfyui_speed.py " + " ".join(argv), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "CPU", "python": platform.python_version(),
            "comfy_kitchen": cs.package_version(sys.executable, "comfy-kitchen"), "steps": args.steps,
            "size": args.size, "tokens": args.tokens,
            "model": "tiny Krea 2" if args.tiny else "full-size synthetic Krea 2 (12.82B, bf16)",
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows: list[dict[str, Any]] = []
    stand_ins = tuple(m for m in ("av", "scipy", "PIL", "sentencepiece") if cg.importlib.util.find_spec(m) is None)
    server = cs.ComfyUIServer.start(src, base, args=("--front-end-root", str(work / "no_frontend"),
                                                     *(() if cuda else ("--cpu",))), stand_ins=stand_ins, timeout=600)
    fp8_file: Path | None = None
    files: dict[str, Path] = {}  # FILE_ROWS' exports, by kind
    try:
        for name in args.rows:
            if args.deadline_s and time.time() - started > args.deadline_s:
                rows.append({"row": name, "error": f"not run: past the {args.deadline_s:.0f} s deadline"})
                continue
            row: dict[str, Any] = {"row": name}
            try:
                unet = source.name
                if name.startswith("stock_fp8"):
                    if fp8_file is None:
                        fp8_file, row["export_s"] = cg.export_kind(source, base, "fp8", "cuda" if cuda else "cpu")
                    unet = fp8_file.name
                if name in FILE_ROWS:
                    kind = FILE_ROWS[name][0]
                    if kind not in files:
                        files[kind], row["export_s"] = cg.export_kind(source, base, kind, "cuda" if cuda else "cpu")
                    unet = files[kind].name
                row.update(time_row(server, name, unet, args, work))
                row["purge"] = drop_row(server, name, unet, args)
            except (RuntimeError, cs.PromptError, TimeoutError, KeyError, ValueError) as err:
                row["error"] = str(err)[-1500:]
                server.free()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            save_outputs(args.out, table(rows, meta), {**meta, "rows": rows})
    finally:
        meta["server_log_tail"] = server.log(40)
        server.stop()
        meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save_outputs(args.out, table(rows, meta), {**meta, "rows": rows})
    print(table(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
