"""File to file in bounded memory: a float checkpoint streamed through quantization into the export.

`model.stream` (auto by default: whenever the run allows it, lowbit_pipe.plan.stream_choice; true forces it),
with `pipeline: [load, detect, quantize, export]`: load builds the model on the meta device (structure
only, no weights) and opens the checkpoint lazily; detect and quantize plan the layers on that structure;
export reads one tensor at a time (lowbit_pipe.files.lazy), quantizes it on `quantize.compute_device` or else
`model.device` as it arrives, and appends it to the output (checkpoint.StreamingWriter). Peak host
memory is about one tensor (a fused native layer: its parts together) plus its quantized form, not the
model. The result holds the very tensors, names and records the loading path writes, which
tests/files/test_stream.py checks bit for bit (the header's recipe says which model.stream ran).

Inputs: a single-file checkpoint or a shard index (diffusers or native names, any prefix), or a
diffusers model folder (config.json + safetensors shards). Float weights only; what needs a forward
(static activations, budgets, evaluate, LoRA, compile) needs the model loaded, not streamed.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lowbit_pipe.arch.detect import strip_prefix
from lowbit_pipe.errors import CheckpointError, FormatError
from lowbit_pipe.files.checkpoint import StreamingWriter, all_finite, shard_files
from lowbit_pipe.files.lazy import LazyTensor, SafetensorsFiles
from lowbit_pipe.formats import FormatSpec, encode_record, get_format, is_stock_loadable
from lowbit_pipe.plan.policy import LayerPlan
from lowbit_pipe.progress import Console

QUANT_METADATA_KEY = "_quantization_metadata"
METADATA_KEY = "lowbit_pipe"


def diffusers_dir_files(path: str) -> list[str]:
    """The safetensors files of a diffusers model folder (its shard index, or its one weights file)."""
    folder = Path(path)
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        return shard_files(str(index[0]))
    files = sorted(str(p) for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(path, "a diffusers model folder without safetensors weights cannot be streamed")
    return files


def _output_layers(diff: dict[str, LazyTensor], plans: list[LayerPlan], arch: Any, config: Any,
                   native: bool) -> tuple[dict[str, LazyTensor], dict[str, Any]]:
    """(output key -> lazy tensor, output layer -> its spec) for the export's key layout. A fused native
    layer takes its parts' one spec (they are planned alike, or the export is refused, as the loading path
    refuses it)."""
    specs = {p.name: p.spec for p in plans}
    if not native:
        return diff, {name: spec for name, spec in specs.items() if spec is not None}
    out = arch.state_dict_to_native(diff)
    layer_specs: dict[str, Any] = {}
    for name, spec in specs.items():
        target, rows = arch.to_native(name, config)
        if rows is None:
            if spec is not None:
                layer_specs[target] = spec
            continue
        parts = arch.from_native_name(target, config)
        chosen = {specs.get(part) for part, _ in parts}
        if len(chosen) != 1:
            raise FormatError(f"{target}: fuses {[p for p, _ in parts]}, planned differently "
                              f"({sorted(str(s.format) if s else 'float' for s in chosen)}); quantize all parts alike "
                              "or use export.layout=diffusers")
        if spec is not None:
            layer_specs[target] = spec
    return out, layer_specs


def _header_bound(keys: list[str], layers: int, metadata_hint: int) -> int:
    """Bytes the header can take at most: per tensor its JSON entry, per layer a record and a summary,
    plus the recipe; doubled, so the reserve never runs out."""
    per_key = sum(len(k) + 96 for k in keys)
    return 2 * (per_key + layers * 5 * 140 + metadata_hint) + 4096


@dataclass
class _Streamed:
    """What streaming the tensors through quantization wrote, for the header and the figures."""

    summary: dict[str, dict] = field(default_factory=dict)  # output layer -> format, shape, activations, record
    counts: Counter[str] = field(default_factory=Counter)  # format -> quantized layers
    bytes_before: int = 0  # the quantized layers' float weights as computed
    bytes_after: int = 0  # their quantized tensors and records


def _write_quantized(writer: StreamingWriter, layer: str, spec: FormatSpec, weight: LazyTensor, key: str,
                     compute_dtype: torch.dtype, device: torch.device, source_path: str, done: _Streamed) -> None:
    """Quantize one layer's weight and write its tensors and record; a FormatError is refused naming the key."""
    fmt = get_format(spec.format)
    w = weight.materialize().to(compute_dtype).to(device)
    done.bytes_before += w.numel() * w.element_size()
    try:
        q = fmt.with_activations(fmt.quantize(w, spec), spec.activations, None, layer)
    except FormatError as err:  # NaN in the weight, a shape the format cannot store: name the key
        raise CheckpointError(source_path, str(err), key) from None
    del w
    for name, t in q.tensors.items():
        writer.write(f"{layer}.{name}", t)
    writer.write(f"{layer}.comfy_quant", encode_record(q.record))
    done.bytes_after += q.nbytes + encode_record(q.record).numel()
    done.summary[layer] = {"format": fmt.name, "shape": list(q.shape), "activations": spec.activations,
                           "record": q.record}
    done.counts[fmt.name] += 1


