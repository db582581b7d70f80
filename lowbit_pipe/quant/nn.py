"""QuantLinear: a Linear whose weight is stored in a low-bit format.

Its buffers are exactly the on-disk tensors of the format (`weight`,
`weight_scale`, ...) plus `comfy_quant`, so `state_dict()` is the ComfyUI
layout as is, and `load_state_dict` of an exported file restores it.

What the forward needs from the record (rotation, activation mode, compute setting, the device facts of the GPU
paths) is resolved once into a `LinearPlan` (Format.linear_plan) and read per call as plain attributes: an
uncompiled model makes hundreds of these calls per step, each paying its Python in host time.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.formats import Format, FormatSpec, QuantizedWeight, encode_record, get_format
from lowbit_pipe.formats.base import LinearPlan
from lowbit_pipe.kernels import reference

# Attributes the plan is resolved from besides the record and the buffers: setting or deleting one (the runtime
# settings do it through the ledger, whose undo sets or deletes it again) resolves the plan again.
PLAN_ATTRIBUTES = frozenset({"compute"})


class QuantLinear(nn.Module):
    # Runtime tensors from Format.prepack (recipe quantize.prepack), or None. Derived from the buffers, so
    # whatever replaces or overwrites them clears it (a LoRA bake: lora.bake._replace; `_load_from_state_dict`).
    # Read on each call, like the buffers: not part of the plan.
    prepacked: dict[str, torch.Tensor] | None = None
    # QuantizedWeight.compute (recipe quantize.nvfp4_compute): how the forward computes; None: the default.
    compute: str | None = None

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None, fmt: Format | None = None):
        """`fmt`: qweight's format when the caller has it already (from_linear), saving a registry look-up."""
        super().__init__()
        self.format = fmt if fmt is not None and fmt.name == qweight.format else get_format(qweight.format)
        self.out_features, self.in_features = qweight.shape
        self.record: dict[str, Any] = dict(qweight.record)
        self._quant_names = tuple(qweight.tensors)
        for key, tensor in qweight.tensors.items():
            self.register_buffer(key, tensor)
        self.register_buffer("comfy_quant", encode_record(self.record))
        derived = self.format.derived_tensors(qweight)  # not exported (non-persistent), follow device moves only
        self._derived_names = tuple(derived)
        for key, tensor in derived.items():
            self.register_buffer(key, tensor, persistent=False)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.refresh_plan()

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: FormatSpec, input_amax: float | None = None,
                    where: str = "", quantizer: Callable[[torch.Tensor, FormatSpec], QuantizedWeight] | None = None
                    ) -> QuantLinear:
        """Quantize `linear` per `spec`; `input_amax` (of the rotated input) is needed for static activations.
        `quantizer(weight, spec)`: what rounds the weight (GPTQ); default the format's round-to-nearest."""
        fmt = get_format(spec.format)
        with torch.no_grad():
            q = quantizer(linear.weight.detach(), spec) if quantizer is not None else \
                fmt.quantize(linear.weight.detach(), spec)
            qweight = fmt.with_activations(q, spec.activations, input_amax, where)
        return cls(qweight, linear.bias, fmt)

    @property
    def qweight(self) -> QuantizedWeight:
        # Read from the buffer table on every call, never cached: a LoRA bake and its ledger undo swap entries of
        # that table directly. (`_buffers[k]`, not getattr: nn.Module's __getattr__ costs microseconds per name.)
        buffers = self._buffers
        runtime = {k: buffers[k] for k in self._derived_names}
        if self.prepacked:
            runtime.update(self.prepacked)
        return QuantizedWeight(self.format.name, (self.out_features, self.in_features),
                               {k: buffers[k] for k in self._quant_names}, self.record, runtime, self.compute)

    @property
    def plan(self) -> LinearPlan:
        """What the forward reads instead of the record (see refresh_plan)."""
        return self._plan

    def refresh_plan(self) -> None:
        """Resolve the forward's plan again from the record, the stored tensors' names and device and `compute`.
        Runs where one of those may change: construction, device moves (`_apply`), loads, `compute` set or
        deleted. Tensor values never enter it, so a bake (same names, shapes, device) needs none."""
        q = self.qweight
        self._plan = self.format.linear_plan(q, q.tensors["weight"].device)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in PLAN_ATTRIBUTES and "_plan" in self.__dict__:
            self.refresh_plan()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if name in PLAN_ATTRIBUTES and "_plan" in self.__dict__:
            self.refresh_plan()

    def derived_for(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The derived buffers that go with `tensors` replacing some of this layer's stored tensors (a bake)."""
        stored = {**{k: getattr(self, k) for k in self._quant_names}, **tensors}
        q = QuantizedWeight(self.format.name, (self.out_features, self.in_features), stored, self.record)
        return {k: t.to(getattr(self, k).device) for k, t in self.format.derived_tensors(q).items()
                if k in self._derived_names}

    def prepack(self) -> dict[str, torch.Tensor] | None:
        """The format's runtime tensors for this layer (not set here: the caller records the attribute)."""
        q = self.qweight
        return self.format.prepack(QuantizedWeight(q.format, q.shape, q.tensors, q.record))

    def _load_from_state_dict(self, *args, **kwargs):
        self.__dict__.pop("prepacked", None)  # the buffers are overwritten: a prepacked copy would be stale
        super()._load_from_state_dict(*args, **kwargs)
        with torch.no_grad():  # derived buffers follow the loaded tensors
            for key, tensor in self.derived_for({}).items():
                getattr(self, key).copy_(tensor)
        self.refresh_plan()  # load_state_dict(assign=True) puts the file's tensors in, on their device

    def dequantize(self) -> torch.Tensor:
        """Float32 weight [out, in] in the original basis."""
        return self.format.dequantize(self.qweight, self._plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # LoRA residual branches (lowbit_pipe.lora.LoraStack, a child module named "lora"): exact,
        # unquantized, on the unrotated input; skipped entirely when empty (bit-exact removal).
        # On CUDA, int8 / fp8 take the stack's concatenated pair into their GPU path (GEMM
        # epilogue / in-place addmm_); everything else (CPU reference included) adds it after.
        if self._buffers["weight"].device != x.device:
            return self._streamed(x)
        fmt, q, plan, bias = self.format, self.qweight, self._plan, self._parameters["bias"]
        lora = self._modules.get("lora")
        if lora is not None and lora.branches:
            if x.is_cuda and fmt.fused_lora_on_cuda:
                return fmt.linear(x, q, bias, lora=(lora.down, lora.up), plan=plan)
            return fmt.linear(x, q, bias, plan=plan) + lora(x)
        return fmt.linear(x, q, bias, plan=plan)

    def _streamed(self, x: torch.Tensor) -> torch.Tensor:
        """One call with this layer's tensors copied to x's device; the layer stays where it is. ComfyUI's partial
        load (a plain ModelPatcher short of memory: lowbit_pipe.comfy.patchers) moves only the layers it has room
        for and leaves the rest in host memory, as it does its own offloaded layers, whose weights it casts per call."""
        device, q = x.device, self.qweight
        moved = dataclasses.replace(q, tensors={k: t.to(device) for k, t in q.tensors.items()},
                                    runtime={k: t.to(device) for k, t in q.runtime.items()})
        bias = self.bias.to(device) if self.bias is not None else None
        out = self.format.linear(x, moved, bias, plan=self.format.linear_plan(moved, device))
        lora = self._modules.get("lora")
        if lora is not None and lora.branches:
            out = out + reference.low_rank_delta(x, lora.down.to(device), lora.up.to(device))
        return out

    def _apply(self, fn, recurse=True):
        # Quantized tensors follow device moves but never dtype casts:
        # model.to(torch.bfloat16) must not touch codes or fp32 scales. Children (the
        # LoRA stack) get the full `fn`: LoRA factors DO follow dtype casts.
        names = self._quant_names + ("comfy_quant",) + self._derived_names
        kept = {n: self._buffers.pop(n) for n in names}
        try:
            super()._apply(fn, recurse)
        finally:
            for n, t in kept.items():
                self._buffers[n] = t.to(fn(t.new_empty(0)).device)
        if self.prepacked:  # same rule: follows the device, never a dtype cast (the same dict: a ledger patch holds it)
            for n, t in self.prepacked.items():
                self.prepacked[n] = t.to(fn(t.new_empty(0)).device)
        self.refresh_plan()  # the device facts follow the tensors' device
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name}, " \
               f"bias={self.bias is not None}"
