"""load: build the embedded tiny model, or read a diffusers directory or a single .safetensors file."""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.arch import ARCHS, Arch, ArchConfig, get_arch
from lowbit_pipe.arch.base import compute_dtype, keeps_fp32
from lowbit_pipe.arch.tiny import build_tiny
from lowbit_pipe.errors import CheckpointError, FormatError
from lowbit_pipe.files.checkpoint import all_finite, load_tensors, metadata_json, read_header, shard_files
from lowbit_pipe.formats import QuantizedWeight, decode_record, encode_record, format_for_record
from lowbit_pipe.ledger import parent_of
from lowbit_pipe.plan.stream_choice import StreamChoice, decide_stream
from lowbit_pipe.progress import Console
from lowbit_pipe.quant.nn import QuantLinear
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.load_fit import check_config, check_fits
from lowbit_pipe.stages.registry import register
from lowbit_pipe.summary import fmt_bytes

METADATA_KEY = "lowbit_pipe"  # header metadata written by export: JSON with arch, config, recipe
QUANT_METADATA_KEY = "_quantization_metadata"  # ComfyUI's header description of the quantized layers


def _build_empty(cls: type[nn.Module], config: dict[str, Any]) -> nn.Module:
    """Construct without allocating weights (meta device); filled by load_state_dict(assign=True)."""
    with torch.device("meta"):
        return cls(**config)


def _list_entries(keys: Any) -> dict[str, set[int]]:
    """Indices per module list a set of keys reaches: {"transformer_blocks": {0, 1}} (first numeric part)."""
    out: dict[str, set[int]] = {}
    for key in keys:
        parts = key.split(".")
        i = next((j for j, p in enumerate(parts) if p.isdigit()), None)
        if i is not None:
            out.setdefault(".".join(parts[:i]), set()).add(int(parts[i]))
    return out


def _ranges(indices: set[int]) -> str:
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return text if len(runs) == 1 else "{" + text + "}"


def brief_keys(keys: list[str], limit: int = 4) -> str:
    """`keys` in a few words: a count, then module lists by index range (transformer_blocks.2-27.*) and other keys."""
    if not keys:
        return "none"
    lists = _list_entries(keys)
    items = [f"{path}.{_ranges(ix)}.*" for path, ix in lists.items()]
    items += [k for k in keys if not any(p.isdigit() for p in k.split("."))]
    more = f", ... {len(items) - limit} more" if len(items) > limit else ""
    return f"{len(keys)} ({', '.join(items[:limit])}{more})"


def key_mismatch(expected: Any, found: Any, missing: list[str], unexpected: list[str]) -> str:
    """The key-mismatch message: what is missing and unexpected, briefly, and each module list whose length
    differs between the model and the file (a file of another size than the config the model was built from)."""
    have, want = _list_entries(found), _list_entries(expected)
    lengths = [f"{path}: {len(have.get(path, ()))} in the file, {len(want.get(path, ()))} in the model"
               for path in dict.fromkeys([*want, *have]) if len(have.get(path, ())) != len(want.get(path, ()))]
    text = f"keys do not match the model: missing {brief_keys(missing)}, unexpected {brief_keys(unexpected)}"
    return text + (f"; {'; '.join(lengths[:3])}" if lengths else "")


