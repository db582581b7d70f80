"""Context: what the stages of one run share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.adapters import Adapter, adapter_for
from lowbit_pipe.arch.base import Arch, ArchConfig, LayerPolicy, compute_dtype
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.plan.plan import Plan
from lowbit_pipe.progress import Console
from lowbit_pipe.recipe import Recipe


@dataclass
class Context:
    recipe: Recipe
    run_dir: Path
    ledger: Ledger = field(default_factory=Ledger)
    model: Any = None  # the object the user works with: diffusers model / pipeline / nn.Module
    owns_model: bool = False  # True when `load` built it: teardown then drops it
    adapter: Adapter | None = None
    arch: Arch | None = None
    arch_config: ArchConfig | None = None
    policy: LayerPolicy = field(default_factory=LayerPolicy)
    model_config: dict[str, Any] = field(default_factory=dict)  # the transformer's constructor config
    source: dict[str, Any] = field(default_factory=dict)  # where the weights came from (path, layout, quantized)
    report: dict[str, Any] = field(default_factory=dict)  # stage results, merged into report.json
    native: bool = False  # the transformer's modules carry native (ComfyUI / BFL) names, e.g. a ComfyUI model
    fused_groups: list[list[str]] = field(default_factory=list)  # layers quantized as one native fused weight
    console: Console = field(default_factory=Console)  # messages, one-line warnings, progress
    stream: Any = None  # model.stream: the checkpoint (load.SourceFile) the export streams from
    stream_choice: Any = None  # validate.StreamChoice: whether this run streams, and why (the runner decides)
    plan: Plan | None = None  # the quantize stage's Plan: per layer format and reason, the attention (what a stream quantizes)
    # run(..., calibrate=): runs the model on the caller's calibration inputs (a ComfyUI sampler, a natively
    # named model's own forward); used instead of the arch's example inputs wherever the recipe calibrates.
    calibrate: Callable[[], None] | None = None
    attention: Any = None  # lowbit_pipe.attention.AppliedAttention: the recipe's 8-bit attention, as applied

    def set_model(self, model: Any, *, owned: bool) -> None:
        self.model = model
        self.owns_model = owned
        self.adapter = adapter_for(model)
        self.model_config = self.adapter.model_config(model)

    @property
    def transformer(self) -> nn.Module:
        if self.model is None or self.adapter is None:
            raise RuntimeError("no model loaded: the pipeline must start with the 'load' stage")
        return self.adapter.transformer(self.model)

    def policy_name(self, name: str) -> str:
        """The name the arch's layer lists know a module by (its diffusers name on a native tree)."""
        if self.native and self.arch is not None:
            return self.arch.from_native_name(name, self.arch_config)[0][0]
        return name

    def example_inputs(self, seed: int, batch: int | None = None) -> dict[str, Any]:
        """The arch's seeded example forward at evaluate's token counts (and its text padding mask, with
        evaluate.text_valid): what calibration, evaluate and the target solver run the model on."""
        ev = self.recipe.evaluate
        if self.arch is None:
            raise RuntimeError("no architecture detected: the pipeline must run the 'detect' stage first")
        inputs = self.arch.example_inputs(self.model_config, batch=ev.batch if batch is None else batch,
                                          image_tokens=ev.image_tokens, text_tokens=ev.text_tokens,
                                          generator=torch.Generator().manual_seed(seed), dtype=self.dtype,
                                          device=self.device)
        if ev.text_valid is None:
            return inputs
        return self.arch.padded_text_inputs(inputs, ev.text_valid)

    @property
    def device(self) -> torch.device:
        p = next(self.transformer.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: model.dtype; unset, a passed-in model's own floating dtype, else float32."""
        if self.recipe.model.dtype is not None:
            return getattr(torch, self.recipe.model.dtype)
        if self.model is not None and not self.owns_model:
            return compute_dtype(self.transformer, torch.float32)
        return torch.float32
