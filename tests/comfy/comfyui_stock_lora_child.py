"""Child process of test_comfy_stock_lora_comfyui.py: ComfyUI's own LoRA loading on quantized MODELs, with the
node pack's registration installed, on the CPU.

    python comfyui_stock_lora_child.py job.json result.json

job: {"comfyui": folder, "loras": folder of LoRA files, "strength": float,
      "files": [{"name", "path": quantized file, "arch", "loras": {style: file name}}],
      "quantize": [{"name", "path": float file, "arch", "recipe", "lora": file name}],
      "refuse": {"path": quantized Krea 2 file, "mixed": file name, "float_only": file name,
                 "float_and_quantized": file name, "float_key"}}

Stock loading is `comfy.sd.load_lora_for_models(model, None, lora, strength, 0)`, what LoraLoaderModelOnly and
LoraLoader run; "stock, no pack" is the same with ComfyUI's own `ModelPatcher.add_patches` put back for the
call (what ComfyUI does without the pack). The in-graph residual is the pack's node (LowbitLoRA). Sampling is
`comfy.sample.sample` (what KSampler runs: prepare_sampling, load_models_gpu, injections, the model's forward),
2 Euler steps at 64 x 64 on the pack's seeded example inputs. ComfyUI is imported from the given folder
(GPL-3; nothing of it is copied). Results go to result.json.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from comfyui_child import run_child

SEED = 3


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@contextlib.contextmanager
def without_the_pack_conversion() -> Iterator[None]:
    """ComfyUI's own add_patches for the duration (the registration's wrapper keeps it as __wrapped__)."""
    from comfy.model_patcher import ModelPatcher

    wrapper = ModelPatcher.__dict__["add_patches"]
    ModelPatcher.add_patches = wrapper.__wrapped__
    try:
        yield
    finally:
        ModelPatcher.add_patches = wrapper


class Sampler:
    def __init__(self, model: Any):
        from lowbit_pipe.comfy.nodes import LowbitExampleInputs

        self.cond, latent = LowbitExampleInputs().make(model, 64, 64, 8, 1, 0)
        self.latent = latent["samples"]

    def __call__(self, model: Any) -> Any:
        import comfy.sample

        noise = comfy.sample.prepare_noise(self.latent, SEED)
        return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", self.cond, self.cond, self.latent,
                                   denoise=1.0, seed=SEED, disable_pbar=True).float()


def _lora(job: dict[str, Any], name: str) -> dict:
    import os

    import comfy.utils

    return comfy.utils.load_torch_file(os.path.join(job["loras"], name), safe_load=True)


def _stock(model: Any, sd: dict, strength: float) -> Any:
    import comfy.sd

    return comfy.sd.load_lora_for_models(model, None, sd, strength, 0)[0]


def _conversion_alone(job: dict[str, Any], model: Any, name: str, sd: dict, strength: float,
                      sample: Any) -> float | None:
    """Stock loader + pack vs the residual node on the LoRA `name` (its tensors `sd`) cut to the keys ComfyUI maps
    onto `model`'s quantized layers; None when it names no other layer (the whole LoRA's figure is that one).

    Where a LoRA names float layers too, ComfyUI merges those into the weight (W + delta) and the node keeps a float
    branch (W x + delta x): equal in exact arithmetic, not in fp32's last bit, which a quantized activation
    downstream can turn into a whole rounding step. On the cut LoRA both sides run the same arithmetic. ComfyUI's key
    map (`model_lora_keys_unet`, what its loader uses) decides where a key lands; the cut is written beside it."""
    import os

    import comfy.lora
    from safetensors.torch import save_file

    from lowbit_pipe.comfy import stock_lora
    from lowbit_pipe.comfy.nodes import LowbitLoRA

    quantized = {n for n, m in model.get_model_object("diffusion_model").named_modules() if stock_lora.is_quantized(m)}
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    keep = {}
    for key, value in sd.items():
        prefix = key.rsplit(".", 2 if key.endswith(".weight") else 1)[0]
        if prefix not in key_map:
            raise KeyError(f"{name}: ComfyUI maps no model weight to LoRA key '{key}'")
        target = key_map[prefix][0] if isinstance(key_map[prefix], tuple) else key_map[prefix]
        if target[len("diffusion_model."):-len(".weight")] in quantized:
            keep[key] = value
    if len(keep) == len(sd):
        return None
    cut = f"{os.path.splitext(name)[0]}_quantized_only.safetensors"
    save_file(keep, os.path.join(job["loras"], cut))
    (residual,) = LowbitLoRA().attach(model, cut, strength)
    return _rel(sample(_stock(model, keep, strength)), sample(residual))


def _hooks(tree: Any) -> int:
    return sum(len(m._forward_hooks) for m in tree.modules())


def _float_patch_errors(patcher: Any, originals: dict) -> list[dict[str, Any]]:
    """Per float-layer key ComfyUI kept: its loaded weight - the file's vs strength * scale * up @ down."""
    rows = []
    tree = patcher.model.diffusion_model
    for key, entries in patcher.patches.items():
        module = key[len("diffusion_model."):-len(".weight")]
        if not key.endswith(".weight") or any(e[3] is not None or e[4] is not None for e in entries):
            continue
        want = 0
        for strength, adapter, *_ in entries:
            up, down, alpha = (w.double() if w is not None and hasattr(w, "double") else w
                               for w in adapter.weights[:3])
            want = want + strength * (float(alpha) / down.shape[0] if alpha is not None else 1.0) * (up @ down)
        got = tree.get_submodule(module).weight.detach().double() - originals[module].double()
        rows.append({"key": key, "max_abs_err": float((got - want).abs().max()), "max_abs_delta": float(want.abs().max())})
    return rows


