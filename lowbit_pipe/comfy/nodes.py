"""ComfyUI nodes: quantize a MODEL by a recipe, add exact LoRA residual branches, export, purge with proof,
and example inputs for calibrating or trying a model without its text encoder.

Every node that changes a model returns a MODEL of its own (lowbit_pipe.comfy.patchers) whose diffusion
model is a structural copy (new modules, shared tensors: lowbit_pipe.comfy.tree) of the one it was given, so
the MODEL upstream stays as it was. What later nodes need rides on that copy as a `NodeState`
(lowbit_pipe.comfy.node_runs): the `NodeRun` owning it (the quantize run and its ledger), the float tree it
came from, the tree before any LoRA. A LoRA node re-attaches to a fresh copy of that base: a new strength or
another file costs a copy and an attach, never a requantization.

How the nodes live with ComfyUI's execution cache: Purge tears the run down and seals every MODEL made from
it (using one raises an error naming the node, never computes in float); the node that made the run reports
its purge count from IS_CHANGED, so re-queueing the workflow re-runs it by itself. Purge takes any value as
a pass-through (`after`), so a graph orders it after its samplers.

ComfyUI's own LoRA patches on a MODEL given to Quantize (or to the LoRA node) become exact residual branches
on the layers that get quantized (lowbit_pipe.comfy.weight_patches); patches on float layers stay ComfyUI's.

The classes use ComfyUI's V1 node API (INPUT_TYPES / RETURN_TYPES / FUNCTION / CATEGORY, DESCRIPTION and
tooltips) and need nothing of ComfyUI but the MODEL objects they are given (and `folder_paths` /
`comfy.model_management` when running inside ComfyUI), so they are tested without it too.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lowbit_pipe.comfy import node_runs
from lowbit_pipe.comfy.node_runs import PURGES, LoraSpec, NodeRun, NodeState
from lowbit_pipe.comfy.patchers import model_with_tree, release_weights, unload_from_comfy
from lowbit_pipe.comfy.stock_lora import STOCK_LORA_NOTE, is_quantized
from lowbit_pipe.files.tempfiles import move
from lowbit_pipe.quant.nn import QuantLinear

CATEGORY = "lowbit_pipe"
AUTO = "auto"
# The recipe "auto" picks per architecture: files stock ComfyUI loads as they are.
ARCH_RECIPES = {"krea2": "krea2_nvfp4_stock", "flux1": "flux1_fp8"}
DEFAULT_RECIPE = "default"  # int8 W8A8 with the arch's keep-float list, for any other architecture


class AnyType(str):
    """ComfyUI's wildcard socket ("*"): accepted by any input, and any output connects to it."""

    def __ne__(self, other: object) -> bool:
        return False


ANY = AnyType("*")


def _tree(model: Any):
    return model.get_model_object("diffusion_model")


def _with_tree(model: Any, tree: Any, run: NodeRun, patches: dict | None = None) -> Any:
    out = model_with_tree(model, tree, run.clone_id, patches)
    _guard_weight_patches(out)
    return out


GUARD_KEY = "lowbit_pipe_weight_patches"


def _guard_weight_patches(model: Any) -> None:
    """The backstop behind the stock-LoRA conversion (lowbit_pipe.comfy.stock_lora, installed with the loader
    registration): ComfyUI's LoRA loaders after Quantize get exact residual branches there, and no weight patch
    reaches a quantized layer. One that does anyway (a ComfyUI the registration refused, a node that writes a
    MODEL's `patches` itself) would be applied by ComfyUI to packed codes while loading the model (garbage, or a
    crash half-way that leaves the shared model patched). A wrapper on the MODEL's sampling preparation (carried
    by every clone ComfyUI makes of it) refuses such a MODEL before ComfyUI loads anything, naming a key and
    saying what to do. ComfyUIs without sampling wrappers get none."""
    try:
        from comfy.patcher_extension import WrappersMP, add_wrapper_with_key
    except ImportError:  # outside ComfyUI, or a ComfyUI before patcher extensions
        return
    options = getattr(model, "model_options", None)
    if options is None or GUARD_KEY in options.get("transformer_options", {}).get("wrappers", {}).get(
            WrappersMP.PREPARE_SAMPLING, {}):
        return
    add_wrapper_with_key(WrappersMP.PREPARE_SAMPLING, GUARD_KEY, _refuse_patched_quantized, options,
                         is_model_options=True)