def install_state_dict(model: nn.Module, state: dict[str, torch.Tensor], where: str, dtype: torch.dtype,
                       file_key: Callable[[str], str] = lambda name: name, hint: str = "",
                       console: Console | None = None) -> list[str]:
    """Load `state` into a (meta) model, rebuilding QuantLinear layers from `.comfy_quant` records.

    Returns the names of the quantized layers. Raises CheckpointError naming the file and key; `hint` ends a
    key or shape mismatch's message (what the model was built from, what to set).
    """
    kept = keeps_fp32(type(model))  # diffusers' fp32 modules stay float32, as its from_pretrained keeps them
    quantized = sorted(k[: -len(".comfy_quant")] for k in state if k.endswith(".comfy_quant"))
    for name in quantized:
        try:
            record = decode_record(state.pop(f"{name}.comfy_quant"), name)
            fmt = format_for_record(record, name)
            tensors = {k[len(name) + 1:]: _owned(state.pop(k)) for k in [k for k in state if k.startswith(name + ".")]}
            bias = tensors.pop("bias", None)
            qweight = fmt.from_tensors(tensors, record, name)
        except FormatError as err:
            raise CheckpointError(where, str(err)) from err
        _check_target(model, name, qweight, where, file_key)
        parent, attr = parent_of(model, name)
        bias_dtype = torch.float32 if kept(f"{name}.bias") else dtype
        setattr(parent, attr, QuantLinear(qweight, bias.to(bias_dtype) if bias is not None else None))
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not _is_quant_key(model, k)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(where, key_mismatch(expected, state, missing, unexpected) + hint)
    items = list(state.items())
    for key, tensor in console.progress(items, "load: check and cast") if console is not None else items:
        if key in expected and expected[key].shape != tensor.shape:
            raise CheckpointError(where, f"shape {tuple(tensor.shape)} does not match the model's "
                                         f"{tuple(expected[key].shape)}{hint or ' (wrong model.config?)'}", key)
        if key in expected and expected[key].is_floating_point() != tensor.is_floating_point():
            raise CheckpointError(where, f"dtype {str(tensor.dtype).removeprefix('torch.')} where the model has a "
                                         f"{str(expected[key].dtype).removeprefix('torch.')} tensor", key)
        if tensor.is_floating_point():
            if not all_finite(tensor):
                raise CheckpointError(where, "NaN or Inf in weights", key)
            state[key] = _owned(tensor, torch.float32 if kept(key) else dtype)
        else:
            state[key] = _owned(tensor)
    model.load_state_dict(state, strict=False, assign=True)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if leftover:
        raise CheckpointError(where, f"tensors the file does not provide: {leftover[:5]}")
    return quantized


def _check_target(model: nn.Module, name: str, qweight: QuantizedWeight, where: str,
                  file_key: Callable[[str], str]) -> None:
    """The model's module for a quantized layer of the file is a Linear of the layer's logical shape, or a
    CheckpointError naming the layer (no such module, not a Linear) or its stored weight (another shape)."""
    try:
        target = model.get_submodule(name)
    except AttributeError:
        raise CheckpointError(where, "quantized layer has no matching module in the model", file_key(name)) from None
    if not isinstance(target, nn.Linear):
        raise CheckpointError(where, f"quantized layer, but the model's module is a {type(target).__name__}, not a "
                                     "Linear", file_key(name))
    if (target.out_features, target.in_features) != qweight.shape:
        raise CheckpointError(where, f"stored {tuple(qweight.tensors['weight'].shape)}, a {qweight.shape[0]}x"
                                     f"{qweight.shape[1]} layer in {qweight.format}, but the model's Linear is "
                                     f"{target.out_features}x{target.in_features}", f"{file_key(name)}.weight")


