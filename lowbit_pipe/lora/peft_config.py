"""peft LoraConfig in a LoRA file: the fields that decide each layer's scale, read and checked.

diffusers writes the config into the safetensors metadata (`lora_adapter_metadata`: fields bare for a
model's `save_lora_adapter`, `<component>.` prefixed, e.g. `transformer.r`, for a pipeline's
`save_lora_weights`); peft's `save_pretrained` writes `adapter_config.json` beside
`adapter_model.safetensors`. Patterns resolve against module names as peft does
(`peft.utils.other.get_pattern_key`). A field that changes the output and cannot be read or applied
is a LoraError naming the file and the field, never a silent default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from lowbit_pipe.errors import LoraError

METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
PEFT_CONFIG_FILE = "adapter_config.json"  # peft save_pretrained: beside adapter_model.safetensors

# peft LoraConfig fields (peft 0.21) that do not change a Linear's delta, given the saved tensors: targeting,
# training, initialization and bookkeeping (base biases, modules_to_save and trainable tokens come as extra
# tensors, which check_matched reports). VeLoRA only swaps the backward pass.
INERT_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "target_modules", "exclude_modules", "lora_dropout", "fan_in_fan_out", "bias", "modules_to_save",
    "init_lora_weights", "layers_to_transform", "layers_pattern", "megatron_config", "megatron_core",
    "trainable_token_indices", "loftq_config", "eva_config", "corda_config", "lora_ga_config", "qalora_group_size",
    "velora_config", "ensure_weight_tying", "runtime_config"})
# Read here: they decide the scale (r / rank_pattern are checked against the factors' rank).
READ_FIELDS = ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora", "lora_bias")
# LoRA variants whose output lowbit_pipe cannot reproduce: set (not None / False / empty), they are a LoraError.
VARIANT_FIELDS = ("use_qalora", "alora_invocation_tokens", "arrow_config", "layer_replication", "monteclora_config",
                  "use_bdlora", "kasa_config", "target_parameters")


def pattern_key(patterns: Iterable[str], name: str) -> str | None:
    """The first of `patterns` that matches module `name` the way peft resolves `rank_pattern` / `alpha_pattern`
    (peft.utils.other.get_pattern_key: the pattern, a regex, matches the whole name or a dotted suffix of it),
    or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of one peft LoraConfig that decide each layer's scale (a pipeline file has one per component)."""

    where: str  # file the config came from (the LoRA file, or its adapter_config.json)
    container: str  # "lora_adapter_metadata" (safetensors metadata) or "" (a JSON file of its own)
    prefix: str  # "transformer." for a component of a pipeline file, "" for a bare config
    r: int | None = None
    lora_alpha: float | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    use_dora: bool = False

    def error(self, name: str, problem: str) -> LoraError:
        inside = f"{self.container}: " if self.container else ""
        return LoraError(f"{self.where} [{inside}{self.prefix}{name}]: {problem}")

    def rank_for(self, module: str) -> tuple[int | None, str]:
        """(rank peft would build for `module`, the field that says so)."""
        key = pattern_key(self.rank_pattern, module)
        return (self.rank_pattern[key], f"rank_pattern[{key!r}]") if key is not None else (self.r, "r")

    def alpha_for(self, module: str) -> tuple[float | None, str]:
        """(alpha peft would use for `module`, the field that says so); None: the config has none."""
        key = pattern_key(self.alpha_pattern, module)
        return (self.alpha_pattern[key], f"alpha_pattern[{key!r}]") if key is not None else \
            (self.lora_alpha, "lora_alpha")


