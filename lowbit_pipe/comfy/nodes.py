"""ComfyUI nodes: quantize a MODEL by a recipe, add exact LoRA residual branches, export, and purge with proof.

Every node returns a clone of the MODEL it was given whose diffusion model is a structural copy (new
modules, shared tensors: lowbit_pipe.comfy.tree) set as an object patch, so the MODEL upstream stays as
it was. State a later node needs lives on that copy, owned by it:

- `_lowbit_run`: the quantize run (its ledger: every swap, with its undo);
- `_lowbit_base`, `_lowbit_loras`: the quantized tree before any LoRA and the LoRAs added since, so a
  LoRA node re-attaches all of them to a fresh copy of the base: a new strength or another file of the
  same rank costs a copy and an attach, never a requantization or a recompile.

Every tree a node makes is recorded in the quantize run's ledger with its undo (put the float layers
back, drop the branches and the node state), so the Purge node's teardown reaches every MODEL made from
that run, including the ones ComfyUI still caches, and proves the quantized tensors are gone.

The node classes use ComfyUI's V1 node API (INPUT_TYPES / RETURN_TYPES / FUNCTION / CATEGORY) and need
nothing of ComfyUI but the MODEL objects they are given (and `folder_paths` / `model_management` when
running inside ComfyUI), so they are tested without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lowbit_pipe.nn import QuantLinear

CATEGORY = "lowbit_pipe"


def _tree(model: Any):  # noqa: ANN202
    return model.get_model_object("diffusion_model")


def _with_tree(model: Any, tree: Any) -> Any:
    out = model.clone()
    out.add_object_patch("diffusion_model", tree)
    return out


def _recipe_arg(recipe: str) -> str | dict:
    """A packaged recipe's name, a .yaml path, or YAML text pasted into the node."""
    text = recipe.strip()
    if "\n" in text or ":" in text and not text.endswith((".yaml", ".yml")):
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
        if not isinstance(data, dict):
            raise ValueError(f"recipe: YAML text must be a mapping of stage keys, got {type(data).__name__}")
        return data
    return text


def _overrides(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


class LowbitQuantize:
    """MODEL + recipe (+ overrides) -> quantized MODEL, through the recipe's load, detect and quantize stages."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    FUNCTION = "quantize"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802 - ComfyUI's name
        return {"required": {
            "model": ("MODEL",),
            "recipe": ("STRING", {"default": "krea2_nvfp4_stock", "multiline": True,
                                  "tooltip": "a packaged recipe's name, a .yaml path, or YAML text"}),
            "overrides": ("STRING", {"default": "", "multiline": True, "tooltip": "key=value, one per line"}),
        }}

    def quantize(self, model: Any, recipe: str, overrides: str = "") -> tuple[Any, str]:
        import lowbit_pipe
        from lowbit_pipe.comfy.tree import structural_copy

        model.model.diffusion_model  # noqa: B018 - a MODEL (ModelPatcher) is required
        source = _tree(model)
        if getattr(source, "_lowbit_run", None) is not None:
            raise ValueError("this MODEL is quantized by lowbit_pipe already; purge it first or quantize the original")
        tree = structural_copy(source)
        result = lowbit_pipe.run(_recipe_arg(recipe), [*_overrides(overrides), "pipeline=[load,detect,quantize]"],
                                 model=tree)
        _set_state(tree, result, source, base=tree, loras=())
        result.context.ledger.record("comfy_tree", "quantized diffusion model (node state)",
                                     lambda: _drop_state(tree), check=lambda: _state_gone(tree))
        return _with_tree(model, tree), (result.run_dir / "summary.txt").read_text()


class LowbitLoRA:
    """MODEL + LoRA file + strength -> MODEL with the LoRA as exact residual branches on its quantized layers."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {
            "model": ("MODEL",),
            "lora_name": (_lora_choices(),) if _lora_choices() else ("STRING", {"default": ""}),
            "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01}),
        }}

    def attach(self, model: Any, lora_name: str, strength: float) -> tuple[Any]:
        from lowbit_pipe import lora
        from lowbit_pipe.comfy.tree import structural_copy

        source = _tree(model)
        base = getattr(source, "_lowbit_base", None) or source
        specs = tuple(getattr(source, "_lowbit_loras", ())) + ((_lora_path(lora_name), float(strength)),)
        tree = structural_copy(base)
        for i, (path, s) in enumerate(specs):
            lora.attach(tree, path, strength=s, name=f"{Path(path).stem}#{i}")
        run = getattr(source, "_lowbit_run", None)
        if run is not None:  # a copy of a quantized tree: the quantize run's purge must reach it
            float_tree = source._lowbit_source
            _set_state(tree, run, float_tree, base=base, loras=specs)
            ledger = run.context.ledger
            for name, module in tree.named_modules():
                if isinstance(module, QuantLinear):
                    ledger.watch(f"{name} (LoRA node copy)", module)
            ledger.record("comfy_tree", f"diffusion model with LoRAs {[Path(p).stem for p, _ in specs]}",
                          lambda: _hollow(tree, float_tree), check=lambda: _state_gone(tree))
        return (_with_tree(model, tree),)


