"""LoRA files -> typed per-layer factors on a given model.

Reads diffusers / peft (`lora_A` / `lora_B`), kohya (`lora_down` / `lora_up` / `alpha`), ComfyUI /
BFL native names and AI-toolkit prefixes; module names map through the arch's LoRA key map
(`Arch.lora_targets`), which splits a fused native module (FLUX `qkv`, `linear1`) into its
diffusers modules with their output rows: each part gets the rows of `up` and the same `down`,
which is exact (rows of B A x are rows of B times A x).

Adapter kinds: "lora" (low rank, can be a residual), "dense" (a full delta `diff`) and "dora"
(LoRA + `dora_scale` / peft `lora_magnitude_vector` magnitude: the delta depends on the weight
itself). Only "lora" can be a residual branch; the others are baked (with a warning naming the layer).

Scale. A layer's low-rank delta is `scale * up @ down` with peft's rule: scale = alpha / rank, or
alpha / sqrt(rank) for rank-stabilized LoRA (`use_rslora`); `LayerFactors.scale` is the one place
it is computed. alpha comes from, first to last: the caller's `alpha` override, the module's
`.alpha` tensor (kohya), the adapter's peft LoraConfig (`alpha_pattern`, else `lora_alpha`; read by
lowbit_pipe.lora.peft_config), else the rank (scale 1, diffusers' default for files without alphas).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lowbit_pipe.arch.keymap import SWAP_HALVES, take_rows
from lowbit_pipe.errors import LoraError
from lowbit_pipe.lora.peft_config import AdapterConfig, AdapterConfigs, adapter_configs

DOWN = ("lora_A.weight", "lora_A.default.weight", "lora_down.weight")
UP = ("lora_B.weight", "lora_B.default.weight", "lora_up.weight")
MAGNITUDE = ("dora_scale", "lora_magnitude_vector", "lora_magnitude_vector.weight", "lora_magnitude_vector.default",
             "lora_magnitude_vector.default.weight")
KNOWN = DOWN + UP + MAGNITUDE + ("alpha", "diff")
UNSUPPORTED = re.compile(r"(lora_mid|lokr_|hada_|diff_b|lora_[AB]\.bias|lora_(up|down)\.bias)")
SUFFIX = re.compile(r"\.(lora_[AB](\.default)?\.(weight|bias)|lora_(down|up|mid)\.(weight|bias)|alpha|dora_scale|diff|diff_b|"
                    r"lora_magnitude_vector(\.default)?(\.weight)?|lokr_w[12](_[ab])?|lokr_t2|hada_w[12]_[ab]|"
                    r"hada_t[12])$")


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """peft's LoRA scaling: alpha / rank, or alpha / sqrt(rank) for rank-stabilized LoRA (use_rslora)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def is_linear(module: nn.Module) -> bool:
    """Whether LoRA branches can go on `module`: a QuantLinear, an nn.Linear, or a Linear by duck type.

    The last is ComfyUI's mixed-precision Linear (`comfy.ops.mixed_precision_ops`, what its loader
    builds every Linear of a quantized checkpoint as): an nn.Module that is no nn.Linear, with int
    `in_features` / `out_features`, a `weight` parameter of logical shape [out, in] (a comfy-kitchen
    QuantizedTensor when quantized, whose shape is the unpacked one) and no child modules but a
    `lora` stack. Wrappers that hold their Linear as a child (peft's LoRA layers) are not matched;
    their child is.
    """
    from lowbit_pipe.quant.nn import QuantLinear

    if isinstance(module, (QuantLinear, nn.Linear)):
        return True
    n_in, n_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    weight = module._parameters.get("weight")
    return (isinstance(n_in, int) and isinstance(n_out, int) and weight is not None
            and tuple(weight.shape) == (n_out, n_in) and all(k == "lora" for k in module._modules))


