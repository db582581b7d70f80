"""What an architecture module provides: detection, structural config, layer policy, example inputs."""

from __future__ import annotations

import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from lowbit_pipe.arch.keymap import KeyMap
from lowbit_pipe.arch.lora import resolve_lora_name
from lowbit_pipe.errors import MalformedKeysError


def keeps_fp32(model_class: type) -> Any:
    """diffusers' rule for `<class>._keep_in_fp32_modules` (modules its from_pretrained keeps in float32 whatever
    `torch_dtype` is: Krea 2's norms, Wan's time embedder and modulation table): a predicate on a parameter or
    buffer name, true when one of the name's dotted parts is such a module (model_loading_utils.py)."""
    names = getattr(model_class, "_keep_in_fp32_modules", None) or []
    names = [names] if isinstance(names, str) else list(names)
    return lambda key: bool(names) and any(m in key.split(".") for m in names)


def cast_keeping_fp32(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` as diffusers' from_pretrained(torch_dtype=dtype) leaves a model: the tensors of the
    class's fp32 modules stay float32, holding values rounded through `dtype` (as loaded from a file saved in
    `dtype`, so an export in `dtype` reloads exactly). diffusers' own `to(dtype)` casts them too (and warns)."""
    if dtype == torch.float32:
        return model
    kept = keeps_fp32(type(model))
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for table in (module._parameters, module._buffers):
                for attr, t in table.items():
                    if t is None or not t.is_floating_point():
                        continue
                    name = f"{prefix}.{attr}" if prefix else attr
                    t.data = t.data.to(dtype).to(torch.float32) if kept(name) and t.dtype != dtype else t.data.to(dtype)
    return model


def compute_dtype(module: nn.Module, default: torch.dtype | None = None) -> torch.dtype | None:
    """The floating dtype a model computes in: its first floating parameter's, skipping the diffusers fp32
    modules (as diffusers' `model.dtype` does; a bf16 Wan's first parameter is its fp32 modulation table)."""
    kept = keeps_fp32(type(module))
    named = list(module.named_parameters())
    found = next((p.dtype for n, p in named if p.is_floating_point() and not kept(n)), None)
    return found or next((p.dtype for _, p in named if p.is_floating_point()), default)


@dataclass(frozen=True)
class ArchConfig:
    """Structural facts about a detected transformer (logical shapes, never packed ones)."""

    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    text_layers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerPolicy:
    """Per-architecture layer lists. Patterns are globs, or `re:<regex>`, on diffusers module names."""

    keep_float: tuple[str, ...] = ()
    sensitive: tuple[str, ...] = ()
    block_paths: tuple[str, ...] = ()  # attribute paths of the repeated-block ModuleLists
    # Attention modules that keep the model's own attention under 8-bit attention (recipe attention.arch_keep):
    # where it measurably costs accuracy and gains no time.
    attention_keep: tuple[str, ...] = ()


class Arch(ABC):
    """One architecture. Stateless (bar caches); registered in arch/__init__.py."""

    id: ClassVar[str]
    diffusers_class: ClassVar[str]  # class name in diffusers.models
    policy: ClassVar[LayerPolicy]
    keymap: ClassVar[KeyMap | None] = None  # diffusers <-> native rules; None: native == diffusers names
    native_markers: ClassVar[tuple[str, ...]] = ()  # native-only keys (no prefix) that identify the arch
    # The forward's text padding mask argument (bool, True = attended); None: the class takes none.
    text_mask_key: ClassVar[str | None] = None

    def model_class(self) -> type[nn.Module]:
        import diffusers

        return getattr(diffusers, self.diffusers_class)

    def detect_model(self, model: nn.Module) -> bool:
        """Whether a live module is this architecture (by class; subclasses may look at modules)."""
        return type(model).__name__ == self.diffusers_class

    @abstractmethod
    def detect_keys(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether a diffusers-layout state dict (prefix stripped, logical shapes) is this architecture."""

    def config_from_model(self, model: nn.Module) -> ArchConfig:
        """Structural config of a live diffusers model."""
        return self.config_from_dict(dict(model.config))

    @abstractmethod
    def config_from_dict(self, c: Mapping[str, Any]) -> ArchConfig:
        """Structural config from diffusers class kwargs (model.config, or the class defaults)."""

    @abstractmethod
    def config_from_keys(self, shapes: dict[str, tuple[int, ...]]) -> ArchConfig:
        """Structural config from a diffusers-layout key->logical-shape map (prefix stripped)."""

    def default_config(self) -> ArchConfig:
        """Config of the class defaults (the released real-size model)."""
        return self.config_from_dict(self.default_kwargs())

    def default_kwargs(self) -> dict[str, Any]:
        sig = inspect.signature(self.model_class().__init__)
        return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}

    # ---- native (ComfyUI / BFL) layout ----------------------------------------------------------
    def detect_native_keys(self, shapes: dict[str, Any]) -> bool:
        """Whether a native-layout map (prefix stripped) is this architecture."""
        return any(k in shapes for k in self.native_markers)

    def from_native(self, state: dict[str, Any]) -> dict[str, Any]:
        """Native -> diffusers layout for a state dict or a key->shape map (prefix stripped, logical shapes)."""
        return self.keymap.from_native(state) if self.keymap else dict(state)

    def state_dict_to_native(self, state: dict[str, Any]) -> dict[str, Any]:
        """Diffusers -> native layout (no prefix; ComfyUI adds `model.diffusion_model.` itself or not)."""
        return self.keymap.to_native(state) if self.keymap else dict(state)

    def to_native(self, name: str, config: ArchConfig | None = None) -> tuple[str, slice | None]:
        """Native module name of a diffusers module, and its output rows when the native module is fused."""
        if self.keymap is None:
            return name, None
        return self.keymap.module_to_native(name, (config or self.default_config()).hidden_size)

    def from_native_name(self, name: str, config: ArchConfig | None = None) -> list[tuple[str, slice | None]]:
        """Diffusers modules of a native module name, with output rows for fused ones."""
        if self.keymap is None:
            return [(name, None)]
        return self.keymap.module_from_native(name, (config or self.default_config()).hidden_size)

    # ---- LoRA -----------------------------------------------------------------------------------
    @cached_property
    def linear_names(self) -> tuple[str, ...]:
        """Linear module names of the diffusers class (default size), from a meta-device build (no memory)."""
        # Resolve the class first: its import creates module-level tensors (diffusers' mag-cache
        # ratios, peft defaults), which inside the meta context would be created on meta for good.
        cls = self.model_class()
        with torch.device("meta"):
            model = cls(**self.lora_template_kwargs())
        return tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear))

    @cached_property
    def linear_names_set(self) -> frozenset[str]:
        """`linear_names` with block indices as `{i}`."""
        return frozenset(re.sub(r"(?<=\.)\d+(?=\.|$)", "{i}", n) for n in self.linear_names)

    def lora_template_kwargs(self) -> dict[str, Any]:
        """Class kwargs for the template build: small, but with every optional module present."""
        return {}

    def lora_targets(self, name: str, config: ArchConfig | None = None) -> list[tuple[str, slice | None]]:
        """(diffusers module, output rows or None) for a LoRA module name in any common form; [] if unknown."""
        return resolve_lora_name(self, name, config)

    def lora_target(self, name: str, config: ArchConfig | None = None) -> str | None:
        """The diffusers module of a LoRA module name when the mapping is 1:1; None if unknown, fused (a
        fused native qkv / linear1 maps to several modules) or row-swapped: use `lora_targets`."""
        targets = self.lora_targets(name, config)
        return targets[0][0] if len(targets) == 1 and targets[0][1] is None else None

    @abstractmethod
    def example_inputs(self, model_config: dict[str, Any], *, batch: int, image_tokens: int, text_tokens: int,
                       generator: torch.Generator, dtype: torch.dtype, device: torch.device | str) -> dict[str, Any]:
        """Seeded forward kwargs (noisy latents, text states, timestep, ...) for `model(**inputs)`."""

    def padded_text_inputs(self, inputs: dict[str, Any], text_valid: int) -> dict[str, Any]:
        """`inputs` plus the text padding mask a pipeline passes when it pads prompts to a fixed length: the first
        `text_valid` text tokens attended, the rest padding. It changes what attention sees (whole key blocks
        masked), so timing and error measured with it are the pipeline's."""
        assert self.text_mask_key is not None, f"{self.id} takes no text padding mask"
        text = inputs["encoder_hidden_states"]  # [B, T, ...]
        mask = torch.zeros(text.shape[:2], dtype=torch.bool, device=text.device)
        mask[:, :text_valid] = True
        return {**inputs, self.text_mask_key: mask}

    def output_tensor(self, output: Any) -> torch.Tensor:
        """The prediction tensor out of a forward's return value."""
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, (tuple, list)):
            return output[0]
        return output.sample


MAX_BLOCKS = 10_000  # released DiTs have under 100 blocks per list


def count_blocks(shapes: Mapping[str, Any], prefix: str) -> int:
    """Number of `<prefix>.<n>.` blocks in a key map (max index + 1; 0 when none)."""
    rx = re.compile(re.escape(prefix) + r"\.(\d+)\.")
    idx = {k: int(m.group(1)) for k in shapes if (m := rx.match(k))}
    if not idx:
        return 0
    key = max(idx, key=idx.__getitem__)
    if idx[key] >= MAX_BLOCKS:  # counted as max + 1, so a stray index would size the model by it
        raise MalformedKeysError(key, f"block index {idx[key]} of '{prefix}': no model has {MAX_BLOCKS} blocks "
                                      f"(the file has {len(set(idx.values()))} distinct indices)")
    return idx[key] + 1


def rows(shapes: Mapping[str, Any], key: str, dim: int = 0, default: int | None = None) -> int:
    """One dimension of a key's shape; `default` (or a KeyError naming the key) when absent."""
    if key not in shapes:
        if default is not None:
            return default
        raise KeyError(f"expected key '{key}' is missing from the state dict")
    return int(tuple(shapes[key])[dim])
