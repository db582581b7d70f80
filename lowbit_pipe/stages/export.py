"""export: safetensors in the layout ComfyUI reads, with the recipe and config in its header."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lowbit_pipe.arch.base import Arch, ArchConfig
from lowbit_pipe.files import layout
from lowbit_pipe.files.checkpoint import export_targets, metadata_json, save_unpublished
from lowbit_pipe.files.tempfiles import discard, publish, publish_together, write_error, write_temp_text
from lowbit_pipe.formats import comfy_versions as compat
from lowbit_pipe.formats import decode_record, is_stock_loadable
from lowbit_pipe.lora import has_residual_lora, residual_metadata, residual_state_dict
from lowbit_pipe.progress import Console
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.recipe import ExportConfig
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.load import METADATA_KEY, QUANT_METADATA_KEY
from lowbit_pipe.stages.registry import register
from lowbit_pipe.version import __version__


def export_state_dict(model: torch.nn.Module, float_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Quantized layers' tensors as they are; float tensors in `float_dtype`. Returns (tensors, per-layer summary)."""
    quant_keys = set()
    layers: dict[str, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            mode = module.format.activation_mode(module.qweight)
            layers[name] = {"format": module.format.name, "shape": [module.out_features, module.in_features],
                            "record": module.record, "activations": mode,
                            "static_ignored": mode == "static" and not module.format.stock_input_scale}
            quant_keys.update(f"{name}.{k}" for k in module._quant_names + ("comfy_quant",))
    state = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if key not in quant_keys and tensor.is_floating_point():
            tensor = tensor.to(float_dtype)
        state[key] = tensor.cpu()
    return state, layers


def shard(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split in key order; a quantized layer's tensors stay in one shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    owners: dict[str, list[str]] = {}
    for key in state:
        owners.setdefault(key.rsplit(".", 1)[0], []).append(key)
    for keys in owners.values():
        nbytes = sum(state[k].numel() * state[k].element_size() for k in keys)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1].update({k: state[k] for k in keys})
        size += nbytes
    return shards


def warn_comfy_kinds(records: dict[str, dict[str, Any]]) -> None:
    """Warn when some layer's kind is one that not every ComfyUI the node pack supports loads stock (naming the
    kinds, what loads each: lowbit_pipe.comfy.compat's table, and the node pack)."""
    message = compat.comfy_warning(records)
    if message is not None:
        warnings.warn(message, stacklevel=3)


def _warn_stock_activations(layers: dict[str, dict]) -> None:
    """Warn about layers whose activation mode stock ComfyUI does not compute as lowbit_pipe does (the warnings
    point at write_export's caller)."""
    unscaled = sorted(n for n, info in layers.items() if info["format"] == "fp8" and info["activations"] == "dynamic")
    if unscaled:
        warnings.warn(f"{len(unscaled)} fp8 layers quantize their activations per token (e.g. {unscaled[0]}); stock "
                      "ComfyUI reads no such mode and uses an input scale of 1 for them: set activations=static "
                      "(a calibrated input_scale) to have it compute what lowbit_pipe computes", stacklevel=3)
    ignored = sorted(n for n, info in layers.items() if info["static_ignored"])
    if ignored:
        warnings.warn(f"{len(ignored)} layers store a static input_scale that stock ComfyUI ignores for their format "
                      f"(e.g. {ignored[0]}, {layers[ignored[0]]['format']}): it quantizes their activations per token",
                      stacklevel=3)


def _export_metadata(state: dict[str, torch.Tensor], layers: dict[str, dict], arch: Arch | None, key_layout: str,
                     model_config: dict[str, Any], recipe: dict[str, Any] | None) -> dict[str, str]:
    """The file header: ours (version, arch, layout, config, recipe, layers) and ComfyUI's quantization metadata."""
    header = {
        "version": __version__,
        "arch": arch.id if arch else None,
        "layout": "native" if key_layout == "comfy" else "diffusers",
        "transformer_config": model_config,
        "recipe": recipe,
        "layers": {n: {"format": i["format"], "shape": i["shape"], "activations": i["activations"]}
                   for n, i in layers.items()},
    }
    # ComfyUI's own description of the quantized layers (its loader reads it; the header wins over the
    # layers' `.comfy_quant` tensors there, so both say the same).
    quant = {k[: -len(".comfy_quant")]: decode_record(t, k) for k, t in state.items() if k.endswith(".comfy_quant")}
    return {METADATA_KEY: json.dumps(header, default=str),
            QUANT_METADATA_KEY: json.dumps({"format_version": "1.0", "layers": quant}, separators=(",", ":"))}


@dataclass
class _Saved:
    """The model's temp files, written and not yet published, and what publishing them makes."""

    together: list[tuple[Path, Path]]  # (temp, target) published as a set before `commit`
    commit: tuple[Path, Path]  # (temp, target) published last: the file, or the shards' index
    files: list[str]
    written: str  # the path a reader opens
    nbytes: int


def _save_shards(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str], shard_bytes: int,
                 total: int, pending: list[Path], inputs: tuple[str | None, ...], console: Console | None) -> _Saved:
    """Shards and their index as temp files (each appended to `pending` as soon as it is complete)."""
    parts = shard(state, shard_bytes)
    stem = path.name.removesuffix(".safetensors")
    together, files, weight_map, nbytes = [], [], {}, 0
    for i, part in enumerate(parts, 1):
        shard_path = path.with_name(f"{stem}-{i:05d}-of-{len(parts):05d}.safetensors")
        tmp, size = save_unpublished(part, shard_path, metadata, inputs=inputs, console=console,
                                     label=f"export: write shard {i}/{len(parts)}")
        pending.append(tmp)
        together.append((tmp, shard_path))
        nbytes += size
        files.append(str(shard_path))
        weight_map.update({k: shard_path.name for k in part})
    index = export_targets(path).index
    index_tmp = write_temp_text(index, json.dumps({"metadata": {"total_size": total, **metadata},
                                                   "weight_map": weight_map}))
    pending.append(index_tmp)
    return _Saved(together, (index_tmp, index), files, str(index), nbytes)