class LowbitExport:
    """MODEL -> .safetensors in ComfyUI's layout (LoRA branches, if any, as a LoRA file beside it)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    FUNCTION = "export"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {"model": ("MODEL",),
                             "path": ("STRING", {"default": "lowbit/model.safetensors"})}}

    def export(self, model: Any, path: str) -> tuple[str]:
        import lowbit_pipe

        out = Path(path)
        if not out.is_absolute():
            out = _output_dir() / out
        figures = lowbit_pipe.export(model, out)
        return (figures["path"],)


class LowbitPurge:
    """Tear down what lowbit_pipe did to a MODEL (its ledger, in reverse) and prove it: bytes freed, patches
    restored, what stayed alive. The MODEL comes back with its float layers."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    FUNCTION = "purge"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {"model": ("MODEL",)}}

    def purge(self, model: Any) -> tuple[Any, str]:
        import lowbit_pipe

        tree = _tree(model)
        run = getattr(tree, "_lowbit_run", None)
        if run is None:
            return model, "lowbit_pipe purge: nothing of lowbit_pipe on this MODEL"
        _unload_from_comfy()  # ComfyUI must let go of the patched model first
        del tree
        report = lowbit_pipe.teardown(run)
        del run
        text = "lowbit_pipe purge: " + json.dumps({k: report[k] for k in (
            "bytes_freed", "retained_bytes", "patches_restored", "unfreed", "proven", "unproven", "caveats",
            "device")}, indent=1)
        print(text)
        return model, text


STATE = ("_lowbit_run", "_lowbit_source", "_lowbit_base", "_lowbit_loras")


def _set_state(tree: Any, run: Any, source: Any, *, base: Any, loras: tuple) -> None:
    # Plain attributes, not submodules (setattr of a Module would register it as a child of the tree).
    tree.__dict__.update(_lowbit_run=run, _lowbit_source=source, _lowbit_base=base, _lowbit_loras=loras)


def _drop_state(tree: Any) -> None:
    for key in STATE:
        tree.__dict__.pop(key, None)


def _state_gone(tree: Any) -> Any:
    left = [k for k in STATE if k in tree.__dict__]
    return True if not left else f"node state {left} still set"


def _hollow(tree: Any, float_tree: Any) -> None:
    """A LoRA node's copy back to float: each quantized or LoRA-carrying layer replaced by the float layer
    at the same path of the tree the quantize node started from."""
    from lowbit_pipe.ledger import parent_of

    for name, module in list(tree.named_modules()):
        if name and (isinstance(module, QuantLinear) or "lora" in module._modules):
            parent, attr = parent_of(tree, name)
            setattr(parent, attr, float_tree.get_submodule(name))
    tree.__dict__.pop("_lowbit_lora", None)
    _drop_state(tree)


def _lora_choices() -> list[str]:
    try:
        import folder_paths  # ComfyUI's
    except ImportError:
        return []
    return list(folder_paths.get_filename_list("loras"))


def _lora_path(name: str) -> str:
    if Path(name).is_file():
        return name
    try:
        import folder_paths
    except ImportError:
        raise FileNotFoundError(f"no LoRA file '{name}'") from None
    return folder_paths.get_full_path_or_raise("loras", name)


def _output_dir() -> Path:
    try:
        import folder_paths
    except ImportError:
        return Path.cwd()
    return Path(folder_paths.get_output_directory())


def _unload_from_comfy() -> None:
    try:
        import comfy.model_management as mm
    except ImportError:
        return
    mm.unload_all_models()
    mm.soft_empty_cache()


NODE_CLASS_MAPPINGS = {"LowbitQuantize": LowbitQuantize, "LowbitLoRA": LowbitLoRA, "LowbitExport": LowbitExport,
                       "LowbitPurge": LowbitPurge}
NODE_DISPLAY_NAME_MAPPINGS = {"LowbitQuantize": "Quantize (lowbit_pipe)", "LowbitLoRA": "LoRA residual (lowbit_pipe)",
                              "LowbitExport": "Export quantized (lowbit_pipe)", "LowbitPurge": "Purge (lowbit_pipe)"}