def _stream_tensors(writer: StreamingWriter, keys: list[str], tensors: dict[str, LazyTensor], specs: dict[str, Any],
                    source_path: str, float_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device,
                    console: Console) -> _Streamed:
    """Every output tensor in key order: the planned layers' weights quantized, the rest in `float_dtype`."""
    done = _Streamed()
    for key in console.progress(keys, "export: stream"):
        layer, _, suffix = key.rpartition(".")
        if layer in specs and suffix == "weight":
            _write_quantized(writer, layer, specs[layer], tensors[key], key, compute_dtype, device, source_path, done)
        else:
            t = tensors[key].materialize()
            if t.is_floating_point() and not all_finite(t):  # what the loading path refuses too
                raise CheckpointError(source_path, "NaN or Inf in weights", key)
            writer.write(key, t.to(float_dtype) if t.is_floating_point() else t)
    return done


def _stream_metadata(source: Any, summary: dict[str, dict], recipe: dict[str, Any] | None, native_out: bool
                     ) -> dict[str, str]:
    """The header the loading path writes: ours and ComfyUI's quantization metadata."""
    from lowbit_pipe.version import __version__

    arch, config = source.arch, source.arch_config
    quant = {name: info["record"] for name, info in summary.items()}
    header = {"version": __version__, "arch": arch.id, "layout": "native" if native_out else "diffusers",
              "transformer_config": source.kwargs, "recipe": recipe,
              "layers": _layers_by_module(summary, arch, config, native_out)}
    return {METADATA_KEY: json.dumps(header, default=str),
            QUANT_METADATA_KEY: json.dumps({"format_version": "1.0", "layers": quant}, separators=(",", ":"))}


def stream_export(source: Any, plans: list[LayerPlan], out: Path, *, layout: str, float_dtype: torch.dtype,
                  compute_dtype: torch.dtype, device: torch.device, recipe: dict[str, Any] | None,
                  console: Console | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Read `source` (load.SourceFile) tensor by tensor, quantize per `plans`, write `out` (an existing `out` is
    replaced only with `overwrite`); returns figures."""
    console = console or Console()
    arch, config = source.arch, source.arch_config
    native_out = layout == "comfy" and arch.keymap is not None
    if source.records:
        raise CheckpointError(source.path, f"{len(source.records)} layers are quantized already; streaming reads "
                                           "float checkpoints (load it whole instead: model.stream=false)")
    with SafetensorsFiles(source.files) as files:
        lazy, _prefix = strip_prefix(files.tensors())
        diff = arch.from_native(lazy) if source.layout == "native" else lazy
        planned = {p.name for p in plans}
        missing = sorted(f"{n}.weight" for n in planned if f"{n}.weight" not in diff)
        if missing:
            raise CheckpointError(source.path, f"the file has no {missing[:3]} (not this model's checkpoint?)")
        tensors, specs = _output_layers(diff, plans, arch, config, native_out)
        keys = list(tensors)
        quant_layers = set(specs)
        bound = _header_bound(keys + [f"{n}.{s}" for n in quant_layers for s in
                                      ("weight_scale", "weight_scale_2", "input_scale", "comfy_quant")],
                              len(quant_layers), len(json.dumps(recipe, default=str)) + len(json.dumps(source.kwargs, default=str)))
        with StreamingWriter(out, bound, inputs=(source.path,), replace=overwrite) as writer:
            done = _stream_tensors(writer, keys, tensors, specs, source.path, float_dtype, compute_dtype, device,
                                   console)
            nbytes = writer.close(_stream_metadata(source, done.summary, recipe, native_out))
    foreign = sorted(n for n, info in done.summary.items() if not is_stock_loadable(info["record"]))
    return {"path": str(out), "bytes": nbytes, "files": 1, "tensors": len(writer.entries),
            "layout": layout if arch.keymap is not None else "diffusers", "quantized_layers": len(done.summary),
            "layers": dict(done.counts), "bytes_before": done.bytes_before, "bytes_after": done.bytes_after,
            "not_stock_comfy": foreign, "streamed": True}


def _layers_by_module(summary: dict[str, dict], arch: Any, config: Any, native: bool) -> dict[str, dict]:
    """The header's per-layer summary keyed by diffusers module, as the loading path writes it."""
    out = {}
    for name, info in summary.items():
        parts = arch.from_native_name(name, config) if native else [(name, None)]
        total = info["shape"][0]
        for module, rows in parts:
            n = len(range(*rows.indices(total))) if rows is not None else total
            out[module] = {"format": info["format"], "shape": [n, info["shape"][1]], "activations": info["activations"]}
    return out
