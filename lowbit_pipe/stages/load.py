"""load: build the embedded tiny model, or read a diffusers directory or a single .safetensors file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowbit_pipe.arch import ARCHS, detect_keys, get_arch
from lowbit_pipe.checkpoint import load_tensors, metadata_json, read_header
from lowbit_pipe.context import Context
from lowbit_pipe.errors import CheckpointError, FormatError
from lowbit_pipe.formats import decode_record, format_for_record
from lowbit_pipe.nn import QuantLinear
from lowbit_pipe.stages import register
from lowbit_pipe.stages.base import Stage

METADATA_KEY = "lowbit_pipe"  # header metadata written by export: JSON with arch, config, recipe


def build_tiny(arch_id: str, config: dict[str, Any], seed: int, dtype: torch.dtype) -> nn.Module:
    """The real diffusers class at a tiny config, with seeded random weights."""
    cls = get_arch(arch_id).model_class()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(**config)
        # Constant-initialised tensors (norm gains, modulation tables) get seeded noise, so
        # every path carries signal as in a trained model and quantization error shows.
        with torch.no_grad():
            for param in model.parameters():
                if param.numel() > 1 and bool((param == param.flatten()[0]).all()):
                    param.add_(torch.randn_like(param) * 0.1)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def _build_empty(cls: type[nn.Module], config: dict[str, Any]) -> nn.Module:
    """Construct without allocating weights (meta device); filled by load_state_dict(assign=True)."""
    with torch.device("meta"):
        return cls(**config)


def install_state_dict(model: nn.Module, state: dict[str, torch.Tensor], where: str, dtype: torch.dtype) -> list[str]:
    """Load `state` into a (meta) model, rebuilding QuantLinear layers from `.comfy_quant` records.

    Returns the names of the quantized layers. Raises CheckpointError naming the file and key.
    """
    quantized = sorted(k[: -len(".comfy_quant")] for k in state if k.endswith(".comfy_quant"))
    for name in quantized:
        layer_where = f"{where} [{name}]"
        try:
            record = decode_record(state.pop(f"{name}.comfy_quant"), layer_where)
            fmt = format_for_record(record, layer_where)
            tensors = {k[len(name) + 1:]: _owned(state.pop(k)) for k in [k for k in state if k.startswith(name + ".")]}
            bias = tensors.pop("bias", None)
            qweight = fmt.from_tensors(tensors, record, layer_where)
        except FormatError as err:
            raise CheckpointError(where, str(err).replace(f"{layer_where}: ", ""), name) from err
        try:
            target = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(where, "quantized layer has no matching module in the model", name) from None
        if not isinstance(target, nn.Linear) or (target.out_features, target.in_features) != qweight.shape:
            shape = getattr(target, "weight", None)
            raise CheckpointError(where, f"record says {qweight.shape[0]}x{qweight.shape[1]} but the model's module is "
                                         f"{type(target).__name__} {tuple(shape.shape) if shape is not None else ''}", name)
        parent, attr = (model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) if "." in name else (model, name)
        setattr(parent, attr, QuantLinear(qweight, bias.to(dtype) if bias is not None else None))
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not _is_quant_key(model, k)]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(where, f"keys do not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                                     f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for key, tensor in state.items():
        if tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                raise CheckpointError(where, "NaN or Inf in weights", key)
            state[key] = _owned(tensor, dtype)
        else:
            state[key] = _owned(tensor)
    model.load_state_dict(state, strict=False, assign=True)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if leftover:
        raise CheckpointError(where, f"tensors the file does not provide: {leftover[:5]}")
    return quantized


def _owned(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy in freshly allocated memory: memory-mapped file data can be misaligned, and
    CPU matmul kernels round differently on misaligned inputs (reload must be bit-exact)."""
    out = tensor.to(dtype) if dtype is not None else tensor
    return out.clone() if out.data_ptr() == tensor.data_ptr() else out


def _is_quant_key(model: nn.Module, key: str) -> bool:
    owner = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    return isinstance(owner, QuantLinear) and key.rsplit(".", 1)[-1] != "bias"


def load_single_file(path: str, arch_id: str | None, config_override: dict[str, Any], dtype: torch.dtype) -> tuple[nn.Module, dict]:
    header = read_header(path)
    meta = metadata_json(header.metadata, METADATA_KEY, path) or {}
    arch_id = arch_id or meta.get("arch")
    config = dict(meta.get("transformer_config") or {})
    if arch_id is None:
        shapes = {k: v.shape for k, v in header.tensors.items()}
        arch = detect_keys(shapes)
        if arch is None:
            raise CheckpointError(path, "cannot tell the architecture from its keys; set model.arch "
                                        f"(known: {', '.join(sorted(ARCHS))})")
        arch_id = arch.id
    config.update(config_override)
    arch = get_arch(arch_id)
    state = load_tensors(path)
    model = _build_empty(arch.model_class(), config)
    quantized = install_state_dict(model, state, path, dtype)
    return model.eval(), {"path": path, "layout": "diffusers", "quantized_layers": len(quantized), "arch": arch_id,
                          "recipe": meta.get("recipe")}


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
        dtype = ctx.dtype
        if ctx.model is not None:  # handed in through the Python API: the caller owns it
            ctx.source = {"path": None, "layout": "object"}
        elif cfg.path is None:
            if cfg.arch is None:
                raise ValueError("model.arch is required for the embedded tiny model (e.g. model=tiny_krea2)")
            ctx.set_model(build_tiny(cfg.arch, dict(cfg.tiny_config), cfg.seed, dtype), owned=True)
            ctx.source = {"path": None, "layout": "tiny", "arch": cfg.arch}
        elif Path(cfg.path).is_dir():
            model, ctx.source = load_diffusers_dir(cfg.path, dtype)
            ctx.set_model(model, owned=True)
        elif Path(cfg.path).is_file():
            model, ctx.source = load_single_file(cfg.path, cfg.arch, dict(cfg.config), dtype)
            ctx.set_model(model, owned=True)
        else:
            raise CheckpointError(cfg.path, "no such file or directory (model.path)")
        if ctx.model is not None and ctx.adapter is None:
            ctx.set_model(ctx.model, owned=False)
        device = _resolve_device(cfg.device)
        if device != ctx.device:
            ctx.transformer.to(device)
        params = sum(p.numel() for p in ctx.transformer.parameters())
        return {"params": params, "source": ctx.source.get("layout"), "device": str(ctx.device)}


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
