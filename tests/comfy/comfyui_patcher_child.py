"""Child process of test_comfy_patchers.py: the MODELs the nodes hand out, inside a real ComfyUI, on the CPU.

    python comfyui_patcher_child.py job.json result.json

job: {"comfyui": folder, "model": float Krea 2 file (native names), "lora": peft LoRA file}

A float MODEL from comfy.sd.load_diffusion_model goes through Quantize (lowbit_pipe) then LoRA residual
(lowbit_pipe). Then, with ComfyUI's own code:

- unloading as dynamic VRAM does it (what a GPU runs, and a CPU cannot: comfy-aimdo needs CUDA): every buffer
  of the loaded model recorded as a backup, ModelPatcher.unpatch_model (object patches off), then
  ModelPatcherDynamic.restore_loaded_backups (ComfyUI 0.29's order in ModelPatcherDynamic.unpatch_model);
- ComfyUI rebuilding the MODEL from its `cached_patcher_init` (clone with force_deepcopy, what a non-dynamic
  delegate or a per-GPU copy does);
- Purge, then the float MODEL again.

Outputs are the diffusion model's on the architecture's seeded example inputs. Results go to result.json.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

from comfyui_child import lora_name, run_child


def _forward(tree: Any) -> Any:
    import torch

    from lowbit_pipe.comfy import native_inputs

    inputs = native_inputs.example_inputs("krea2", tree, batch=1, image_tokens=16, text_tokens=4,
                                          generator=torch.Generator().manual_seed(3), dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        return tree(inputs.x, inputs.timestep, inputs.context, **inputs.extra).float()


def _rel(a: Any, b: Any) -> float:
    return float((a - b).norm() / b.norm())


def check(job: dict[str, Any]) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils
    from comfy.model_patcher import ModelPatcher, ModelPatcherDynamic

    from lowbit_pipe.comfy.node_runs import PurgedModelError
    from lowbit_pipe.comfy.nodes import LowbitLoRA, LowbitPurge, LowbitQuantize
    from lowbit_pipe.comfy.patchers import model_with_tree
    from lowbit_pipe.comfy.tree import structural_copy
    from lowbit_pipe.quant.nn import QuantLinear

    out: dict[str, Any] = {}
    float_model = comfy.sd.load_diffusion_model(job["model"])
    float_tree = float_model.get_model_object("diffusion_model")
    float_tensors = {k: v for k, v in float_tree.state_dict(keep_vars=True).items()}
    float_out = _forward(float_tree)

    quantized, _ = LowbitQuantize().quantize(float_model, "default", unique_id="q")
    (with_lora,) = LowbitLoRA().attach(quantized, lora_name(job["lora"]), 1.0, unique_id="l")
    tree = with_lora.get_model_object("diffusion_model")
    out["own_base_model"] = (quantized.model is not float_model.model and with_lora.model is not quantized.model)
    out["tree_is_the_base_models"] = with_lora.model.diffusion_model is tree
    out["float_base_model_untouched"] = float_model.model.diffusion_model is float_tree
    out["object_patch_left"] = "diffusion_model" in with_lora.object_patches
    out["one_clone_id_per_run"] = quantized.clone_base_uuid == with_lora.clone_base_uuid != float_model.clone_base_uuid
    out["quantized_layers"] = sum(isinstance(m, QuantLinear) for m in tree.modules())
    lora_out = _forward(tree)
    out["lora_vs_float_rel"] = _rel(lora_out, float_out)

    # A dynamic-VRAM upstream MODEL (ModelPatcherDynamic needs CUDA: a ModelPatcher that says it is dynamic, which
    # ComfyUI's clone() treats the same way): a node's MODEL around QuantLinears is a plain ModelPatcher all the
    # same, one around ComfyUI's own layers stays dynamic.
    class DynamicLike(ModelPatcher):
        def is_dynamic(self) -> bool:
            return True

    dynamic = float_model.clone()
    dynamic.__class__ = DynamicLike
    for name, made in (("quantized", tree), ("float", float_tree)):
        from_dynamic = model_with_tree(dynamic, structural_copy(made), uuid.uuid4())
        out[f"{name}_from_dynamic_patcher"] = [type(from_dynamic).__name__, from_dynamic.is_dynamic()]

    # Load as ComfyUI does, then unload in dynamic VRAM's order.
    mm.load_models_gpu([with_lora], force_full_load=True)
    for key, buf in with_lora.model.named_buffers(recurse=True):
        with_lora.backup_buffers.setdefault(key, buf)
    out["buffers_recorded"] = len(with_lora.backup_buffers)
    try:
        ModelPatcher.unpatch_model(with_lora, unpatch_weights=False)
        ModelPatcherDynamic.restore_loaded_backups(with_lora)
        out["dynamic_unload"] = "ok"
    except Exception as err:  # noqa: BLE001 - reported, the parent asserts
        out["dynamic_unload"] = f"{type(err).__name__}: {err}"
    out["float_tree_layer_classes"] = sorted({type(m).__name__ for m in float_tree.modules()
                                              if "Linear" in type(m).__name__})
    out["after_unload_rel"] = float((_forward(with_lora.get_model_object("diffusion_model")) - lora_out).abs().max())

    # ComfyUI rebuilding the MODEL (a non-dynamic delegate, a copy per GPU) from its cached_patcher_init.
    rebuilt = with_lora.clone(force_deepcopy=True)
    rebuilt_tree = rebuilt.get_model_object("diffusion_model")
    out["rebuilt_is_another_tree"] = rebuilt_tree is not tree
    out["rebuilt_quantized_layers"] = sum(isinstance(m, QuantLinear) for m in rebuilt_tree.modules())
    out["rebuilt_max_diff"] = float((_forward(rebuilt_tree) - lora_out).abs().max())

    _, report = LowbitPurge().purge(with_lora)["result"]
    out["purge_report"] = report
    for name, make in (("purged_forward", lambda: _forward(tree)),
                       ("purged_rebuilt_forward", lambda: _forward(rebuilt_tree)),
                       ("purged_rebuild", lambda: with_lora.clone(force_deepcopy=True))):
        try:
            make()
            out[name] = "ran"
        except PurgedModelError as err:
            out[name] = f"PurgedModelError: {err}"
    mm.load_models_gpu([float_model], force_full_load=True)
    out["float_after_max_diff"] = float((_forward(float_model.get_model_object("diffusion_model")) - float_out).abs().max())
    out["float_tensors_same"] = all(float_tree.state_dict(keep_vars=True)[k] is v for k, v in float_tensors.items())
    return out


def main(argv: list[str]) -> int:
    return run_child(argv, lambda job, result: result.update(check(job)))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