def _refuse_patched_quantized(executor: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    from lowbit_pipe.comfy import stock_lora, weight_patches

    tree = model.get_model_object("diffusion_model")
    quantized = {name for name, m in tree.named_modules() if stock_lora.is_quantized(m)}
    hit = [k for k in model.patches if weight_patches._layer_of(k if isinstance(k, str) else k[0]) in quantized]
    if hit:
        raise weight_patches.UnsupportedPatchError(
            f"{len(hit)} ComfyUI weight patches target quantized layers, e.g. '{hit[0]}', and did not become residual "
            "branches (this pack turns those of ComfyUI's LoRA loaders into exact branches where its registration "
            "runs: see the log at start): ComfyUI cannot patch packed weights. Load the LoRA with 'LoRA residual "
            "(lowbit_pipe)' instead (exact branches), or before Quantize")
    return executor(model, *args, **kwargs)


def node_recipe(recipe: str, overrides: str, arch_id: str | None, fixed: list[str] = (),
                layers: list[str] | None = None) -> Any:
    """The Recipe a Quantize node runs: its `recipe` input ("auto" (the arch's default), a packaged recipe's name, a
    .yaml file in models/lowbit_recipes, or YAML text) with its override lines, every part checked as hostile input
    (lowbit_pipe.comfy.node_inputs), then `fixed` (the node's own settings) and the node's pipeline."""
    from lowbit_pipe.comfy import node_inputs
    from lowbit_pipe.config.compose import compose_recipe, parse_recipe_text, read_recipe_file
    from lowbit_pipe.paths import packaged_recipes

    text = recipe.strip()
    lines = node_inputs.overrides(overrides)
    if text in ("", AUTO):
        source: str | dict = ARCH_RECIPES.get(arch_id or "", DEFAULT_RECIPE)
    elif "\n" in text or ":" in text and not text.endswith((".yaml", ".yml")):
        source = parse_recipe_text(text, "recipe")
        node_inputs.check_recipe_data(source, "recipe")
    elif text.endswith((".yaml", ".yml")):
        path = node_inputs.recipe_file(text, _recipe_folder())
        label = f"models/{node_inputs.RECIPE_FOLDER}/{text}"
        source = read_recipe_file(path, label)
        node_inputs.check_recipe_data(source, label)
    elif text in packaged_recipes():
        source = text
    else:
        raise node_inputs.unknown_recipe(text)
    composed = compose_recipe(source, [*fixed, *lines, "pipeline=[load,detect,quantize]"])
    if layers is not None:  # rules that name no layer of this model: a recipe written for another architecture
        shown = text if len(text) <= 60 and "\n" not in text else "<YAML text>"
        node_inputs.check_patterns(composed.quantize, layers, shown, node_inputs.recipe_arch(source), arch_id)
    return composed


def _ui(text: str, result: tuple) -> dict[str, Any]:
    """An output node's return: the text shown under the node in ComfyUI's UI, and the outputs."""
    return {"ui": {"text": [text]}, "result": result}


# ============================================================================================== Quantize
class LowbitQuantize:
    DESCRIPTION = ("Quantizes the diffusion model by a lowbit_pipe recipe (NVFP4, INT8, FP8, W4A4, ...). The MODEL "
                   "given stays as it was. ComfyUI LoRAs already on the MODEL become exact residual branches. Recipes "
                   "that calibrate (static activations, GPTQ, SVDQuant) run the model on the CONDITIONING / LATENT "
                   "given, or on the architecture's example inputs. The run's summary is shown on the node.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "STRING")
    RETURN_NAMES = ("model", "report")
    OUTPUT_TOOLTIPS = ("the quantized model (a new MODEL; the input one is unchanged)",
                       "the run's summary: layers per format, bytes before / after, seconds (also shown on the node)")
    FUNCTION = "quantize_node"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802 - ComfyUI's name
        from lowbit_pipe.comfy.node_inputs import RECIPE_FOLDER, offered_recipes

        return {
            "required": {
                "model": ("MODEL", {"tooltip": "the float diffusion model (Load Diffusion Model)"}),
                "recipe": ([AUTO, *offered_recipes()], {"default": AUTO, "tooltip": (
                    "'auto' (Krea 2: krea2_nvfp4_stock, FLUX.1: flux1_fp8, others: default = int8) or a packaged "
                    "recipe; recipe_text, when not empty, is used instead")}),
                "overrides": ("STRING", {"default": "", "multiline": True, "tooltip": (
                    "recipe overrides, key=value, one per line (e.g. quantize.default.format=fp8)")}),
            },
            "optional": {
                "conditioning": ("CONDITIONING", {"tooltip": (
                    "calibration prompt states (only recipes that calibrate use them); without: the architecture's "
                    "seeded example inputs")}),
                "latent": ("LATENT", {"tooltip": "calibration image size (its shape; the noise is seeded)"}),
                "recipe_text": ("STRING", {"default": "", "multiline": True, "tooltip": (
                    f"instead of the list: a .yaml file in models/{RECIPE_FOLDER}/, YAML text, or any packaged "
                    "recipe's name; empty: the list's choice")}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, recipe: Any = None) -> bool | str:  # noqa: N802 - ComfyUI's name
        """Any text passes ComfyUI's check of the list: a workflow saved when `recipe` was free text (a .yaml name,
        YAML text) still queues. What it may name is checked when the node runs (node_recipe), as before."""
        return recipe is None or isinstance(recipe, str) or f"recipe: {type(recipe).__name__} is not text"

    @classmethod
    def IS_CHANGED(cls, unique_id: str | None = None, **_: Any) -> str:  # noqa: N802 - ComfyUI's name
        return f"purges={PURGES.of(unique_id)}"  # moves when this node's run is purged: re-queue re-runs it

    def quantize_node(self, model: Any, recipe: str, overrides: str = "", conditioning: Any = None,
                      latent: Any = None, recipe_text: str = "", unique_id: str | None = None) -> dict[str, Any]:
        """ComfyUI's entry: `quantize` with recipe_text in place of the list's choice when given, its summary
        shown on the node."""
        chosen = recipe_text if recipe_text.strip() else recipe
        out, summary = self.quantize(model, chosen, overrides, conditioning, latent, unique_id)
        return _ui(summary, (out, summary))

    def quantize(self, model: Any, recipe: str, overrides: str = "", conditioning: Any = None, latent: Any = None,
                 unique_id: str | None = None) -> tuple[Any, str]:
        import lowbit_pipe
        from lowbit_pipe.arch import detect_module
        from lowbit_pipe.comfy import weight_patches
        from lowbit_pipe.comfy.tree import structural_copy

        made_by = f"Quantize (lowbit_pipe) node {unique_id}" if unique_id else "Quantize (lowbit_pipe)"
        source = _tree(model)
        node_runs.check_usable(source, made_by)
        if node_runs.state_of(source) is not None:
            raise ValueError(f"{made_by}: this MODEL comes from a lowbit_pipe node already (quantized, or with lowbit "
                             "LoRA branches); quantize the float MODEL, then add LoRAs")
        packed = [name for name, m in source.named_modules() if is_quantized(m)]
        if packed:
            raise ValueError(f"{made_by}: this MODEL is quantized already ({len(packed)} layers, e.g. '{packed[0]}': a "
                             "quantized file?); Quantize takes a float model. Add LoRAs to it with 'LoRA residual "
                             "(lowbit_pipe)'")
        patches = weight_patches.read_patches(dict(getattr(model, "patches", {}) or {}))
        found = detect_module(source)
        arch_id = found.arch.id if found is not None else None
        # Round on ComfyUI's GPU, layer by layer; the model stays where ComfyUI keeps it until it samples.
        device = getattr(model, "load_device", None)
        on_gpu = [f"quantize.compute_device={device}"] if getattr(device, "type", None) == "cuda" else []
        linears = [name for name, m in source.named_modules() if isinstance(m, torch.nn.Linear)]
        composed = node_recipe(recipe, overrides, arch_id, on_gpu, linears)  # refused here, before anything changes
        release_weights(model)  # the shared model must hold its own weights, not another clone's patched ones
        tree = structural_copy(source)
        result = lowbit_pipe.run(composed, model=tree, run_dir=_run_dir(unique_id),
                                 calibrate=_calibration(tree, arch_id, conditioning, latent, composed.quantize))
        run = NodeRun(result.context.ledger, made_by, unique_id, result)
        try:
            quantized = {name for name, m in tree.named_modules() if isinstance(m, QuantLinear)}
            kept_patches = _branches_from_patches(tree, model, patches, quantized, run)
        except BaseException:
            lowbit_pipe.teardown(result)
            raise
        node_runs.set_state(tree, NodeState(run, source, base=tree))
        run.ledger.record("comfy_tree", "quantized diffusion model (node state)", lambda: node_runs.drop_state(tree),
                          check=lambda: node_runs.state_gone(tree))
        summary = (result.run_dir / "summary.txt").read_text()
        calibration = (result.report.get("quantize") or {}).get("calibration")
        if calibration:
            summary += f"\ncalibrated on {calibration.get('source')}"
        converted = len(patches.low_rank) - sum(1 for layer in patches.low_rank if layer not in quantized)
        if converted:
            summary += f"\nComfyUI LoRA patches on {converted} quantized layers became exact residual branches"
        out = _with_tree(model, tree, run, kept_patches)
        out, summary = _planned_attention(out, result, run, made_by, unique_id, summary)
        return out, summary


def _planned_attention(out: Any, result: Any, run: NodeRun, made_by: str, unique_id: str | None,
                       summary: str) -> tuple[Any, str]:
    """The run's Plan's attention on the node's MODEL: an 8-bit format becomes ComfyUI's attention override (dropped
    by Purge), whether the recipe's attention.format or quantize.target's choice; the stock one changes nothing."""
    plan = result.context.plan
    if plan is None or plan.attention.stock:
        return out, summary
    from lowbit_pipe.comfy.attention import drop_attention8, override_of, with_attention8

    cfg = result.context.recipe.attention
    attention = plan.attention.format
    out = with_attention8(out, attention, made_by, unique_id, cfg.arch_keep, cfg.route,
                          result.context.recipe.quantize.speed_cache)
    run.ledger.record("comfy_attention", f"8-bit attention ({attention}) override on the MODEL",
                      lambda: drop_attention8(out, time.strftime("%H:%M:%S")))
    summary += (f"\n8-bit attention ({attention} Q·Kᵀ, fp8 P·V) through ComfyUI's attention override "
                f"({plan.attention.reason})")
    override = override_of(out)
    if override is not None and override.router is not None:
        summary += f"; routed per call shape (attention.route {cfg.route})"
        summary += "".join(f"; {note}" for note in override.notes)
    if list(cfg.layers) != ["*"]:  # diffusers module names: none here
        summary += (f"; attention.layers {list(cfg.layers)} names diffusers modules and is not applied in ComfyUI: "
                    "every attention call of the MODEL gets it")
    return out, summary


def _branches_from_patches(tree: Any, model: Any, patches: Any, quantized: set[str], run: NodeRun) -> dict:
    """ComfyUI's LoRA patches on the `quantized` layers -> residual branches on `tree` (recorded in the run's
    ledger); returns the patch dict the new MODEL keeps (those on float layers). Refuses what cannot be a branch."""
    from lowbit_pipe import lora
    from lowbit_pipe.comfy import weight_patches

    bad = {k: why for k, why in patches.other.items() if weight_patches._layer_of(k) in quantized}
    if bad:
        key, why = next(iter(bad.items()))
        raise weight_patches.UnsupportedPatchError(
            f"{run.made_by}: the MODEL carries a ComfyUI weight patch on '{key}', {why}, and that layer is quantized: "
            f"it cannot become an exact residual branch ({len(bad)} such patches). Load that LoRA after Quantize "
            "with 'LoRA residual (lowbit_pipe)', or keep those layers float (quantize.rules)")
    low_rank = [p for layer in sorted(quantized) for p in patches.low_rank.get(layer, [])]
    for i, (state, strength) in enumerate(weight_patches.as_lora_states(low_rank)):
        lora.attach(tree, state, strength=strength, name=f"comfyui_lora_{i}", ledger=run.ledger)
    return {k: v for k, v in dict(getattr(model, "patches", {}) or {}).items()
            if weight_patches._layer_of(k if isinstance(k, str) else k[0]) not in quantized}


def _calibration(tree: Any, arch_id: str | None, conditioning: Any, latent: Any, qz: Any) -> Any:
    """The calibration the run uses where its recipe calibrates, one input set per sample (None for an arch this cannot feed; the
    run then says calibration needs inputs), with the recipe's calibration samples, steps and seed (`qz`, its
    quantize section). Inputs are drawn lazily: a recipe that does not calibrate costs nothing."""
    from lowbit_pipe.arch import get_arch
    from lowbit_pipe.comfy import native_inputs as ni
    from lowbit_pipe.plan.held_out import CalibrationUnits
    from lowbit_pipe.recipe import EvaluateConfig

    if arch_id not in ni.SUPPORTED:
        return None
    ev = EvaluateConfig()  # the CLI's example-input sizes

    kinds = qz.calibration.kinds
    masked = get_arch(arch_id).text_mask_key is not None

    def sample(i: int) -> Any:
        # Sample i is of kind i % len(kinds), as in the CLI. ComfyUI's conditioning carries no text mask: a kind's
        # padded prompt (text_valid) comes as its attended tokens alone, as ComfyUI's text encoders give a prompt.
        kind = kinds[i % len(kinds)]
        text = max(1, round(ev.text_tokens * kind.text_scale))
        if kind.text_valid is not None and masked:  # the CLI pads these under the arch's mask; others ignore it
            text = max(1, round(text * kind.text_valid))
        param = next(p for p in tree.parameters() if p.is_floating_point())
        gen = torch.Generator().manual_seed(qz.calibration_seed + i)
        example = ni.example_inputs(arch_id, tree, batch=ev.batch, image_tokens=max(1, round(ev.image_tokens *
                                    kind.image_scale)), text_tokens=text, generator=gen, dtype=param.dtype,
                                    device=param.device)
        if conditioning is None:
            return example
        gen = torch.Generator().manual_seed(qz.calibration_seed + i)
        return ni.comfy_inputs(arch_id, conditioning, latent, generator=gen, dtype=param.dtype, device=param.device,
                               fallback=example)

    # One function per sample: the quantize stage keeps some aside to check the calibration on (plan/held_out.py).
    runs = tuple(ni.calibration_runner(arch_id, tree, lambda _, i=i: sample(i), samples=1, steps=qz.calibration_steps)
                 for i in range(qz.calibration_samples))
    description = ("the node's CONDITIONING" + (" and LATENT size" if latent is not None else "")
                   if conditioning is not None else "the arch's example inputs") + \
        f", in ComfyUI's layout, through the diffusion model's own forward ({qz.calibration_samples} samples x " \
        f"{qz.calibration_steps} Euler steps)"
    return CalibrationUnits(runs, tuple(f"sample {i}" for i in range(len(runs))), description)


# ============================================================================================== LoRA
class LowbitLoRA:
    DESCRIPTION = ("Adds a LoRA as exact low-rank residual branches (never baked into 4-bit weights, where a small "
                   "LoRA would drown in the rounding). Works on a MODEL from Quantize (lowbit_pipe) or on a quantized "
                   "file opened with Load Diffusion Model; chain several. Reads peft / diffusers, kohya, AI-toolkit "
                   "and ComfyUI LoRA files.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("the model with the LoRA's branches (a new MODEL; the input one is unchanged)",)
    FUNCTION = "attach"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "a quantized MODEL (Quantize, or Load Diffusion Model on a quantized file)"}),
                "lora_name": (_lora_choices(), {"tooltip": "a LoRA file from models/loras"}),
                "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0, "step": 0.01,
                                       "tooltip": "the branch's scale (exact: changing it requantizes nothing)"}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def IS_CHANGED(cls, unique_id: str | None = None, **_: Any) -> str:  # noqa: N802
        return f"purges={PURGES.of(unique_id)}"

    def attach(self, model: Any, lora_name: str, strength: float, unique_id: str | None = None) -> tuple[Any]:
        from lowbit_pipe import lora
        from lowbit_pipe.comfy import weight_patches
        from lowbit_pipe.comfy.tree import structural_copy
        from lowbit_pipe.ledger import Ledger

        made_by = f"LoRA residual (lowbit_pipe) node {unique_id}" if unique_id else "LoRA residual (lowbit_pipe)"
        source = _tree(model)
        node_runs.check_usable(source, made_by)
        state = node_runs.state_of(source)
        path = _lora_path(lora_name)
        if state is None:  # a MODEL no lowbit node made (a quantized file): this node owns what it adds
            run, base, float_tree, loras = NodeRun(Ledger(), made_by, unique_id), source, source, ()
        else:
            run, base, float_tree, loras = state.run, state.base, state.source, state.loras
        specs = (*loras, LoraSpec(path, float(strength), f"{Path(path).stem}#{len(loras)}"))
        patches = weight_patches.read_patches(dict(getattr(model, "patches", {}) or {}))
        release_weights(model)
        tree = structural_copy(base)
        quantized = {name for name, m in tree.named_modules() if is_quantized(m)}
        kept = _branches_from_patches(tree, model, patches, quantized, run) if patches.low_rank or patches.other else None
        for spec in specs:  # no ledger: its mirror branches on the run's float originals are shared by all copies;
            # the copy's own undo (node_runs.hollow, below) takes its branches off with its layers
            lora.attach(tree, spec.source, strength=spec.strength, name=spec.name)
        node_runs.set_state(tree, NodeState(run, float_tree, base=base, loras=specs))
        for name, module in tree.named_modules():
            if isinstance(module, QuantLinear):
                run.ledger.watch(f"{name} (LoRA node copy)", module)
        run.ledger.record("comfy_tree", f"diffusion model with LoRAs {[Path(str(s.source)).stem for s in specs]}",
                          lambda: node_runs.hollow(tree, float_tree), check=lambda: node_runs.state_gone(tree))
        return (_with_tree(model, tree, run, kept),)


# ============================================================================================== Export
class LowbitExport:
    DESCRIPTION = ("Writes the model as a .safetensors file in ComfyUI's layout into models/diffusion_models, where "
                   "Load Diffusion Model lists it (lowbit_* kinds need this node pack installed to load). LoRA "
                   "branches go into a LoRA file beside it (models/loras) that stock LoRA loaders read. "
                   + STOCK_LORA_NOTE)
    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    OUTPUT_TOOLTIPS = ("the written file",)
    FUNCTION = "export"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {
            "model": ("MODEL", {"tooltip": "the model to write (quantized or not)"}),
            "filename": ("STRING", {"default": "lowbit/model.safetensors", "tooltip": (
                "a file name in models/diffusion_models: 'name' or 'folder/name' (.safetensors is added)")}),
        }, "optional": {
            "overwrite": ("BOOLEAN", {"default": False, "tooltip": (
                "replace an existing file of that name (and its LoRA file); off: an existing file is never touched")}),
        }}

    def export(self, model: Any, filename: str, overwrite: bool = False) -> dict[str, Any]:
        import lowbit_pipe
        from lowbit_pipe.comfy import node_inputs
        from lowbit_pipe.files.checkpoint import export_targets
        from lowbit_pipe.lora import has_residual_lora

        node_runs.check_usable(_tree(model), "Export (lowbit_pipe)")
        base = _models_dir("diffusion_models") or Path.cwd()
        out = node_inputs.inside(base, node_inputs.safe_name(filename, "filename", suffixes=(".safetensors",)),
                                 "filename")
        targets = export_targets(out)
        loras = _models_dir("loras")
        lora_target = loras / targets.lora.name if loras is not None else targets.lora
        lora = has_residual_lora(_tree(model))
        for path in (out, targets.index, *((targets.lora, lora_target) if lora else ())):  # before any work
            node_inputs.free_target(path, "filename", overwrite=overwrite)
        out.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            figures = lowbit_pipe.export(model, out, overwrite=overwrite)
        shown = _shown(Path(figures["path"]))
        lines = [f"wrote {shown} ({figures.get('bytes', 0) / 2**20:.1f} MiB)"]
        if figures.get("lora_path"):  # inside ComfyUI: into models/loras, where LoRA loaders look
            if Path(figures["lora_path"]) != lora_target:
                lora_target.parent.mkdir(parents=True, exist_ok=True)
                move(Path(figures["lora_path"]), lora_target, replace=overwrite)
            lines.append(f"LoRA branches: {_shown(lora_target)}")
        lines += [f"warning: {w.message}" for w in caught]
        patched = len(getattr(model, "patches", {}) or {})
        if patched:
            lines.append(f"note: {patched} ComfyUI weight patches on float layers are not in the file")
        lines += _stock_lora_lines(model, figures)
        text = "\n".join(lines)
        return _ui(text, (shown,))


def _shown(path: Path) -> str:
    """A written file as the UI shows it: relative to ComfyUI's models folder (the working directory outside
    ComfyUI), never the server's absolute path."""
    try:
        import folder_paths
        base = Path(folder_paths.models_dir)
    except ImportError:
        base = Path.cwd()
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return path.name


def _stock_lora_lines(model: Any, figures: dict[str, Any]) -> list[str]:
    """What Export says about ComfyUI's own LoRA loaders: branches they made on this MODEL are not in the file, and
    what they do to a quantized file without this pack."""
    from lowbit_pipe.comfy.stock_lora import injections_of

    lines = []
    layers = {layer for injection in injections_of(model) for layer in injection.stacks}
    if layers:
        lines.append(f"note: a LoRA from ComfyUI's own loader (exact branches on {len(layers)} quantized layers) is not "
                     "in the file: load it again on the exported file")
    if figures.get("quantized_layers"):
        lines.append(f"LoRA on this file: {STOCK_LORA_NOTE}")
    return lines


# ============================================================================================== Purge
class LowbitPurge:
    DESCRIPTION = ("Tears down the lowbit_pipe run behind a MODEL (every MODEL made from it) and proves it: bytes "
                   "freed, patches restored, what stayed alive. A purged MODEL refuses to run (it never computes in "
                   "float behind your back); queue the workflow again and the Quantize / LoRA nodes re-run. Connect "
                   "a sampler's output to 'after' so Purge runs once sampling is done.")
    CATEGORY = CATEGORY
    RETURN_TYPES = (ANY, "STRING")
    RETURN_NAMES = ("after", "report")
    OUTPUT_TOOLTIPS = ("the 'after' input, unchanged (to chain nodes after the purge)", "the teardown's proof (JSON)")
    FUNCTION = "purge"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {"model": ("MODEL", {"tooltip": "a MODEL made by a lowbit_pipe node"})},
                "optional": {"after": (ANY, {"tooltip": (
                    "anything (a LATENT, an IMAGE, ...) that must be computed before the purge: connect the "
                    "sampler's output here")})}}

    def purge(self, model: Any, after: Any = None) -> dict[str, Any]:
        from lowbit_pipe.comfy.attention import drop_attention8

        dropped = drop_attention8(model, time.strftime("%H:%M:%S"))
        attention = (f"8-bit attention ({dropped.qk_format}) of {dropped.made_by} dropped "
                     f"(calls: {dict(dropped.calls)})") if dropped is not None else None
        tree = _tree(model)
        state = node_runs.state_of(tree)
        if state is None:
            sealed = getattr(tree, "__dict__", {}).get(node_runs.SEAL_ATTR)
            text = "lowbit_pipe purge: " + (attention or ("already purged" if sealed else
                                                          "nothing of lowbit_pipe on this MODEL"))
            return _ui(text, (after, text))
        run = state.run
        del state, tree
        unload_from_comfy(model)  # ComfyUI lets go of the loaded model (and its clones) first
        report = node_runs.purge(run, teardown=_teardown)
        text = "lowbit_pipe purge: " + json.dumps({k: report.get(k) for k in (
            "bytes_freed", "retained_bytes", "patches_restored", "unfreed", "proven", "unproven", "caveats",
            "device")}, indent=1) + (f"\n{attention}" if attention else "")
        print(text)
        return _ui(text, (after, text))