def _owned(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor in memory of its own, aligned: CPU matmul kernels round differently on misaligned inputs
    (reload must be bit-exact). What load_tensors read (a whole fresh allocation) is kept as it is, so a load
    holds each tensor once; a view into a larger storage or misaligned data is copied."""
    out = tensor.to(dtype) if dtype is not None else tensor
    if out.data_ptr() != tensor.data_ptr():
        return out  # converted: a fresh copy already
    whole = out.storage_offset() == 0 and out.untyped_storage().nbytes() == out.numel() * out.element_size()
    return out if whole and out.data_ptr() % 64 == 0 else out.clone()


def _is_quant_key(model: nn.Module, key: str) -> bool:
    owner = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    return isinstance(owner, QuantLinear)  # built whole from the file's tensors, bias included


def quantization_metadata(metadata: dict[str, str], shapes: dict[str, Any], where: str) -> dict[str, dict]:
    """Records of the `_quantization_metadata` header ({"layers": {name: record}}), by layer name as the
    file spells it: how ComfyUI's tools describe quantized layers (some files carry no `.comfy_quant`
    tensors, only this). A name may be written with or without the `model.diffusion_model.` prefix."""
    data = metadata_json(metadata, QUANT_METADATA_KEY, where)
    if data is None:
        return {}
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise CheckpointError(where, f"metadata '{QUANT_METADATA_KEY}' has no 'layers' mapping")
    out = {}
    for name, record in layers.items():
        if not isinstance(record, dict) or "format" not in record:
            raise CheckpointError(where, f"metadata '{QUANT_METADATA_KEY}': layer record without 'format'", name)
        hits = [p + name for p in ("", "model.diffusion_model.") if f"{p}{name}.weight" in shapes]
        hits += [k[: -len(".weight")] for k in shapes if k.endswith(f".{name}.weight")] if not hits else []
        if not hits:
            raise CheckpointError(where, f"metadata '{QUANT_METADATA_KEY}' describes a layer the file does not hold",
                                  name)
        out[hits[0]] = record
    return out


def _read_records(path: str, keys: list[str]) -> dict[str, dict]:
    """`.comfy_quant` records of a file, by layer name (small tensors: cheap to read before the weights)."""
    tensors = load_tensors(path, keys)
    return {k[: -len(".comfy_quant")]: decode_record(t, f"{path} [{k}]") for k, t in tensors.items()}


def check_file_tensors(state: dict[str, torch.Tensor], path: str, console: Console | None = None) -> None:
    """Validate every layer under the keys the FILE uses (before any renaming), so errors name them."""
    quantized = {k[: -len(".comfy_quant")] for k in state if k.endswith(".comfy_quant")}
    for name in sorted(quantized):
        try:
            record = decode_record(state[f"{name}.comfy_quant"], name)
            tensors = {k[len(name) + 1:]: t for k, t in state.items() if k.startswith(name + ".") and not k.endswith(".comfy_quant")}
            tensors.pop("bias", None)
            format_for_record(record, name).from_tensors(tensors, record, name)
        except FormatError as err:
            raise CheckpointError(path, str(err)) from err
    items = list(state.items())
    for key, tensor in console.progress(items, "load: check values") if console is not None else items:
        if key.rsplit(".", 1)[0] not in quantized and tensor.is_floating_point() and not all_finite(tensor):
            raise CheckpointError(path, "NaN or Inf in weights", key)


@dataclass
class SourceFile:
    """What a weights file (or a shard index) says before any weight is read."""

    path: str
    files: list[str]
    meta: dict[str, Any]  # our own header (lowbit_pipe), {} for other tools' files
    records: dict[str, dict]  # `.comfy_quant` / `_quantization_metadata` records, by layer as the file spells it
    header_records: dict[str, dict]  # those from the header only
    arch: Arch
    arch_config: ArchConfig
    layout: str  # "native" or "diffusers"
    kwargs: dict[str, Any]  # the diffusers class's constructor config


def inspect_file(path: str, arch_id: str | None, config_override: dict[str, Any]) -> SourceFile:
    """Headers, records, architecture and constructor config of a single-file checkpoint or shard index.

    The architecture: `arch_id` (model.arch) when given, else the file's own header, else key detection.
    "generic" only changes how detect plans the layers; the model is still built as the file's class."""
    from lowbit_pipe.arch.detect import UnknownArchError, detect_state_dict
    from lowbit_pipe.errors import MalformedKeysError

    if arch_id == "generic":
        arch_id = None
    files = shard_files(path)
    headers = [read_header(f) for f in files]
    shapes = {k: v.shape for h in headers for k, v in h.tensors.items()}
    meta = _our_metadata(headers[0].metadata, files[0])
    records = {}
    for f, h in zip(files, headers):
        records.update(_read_records(f, [k for k in h.tensors if k.endswith(".comfy_quant")]))
    header_records = quantization_metadata(headers[0].metadata, shapes, files[0])
    for name, record in header_records.items():  # ComfyUI lets the header win; two stories is a broken file
        if name in records and records[name] != record:
            raise CheckpointError(path, f"its .comfy_quant record {json.dumps(records[name])} contradicts the "
                                        f"'{QUANT_METADATA_KEY}' header's {json.dumps(record)}", name)
    records.update(header_records)
    try:
        detected, arch_config, file_layout = detect_state_dict(shapes, records)
    except MalformedKeysError as err:
        raise CheckpointError(path, err.args[0].split("]: ", 1)[-1], err.key) from None
    except UnknownArchError as err:
        if arch_id is None and meta.get("arch") is None:
            raise CheckpointError(path, f"{err}; set model.arch (known: {', '.join(sorted(ARCHS))})") from None
        detected, arch_config, file_layout = None, None, meta.get("layout", "diffusers")
    except (FormatError, KeyError, ValueError, ZeroDivisionError, IndexError) as err:  # a config read off damaged shapes
        raise CheckpointError(path, f"its keys look like a known architecture, but their shapes do not add up "
                                    f"({type(err).__name__}: {err})") from None
    arch = get_arch(arch_id or meta.get("arch") or detected.id)
    if arch_config is None or (detected is not None and detected.id != arch.id):
        arch_config = arch.default_config()
    # A file we wrote carries its exact constructor config; never infer it from (packed) shapes then.
    kwargs = dict(meta["transformer_config"]) if meta.get("transformer_config") else arch.default_kwargs()
    kwargs.update(config_override)
    check_config(kwargs, path)  # before any meta build, the loading one or streaming's
    return SourceFile(path, files, meta, records, header_records, arch, arch_config, file_layout, kwargs)