@dataclass(frozen=True)
class LayerFactors:
    """One adapter's contribution to one Linear: delta W = scale * up @ down (kind "lora"), scale =
    alpha / rank, or alpha / sqrt(rank) with `rslora` (see `lora_scale`)."""

    module: str  # diffusers module name in the model
    kind: str  # "lora" | "dense" | "dora"
    down: torch.Tensor | None = None  # [rank, in]
    up: torch.Tensor | None = None  # [out, rank] (rows already cut for a fused native module)
    alpha: float = 1.0
    delta: torch.Tensor | None = None  # kind "dense": [out, in]
    magnitude: torch.Tensor | None = None  # kind "dora": dora_scale ([out, 1] or [1, in])
    keys: tuple[str, ...] = ()
    rslora: bool = False  # rank-stabilized (peft use_rslora): scale = alpha / sqrt(rank)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0]) if self.down is not None else 0

    @property
    def scale(self) -> float:
        """What multiplies up @ down (strength aside); every consumer (branches, bakes, export) uses this."""
        return lora_scale(self.alpha, self.rank, self.rslora)

    def delta_weight(self, weight: torch.Tensor | None = None, strength: float = 1.0) -> torch.Tensor:
        """fp32 [out, in] delta at `strength` (DoRA needs the current `weight`)."""
        if self.kind == "dense":
            return self.delta.float() * strength
        low = (self.up.float() @ self.down.float()) * self.scale
        if self.kind == "lora":
            return low * strength
        # DoRA (peft / ComfyUI): W' = m * (W + dW) / ||W + dW|| along the magnitude's axis; a
        # strength interpolates W -> W' (ComfyUI's weight_decompose).
        w = weight.float()
        merged = w + low
        m = self.magnitude.float()
        norm = merged.norm(dim=1, keepdim=True) if m.shape[0] == w.shape[0] and m.dim() == 2 and m.shape[1] == 1 \
            else merged.norm(dim=0, keepdim=True)
        return (merged * (m.reshape(norm.shape) / norm) - w) * strength


@dataclass
class LoraData:
    """A parsed LoRA file mapped onto one model."""

    where: str  # file path or "<state dict>"
    layers: list[LayerFactors]
    unmatched: list[str] = field(default_factory=list)  # keys of no model Linear
    unsupported: list[str] = field(default_factory=list)  # keys of adapter types we cannot apply
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def ranks(self) -> list[int]:
        return sorted({f.rank for f in self.layers if f.kind != "dense"})

    @property
    def alphas(self) -> list[float]:
        return sorted({f.alpha for f in self.layers if f.kind != "dense"})

    @property
    def rslora(self) -> bool:
        return any(f.rslora for f in self.layers)


def read_state(path_or_state: str | Path | Mapping[str, torch.Tensor], max_tensor_bytes: int | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """(tensors, safetensors metadata, where) of a file path or an in-memory state dict. `max_tensor_bytes`: a
    file tensor claiming more (a factor or delta larger than any Linear of the model could use) is refused from
    the header, before anything is read."""
    if isinstance(path_or_state, Mapping):
        return dict(path_or_state), {}, "<state dict>"
    from lowbit_pipe.files.checkpoint import load_tensors, read_header

    path = str(path_or_state)
    if not Path(path).is_file():
        raise LoraError(f"{path}: no such LoRA file")
    header = read_header(path)  # checks the header, errors name the file
    for key, info in header.tensors.items():
        claim = info.offsets[1] - info.offsets[0]
        if max_tensor_bytes is not None and claim > max_tensor_bytes:
            raise LoraError(f"{path} [{key}]: claims {claim} bytes, more than a full fp32 delta of the model's largest "
                            f"Linear ({max_tensor_bytes}): a corrupt header, or a LoRA for another model")
    return load_tensors(path, header=header), dict(header.metadata), path


def _layer_scale(written: str, parts: Mapping[str, str], state: Mapping[str, torch.Tensor], rank: int,
                 cfg: AdapterConfig | None, alpha: float | None, down_key: str, where: str) -> tuple[float, bool]:
    """(alpha, rslora) of one module, in the order the module doc gives."""
    from lowbit_pipe.arch.lora import strip_lora_prefixes

    rslora = cfg.use_rslora if cfg is not None else False
    name = strip_lora_prefixes(written)[0]  # the module name peft matched its patterns against
    if cfg is not None:
        want, source = cfg.rank_for(name)
        if want is not None and want != rank:
            raise cfg.error(source, f"gives module '{name}' rank {want}, but its factors have rank {rank} ({down_key})")
    if alpha is not None:
        return float(alpha), rslora
    if "alpha" in parts:
        a = _values(state[parts["alpha"]], parts["alpha"], where)
        if a.numel() != 1:
            raise LoraError(f"{where} [{parts['alpha']}]: alpha of shape {tuple(a.shape)}, expected one value")
        return float(a.float().reshape(())), rslora
    if cfg is not None:
        a, source = cfg.alpha_for(name)
        if a is None:
            raise cfg.error("lora_alpha", f"is missing and no alpha_pattern matches module '{name}' (peft would take "
                                          "its default of 8): pass alpha= to say which alpha the LoRA was trained with")
        return a, rslora
    return float(rank), rslora


def _group(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, str]], list[str]]:
    """{module name as written: {suffix: key}}, and keys that are no LoRA tensor at all."""
    groups: dict[str, dict[str, str]] = {}
    stray = []
    for key in state:
        m = SUFFIX.search(key)
        if m is None:
            stray.append(key)
            continue
        groups.setdefault(key[: m.start()], {})[m.group(0)[1:]] = key
    return groups, stray