def _save_model(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str], cfg: ExportConfig,
                pending: list[Path], inputs: tuple[str | None, ...], console: Console | None) -> _Saved:
    """The model as one temp file, or as shards and their index when it is over export.shard_bytes."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    if cfg.shard_bytes is None or total <= cfg.shard_bytes:
        tmp, nbytes = save_unpublished(state, path, metadata, inputs=inputs, console=console)
        pending.append(tmp)
        return _Saved([], (tmp, path), [str(path)], str(path), nbytes)
    return _save_shards(state, path, metadata, cfg.shard_bytes, total, pending, inputs, console)


def _keyed_state(state: dict[str, torch.Tensor], layers: dict[str, dict], cfg: ExportConfig, arch: Arch | None,
                 arch_config: ArchConfig | None, native: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The state under the key layout the file is written in, and that layout ("comfy" or "diffusers")."""
    key_layout = cfg.layout if arch is not None and arch.keymap is not None else "diffusers"
    rows = {name: info["shape"][0] for name, info in layers.items()}
    if key_layout == "comfy" and not native:
        state = layout.to_native(state, arch, arch_config, rows)
    elif key_layout == "diffusers" and native:
        state = layout.from_native(state, arch, arch_config, rows)
    return state, key_layout


def write_export(model: torch.nn.Module, path: Path, cfg: ExportConfig, *, float_dtype: torch.dtype,
                 arch: Arch | None, arch_config: ArchConfig | None, model_config: dict[str, Any],
                 recipe: dict[str, Any] | None = None, inputs: tuple[str | None, ...] = (),
                 native: bool = False, console: Console | None = None) -> dict[str, Any]:
    """Write `model` (quantized layers as they are, float tensors in `float_dtype`) per `cfg`; returns figures.
    `native`: the model's modules already carry native names (a ComfyUI model); `console`: progress per tensor."""
    residual = has_residual_lora(model)
    if residual and cfg.residual_lora == "error":
        # Residual branches are runtime state the model file cannot hold: never drop them silently.
        raise ValueError("the model carries LoRA residual branches that the model file cannot hold; "
                         "set export.residual_lora=separate to write them as a LoRA file, or bake them (lora.mode)")
    state, layers = export_state_dict(model, float_dtype)
    state, key_layout = _keyed_state(state, layers, cfg, arch, arch_config, native)
    lora_state = lora_meta = None
    if residual:  # named as this file's layers are; built before anything is written (a refusal leaves no file)
        lora_layout = "native" if key_layout == "comfy" else "diffusers"
        lora_state = residual_state_dict(model, lora_layout, arch=arch, config=arch_config, native=native)
        lora_meta = residual_metadata(model, lora_layout)
    foreign = sorted(n for n, info in layers.items() if not is_stock_loadable(info["record"]))
    warn_comfy_kinds({name: info["record"] for name, info in layers.items()})
    _warn_stock_activations(layers)
    metadata = _export_metadata(state, layers, arch, key_layout, model_config, recipe)
    result: dict[str, Any] = {}
    pending: list[Path] = []  # complete temp files not yet published: removed if anything stops the export
    try:
        saved = _save_model(state, path, metadata, cfg, pending, inputs, console)
        if residual:
            lora_path = export_targets(path).lora
            lora_tmp, result["lora_bytes"] = save_unpublished(lora_state, lora_path, lora_meta, console=console,
                                                              label="export: write LoRA")
            pending.append(lora_tmp)
            saved.together.insert(0, (lora_tmp, lora_path))
            result["lora_path"] = str(lora_path)
        _publish_export(saved.together, saved.commit, replace=cfg.overwrite)
    finally:
        discard(pending)  # nothing left once published; a stopped export (error, interrupt) leaves no temp file
    result = {"path": saved.written, "bytes": saved.nbytes, "files": len(saved.files) + bool(residual),
              "tensors": len(state), "layout": key_layout, "quantized_layers": len(layers),
              "not_stock_comfy": foreign, **result}
    return result