def _our_metadata(metadata: dict[str, str], where: str) -> dict[str, Any]:
    """The file's own `lowbit_pipe` header ({} when absent), its fields typed, or a CheckpointError naming them."""
    meta = metadata_json(metadata, METADATA_KEY, where)
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise CheckpointError(where, f"metadata '{METADATA_KEY}' is {type(meta).__name__}, not a JSON object",
                              METADATA_KEY)
    for field, kind in (("arch", str), ("layout", str), ("transformer_config", dict)):
        if meta.get(field) is not None and not isinstance(meta[field], kind):
            raise CheckpointError(where, f"metadata '{METADATA_KEY}' field '{field}' is {str(meta[field])[:60]}, "
                                         f"not a {kind.__name__}", METADATA_KEY)
    if meta.get("arch") is not None and meta["arch"] not in ARCHS:
        raise CheckpointError(where, f"metadata '{METADATA_KEY}' names arch '{meta['arch'][:60]}' (known: "
                                     f"{', '.join(sorted(ARCHS))})", METADATA_KEY)
    if meta.get("layout") not in (None, "native", "diffusers"):
        raise CheckpointError(where, f"metadata '{METADATA_KEY}' layout '{meta['layout'][:60]}' is neither "
                                     "'native' nor 'diffusers'", METADATA_KEY)
    return meta


def config_hint(src: SourceFile, config_override: dict[str, Any]) -> str:
    """What the model was built from and what to set when the file does not fit it (a mismatch's last words)."""
    if src.meta.get("transformer_config"):
        built = "the constructor config in the file's own header"
    else:
        built = f"the {src.arch.model_class().__name__} class defaults (the released model's size)"
    if config_override:
        built += f" with model.config {dict(config_override)}"
    return (f"; the model was built from {built}: for a file of another size set model.config to its constructor "
            f"config, e.g. +model.config.num_layers=N (the diffusers config.json keys; docs/usage.md, 'model.config')")