def _generic_targets(name: str, linears: Mapping[str, nn.Module]) -> list[tuple[str, slice | None]]:
    """No arch map: module names as written (prefixes stripped), or kohya underscores matched to them."""
    from lowbit_pipe.arch.lora import strip_lora_prefixes

    stripped, kohya = strip_lora_prefixes(name)
    if kohya:
        hit = {n.replace(".", "_"): n for n in linears}.get(stripped)
        return [(hit, None)] if hit else []
    return [(stripped, None)] if stripped in linears else []


def _values(t: torch.Tensor, key: str, where: str) -> torch.Tensor:
    """A factor, alpha or magnitude as read: floating point and finite (an integer or NaN factor would
    apply garbage, or NaN, to every output of its layer)."""
    if not t.is_floating_point():
        raise LoraError(f"{where} [{key}]: dtype {t.dtype}; LoRA tensors are floating point")
    if not torch.isfinite(t.half() if t.element_size() == 1 else t).all():
        raise LoraError(f"{where} [{key}]: NaN or Inf values")
    return t


def _matrix(t: torch.Tensor, key: str, where: str) -> torch.Tensor:
    """2-D view of a factor; a 1x1 conv factor [r, k, 1, 1] is a Linear factor."""
    _values(t, key, where)
    if t.dim() == 4 and t.shape[2:] == (1, 1):
        return t.reshape(t.shape[0], t.shape[1])
    if t.dim() != 2:
        raise LoraError(f"{where} [{key}]: factor of shape {tuple(t.shape)} is not a Linear LoRA factor (LoCon conv "
                        "kernels > 1x1 cannot apply to a Linear)")
    return t


@dataclass(frozen=True)
class _Onto:
    """What a file's module names resolve onto: the model's Linears by diffusers name, its arch and config."""

    linears: Mapping[str, Any]  # diffusers module name -> Linear (or, for a natively named model, its part's shape)
    arch: Any
    config: Any
    native: bool  # the model carries native names (a ComfyUI model)
    where: str  # the file, for errors

    def targets(self, written: str) -> list[tuple[str, slice | None]]:
        """The layers (and rows of a fused one) a module as written in the file applies to."""
        targets = self.arch.lora_targets(written, self.config) if self.arch is not None else \
            _generic_targets(written, self.linears)
        return [(t, rows) for t, rows in targets if t in self.linears]


@dataclass(frozen=True)
class _ModuleKeys:
    """One module's tensors as the file names them, and what kind of adapter they make."""

    kind: str  # "lora", "dora" or "dense"
    keys: tuple[str, ...]
    down: str | None
    up: str | None
    magnitude: str | None


