"""The node pack on a real ComfyUI MODEL: Quantize, LoRA, Export and Purge, on the CPU.

    python bench/comfy_nodes_check.py /path/to/ComfyUI [--out bench/results/comfy_nodes_check] [--recipe krea2_nvfp4]

One process: a float tiny Krea 2 (in the sizes ComfyUI detects) is exported by lowbit_pipe and loaded
with ComfyUI's own `comfy.sd.load_diffusion_model`, the pack's registration installed as ComfyUI's start
would. Then, as a workflow would chain them:

1. Quantize node (the recipe; krea2_nvfp4 writes lowbit_ kinds) -> MODEL; ComfyUI loads it
   (`load_models_gpu`, which applies the node's object patch) and runs its diffusion model's forward;
   the upstream float MODEL must still give its own output bit for bit.
2. LoRA node (a seeded peft LoRA, strengths 1.0 and 0.5): per-layer deltas exact and linear in the
   strength, the quantized layers' tensors shared (nothing requantized).
3. Export node -> file; ComfyUI's loader reads it (pack installed) and its forward matches the quantized
   MODEL's (lowbit kinds run our kernels bit for bit; stock int8 layers run comfy-kitchen's).
4. Purge node on the LoRA MODEL while ComfyUI holds it loaded: its report (bytes freed, retained bytes,
   what stayed alive), and every MODEL made from the run computing float again.

Writes `<out>.md` and `<out>.json`. ComfyUI is GPL-3: imported from SRC_DIR at run time, nothing copied.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfy_check import SEED, TINY, _comfy_cpu_setup, comfy_commit


def check(src: Path, recipe: str, tmp: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    import lowbit_pipe
    from lowbit_pipe.lora.make_example import example_lora

    out: dict[str, Any] = {"recipe": recipe}
    floating = lowbit_pipe.run("default", [*TINY["krea2"], "pipeline=[load,detect,export]",
                                          f"export.path={tmp / 'float.safetensors'}"], run_dir=tmp / "float")
    lora_sd, _ = example_lora(floating.model, floating.context.arch, style="peft", rank=8, seed=5, rel=0.02)
    save_file(lora_sd, str(tmp / "style.safetensors"))
    del floating

    _comfy_cpu_setup(src)
    import comfy.model_management as mm
    import comfy.sd

    from lowbit_pipe.comfy import install_into_comfyui
    from lowbit_pipe.comfy.nodes import LowbitExport, LowbitLoRA, LowbitPurge, LowbitQuantize
    from lowbit_pipe.quant.nn import QuantLinear

    registration = install_into_comfyui()
    model = comfy.sd.load_diffusion_model(str(tmp / "float.safetensors"))
    cfg = model.model.model_config.unet_config

    def forward(patcher: Any) -> Any:
        mm.load_models_gpu([patcher], force_full_load=True)  # applies the patcher's object patches
        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(1, cfg["channels"], 8, 8, generator=g)
        ctx = torch.randn(1, 6, cfg["txtlayers"] * cfg["txtdim"], generator=g)
        with torch.inference_mode():
            return patcher.model.diffusion_model(x, torch.tensor([0.5]), ctx).clone()

    float_out = forward(model)
    quantized, summary = LowbitQuantize().quantize(model, recipe, "")
    q_out = forward(quantized)
    out["quantize"] = {"summary": summary.splitlines()[-6:], "finite": bool(torch.isfinite(q_out).all()),
                       "rel_error_vs_float": float((q_out - float_out).norm() / float_out.norm()),
                       "quantized_layers": sum(isinstance(m, QuantLinear)
                                               for m in quantized.get_model_object("diffusion_model").modules())}
    out["upstream_float_unchanged"] = bool(torch.equal(forward(model), float_out))

    import folder_paths

    folder_paths.add_model_folder_path("loras", str(tmp))  # the LoRA node reads names from ComfyUI's LoRA list
    folder_paths.filename_list_cache.pop("loras", None)
    (full,) = LowbitLoRA().attach(quantized, "style.safetensors", 1.0)
    (half,) = LowbitLoRA().attach(quantized, "style.safetensors", 0.5)
    layer = "blocks.0.attn.wq"
    x = torch.randn(4, quantized.get_model_object("diffusion_model").get_submodule(layer).in_features)
    with torch.inference_mode():
        base = quantized.get_model_object("diffusion_model").get_submodule(layer)(x)
        d_full = full.get_model_object("diffusion_model").get_submodule(layer)(x) - base
        d_half = half.get_model_object("diffusion_model").get_submodule(layer)(x) - base
    shared = full.get_model_object("diffusion_model").get_submodule(layer).weight.data_ptr() == \
        quantized.get_model_object("diffusion_model").get_submodule(layer).weight.data_ptr()
    lora_out = forward(full)
    out["lora"] = {"layer": layer, "delta_norm": float(d_full.norm()),
                   "linear_in_strength_max_abs": float((d_full - 2 * d_half).abs().max()),
                   "quantized_tensors_shared": bool(shared),
                   "model_output_changed": float((lora_out - q_out).norm() / q_out.norm())}

    (path,) = LowbitExport().export(quantized, str(tmp / "export" / "model.safetensors"))
    reloaded = comfy.sd.load_diffusion_model(path)
    r_out = forward(reloaded)
    out["export"] = {"path": Path(path).name, "equal": bool(torch.equal(r_out, q_out)),
                     "rel_diff_vs_quantized_model": float((r_out - q_out).norm() / q_out.norm())}
    del reloaded

    refs = [weakref.ref(m) for p in (quantized, full, half) for m in p.get_model_object("diffusion_model").modules()
            if isinstance(m, QuantLinear)]
    forward(full)  # ComfyUI holds the LoRA MODEL loaded when Purge runs
    _, text = LowbitPurge().purge(full)
    gc.collect()
    report = json.loads(text.split(":", 1)[1])
    out["purge"] = {**report, "quantized_layers_alive_after": sum(r() is not None for r in refs),
                    "models_float_again": all(not any(isinstance(m, QuantLinear) for m in
                                                      p.get_model_object("diffusion_model").modules())
                                              for p in (quantized, full, half)),
                    "float_model_output_unchanged": bool(torch.equal(forward(model), float_out))}
    out["uninstall"] = {k: v for k, v in registration.uninstall().items() if k in ("unfreed", "patches_restored")}
    return out


def write(out: Path, result: dict[str, Any], argv: list[str]) -> None:
    q, lo, ex, pu = result["quantize"], result["lora"], result["export"], result["purge"]
    lines = [
        "# The node pack on a ComfyUI MODEL (CPU)", "", f"`python bench/comfy_nodes_check.py {' '.join(argv)}`", "",
        f"ComfyUI {result['comfy'].get('commit')}; tiny Krea 2 in the sizes ComfyUI detects; recipe "
        f"`{result['recipe']}`.", "",
        "| step | result |", "|---|---|",
        f"| Quantize | {q['quantized_layers']} layers quantized; ComfyUI forward finite: {q['finite']}; rel error vs float "
        f"{q['rel_error_vs_float']:.4f}; upstream float MODEL unchanged: {result['upstream_float_unchanged']} |",
        f"| LoRA (1.0 and 0.5) | delta norm {lo['delta_norm']:.3e} on `{lo['layer']}`; max abs(d(1.0) - 2 d(0.5)) "
        f"{lo['linear_in_strength_max_abs']:.1e}; quantized tensors shared (not requantized): "
        f"{lo['quantized_tensors_shared']}; model output moved {lo['model_output_changed']:.2e} |",
        f"| Export | ComfyUI's loader reads the file (pack installed); its forward vs the quantized MODEL's: rel diff "
        f"{ex['rel_diff_vs_quantized_model']:.1e} (bit-equal: {ex['equal']}; the file's stock int8 layers run "
        "comfy-kitchen's int8 kernel, whose scale product rounds differently: bench/results/comfy_check.md) |",
        f"| Purge (MODEL held loaded by ComfyUI) | freed {pu['bytes_freed']} bytes, retained {pu['retained_bytes']}, "
        f"patches restored {pu['patches_restored']}, unfreed {pu['unfreed'] or 'none'}, proven {pu['proven']}; "
        f"quantized layers alive after: {pu['quantized_layers_alive_after']}; every MODEL of the run float again: "
        f"{pu['models_float_again']}; float MODEL output unchanged: {pu['float_model_output_unchanged']} |",
        f"| Uninstall of the registration | unfreed {result['uninstall']['unfreed'] or 'none'}, patches restored "
        f"{result['uninstall']['patches_restored']} |", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({"command": "python bench/comfy_nodes_check.py " + " ".join(argv),
                                                    **result}, indent=2, default=str) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="a ComfyUI source folder")
    p.add_argument("--out", default="bench/results/comfy_nodes_check")
    p.add_argument("--recipe", default="krea2_nvfp4")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = check(Path(args.src), args.recipe, Path(tmp))
    result["comfy"] = comfy_commit(Path(args.src))
    write(Path(args.out), result, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
