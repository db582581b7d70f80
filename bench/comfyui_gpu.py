"""The node pack in a running ComfyUI on the GPU: sampling speed and VRAM per export kind, and purge cycles.

    python bench/comfyui_gpu.py --work /tmp/cgpu --out bench/results/comfyui_h200 [--parts files cycles]
    python bench/comfyui_gpu.py --tiny --work /tmp/cgpu_cpu --out /tmp/comfyui_cpu     # the same on a CPU, seconds

ComfyUI 0.29.0 (../shared/comfyui-0.29.0.tar.xz) is unpacked and started as a server (bench/comfyui_server.py) with
the node pack installed by `python -m lowbit_pipe.comfy install --base-directory`, and one instrumentation node
of this bench (device memory: reset / read the peak). A full-size synthetic Krea 2 (bench/make_checkpoint.py,
bf16, 25.6 GB) is the float model; each kind is a file streamed from it by the CLI (model.stream=true) into
models/diffusion_models and deleted after its row (the disk holds one at a time).

Part `files`: per file (bf16 first), queued through the HTTP API: Load Diffusion Model -> Example inputs
(1024 x 1024, 512 text tokens) -> KSampler -> SaveLatent, after one warm-up queue; seconds per step =
(time of a `--steps`-step queue - time of a 1-step queue) / (steps - 1), from ComfyUI's own execution
timestamps; peak VRAM = the device's peak allocation during the timed queue (weights, activations, workspace).
Speed is reported as a ratio to the bf16 file's, measured in the same run.

Part `cycles`: `--cycles` times Quantize (lowbit_pipe) -> LoRA residual -> KSampler -> Purge (after the latent)
on the bf16 MODEL, each queued with a new seed (no cache clearing by hand); after each, the device memory
allocated against the baseline measured before the first cycle (the float model loaded alone), and Purge's
own proof.

Writes <out>.json and <out>.md after every row (a cut call keeps what it measured).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import comfyui_server as cs
from outputs import save_outputs

ROOT = Path(__file__).resolve().parent.parent
STATS_NODES = "lowbit_bench_nodes"
# An instrumentation node of this bench (not the pack): resets or reads the device's peak allocation, passing any
# value through so a graph orders it around the sampler.
STATS_NODE = '''import torch


class AnyType(str):
    def __ne__(self, other):
        return False


class LowbitBenchDeviceMemory:
    CATEGORY = "testing"
    RETURN_TYPES = (AnyType("*"), "STRING")
    FUNCTION = "run"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": (AnyType("*"),), "reset": ("BOOLEAN", {"default": False})}}

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def run(self, value, reset):
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()
            if reset:
                torch.cuda.reset_peak_memory_stats()
        if cuda:  # torch's allocator, and the device as a whole (an allocator of ComfyUI's own is seen there only)
            free, total = torch.cuda.mem_get_info()
            text = '{"allocated": %d, "peak": %d, "reserved": %d, "device_used": %d}' % (
                torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved(),
                total - free)
        else:
            text = "{}"
        return {"ui": {"text": [text]}, "result": (value, text)}


NODE_CLASS_MAPPINGS = {"LowbitBenchDeviceMemory": LowbitBenchDeviceMemory}
'''

# name -> CLI overrides of the stream export (quantize.*); files stock ComfyUI 0.29.0 loads, then the headline recipe.
KINDS = {
    "fp8": ["quantize.default.format=fp8", "quantize.default.granularity=tensor"],
    "int8": ["quantize.default.format=int8"],
    "int8+convrot": ["quantize.default.format=int8", "quantize.default.rotation=convrot"],
    "nvfp4": ["recipe=krea2_nvfp4_stock"],
    "mxfp8": ["quantize.default.format=mxfp8"],
    "convrot_w4a4": ["quantize.default.format=convrot_w4a4"],
    "krea2_nvfp4": ["recipe=krea2_nvfp4"],
}


def prepare(work: Path, archive: Path) -> tuple[Path, Path]:
    src = work / "src" / "comfyui"
    if not (src / "main.py").is_file():
        src = cs.unpack(archive, work / "src")
    base = work / "base"
    print(cs.install_pack(base).strip(), flush=True)
    (base / "custom_nodes" / STATS_NODES).mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / STATS_NODES / "__init__.py").write_text(STATS_NODE)
    (base / "models" / "diffusion_models").mkdir(parents=True, exist_ok=True)
    (base / "models" / "loras").mkdir(parents=True, exist_ok=True)
    return src, base


def float_file(base: Path, tiny: bool) -> Path:
    path = base / "models" / "diffusion_models" / "krea2_bf16.safetensors"
    if path.is_file():
        return path
    t0 = time.time()
    if tiny:
        cmd = [sys.executable, "-m", "lowbit_pipe", "model=tiny_krea2_comfy", "pipeline=[load,detect,export]",
               f"export.path={path}", "export.dtype=bfloat16", f"hydra.run.dir={base.parent / 'runs' / 'float'}"]
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "make_checkpoint.py"), str(path), "--dtype", "bfloat16"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=cs._env())
    print(f"float file: {path.stat().st_size / 1e9:.2f} GB in {time.time() - t0:.0f} s", flush=True)
    return path


def lora_file(base: Path, source: Path, rank: int = 16) -> str:
    """A seeded native-named LoRA over every block's attention and MLP Linears of `source`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = "bench_lora.safetensors"
    path = base / "models" / "loras" / name
    if path.is_file():
        return name
    g = torch.Generator().manual_seed(0)
    state = {}
    with safe_open(str(source), "pt") as f:
        for key in f.keys():
            if key.startswith("blocks.") and key.endswith(".weight") and (".attn.w" in key or ".mlp." in key):
                out_f, in_f = f.get_slice(key).get_shape()
                layer = key[: -len(".weight")]
                state[f"diffusion_model.{layer}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).to(torch.bfloat16)
                state[f"diffusion_model.{layer}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(state, str(path))
    return name


def export_kind(source: Path, base: Path, kind: str, device: str) -> tuple[Path, float | None]:
    """The CLI's export of `kind` from `source` into ComfyUI's models folder, and its seconds; (path, None) where
    an earlier call in this scratch folder exported it (an export appears only whole: temp file + rename)."""
    out = base / "models" / "diffusion_models" / f"krea2_{kind.replace('+', '_')}.safetensors"
    if out.is_file():
        return out, None
    overrides = KINDS[kind]
    recipe = [o for o in overrides if o.startswith("recipe=")] or ["recipe=default"]
    cmd = [sys.executable, "-m", "lowbit_pipe", *recipe, f"model.path={source}", "model.stream=true",
           f"model.device={device}", "model.dtype=bfloat16", "pipeline=[load,detect,quantize,export]",
           f"export.path={out}", *[o for o in overrides if not o.startswith("recipe=")],
           f"hydra.run.dir={base.parent / 'runs' / kind}"]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=cs._env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"export of {kind} failed: {proc.stderr[-2000:]}")
    return out, time.time() - t0


def graph(unet: str, steps: int, seed: int, size: int, tokens: int, tag: str, extra: dict | None = None,
          model: list | None = None) -> dict[str, Any]:
    g = {"m": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
         "e": {"class_type": "LowbitExampleInputs", "inputs": {"model": ["m", 0], "width": size, "height": size,
                                                               "text_tokens": tokens, "batch_size": 1, "seed": 0}},
         "r": {"class_type": "LowbitBenchDeviceMemory", "inputs": {"value": ["e", 1], "reset": True}},
         "k": {"class_type": "KSampler", "inputs": {"model": model or ["m", 0], "seed": seed, "steps": steps, "cfg": 1.0,
                                                    "sampler_name": "euler", "scheduler": "simple", "positive": ["e", 0],
                                                    "negative": ["e", 0], "latent_image": ["r", 0], "denoise": 1.0}},
         "p": {"class_type": "LowbitBenchDeviceMemory", "inputs": {"value": ["k", 0], "reset": False}},
         "s": {"class_type": "SaveLatent", "inputs": {"samples": ["p", 0], "filename_prefix": f"latents/{tag}"}}}
    g.update(extra or {})
    return g


def device_memory(server: cs.ComfyUIServer) -> dict[str, int]:
    """The device's allocation now, read inside the server by a queue of the instrumentation node alone."""
    entry = server.run({"l": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
                        "x": {"class_type": "LowbitBenchDeviceMemory", "inputs": {"value": ["l", 0], "reset": False}}})
    return memory(server, entry, "x")


def executed_seconds(entry: dict[str, Any]) -> float:
    """ComfyUI's own execution time of a prompt: execution_start -> execution_success timestamps (ms)."""
    stamps = {kind: data.get("timestamp") for kind, data in entry["status"]["messages"]}
    return (stamps["execution_success"] - stamps["execution_start"]) / 1000.0


def memory(server: cs.ComfyUIServer, entry: dict[str, Any], node: str) -> dict[str, int]:
    texts = server.texts(entry, node)
    return json.loads(texts[0]) if texts else {}


def time_file(server: cs.ComfyUIServer, unet: str, steps: int, size: int, tokens: int, tag: str) -> dict[str, Any]:
    server.run(graph(unet, 1, 0, size, tokens, f"{tag}_warm"))  # loads the file and the model
    one = server.run(graph(unet, 1, 1, size, tokens, f"{tag}_1"))
    many = server.run(graph(unet, steps, 2, size, tokens, f"{tag}_n"))
    t1, tn = executed_seconds(one), executed_seconds(many)
    latent = server.latent(many, "s")
    return {"s_per_step": (tn - t1) / (steps - 1), "queue_1_step_s": t1, f"queue_{steps}_steps_s": tn,
            "peak_bytes": memory(server, many, "p").get("peak"),
            "device_used_bytes": memory(server, many, "p").get("device_used"), "finite": bool(torch.isfinite(latent).all()),
            "latent_std": float(latent.float().std())}


def table(rows: list[dict[str, Any]], cycles: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# The node pack in a running ComfyUI on {meta['device']}", "", f"`{meta['command']}`", "",
             f"ComfyUI 0.29.0 server, torch {meta['torch']}, comfy-kitchen {meta.get('comfy_kitchen')}. "
             f"{meta['model']}; {meta['size']} x {meta['size']}, {meta['tokens']} text tokens, batch 1, Euler, cfg 1 "
             "(one model call per step). s/step from ComfyUI's execution timestamps (a "
             f"{meta['steps']}-step queue minus a 1-step queue). Memory: ComfyUI 0.29 on a GPU loads weights through "
             "its own allocator (comfy-aimdo's dynamic VRAM), which torch's allocator statistics do not see: 'in use' is "
             "the device's used memory (total - free) after the timed queue, weights included; 'allocator peak' is "
             "torch's peak during it (activations, workspaces). Random weights: speed and memory, not images.", "",
             "| file | how ComfyUI loads it | s/step | speedup vs bf16 | device memory in use GB | torch allocator peak GB | file GB | export s |",
             "|---|---|---|---|---|---|---|---|"]
    bf16 = next((r for r in rows if r["kind"] == "bf16" and "s_per_step" in r), None)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | error: {r['error'][:120]} | | | | | | |")
            continue
        speed = f"{bf16['s_per_step'] / r['s_per_step']:.2f}x" if bf16 else "-"
        peak = f"{r['peak_bytes'] / 1e9:.2f}" if r.get("peak_bytes") else "-"
        used = f"{r['device_used_bytes'] / 1e9:.1f}" if r.get("device_used_bytes") else "-"
        lines.append(f"| {r['kind']} | {r['loader']} | {r['s_per_step']:.3f} | {speed} | {used} | {peak} | "
                     f"{r['file_bytes'] / 1e9:.2f} | {r.get('export_s', 0):.0f} |")
    if cycles:
        base = meta.get("cycle_baseline_bytes")
        lines += ["", f"## Quantize -> LoRA residual -> KSampler -> Purge, {len(cycles)} cycles", "",
                  f"Baseline: {base} bytes allocated after ComfyUI's /free, before the first cycle (Purge unloads the "
                  "model and its clones, the float one included).", "",
                  "| cycle | s | allocated after Purge - baseline (bytes) | Purge proven | retained bytes | unfreed |",
                  "|---|---|---|---|---|---|"]
        for c in cycles:
            lines.append(f"| {c['cycle']} | {c['seconds']:.1f} | {c['allocated_after'] - base if base is not None else '-'} | "
                         f"{c['purge'].get('proven')} | {c['purge'].get('retained_bytes')} | {c['purge'].get('unfreed')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", required=True, help="scratch folder (ComfyUI, its base directory, the model files)")
    p.add_argument("--out", default="bench/results/comfyui_h200")
    p.add_argument("--parts", nargs="+", default=["files", "cycles"], choices=["files", "cycles"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the tiny Krea 2 on the CPU (a smoke run of this script)")
    p.add_argument("--archive", default=str(cs.ARCHIVE), help="the ComfyUI source archive (default: ../shared's; the "
                   "GPU machine gets a copy carried in the repo)")
    args = p.parse_args(argv)
    work = Path(args.work)
    src, base = prepare(work, Path(args.archive))
    source = float_file(base, args.tiny)
    cuda = torch.cuda.is_available() and not args.tiny
    server_args = ("--front-end-root", str(work / "no_frontend"), *(() if cuda else ("--cpu",)))
    (work / "no_frontend").mkdir(exist_ok=True)
    meta = {"command": "python bench/comfyui_gpu.py " + " ".join(argv), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if cuda else "CPU", "python": platform.python_version(),
            "comfy_kitchen": cs.package_version(sys.executable, "comfy-kitchen"), "steps": args.steps,
            "size": args.size, "tokens": args.tokens,
            "model": "tiny Krea 2 (model=tiny_krea2_comfy)" if args.tiny else "full-size synthetic Krea 2 (12.82B, bf16)",
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    rows: list[dict[str, Any]] = []
    cycles: list[dict[str, Any]] = []

    def save() -> None:
        save_outputs(args.out, table(rows, cycles, meta), {**meta, "files": rows, "cycles": cycles})

    # What a GPU machine with no network lacks and cannot be carried there (PyAV 35 MB, SciPy 37 MB, Pillow 7 MB,
    # SentencePiece): ComfyUI imports them at start, the loading / sampling path this bench runs never calls them.
    stand_ins = tuple(m for m in ("av", "scipy", "PIL", "sentencepiece") if importlib.util.find_spec(m) is None)
    meta["stand_ins"] = list(stand_ins)
    server = cs.ComfyUIServer.start(src, base, args=server_args, stand_ins=stand_ins, timeout=600)
    try:
        if "files" in args.parts:
            for kind in ["bf16", *args.kinds]:
                row: dict[str, Any] = {"kind": kind}
                try:
                    path = source
                    if kind != "bf16":
                        path, row["export_s"] = export_kind(source, base, kind, "cuda" if cuda else "cpu")
                    row["file_bytes"] = path.stat().st_size
                    row["loader"] = "stock" if kind != "krea2_nvfp4" else "with the pack (lowbit_ kinds)"
                    row.update(time_file(server, path.name, args.steps, args.size, args.tokens, kind))
                    if kind != "bf16":
                        server.free()
                        device_memory(server)  # a queue after /free, which ComfyUI applies before it
                        path.unlink()
                except (RuntimeError, cs.PromptError, TimeoutError) as err:
                    row["error"] = str(err)
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
        if "cycles" in args.parts:
            lora = lora_file(base, source)
            server.free()
            meta["cycle_baseline_bytes"] = device_memory(server).get("allocated")  # nothing loaded
            for i in range(args.cycles):
                extra = {"q": {"class_type": "LowbitQuantize", "inputs": {"model": ["m", 0], "recipe": "auto",
                                                                          "overrides": ""}},
                         "l": {"class_type": "LowbitLoRA", "inputs": {"model": ["q", 0], "lora_name": lora, "strength": 1.0}},
                         "g": {"class_type": "LowbitPurge", "inputs": {"model": ["l", 0], "after": ["p", 0]}},
                         "a": {"class_type": "LowbitBenchDeviceMemory", "inputs": {"value": ["g", 0], "reset": False}}}
                t0 = time.time()
                entry = server.run(graph(source.name, 2, 100 + i, 512, 64, f"cyc{i}", extra, model=["l", 0]))
                purge_text = server.texts(entry, "g")[0]
                cycles.append({"cycle": i, "seconds": time.time() - t0,
                               "allocated_after": memory(server, entry, "a").get("allocated", 0),
                               "peak": memory(server, entry, "p").get("peak"),
                               "device_used_after": memory(server, entry, "a").get("device_used"),
                               "purge": json.loads(purge_text.split(":", 1)[1])})
                print(json.dumps(cycles[-1]), flush=True)
                save()
    finally:
        meta["server_log_tail"] = server.log(30)
        server.stop()
        meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save()
    print(table(rows, cycles, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