def _module_keys(written: str, parts: Mapping[str, str], where: str) -> _ModuleKeys:
    """The module's kind and factor keys; refused when it has neither a full pair of factors nor a dense diff."""
    keys = tuple(parts.values())
    down_key = next((parts[s] for s in DOWN if s in parts), None)
    up_key = next((parts[s] for s in UP if s in parts), None)
    mag_key = next((parts[s] for s in MAGNITUDE if s in parts), None)
    if "diff" in parts:
        kind = "dense"
    elif down_key and up_key:
        kind = "dora" if mag_key else "lora"
    else:
        raise LoraError(f"{where} [{keys[0]}]: module '{written}' has {sorted(parts)}; a LoRA needs both "
                        "lora_A/lora_down and lora_B/lora_up")
    return _ModuleKeys(kind, keys, down_key, up_key, mag_key)


def _model_config(model: nn.Module, arch: Any, config: Any, native: bool, where: str) -> Any:
    """`config` when given (or no arch), else the arch's config read off the model (a natively named model:
    detected from its keys, refused when they are not `arch`'s)."""
    if arch is None or config is not None:
        return config
    if native:
        from lowbit_pipe.arch.detect import detect_module

        found = detect_module(model)
        if found is None or found.arch is not arch:
            raise LoraError(f"{where}: the model is not a {arch.id} model (its keys do not match)")
        return found.config
    return arch.config_from_model(model)


def _fit_targets(onto: _Onto, mk: _ModuleKeys, targets: list[tuple[str, slice | None]], down: torch.Tensor,
                 up: torch.Tensor, mag: torch.Tensor | None, a: float, rslora: bool) -> list[LayerFactors]:
    """The factors per target layer (a fused one: its rows of `up` and of a row magnitude), refused when they do not
    fit the layer."""
    where, out = onto.where, []
    total = up.shape[0]
    for module, rows in targets:
        layer = onto.linears[module]
        part = take_rows(up, rows, layer.in_features)
        if down.shape[1] != layer.in_features or part.shape[0] != layer.out_features:
            named = f"'{onto.arch.to_native(module, onto.config)[0]}' (diffusers '{module}')" if onto.native \
                else f"'{module}'"
            raise LoraError(f"{where} [{mk.up}]: factors up {tuple(part.shape)} @ down {tuple(down.shape)} do not fit "
                            f"layer {named} ({layer.out_features}x{layer.in_features})")
        m = take_rows(mag, rows, layer.in_features) if mag is not None and mag.shape[0] == total else mag
        if m is not None and tuple(m.shape) not in ((layer.out_features, 1), (1, layer.in_features)):
            raise LoraError(f"{where} [{mk.magnitude}]: DoRA magnitude {tuple(m.shape)} fits neither the rows "
                            f"({layer.out_features}, 1) nor the columns (1, {layer.in_features}) of '{module}'")
        f = LayerFactors(module, mk.kind, down, part, a, None, m, mk.keys, rslora)
        out.append(_compact(f) if isinstance(rows, slice) else f)
    return out


def _parse_module(onto: _Onto, written: str, parts: Mapping[str, str], state: Mapping[str, torch.Tensor],
                  configs: AdapterConfigs, alpha: float | None, data: LoraData) -> None:
    """One module of the file into `data`: its layers' factors, or its keys as unsupported / unmatched."""
    where = onto.where
    if any(UNSUPPORTED.match(s) for s in parts):
        data.unsupported.extend(parts.values())
        return
    mk = _module_keys(written, parts, where)
    targets = onto.targets(written)
    if not targets:
        data.unmatched.extend(mk.keys)
        return
    if mk.kind == "dense":
        data.layers.extend(_dense(state[parts["diff"]], targets, onto.linears, mk.keys, where))
        return
    cfg = configs.for_module(written)
    if cfg is not None and cfg.use_dora != (mk.kind == "dora"):
        raise cfg.error("use_dora", f"is {str(cfg.use_dora).lower()}, but module '{written}' "
                                    + (f"has no DoRA magnitude (lora_magnitude_vector / dora_scale; {mk.keys[0]})"
                                       if cfg.use_dora else f"carries a DoRA magnitude ({mk.magnitude})"))
    down = _matrix(state[mk.down], mk.down, where)
    up = _matrix(state[mk.up], mk.up, where)
    rank = down.shape[0]
    if up.shape[1] != rank:
        raise LoraError(f"{where} [{mk.up}]: up {tuple(up.shape)} does not match down rank {rank} ({mk.down})")
    a, rslora = _layer_scale(written, parts, state, rank, cfg, alpha, mk.down, where)
    if rank == 0:
        raise LoraError(f"{where} [{mk.down}]: rank 0 (down {tuple(down.shape)})")
    mag = _values(state[mk.magnitude], mk.magnitude, where) if mk.kind == "dora" else None
    if mag is not None and mag.dim() == 1:
        mag = mag.reshape(-1, 1)  # peft's lora_magnitude_vector [out]: one magnitude per output row
    data.layers.extend(_fit_targets(onto, mk, targets, down, up, mag, a, rslora))