def load_single_file(path: str, arch_id: str | None, config_override: dict[str, Any], dtype: torch.dtype,
                     console: Console | None = None) -> tuple[nn.Module, dict]:
    """A state dict in one file (or an index of shards): diffusers or native layout, any prefix, float or quantized.
    `console`: a line saying what is read, then progress per tensor (a 12B model's load is minutes)."""
    from lowbit_pipe.arch.detect import strip_prefix
    from lowbit_pipe.files import layout

    src = inspect_file(path, arch_id, config_override)
    arch, arch_config, records = src.arch, src.arch_config, src.records
    if console is not None:
        size = sum(Path(f).stat().st_size for f in src.files)
        console.say(f"load: {path} ({src.arch.id}, {fmt_bytes(size)} in {len(src.files)} "
                    f"file{'s' if len(src.files) > 1 else ''})")
    model = _build_empty(arch.model_class(), src.kwargs)
    # Only the keys under the model's prefix are read (an all-in-one file's VAE and text encoders are not), and
    # only once they fit the model built above.
    headers = [read_header(f) for f in src.files]
    _, keep_prefix = strip_prefix({k: None for h in headers for k in h.tensors})
    wanted = [[k for k in h.tensors if k.startswith(keep_prefix)] for h in headers]
    check_fits(model, {k: h.tensors[k].offsets[1] - h.tensors[k].offsets[0] for h, keys in zip(headers, wanted)
                       for k in keys}, path)
    state: dict[str, torch.Tensor] = {}
    for i, (f, keys) in enumerate(zip(src.files, wanted), 1):
        label = "load: read" + (f" shard {i}/{len(src.files)}" if len(src.files) > 1 else "")
        state.update(load_tensors(f, keys, console=console, label=label))
    state.update({f"{name}.comfy_quant": encode_record(record) for name, record in src.header_records.items()})
    check_file_tensors(state, path, console)
    state, prefix = strip_prefix(state)
    if src.layout == "native":
        rows = {}
        for name in layout.quantized_layers(state):
            record = records.get(prefix + name) or records.get(name)
            rows[name] = format_for_record(record, f"{path} [{name}]").logical_shape(tuple(state[f"{name}.weight"].shape), record)[0]
        try:
            state = layout.from_native(state, arch, arch_config, rows)
        except FormatError as err:
            raise CheckpointError(path, str(err)) from err

    def file_key(name: str) -> str:  # errors name the layer as the file spells it
        return prefix + (arch.to_native(name, arch_config)[0] if src.layout == "native" else name)

    quantized = install_state_dict(model, state, path, dtype, file_key, config_hint(src, config_override), console)
    return model.eval(), {"path": path, "layout": src.layout, "prefix": prefix, "quantized_layers": len(quantized),
                          "arch": arch.id, "recipe": src.meta.get("recipe"), "files": len(src.files)}


def inspect_dir(path: str, config_override: dict[str, Any]) -> SourceFile:
    """A diffusers model folder as a SourceFile: its class from config.json, its safetensors shards."""
    from lowbit_pipe.files.stream import diffusers_dir_files

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(path, "not a diffusers model directory (no config.json)")
    config = json.loads(config_file.read_text())
    class_name = config.get("_class_name")
    arch = next((a for a in ARCHS.values() if a.diffusers_class == class_name), None)
    if arch is None:
        raise CheckpointError(str(config_file), f"class '{class_name}' is none of the architectures lowbit_pipe "
                                                f"streams ({', '.join(sorted(ARCHS))})", "_class_name")
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    kwargs.update(config_override)
    check_config(kwargs, str(config_file))
    return SourceFile(path, diffusers_dir_files(path), {}, {}, {}, arch, arch.config_from_dict(kwargs), "diffusers",
                      kwargs)