def _empty(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (str, list, tuple, dict)) and not value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_config(fields: Mapping[str, Any], cfg: AdapterConfig) -> AdapterConfig:
    """Validate one LoraConfig's fields; everything that changes the output and cannot be read is a LoraError."""
    peft_type = fields.get("peft_type")
    if peft_type is not None and (not isinstance(peft_type, str) or peft_type.upper() != "LORA"):
        raise cfg.error("peft_type", f"is {peft_type!r}: not a LoRA adapter")
    for name in VARIANT_FIELDS:
        if not _empty(fields.get(name)):
            raise cfg.error(name, f"is set ({fields[name]!r}): this LoRA variant changes the layer output in a way "
                                  "lowbit_pipe cannot reproduce")
    for name in ("use_rslora", "use_dora", "lora_bias"):
        if fields.get(name) is not None and not isinstance(fields[name], bool):
            raise cfg.error(name, f"is {fields[name]!r} ({type(fields[name]).__name__}): expected true or false")
    r = fields.get("r")
    if r is not None:
        if not _number(r) or r != int(r) or r < 1:
            raise cfg.error("r", f"is {r!r}: expected a positive integer rank")
        r = int(r)
    lora_alpha = fields.get("lora_alpha")
    if lora_alpha is not None:
        if not _number(lora_alpha):
            raise cfg.error("lora_alpha", f"is {lora_alpha!r} ({type(lora_alpha).__name__}): expected a number")
        lora_alpha = float(lora_alpha)
    patterns = {}
    for name, check, what in (("rank_pattern", lambda v: _number(v) and v == int(v) and v >= 1, "a positive integer"),
                              ("alpha_pattern", _number, "a number")):
        table = fields.get(name)
        if table is None:
            table = {}
        if not isinstance(table, dict):
            raise cfg.error(name, f"is {table!r} ({type(table).__name__}): expected a mapping of module patterns")
        for key, value in table.items():
            if not check(value):
                raise cfg.error(f"{name}[{key!r}]", f"is {value!r}: expected {what}")
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as err:
                raise cfg.error(f"{name}[{key!r}]", f"is not a valid module pattern ({err})") from None
        patterns[name] = {k: (int(v) if name == "rank_pattern" else float(v)) for k, v in table.items()}
    unknown = sorted(k for k, v in fields.items()
                     if k not in INERT_FIELDS and k not in READ_FIELDS and k not in VARIANT_FIELDS and k != "peft_type"
                     and not _empty(v))
    if unknown:
        fields_named = [cfg.prefix + k for k in unknown]
        warnings.warn(f"{cfg.where} [{cfg.container or 'config'}]: LoraConfig fields {fields_named} are unknown to "
                      "lowbit_pipe and ignored; if one changes the LoRA's output, the result is wrong", stacklevel=4)
    return dataclasses.replace(cfg, r=r, lora_alpha=lora_alpha, rank_pattern=patterns["rank_pattern"],
                               alpha_pattern=patterns["alpha_pattern"], use_rslora=bool(fields.get("use_rslora")),
                               use_dora=bool(fields.get("use_dora")))


@dataclass
class AdapterConfigs:
    """The LoraConfig(s) a file carries, one per component prefix ("transformer." or "" for a bare config); each
    is validated when a module of the model first needs it (a pipeline file's text-encoder config is never read)."""

    where: str
    container: str
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # prefix -> raw fields
    _read: dict[str, AdapterConfig] = field(default_factory=dict)

    def for_module(self, written: str) -> AdapterConfig | None:
        """The config of the component module `written` (as written in the file) belongs to, by its prefix."""
        if not self.groups:
            return None
        prefix = next((p for p in self.groups if p and written.startswith(p)), None)
        if prefix is None:
            if "" in self.groups:
                prefix = ""
            elif len(self.groups) == 1:
                prefix = next(iter(self.groups))
            else:
                components = sorted(p.rstrip(".") for p in self.groups)
                raise LoraError(f"{self.where} [{self.container}]: LoraConfigs for {components}, and module "
                                f"'{written}' starts with none of them: cannot tell which one applies")
        if prefix not in self._read:
            self._read[prefix] = _read_config(self.groups[prefix], AdapterConfig(self.where, self.container, prefix))
        return self._read[prefix]


def adapter_configs(metadata: Mapping[str, str], where: str, path: Path | None = None) -> AdapterConfigs:
    """The LoraConfig(s) from the safetensors metadata diffusers writes (`lora_adapter_metadata`), else from the
    `adapter_config.json` peft's save_pretrained puts beside `adapter_model.safetensors`; none when the file
    carries no config."""
    raw = metadata.get(METADATA_KEY)
    if raw is not None:
        source, container = where, METADATA_KEY
    elif path is not None and path.name == "adapter_model.safetensors" and (path.parent / PEFT_CONFIG_FILE).is_file():
        source, container = str(path.parent / PEFT_CONFIG_FILE), ""
        raw = (path.parent / PEFT_CONFIG_FILE).read_text(encoding="utf-8")
    else:
        return AdapterConfigs(where, METADATA_KEY)
    label = f"{source} [{container}]" if container else source
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, TypeError) as err:
        raise LoraError(f"{label}: the adapter config is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise LoraError(f"{label}: the adapter config is a {type(data).__name__}, expected a JSON object")
    # A pipeline's save_lora_weights writes `<component>.<field>` (LoraConfig fields have no dots).
    configs = AdapterConfigs(source, container)
    for key, value in data.items():
        prefix, dot, name = key.rpartition(".")
        configs.groups.setdefault(prefix + dot, {})[name] = value
    return configs