def parse_lora(path_or_state: str | Path | Mapping[str, torch.Tensor], model: nn.Module, *, arch: Any = None,
               config: Any = None, alpha: float | None = None) -> LoraData:
    """Map a LoRA file onto `model`'s Linear / QuantLinear layers (diffusers module names).

    `arch` (an Arch, or None: generic names) resolves native / kohya / prefixed names; `config` (ArchConfig)
    sizes fused splits; `alpha` overrides every alpha of the file (`.alpha` tensors, `lora_alpha`,
    `alpha_pattern`; a `use_rslora` adapter keeps its alpha / sqrt(rank)). Without any: alpha = rank.
    """
    # nn.Linear, QuantLinear, and ComfyUI's mixed-precision Linear (no nn.Linear; see is_linear)
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    largest = max((m.out_features * m.in_features * 4 for m in linears.values()), default=0) + (1 << 20)
    state, metadata, where = read_state(path_or_state, largest)
    configs = adapter_configs(metadata, where, None if isinstance(path_or_state, Mapping) else Path(where))
    # A model of the arch that is not its diffusers class carries native names (a ComfyUI model): names are
    # resolved to diffusers modules as usual, then the factors are put back together per native module.
    native = arch is not None and arch.keymap is not None and not arch.detect_model(model)
    config = _model_config(model, arch, config, native, where)
    onto = _Onto(_diffusers_view(linears, arch, config) if native else linears, arch, config, native, where)
    groups, stray = _group(state)
    data = LoraData(where, [], unmatched=list(stray), metadata=metadata)
    for written, parts in groups.items():
        _parse_module(onto, written, parts, state, configs, alpha, data)
    if native:
        data.layers = _fuse_native(data.layers, arch, config, linears, where)
    return data


def _compact(f: LayerFactors) -> LayerFactors:
    """A part cut from a fused pair without the rank columns its up rows do not use (all zero), which
    a block-diagonal fused pair (one part per column block, as the residual export writes FLUX qkv)
    leaves in every part: the delta is the same (zero columns add nothing), the branch is thinner.
    alpha follows the rank, so the scale stays what it was."""
    used = f.up.ne(0).any(dim=0)
    n = int(used.sum())
    if n == f.rank or n == 0:
        return f
    alpha = f.scale * (math.sqrt(n) if f.rslora else n)
    return dataclasses.replace(f, down=f.down[used], up=f.up[:, used], alpha=alpha)


@dataclass(frozen=True)
class _Shape:
    in_features: int
    out_features: int


def _diffusers_view(linears: Mapping[str, nn.Module], arch: Any, config: Any) -> dict[str, Any]:
    """Diffusers module name -> its (in, out) shape, for the Linears of a natively named model (a fused
    native module gives each part its rows)."""
    out: dict[str, Any] = {}
    for name, layer in linears.items():
        for module, rows in arch.from_native_name(name, config):
            n = len(range(*rows.indices(layer.out_features))) if rows is not None else layer.out_features
            out[module] = _Shape(layer.in_features, n)
    return out