def _teardown(run: NodeRun) -> dict[str, Any]:
    import lowbit_pipe

    if run.result is not None:
        report = lowbit_pipe.teardown(run.result)
        run.result = None
        return report
    return run.ledger.unwind().as_dict()


# ============================================================================================== 8-bit attention
class LowbitAttention8:
    DESCRIPTION = ("Runs the model's attention in 8 bits (lowbit_pipe's attention kernel: Q·Kᵀ in INT8 or FP8 with "
                   "per-block scales and K smoothing, P·V in FP8) through ComfyUI's attention override, on a clone: "
                   "the MODEL given is unchanged. Calls it cannot serve (a mask, cross-attention, a GPU without the "
                   "kernel: before Hopper, head dims other than 64 / 128) keep ComfyUI's attention, and so do call "
                   "shapes where ComfyUI's attention is the faster (timed once per shape on the GPU; fp8 also tries "
                   "cuDNN's FP8 kernel). Purge drops it.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("the model with 8-bit attention (a new MODEL; the input one is unchanged)",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {
            "model": ("MODEL", {"tooltip": "any diffusion model (float or quantized)"}),
            "format": (["int8", "fp8", "bf16"], {"default": "int8", "tooltip": (
                "the format of Q·Kᵀ (P·V is FP8 in both); bf16: ComfyUI's own attention (removes this pack's)")}),
        }, "optional": {
            "blocks_only": ("BOOLEAN", {"default": True, "tooltip": (
                "only the attention of the model's repeated blocks; off: every call, Krea 2's text fusion too "
                "(short sequences: no time saved, more error)")}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def IS_CHANGED(cls, unique_id: str | None = None, **_: Any) -> str:  # noqa: N802
        return f"purges={PURGES.of(unique_id)}"

    def apply(self, model: Any, format: str, blocks_only: bool = True,  # noqa: A002 - the input's name
              unique_id: str | None = None) -> tuple[Any]:
        from lowbit_pipe.comfy.attention import with_attention8

        made_by = f"8-bit attention (lowbit_pipe) node {unique_id}" if unique_id else "8-bit attention (lowbit_pipe)"
        node_runs.check_usable(_tree(model), made_by)
        return (with_attention8(model, format, made_by, unique_id, blocks_only),)


# ============================================================================================== example inputs
class LowbitExampleInputs:
    DESCRIPTION = ("The architecture's seeded example inputs for this MODEL, in ComfyUI's layout: a CONDITIONING (random "
                   "text states of the right width) and an empty LATENT. For calibrating Quantize, or trying a model "
                   "with no text encoder at hand; images from them are not meaningful pictures.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING", "LATENT")
    RETURN_NAMES = ("conditioning", "latent")
    OUTPUT_TOOLTIPS = ("seeded random text states", "an empty latent of the size asked")
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:  # noqa: N802
        return {"required": {
            "model": ("MODEL", {"tooltip": "a Krea 2 or FLUX.1 model (its widths set the shapes)"}),
            "width": ("INT", {"default": 64, "min": 16, "max": 4096, "step": 16, "tooltip": "image width in pixels"}),
            "height": ("INT", {"default": 64, "min": 16, "max": 4096, "step": 16, "tooltip": "image height in pixels"}),
            "text_tokens": ("INT", {"default": 16, "min": 1, "max": 4096, "tooltip": "length of the text states"}),
            "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": "images per batch"}),
            # "fixed": ComfyUI's UI would otherwise add its "randomize" control to an INT named seed, changing the
            # inputs (and re-running everything after this node) at every queue
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**32 - 1, "control_after_generate": "fixed",
                             "tooltip": "seed of the text states"}),
        }}

    def make(self, model: Any, width: int, height: int, text_tokens: int, batch_size: int, seed: int) -> tuple:
        from lowbit_pipe.arch import detect_module
        from lowbit_pipe.comfy import native_inputs as ni

        tree = _tree(model)
        found = detect_module(tree)
        arch_id = found.arch.id if found is not None else "unknown"
        gen = torch.Generator().manual_seed(seed)
        example = ni.example_inputs(arch_id, tree, batch=batch_size, image_tokens=1, text_tokens=text_tokens,
                                    generator=gen, dtype=torch.float32, device="cpu")
        channels = example.x.shape[1]
        latent = torch.zeros(batch_size, channels, height // 8, width // 8)
        options: dict[str, Any] = {}
        if "y" in example.extra:
            options["pooled_output"] = example.extra["y"]
        if "guidance" in example.extra:
            options["guidance"] = float(example.extra["guidance"][0])
        return ([[example.context, options]], {"samples": latent})


# ============================================================================================== ComfyUI glue
KEPT_RUNS = 50  # run folders of Quantize nodes kept under output/lowbit_runs; older ones are removed


def _run_dir(node_id: str | None) -> Path:
    """Where a node's run writes its report: ComfyUI's output folder (lowbit_runs/<date>/<time>-node<id>), else
    the working directory. Inside ComfyUI the oldest run folders beyond KEPT_RUNS are removed first."""
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S") + f"-{time.time_ns() % 10**6:06d}" + (f"-node{node_id}" if node_id else "")
    try:
        import folder_paths
    except ImportError:
        return Path("runs") / stamp
    runs = Path(folder_paths.get_output_directory()) / "lowbit_runs"
    prune_runs(runs, KEPT_RUNS - 1)
    return runs / stamp


def prune_runs(runs: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` node run folders (`<date>/<time>-node<id>` holding a report.json; nothing
    else is touched) and the date folders they leave empty; returns what was removed."""
    import shutil

    found = sorted((p.parent for p in runs.glob("*/*/report.json")), key=lambda p: p.stat().st_mtime)
    removed = found[: max(len(found) - keep, 0)]
    for folder in removed:
        shutil.rmtree(folder)
        if not any(folder.parent.iterdir()):
            folder.parent.rmdir()
    return removed


def _recipe_folder() -> Path | None:
    """ComfyUI's models/lowbit_recipes (the only folder a node reads recipe files from); None outside ComfyUI."""
    from lowbit_pipe.comfy.node_inputs import RECIPE_FOLDER

    try:
        import folder_paths
    except ImportError:
        return None
    return Path(folder_paths.models_dir) / RECIPE_FOLDER


def _lora_choices() -> list[str]:
    try:
        import folder_paths  # ComfyUI's
    except ImportError:
        return []
    return list(folder_paths.get_filename_list("loras"))


def _lora_path(name: str) -> str:
    """Inside ComfyUI: a file of ComfyUI's LoRA list, nothing else (the input is any text a prompt sends). Outside
    ComfyUI (scripts, tests): a path."""
    try:
        import folder_paths
    except ImportError:
        if Path(name).is_file():
            return name
        raise FileNotFoundError(f"no LoRA file '{name}'") from None
    if name not in folder_paths.get_filename_list("loras"):
        raise FileNotFoundError(f"lora_name: '{name}' is not in ComfyUI's LoRA list (models/loras)")
    return folder_paths.get_full_path_or_raise("loras", name)


def _models_dir(kind: str) -> Path | None:
    """ComfyUI's folder for `kind` of model (diffusion_models, loras): the one of that name when the kind has
    several (diffusion_models lists models/unet first, a legacy name); None outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return None
    folders = [Path(p) for p in folder_paths.get_folder_paths(kind)]
    return next((p for p in folders if p.name == kind), folders[0])


from lowbit_pipe.comfy.compile_node import LowbitCompile  # noqa: E402 - its own module; registered here
from lowbit_pipe.comfy.compute_node import LowbitCompute  # noqa: E402 - its own module; registered here

NODE_CLASS_MAPPINGS = {"LowbitQuantize": LowbitQuantize, "LowbitLoRA": LowbitLoRA, "LowbitExport": LowbitExport,
                       "LowbitPurge": LowbitPurge, "LowbitExampleInputs": LowbitExampleInputs,
                       "LowbitAttention8": LowbitAttention8, "LowbitCompile": LowbitCompile,
                       "LowbitCompute": LowbitCompute}
NODE_DISPLAY_NAME_MAPPINGS = {"LowbitQuantize": "Quantize (lowbit_pipe)", "LowbitLoRA": "LoRA residual (lowbit_pipe)",
                              "LowbitExport": "Export quantized (lowbit_pipe)", "LowbitPurge": "Purge (lowbit_pipe)",
                              "LowbitExampleInputs": "Example inputs (lowbit_pipe)",
                              "LowbitAttention8": "8-bit attention (lowbit_pipe)",
                              "LowbitCompile": "Compile (lowbit_pipe)",
                              "LowbitCompute": "Compute (lowbit_pipe)"}
