"""The uncompiled path's norms and RoPE as single kernels (lowbit_pipe.kernels.norm_rope) on a diffusers model.

Recipe key `attention.fused_norm_rope`. Two kinds of change, each recorded in the ledger and undone by teardown:

- Norm modules of a known class (NORM_KINDS: Krea 2's zero-centred RMSNorm, diffusers' RMSNorm) get an instance
  `forward` that runs the one-pass kernel where it serves (CUDA, eager) and the class's own forward elsewhere. The module, its
  class, its parameters and state_dict keys stay as they were; only the instance attribute is added.
- Attention processors whose `__call__` calls `apply_rotary_emb` (a global of diffusers' processor modules:
  FLUX, Krea 2, ...) get a processor of a subclass whose `__call__` is the stock code with that one global
  rebound to `FusedRope`, the same mechanism as 8-bit attention's (processors.rebound_class). Applied before
  8-bit attention, so the 8-bit processor builds on this one and evaluate's float reference keeps the same RoPE.

- Modules whose code passes one input unchanged to several quantized layers (SHARED_INPUT_MODULES, read off
  diffusers' code: Krea 2's attention with its stock processor, x -> to_q / to_k / to_v / to_gate, and its SwiGLU,
  x -> gate / up) get an instance `forward` that opens that input to one activation quantization for the call
  (lowbit_pipe.kernels.dispatch.shared_inputs) around the class's own forward.

Under torch.compile all of them fall back to the torch code, which Inductor fuses by itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.attention.norm_kinds import NormKind, norm_kind
from lowbit_pipe.attention.processors import attention_modules, processor_for, rebound_class, swap_processor
from lowbit_pipe.kernels.dispatch import compiling, sharing_forward
from lowbit_pipe.ledger import Ledger

ROPE_GLOBAL = "apply_rotary_emb"
_16BIT = (torch.float16, torch.bfloat16)


class FusedNormForward:
    """A known norm module's forward: the one-pass kernel on CUDA in eager, the class's forward elsewhere (a weight
    on another device or of another dtype). What never changes (the module's dim; modules with a bias are not
    given one) is settled once; each call checks only its input. Holds the module weakly (this object sits in the
    module's own __dict__); `kernels` is lowbit_pipe.kernels.norm_rope, imported once by the caller."""

    def __init__(self, module: nn.Module, kind: NormKind, kernels: ModuleType) -> None:
        self.module = weakref.ref(module)
        self.kind = kind
        self.kernels = kernels
        self.dim = _dims(module.dim)
        self.calls = 0  # kernel calls: the report says whether the kernel ran at all

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        module = self.module()
        if (not compiling() and hidden_states.dim() and tuple(hidden_states.shape[-1:]) == self.dim
                and self.kernels.kernel_serves(hidden_states, self.dim[0])):
            weight = module.weight  # None for an RMSNorm without elementwise_affine
            out_dtype, round_first = hidden_states.dtype, False
            if self.kind.diffusers_rounding and weight is not None:
                out_dtype, round_first = ((weight.dtype, True) if weight.dtype in _16BIT
                                          else (torch.promote_types(hidden_states.dtype, weight.dtype), False))
            if out_dtype in (torch.float32, *_16BIT) and (weight is None or weight.device == hidden_states.device):
                self.calls += 1
                return self.kernels.rms_norm(hidden_states, weight, module.eps, self.kind.offset,
                                             round_first=round_first, out_dtype=out_dtype)
        return type(module).forward(module, hidden_states)


# class name -> (the diffusers module defining it, the processor class its code must run under or None)
SHARED_INPUT_MODULES = {
    "Krea2Attention": ("diffusers.models.transformers.transformer_krea2", "Krea2AttnProcessor"),
    "Krea2SwiGLU": ("diffusers.models.transformers.transformer_krea2", None),
}


class SharedInputForward:
    """A module's forward with `hidden_states` open to one activation quantization for the quantized layers that
    read it (dispatch.sharing_forward), in eager, while the module runs the code that was read (for an attention
    module: a processor of the stock class or a subclass, such as the RoPE and 8-bit ones built on it); otherwise
    the class's forward as it is. Holds the module weakly."""

    def __init__(self, module: nn.Module, processor_class: str | None) -> None:
        self.module = weakref.ref(module)
        self.processor_class = processor_class
        cls = type(module)
        self.forward = sharing_forward(cls.forward, ("hidden_states",), self.vouched, f"{cls.__name__}.forward")

    def vouched(self, module: nn.Module) -> bool:
        if self.processor_class is None:
            return True
        return any(c.__name__ == self.processor_class and c.__module__.startswith("diffusers.")
                   for c in type(getattr(module, "processor", None)).__mro__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(self.module(), *args, **kwargs)


def _dims(dim) -> tuple[int, ...]:
    return (int(dim),) if isinstance(dim, int) else tuple(int(v) for v in dim)


class FusedRope:
    """`apply_rotary_emb`'s signature: the one-pass kernel for the interleaved real form on CUDA in eager (4-D x,
    fp32 cos / sin of [S, D]), the stock function for everything else. `kernels`: lowbit_pipe.kernels.norm_rope."""

    def __init__(self, stock: Callable[..., torch.Tensor], kernels: ModuleType) -> None:
        self.stock = stock
        self.kernels = kernels
        self.calls = 0

    def __call__(self, x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1,
                 sequence_dim: int = 2) -> torch.Tensor:
        if (use_real and use_real_unbind_dim == -1 and sequence_dim in (1, 2) and x.dim() == 4
                and isinstance(freqs_cis, (tuple, list)) and len(freqs_cis) == 2 and not compiling()
                and x.shape[-1] % 2 == 0 and self.kernels.kernel_serves(x, x.shape[-1])):
            cos, sin = freqs_cis
            want = (x.shape[sequence_dim], x.shape[-1])
            if (cos.dtype == sin.dtype == torch.float32 and tuple(cos.shape) == want and tuple(sin.shape) == want
                    and cos.device == x.device == sin.device and cos.is_contiguous() and sin.is_contiguous()):
                self.calls += 1
                return self.kernels.rope(x, cos, sin, sequence_dim)
        return self.stock(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim,
                          sequence_dim=sequence_dim)


@dataclass
class AppliedFusion:
    """What got the fused kernels: norm modules and attention processors by name, and their kernel calls."""

    norms: dict[str, FusedNormForward] = field(default_factory=dict)
    processors: list[str] = field(default_factory=list)
    ropes: list[FusedRope] = field(default_factory=list)
    shared: list[str] = field(default_factory=list)  # modules whose layers quantize their input once

    def as_dict(self) -> dict[str, Any]:
        """What was changed (report.json's attention.fused_norm_rope); the kernels' calls, counted since."""
        return {"norm_modules": len(self.norms), "rope_processors": len(self.processors),
                "shared_input_modules": len(self.shared),
                "norm_kernel_calls": sum(f.calls for f in self.norms.values()),
                "rope_kernel_calls": sum(r.calls for r in self.ropes)}


def uses_rope(processor: Any) -> bool:
    """Whether the processor's own __call__ calls diffusers' apply_rotary_emb (and holds no weights)."""
    if isinstance(processor, nn.Module):
        return False
    code = getattr(getattr(type(processor), "__call__", None), "__code__", None)
    return code is not None and ROPE_GLOBAL in code.co_names


def apply_fused_norm_rope(root: nn.Module, ledger: Ledger) -> AppliedFusion:
    """Give `root`'s known norm modules the one-pass forward and its RoPE-calling processors the one-pass RoPE,
    each change in `ledger`."""
    try:
        from lowbit_pipe.kernels import norm_rope  # Triton's import: the kernels and their torch forms
    except ImportError as err:
        raise ImportError(f"attention.fused_norm_rope needs triton (lowbit_pipe.kernels.norm_rope): {err}") from None
    applied = AppliedFusion()
    for name, module in root.named_modules():
        kind = norm_kind(module)
        if kind is None or "forward" in vars(module) or getattr(module, "bias", None) is not None:
            continue  # not a known norm, already patched, or with a bias (the kernel has none)
        fused = FusedNormForward(module, kind, norm_rope)
        ledger.patch_attr(module, "forward", fused, name=f"{name}.forward (fused RMSNorm)")
        applied.norms[name] = fused
    classes: dict[type, type] = {}
    for name, module in attention_modules(root).items():
        stock = module.processor
        if not uses_rope(stock):
            continue
        stock_cls = type(stock)
        if stock_cls not in classes:
            rope = FusedRope(stock_cls.__call__.__globals__[ROPE_GLOBAL], norm_rope)
            applied.ropes.append(rope)
            classes[stock_cls] = rebound_class(stock_cls, {ROPE_GLOBAL: rope}, "FusedRope",
                                               "with its rotary embedding as one kernel in eager")
        swap_processor(ledger, name, module, stock, processor_for(stock, classes[stock_cls]))
        applied.processors.append(name)
    for name, module in root.named_modules():
        where = SHARED_INPUT_MODULES.get(type(module).__name__)
        if where is None or type(module).__module__ != where[0] or "forward" in vars(module):
            continue
        ledger.patch_attr(module, "forward", SharedInputForward(module, where[1]), name=f"{name}.forward (shared input)")
        applied.shared.append(name)
    return applied
