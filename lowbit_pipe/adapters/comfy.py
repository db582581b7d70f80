"""ComfyUI model objects: the MODEL a loader node returns (a ModelPatcher holding a BaseModel whose
`diffusion_model` carries native module names).

Recognised by duck typing (no ComfyUI import here): an object with `get_model_object`, `model`,
`load_device` and `patches`. The transformer is `get_model_object("diffusion_model")`, which honours
object patches (how ComfyUI node packs swap a whole diffusion model; lowbit_pipe's own nodes do).

Before the pipeline touches the modules (`prepare`): a MODEL carrying ComfyUI weight patches (its own
LoRA loader's) is refused, since they would be applied to the quantized weights as well (a LoRA twice);
a MODEL that ComfyUI holds partly offloaded is loaded fully first, or refused when that cannot be done.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lowbit_pipe.adapters.base import Adapter


def is_model_patcher(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("get_model_object", "model", "load_device", "patches")) and \
        isinstance(getattr(obj.model, "diffusion_model", None), nn.Module)


class ComfyModelAdapter(Adapter):
    name = "comfy_model"

    @classmethod
    def accepts(cls, obj: Any) -> bool:
        return is_model_patcher(obj)

    def transformer(self, obj: Any) -> nn.Module:
        return obj.get_model_object("diffusion_model")

    def model_config(self, obj: Any) -> dict[str, Any]:
        return {}  # ComfyUI's unet_config is not the diffusers class's kwargs; a reload reads the keys

    def prepare(self, obj: Any) -> None:
        if obj.patches:
            raise ValueError(f"this ComfyUI MODEL carries weight patches on {len(obj.patches)} weights (ComfyUI's own "
                             "LoRA loader): they would be applied to the quantized weights too. Quantize the model "
                             "without them, then add LoRAs with the lowbit LoRA node (exact residual branches)")
        if _fully_loaded(obj):
            return
        import comfy.model_management as mm  # only a ComfyUI process gets here with a partly loaded model

        mm.load_models_gpu([obj], force_full_load=True)
        if not _fully_loaded(obj):
            raise ValueError("ComfyUI holds this MODEL partly offloaded (low VRAM or dynamic VRAM) and would not load "
                             "it fully: lowbit_pipe needs every weight in place to quantize it; free memory or use a "
                             "non-dynamic clone (model.clone(disable_dynamic=True))")


def _fully_loaded(obj: Any) -> bool:
    """No weight of the model is left to ComfyUI's low-VRAM casting (or the model is not loaded at all,
    with every weight in the module tree on its offload device: then there is nothing partial)."""
    model = obj.model
    if getattr(model, "model_lowvram", False):
        return False
    counter = getattr(obj, "lowvram_patch_counter", None)
    return not (callable(counter) and counter())