def check_file(job: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd

    from lowbit_pipe.comfy import stock_lora
    from lowbit_pipe.comfy.nodes import LowbitLoRA

    strength = float(job["strength"])
    model = comfy.sd.load_diffusion_model(case["path"])
    tree = model.get_model_object("diffusion_model")
    quantized = sorted(n for n, m in tree.named_modules() if stock_lora.is_quantized(m))
    floats = {n: m.weight.detach().clone() for n, m in tree.named_modules()
              if n not in quantized and hasattr(m, "in_features") and getattr(m, "weight", None) is not None}
    sample = Sampler(model)
    plain = sample(model)
    out: dict[str, Any] = {"name": case["name"], "quantized_layers": len(quantized), "styles": {}}
    for style, name in case["loras"].items():
        sd = _lora(job, name)
        stock = _stock(model, sd, strength)
        injections = stock_lora.injections_of(stock)
        converted = sorted(layer for i in injections for layer in i.stacks)
        got = sample(stock)
        float_rows = _float_patch_errors(stock, floats)
        (residual,) = LowbitLoRA().attach(model, name, strength)
        want = sample(residual)
        whole, alone = _rel(got, want), _conversion_alone(job, model, name, sd, strength, sample)
        row = {"stock_vs_residual": whole if alone is None else alone, "stock_vs_residual_with_float": whole,
               "float_layers_in_lora": alone is not None,
               "lora_effect": _rel(want, plain), "converted_layers": converted,
               "converted_are_quantized": set(converted) <= set(quantized),
               "kept_patches": sorted(stock.patches), "float_patch_rows": float_rows,
               "kept_on_quantized": [k for k in stock.patches if k[len("diffusion_model."):-len(".weight")] in quantized]}
        if style == "peft":  # what ComfyUI does without the pack, for the record (and to show the test can fail)
            with without_the_pack_conversion():
                bare = _stock(model, sd, strength)
            rounded = sample(bare)
            row["no_pack_vs_residual"] = _rel(rounded, want)
            row["no_pack_effect_ratio"] = _rel(rounded, plain) / max(_rel(want, plain), 1e-30)
            del bare
        out["styles"][style] = row
        del stock, residual, injections
    mm.unload_all_models()
    out["hooks_left_after_unload"] = _hooks(tree)
    out["plain_again_equal"] = bool((sample(model) == plain).all())
    mm.unload_all_models()
    return out


def check_quantize(job: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd

    from lowbit_pipe.comfy import stock_lora
    from lowbit_pipe.comfy.nodes import LowbitLoRA, LowbitPurge, LowbitQuantize
    from lowbit_pipe.comfy.weight_patches import UnsupportedPatchError

    strength = float(job["strength"])
    floating = comfy.sd.load_diffusion_model(case["path"])
    sample = Sampler(floating)
    quantized, _ = LowbitQuantize().quantize(floating, case["recipe"], "", unique_id="q")
    sd = _lora(job, case["lora"])
    stock = _stock(quantized, sd, strength)
    (residual,) = LowbitLoRA().attach(quantized, case["lora"], strength, unique_id="r")
    got, want, plain = sample(stock), sample(residual), sample(quantized)
    whole, alone = _rel(got, want), _conversion_alone(job, quantized, case["lora"], sd, strength, sample)
    out = {"name": case["name"], "stock_vs_residual": whole if alone is None else alone,
           "stock_vs_residual_with_float": whole, "float_layers_in_lora": alone is not None, "lora_effect": _rel(want, plain),
           "converted_layers": len({layer for i in stock_lora.injections_of(stock) for layer in i.stacks})}
    with without_the_pack_conversion():
        bare = _stock(quantized, sd, strength)
    try:
        sample(bare)
        out["no_pack"] = "sampled"
    except UnsupportedPatchError as err:  # the sampling guard, the backstop behind the conversion
        out["no_pack"] = f"UnsupportedPatchError: {err}"
    tree = stock.get_model_object("diffusion_model")
    sample(stock)  # loaded (injected) when Purge runs
    _, report = LowbitPurge().purge(stock)["result"]
    out["purge_report"] = report
    out["hooks_left_after_purge"] = _hooks(tree)
    mm.unload_all_models()
    return out


def check_refuse(job: dict[str, Any]) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sd

    from lowbit_pipe.comfy import stock_lora
    from lowbit_pipe.comfy.weight_patches import UnsupportedPatchError

    spec = job["refuse"]
    model = comfy.sd.load_diffusion_model(spec["path"])
    out: dict[str, Any] = {}
    try:
        _stock(model, _lora(job, spec["mixed"]), 1.0)
        out["mixed"] = "accepted"
    except UnsupportedPatchError as err:
        out["mixed"] = f"UnsupportedPatchError: {err}"
    out["model_untouched"] = not model.patches and not model.injections
    tree = model.get_model_object("diffusion_model")
    before = tree.get_submodule(spec["float_key"][len("diffusion_model."):-len(".weight")]).weight.detach().clone()
    accepted = _stock(model, _lora(job, spec["float_only"]), 1.0)
    out["float_only_patches"] = sorted(accepted.patches)
    out["float_only_injections"] = len(stock_lora.injections_of(accepted))
    sample = Sampler(model)
    out["float_only_finite"] = bool(sample(accepted).isfinite().all())
    after = accepted.model.diffusion_model.get_submodule(spec["float_key"][len("diffusion_model."):-len(".weight")])
    out["float_only_weight_changed"] = float((after.weight.detach().double() - before.double()).abs().max())
    mm.unload_all_models()
    # A plain LoRA on a float layer and a quantized one: ComfyUI's patch on the first, a branch on the second.
    originals = {n: m.weight.detach().clone() for n, m in tree.named_modules()
                 if hasattr(m, "in_features") and not stock_lora.is_quantized(m)}
    both = _stock(model, _lora(job, spec["float_and_quantized"]), 1.0)
    sample(both)
    out["float_and_quantized"] = {"kept_patches": sorted(both.patches), "float_patch_rows": _float_patch_errors(both, originals),
                                  "converted_layers": sorted(layer for i in stock_lora.injections_of(both) for layer in i.stacks)}
    mm.unload_all_models()
    return out


def main(argv: list[str]) -> int:
    def body(job: dict[str, Any], result: dict[str, Any]) -> None:
        import folder_paths

        from lowbit_pipe.comfy import install_into_comfyui

        registration = install_into_comfyui()
        result["wrapped"] = list(registration.wrapped)
        folder_paths.add_model_folder_path("loras", job["loras"], is_default=True)
        result["files"] = [check_file(job, case) for case in job.get("files", [])]
        result["quantize"] = [check_quantize(job, case) for case in job.get("quantize", [])]
        if job.get("refuse"):
            result["refuse"] = check_refuse(job)
        report = registration.uninstall()
        result["uninstall"] = {k: report.get(k) for k in ("patches_restored", "unfreed", "errors")}
        from comfy.model_patcher import ModelPatcher

        result["add_patches_restored"] = not hasattr(ModelPatcher.add_patches, "__wrapped__")
    return run_child(argv, body, archs=("krea2", "flux1"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