def _publish_export(together: list[tuple[Path, Path]], commit: tuple[Path, Path], *, replace: bool) -> None:
    """One file: a rename. Files that belong together (shards and their index; a model and its LoRA file):
    published as a set, the index (or model) last, so a reader never meets a mix of two exports. `replace=False`:
    an existing target (written meanwhile by another run) stops it with nothing replaced."""
    try:
        if together:
            publish_together(together, commit, replace=replace)
        else:
            publish(*commit, replace=replace)
    except OSError as err:
        raise write_error(err, commit[1]) from err


def _written_records(path: Path) -> dict[str, dict[str, Any]]:
    """Layer -> `.comfy_quant` record of a written file, from its `_quantization_metadata` header."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        quant = metadata_json(f.metadata() or {}, QUANT_METADATA_KEY, str(path))
    return dict((quant or {}).get("layers") or {})


@register
class Export(Stage):
    name = "export"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.export
        path = Path(cfg.path) if cfg.path else ctx.run_dir / "model.safetensors"
        dtype = ctx.dtype if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        recipe = OmegaConf.to_container(OmegaConf.structured(ctx.recipe), resolve=True)
        if ctx.stream is not None:
            from lowbit_pipe.files.stream import stream_export
            from lowbit_pipe.quant.swap import compute_device

            # Rounding runs where the loading path would run it: quantize.compute_device, else model.device.
            device = torch.device(ctx.recipe.model.device or "cpu") if ctx.recipe.model.device != "auto" else \
                torch.device("cuda" if torch.cuda.is_available() else "cpu")
            device = compute_device(ctx.recipe.quantize.compute_device) or device
            result = stream_export(ctx.stream, list(ctx.plan.layers) if ctx.plan is not None else [], path, layout=cfg.layout, float_dtype=dtype,
                                   compute_dtype=ctx.dtype, device=device, recipe=recipe, console=ctx.console,
                                   overwrite=cfg.overwrite)
            warn_comfy_kinds(_written_records(Path(result["path"])))
            ctx.report["export"] = result
            return {k: v for k, v in result.items() if k not in ("not_stock_comfy", "layers")}
        result = write_export(ctx.transformer, path, cfg, float_dtype=dtype, arch=ctx.arch, arch_config=ctx.arch_config,
                              model_config=ctx.model_config, recipe=recipe, inputs=(ctx.recipe.model.path,),
                              native=ctx.native, console=ctx.console)
        ctx.report["export"] = result
        return {k: v for k, v in result.items() if k != "not_stock_comfy"}