def _fuse_native(layers: list[LayerFactors], arch: Any, config: Any, linears: Mapping[str, nn.Module],
                 where: str) -> list[LayerFactors]:
    """Factors on diffusers modules -> factors on the native modules of the model. A fused native module
    (FLUX qkv) gets one low-rank pair whose up rows hold each part's up at the part's rows: exact, rows of
    B A x being rows of B times A x. Parts with one shared down (a native-named file) keep that down once;
    otherwise the downs stack along the rank and each part's up sits in its own rank columns (scales
    folded into up)."""
    groups: dict[str, list[tuple[slice | None, LayerFactors]]] = {}
    for f in layers:
        native, rows = arch.to_native(f.module, config)
        groups.setdefault(native, []).append((rows, f))
    out = []
    for native, parts in groups.items():
        if len(parts) == 1 and parts[0][0] is None:
            f = parts[0][1]
            if arch.keymap.is_swapped(native):  # back to the native module's (shift, scale) rows
                n_in = linears[native].in_features
                rows_wise = f.magnitude is not None and f.magnitude.shape[0] == linears[native].out_features
                f = dataclasses.replace(f, up=take_rows(f.up, SWAP_HALVES, n_in) if f.up is not None else None,
                                        delta=take_rows(f.delta, SWAP_HALVES, n_in) if f.delta is not None else None,
                                        magnitude=take_rows(f.magnitude, SWAP_HALVES, n_in) if rows_wise
                                        else f.magnitude)
            out.append(dataclasses.replace(f, module=native))
            continue
        layer = linears[native]
        kinds = {f.kind for _, f in parts}
        keys = tuple(k for _, f in parts for k in f.keys)
        if kinds == {"dense"}:
            delta = torch.zeros(layer.out_features, layer.in_features)
            for rows, f in parts:
                delta[rows] = f.delta.float()
            out.append(LayerFactors(native, "dense", delta=delta, keys=keys))
            continue
        if kinds != {"lora"}:
            raise LoraError(f"{where} [{keys[0]}]: a {'/'.join(sorted(k.upper() for k in kinds))} adapter on parts of "
                            f"the fused native layer '{native}' cannot be applied to it")
        shared = all(f.down is parts[0][1].down and f.scale == parts[0][1].scale for _, f in parts)
        downs = [parts[0][1].down] if shared else [f.down for _, f in parts]
        rank = sum(d.shape[0] for d in downs)
        up = torch.zeros(layer.out_features, rank, dtype=torch.float32)
        col = 0
        for rows, f in parts:
            width = f.rank
            up[rows, col:col + width] = f.up.float() * (1.0 if shared else f.scale)
            col += 0 if shared else width
        if shared:
            f0 = parts[0][1]
            out.append(LayerFactors(native, "lora", f0.down, up, f0.alpha, keys=keys, rslora=f0.rslora))
        else:
            out.append(LayerFactors(native, "lora", torch.cat([d.float() for d in downs]), up, float(rank), keys=keys))
    return out


def _dense(delta: torch.Tensor, targets: list, linears: Mapping[str, nn.Module], keys: tuple[str, ...],
           where: str) -> list[LayerFactors]:
    out = []
    for module, rows in targets:
        layer = linears[module]
        part = take_rows(_matrix(delta, keys[0], where), rows, layer.in_features)
        if tuple(part.shape) != (layer.out_features, layer.in_features):
            raise LoraError(f"{where} [{keys[0]}]: diff {tuple(part.shape)} does not fit layer '{module}' "
                            f"({layer.out_features}x{layer.in_features})")
        out.append(LayerFactors(module, "dense", delta=part, keys=keys))
    return out


def check_matched(data: LoraData, strict: bool) -> list[str]:
    """Raise (strict) or return warning lines for unmatched / unsupported keys."""
    problems = []
    if data.unmatched:
        problems.append(f"{data.where}: {len(data.unmatched)} LoRA keys match no Linear of the model: "
                        f"{sorted(data.unmatched)[:12]}{' ...' if len(data.unmatched) > 12 else ''}")
    if data.unsupported:
        problems.append(f"{data.where}: {len(data.unsupported)} keys of unsupported adapter types (LoKr, LoHa, Tucker "
                        f"mid, bias deltas): {sorted(data.unsupported)[:12]}{' ...' if len(data.unsupported) > 12 else ''}")
    if problems and strict:
        raise LoraError("; ".join(problems) + " (set lora.strict=false to skip them with a warning)")
    return problems
