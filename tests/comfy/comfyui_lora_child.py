"""Child process of test_lora_comfyui.py: LoRA files against a real ComfyUI, on the CPU.

    python comfyui_lora_child.py job.json result.json

job: {"comfyui": folder, "install_pack": bool,
      "weights": [{"name", "model": float file, "lora", "strength", "oracle"}],
      "attach": [{"name", "model": quantized file, "lora", "strength", "oracle"}]}

An oracle file holds {native module: delta W (float64) at strength 1}.

- weights: ComfyUI's own LoRA loading (comfy.sd.load_lora_for_models, what LoraLoaderModelOnly runs, with
  comfy.lora.model_lora_keys_unet's key map and the weight adapter's calculate_weight) on the float MODEL,
  weights patched by load_models_gpu: per module, patched W - W vs strength * delta; the log's "lora key not
  loaded" / "NOT LOADED" lines.
- attach: the quantized file loaded by comfy.sd.load_diffusion_model (comfy.ops mixed-precision Linears,
  comfy-kitchen QuantizedTensor weights), the LoRA put on it by lowbit_pipe's LoRA node (LowbitLoRA: a
  structural copy + lora.attach): per module, the node MODEL's layer output vs ComfyUI's own output of the
  same layer plus strength * x @ delta^T, on a seeded input; then the whole model's forward.

ComfyUI is imported from the given folder (GPL-3; nothing of it is copied). Results go to result.json.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from comfyui_child import lora_name, run_child

SEED = 7
TOKENS = 6


class LogCatcher(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _oracle(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def check_weights(case: dict[str, Any], catcher: LogCatcher) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    oracle = _oracle(case["oracle"])
    strength = float(case["strength"])
    lora_sd = comfy.utils.load_torch_file(case["lora"], safe_load=True)
    original = comfy.utils.load_torch_file(case["model"], safe_load=True)
    patcher = comfy.sd.load_diffusion_model(case["model"])
    catcher.lines.clear()
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, lora_sd, strength, 0)
    problems = [ln for ln in catcher.lines if "lora key not loaded" in ln or "NOT LOADED" in ln]
    mm.load_models_gpu([patched], force_full_load=True)
    dm = patched.model.diffusion_model
    rows = []
    for module, delta in oracle.items():
        w = dm.get_submodule(module).weight.detach()
        w0 = original[f"{module}.weight"]
        got = w.double() - w0.double()
        want = strength * delta.double()
        rows.append({"module": module, "dtype": str(w.dtype), "max_abs_err": float((got - want).abs().max()),
                     "max_abs_delta": float(want.abs().max()), "max_abs_weight": float(w0.abs().max())})
    out = {"name": case["name"], "not_loaded": problems, "patch_keys": sorted(patched.patches),
           "oracle_keys": sorted(f"diffusion_model.{m}.weight" for m in oracle), "layers": rows}
    mm.unload_all_models()
    return out


def _storage(weight: Any) -> int:
    """Where a weight's stored values live (a QuantizedTensor's packed data): equal for the same weight even
    when ComfyUI re-wraps the Parameter on a load."""
    return getattr(weight, "_qdata", weight).untyped_storage().data_ptr()


def check_attach(case: dict[str, Any]) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd
    import torch
    from comfy_kitchen.tensor import QuantizedTensor

    from lowbit_pipe.comfy.nodes import LowbitLoRA

    oracle = _oracle(case["oracle"])
    strength = float(case["strength"])
    patcher = comfy.sd.load_diffusion_model(case["model"])
    mm.load_models_gpu([patcher], force_full_load=True)
    dm = patcher.model.diffusion_model
    gen = torch.Generator().manual_seed(SEED)
    inputs, base = {}, {}
    for module in oracle:
        layer = dm.get_submodule(module)
        dtype = getattr(layer, "factory_kwargs", {}).get("dtype") or torch.float32
        inputs[module] = torch.randn(TOKENS, layer.in_features, generator=gen).to(dtype)
        with torch.inference_mode():
            base[module] = layer(inputs[module])
    (with_lora,) = LowbitLoRA().attach(patcher, lora_name(case["lora"]), strength)
    mm.load_models_gpu([with_lora], force_full_load=True)
    tree = with_lora.get_model_object("diffusion_model")
    rows = []
    for module, delta in oracle.items():
        layer = tree.get_submodule(module)
        x = inputs[module]
        with torch.inference_mode():
            got = layer(x).double()
        want = base[module].double() + strength * (x.double() @ delta.double().T)
        rows.append({"module": module, "layer_class": type(layer).__qualname__,
                     "is_nn_linear": isinstance(layer, torch.nn.Linear),
                     "quantized": isinstance(layer.weight, QuantizedTensor),
                     "layout": getattr(layer.weight, "_layout_cls", None),
                     "shares_weight": _storage(layer.weight) == _storage(dm.get_submodule(module).weight),
                     "max_abs_err": float((got - want).abs().max()),
                     "max_abs_out": float(want.abs().max()),
                     "max_abs_delta_out": float((want - base[module].double()).abs().max())})
    cfg = with_lora.model.model_config.unet_config
    forward = _forward(tree, cfg, torch)  # the whole diffusion model with the branches, ComfyUI's forward
    plain = _forward(dm, cfg, torch)
    mm.unload_all_models()
    return {"name": case["name"], "layers": rows, "forward_finite": bool(torch.isfinite(forward).all()),
            "forward_rel_change": float((forward - plain).norm() / plain.norm())}


def _forward(dm, cfg: dict, torch) -> Any:
    """The diffusion model's output on seeded inputs under inference_mode (Krea 2 or FLUX.1)."""
    g = torch.Generator().manual_seed(SEED)
    dtype = next((p.dtype for p in dm.parameters() if p.dtype in (torch.float32, torch.bfloat16, torch.float16)),
                 torch.float32)
    with torch.inference_mode():
        if cfg.get("image_model") == "krea2":
            x = torch.randn(1, cfg["channels"], 8, 8, generator=g).to(dtype)
            ctx = torch.randn(1, 6, cfg["txtlayers"] * cfg["txtdim"], generator=g).to(dtype)
            return dm(x, torch.tensor([0.5]), ctx).float()
        x = torch.randn(1, cfg["in_channels"], 8, 8, generator=g).to(dtype)
        ctx = torch.randn(1, 6, cfg["context_in_dim"], generator=g).to(dtype)
        y = torch.randn(1, cfg["vec_in_dim"], generator=g).to(dtype) if cfg.get("vec_in_dim") else None
        kw = {"guidance": torch.tensor([3.5])} if cfg.get("guidance_embed") else {}
        return dm(x, torch.tensor([0.5]), ctx, y=y, **kw).float()


def main(argv: list[str]) -> int:
    catcher = LogCatcher()
    logging.getLogger().addHandler(catcher)
    logging.getLogger().setLevel(logging.INFO)

    def body(job: dict[str, Any], result: dict[str, Any]) -> None:
        if job.get("install_pack"):
            from lowbit_pipe.comfy import install_into_comfyui

            install_into_comfyui()
        for case in job.get("weights", []):
            result["weights"].append(check_weights(case, catcher))
        for case in job.get("attach", []):
            result["attach"].append(check_attach(case))
    return run_child(argv, body, archs=("krea2", "flux1"), result={"weights": [], "attach": []})


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