def load_diffusers_dir(path: str, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    import diffusers

    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise CheckpointError(path, "not a diffusers model directory (no config.json)")
    class_name = json.loads(config_file.read_text()).get("_class_name")
    cls = getattr(diffusers, class_name or "", None)
    if cls is None:
        raise CheckpointError(str(config_file), f"unknown diffusers class '{class_name}'", "_class_name")
    model = cls.from_pretrained(path, torch_dtype=dtype)
    return model.eval(), {"path": path, "layout": "diffusers_dir", "quantized_layers": 0}


@register
class Load(Stage):
    name = "load"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.model
        choice = ctx.stream_choice or decide_stream(ctx.recipe, model_given=ctx.model is not None, hands_back=True)
        source = None
        if choice.stream and choice.mode == "auto":  # the recipe allows it; can streaming read the file?
            source, choice = _streamable_source(cfg, choice)
        ctx.stream_choice = choice
        ctx.report["stream"] = choice.as_dict()
        if cfg.path is not None and ctx.model is None and "detect" not in ctx.recipe.pipeline:
            ctx.console.say(f"load:   {choice.line()}")  # else on the plan line
        if choice.stream:
            return self._stream(ctx, source)
        if ctx.model is not None:  # handed in through the Python API: the caller owns it
            ctx.source = {"path": None, "layout": "object", "object": ctx.adapter.name}
            ctx.adapter.prepare(ctx.model)
            _check_given_dtype(ctx)
        elif cfg.path is None:
            arch_id = cfg.arch or cfg.tiny_arch
            if arch_id is None or arch_id == "generic":
                raise ValueError("model.tiny_arch is required for the embedded tiny model (pick one with model=tiny_krea2)")
            ctx.set_model(build_tiny(arch_id, dict(cfg.tiny_config), cfg.seed, ctx.dtype), owned=True)
            ctx.source = {"path": None, "layout": "tiny", "arch": arch_id}
        elif Path(cfg.path).is_dir():
            ctx.console.say(f"load: {cfg.path} (diffusers model folder, read by diffusers' from_pretrained)")
            model, ctx.source = load_diffusers_dir(cfg.path, ctx.dtype)
            ctx.set_model(model, owned=True)
        elif Path(cfg.path).is_file():
            model, ctx.source = load_single_file(cfg.path, cfg.arch, dict(cfg.config), ctx.dtype, ctx.console)
            ctx.set_model(model, owned=True)
        else:
            raise CheckpointError(cfg.path, "no such file or directory (model.path)")
        if cfg.device is not None:
            device = _resolve_device(cfg.device)
            if device != ctx.device:
                _move(ctx, device)
        params = sum(p.numel() for p in ctx.transformer.parameters())
        return {"params": params, "source": ctx.source.get("layout"), "device": str(ctx.device), "dtype": str(ctx.dtype)}

    def _stream(self, ctx: Context, src: SourceFile | None = None) -> dict[str, Any]:
        """model.stream: the structure on the meta device (no weights), the checkpoint opened lazily by export."""
        cfg = ctx.recipe.model
        if ctx.model is not None:
            raise ValueError("model.stream=true streams model.path; a model passed in is loaded already")
        path = cfg.path
        src = src or inspect_source(path, cfg.arch, dict(cfg.config))
        ctx.stream = src
        ctx.set_model(_build_empty(src.arch.model_class(), src.kwargs).eval(), owned=True)
        ctx.source = {"path": path, "layout": src.layout, "arch": src.arch.id, "files": len(src.files), "stream": True}
        params = sum(p.numel() for p in ctx.transformer.parameters())
        return {"params": params, "source": src.layout, "device": str(_resolve_device(cfg.device or "cpu")),
                "dtype": str(ctx.dtype), "stream": True}


def inspect_source(path: str, arch_id: str | None, config_override: dict[str, Any]) -> SourceFile:
    """What streaming reads model.path as: a diffusers folder, or a single file / shard index."""
    if Path(path).is_dir():
        return inspect_dir(path, config_override)
    return inspect_file(path, arch_id, config_override)


def _streamable_source(cfg: Any, choice: StreamChoice) -> tuple[SourceFile | None, StreamChoice]:
    """model.stream=auto with a recipe that allows it: the source when streaming can read it, else a choice to
    load it whole, saying why (quantized layers; a diffusers class no architecture here builds)."""
    try:
        src = inspect_source(cfg.path, cfg.arch, dict(cfg.config))
    except CheckpointError as err:  # loading reads what it can (any diffusers class), or fails naming the file
        why = f"streaming cannot read model.path ({err})"
        return None, StreamChoice(choice.mode, False, why, (("model.path", why),))
    if src.records:
        why = f"model.path holds {len(src.records)} quantized layers (a stream reads float checkpoints)"
        return None, StreamChoice(choice.mode, False, why, (("model.path", why),))
    return src, choice


def _check_given_dtype(ctx: Context) -> None:
    """A passed-in model is computed in its own dtype; casting the caller's weights is not undoable
    exactly (fp32 -> bf16 loses bits), so a different model.dtype is refused, not applied."""
    want = ctx.recipe.model.dtype
    have = compute_dtype(ctx.transformer)
    if want is not None and have is not None and getattr(torch, want) != have:
        raise ValueError(f"model.dtype={want}, but the model passed in is {str(have).removeprefix('torch.')}; "
                         "cast it yourself or leave model.dtype unset")


def _move(ctx: Context, device: torch.device) -> None:
    """Move the transformer to `device`; a passed-in model's move is a ledger entry (teardown moves it back)."""
    transformer = ctx.transformer
    before = ctx.device
    transformer.to(device)
    if ctx.owns_model:
        return
    ref = weakref.ref(transformer)

    def undo() -> None:
        module = ref()
        if module is not None:
            module.to(before)

    def check() -> Any:
        module = ref()
        p = next(module.parameters(), None) if module is not None else None
        return True if p is None or p.device == before else f"still on {p.device}"

    ctx.ledger.record("device_move", f"{type(transformer).__name__}: {before} -> {device}", undo, check)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
