"""`attention.fused_norm_rope` on ComfyUI's own model code: its RMSNorms and RoPE as one-pass kernels.

ComfyUI runs its own modules (comfy/ldm/...), not diffusers', so lowbit_pipe.attention.fused does not reach them.
This module does the same for ComfyUI (0.29.0's code; checked in tests/comfy/test_comfy_fused.py) where a natively named
model is quantized with the recipe key set (the attention step, lowbit_pipe.stages.attention, calls `apply_comfy_fused_norm_rope`; the Quantize
node runs that stage on its own structural copy of the tree):

- Norms. Krea 2's `RMSNorm` (comfy.ldm.krea2.model: `F.rms_norm` of x upcast to fp32 with the weight `scale + 1`
  in fp32, cast back to x's dtype: three passes) and ComfyUI's ops `RMSNorm` (comfy.ops, a torch.nn.RMSNorm: FLUX.1's
  q / k norms, Qwen-Image's q / k and text norms; the weight as ComfyUI casts it, `eps` None meaning fp32's
  epsilon, one rounding to x's dtype). Both are `lowbit_pipe.kernels.norm_rope.rms_norm`: fp32 inside, one
  rounding, reading a strided view (FLUX's q / k are slices of the packed qkv, Krea 2's a permuted view) and
  writing the contiguous result ComfyUI's own code returns. The comfy.ops norm keeps ComfyUI's weight handling:
  `comfy.ops.cast_bias_weight` / `uncast_bias_weight` when the module casts weights (dynamic VRAM, offloading,
  weight patches), the interrupt check (`run_every_op`) as the class does.
- RoPE. ComfyUI's `apply_rope` (q, k) / `apply_rope1` (comfy.ldm.flux.math; freqs as 2x2 rotation matrices
  [B, 1, L, D/2, 2, 2]): `norm_rope.rope_pairs`, in freqs' dtype as the torch code computes (Qwen-Image passes
  bf16 freqs: the first product rounded to bf16 before the second is added). Where they are called: Krea 2's
  `Attention.forward` (global `apply_rope`), FLUX.1's `DoubleStreamBlock` / `SingleStreamBlock.forward`
  (global `attention`, comfy.ldm.flux.math.attention, whose global `apply_rope` is rebound in a copy of it),
  Qwen-Image's `Attention.forward` (global `apply_rope1`).

- Shared inputs. Quantized layers that read one input quantize it once inside a scope that vouches the input stays
  unchanged while they read it (lowbit_pipe.kernels.dispatch.shared_inputs; ComfyUI's inference tensors have no
  version counter to tell otherwise). Krea 2's `Attention` (x -> wq, wk, wv, gate) and `SwiGLU` (x -> gate, up)
  and Qwen-Image's `Attention` (each stream -> its q, k, v) open one around their stock forward, read off ComfyUI
  0.29.0's code; it closes with the forward, taking the activations off the inputs. FLUX.1's blocks project
  through one packed layer.

- Grouped k / v. Krea 2's `Attention` (48 q heads, 12 k / v heads) repeats k and v to 48 heads before ComfyUI's
  attention function; its fused forward hands them over with their own heads and `enable_gqa` instead (every
  attention function of ComfyUI 0.29.0 takes it; torch's SDPA keeps cuDNN's kernel: 0.93 -> 0.79 ms per call at
  1024² on an H100, bench/results/gqa_attention_h100.md). That forward is lowbit_pipe's, with ComfyUI's arithmetic
  (as the block forward below; the others run ComfyUI's own code objects); the stock code runs where something
  could expect the repeated heads: an attn1 / attn1_output patch, or an attention override other than ours.

- Modulation and residuals. Krea 2's `SingleStreamBlock` runs `(1 + scale) * norm(x) + shift` (the norm, a
  multiply, an add: three passes over the block's activations) and `x + gate * y` (two) twice per block; its fused
  forward (lowbit_pipe's, with ComfyUI 0.29.0's arithmetic) runs each as one kernel (norm_rope.modulated_rms_norm,
  gated_residual) that rounds after each op as torch does, so the result is torch's bit for bit but for the norm's
  rare last-place flip; the stock forward where a reference image brings its own timestep-zero rows.

How: each such module's class is swapped, on that module object only, for a subclass of its own class: the norms'
`forward` runs the kernel where it serves and the class's own forward elsewhere; the attention modules' `forward`
is the class's own code object run against a copy of its module's globals with the one function rebound
(lowbit_pipe.attention.processors.rebound_function, as 8-bit attention rebinds diffusers' dispatch), under
Krea 2's grouped-k / v forward; Krea 2's blocks get their modulated forward (those two are our code computing
ComfyUI's arithmetic, nothing of its source copied). No module global changes: another model in the process (a
stock MODEL, the float MODEL upstream of the Quantize node) runs ComfyUI's code untouched. A class rather than an
instance `forward`: the nodes' structural copies of the tree (tree.structural_copy: the LoRA node's copy,
ComfyUI's per-device rebuilds) copy each module with its class, so every copy runs its own module through the fused
forward, where an instance attribute would have carried a forward bound to the original module. Every swap is a
ledger entry; the undo (teardown, Purge) restores the exact stock class, checked by identity, and switches the
kernels off for any copy that still has the fused class (a sealed one).

The kernels run on CUDA in eager only (`any_device`, a test-only argument, lets them run on the CPU under
TRITON_INTERPRET=1): under torch.compile (ComfyUI's TorchCompileModel) the class's own code runs and Inductor
fuses it (but for Krea 2's grouped k / v, plain torch code that Inductor could not undo: compiled too), and on
the CPU, in training (comfy.model_management.in_training) or with autograd, ComfyUI's code runs as it would. Not
fused: the modulation around other architectures' norms (FLUX.1's, Qwen-Image's), LayerNorms, and other
architectures' attention code (their comfy.ops RMSNorms do get the norm kernel, which computes what that class
computes whatever model it sits in).

On CUDA, ComfyUI's apply_rope / apply_rope1 already run as one comfy-kitchen kernel (its CUDA backend), so the
RoPE part replaces one one-pass kernel by another (ours 5x faster on Krea 2's q:
bench/results/rope_kernels_h100_s55.md); the norms save passes (Krea 2's upcast copy, norm and cast back; for
FLUX.1 and Qwen-Image torch's own norm is one kernel already). The whole effect on a ComfyUI step: docs/comfyui.md.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.attention.processors import rebound_function
from lowbit_pipe.kernels.dispatch import compiling, sharing_forward
from lowbit_pipe.ledger import Ledger

_FP32_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's eps when None, for fp16 / bf16 / fp32 inputs
KREA2_MODULE = "comfy.ldm.krea2.model"
FLUX_LAYERS = "comfy.ldm.flux.layers"
FLUX_MATH = "comfy.ldm.flux.math"
QWEN_MODULE = "comfy.ldm.qwen_image.model"
ATTENTION_MODULE = "comfy.ldm.modules.attention"


@dataclass(eq=False)
class Fusion:
    """One application's shared state: the kernels, where they may run, and how often they did."""

    kernels: ModuleType  # lowbit_pipe.kernels.norm_rope
    ops: ModuleType | None  # comfy.ops
    model_management: ModuleType | None  # comfy.model_management
    any_device: bool = False  # test-only: the kernels on CPU tensors too (TRITON_INTERPRET=1)
    active: bool = True  # off once the run is torn down (a copy still holding a fused class runs ComfyUI's code)
    norm_calls: int = 0
    rope_calls: int = 0
    grouped_calls: int = 0  # Krea 2 attention calls that handed k / v over with their own heads
    modulation_calls: int = 0  # Krea 2 blocks' modulated norms and gated residuals run as one kernel each

    def eager_on(self, x: torch.Tensor) -> bool:
        """Whether this call may take a kernel: eager, CUDA (or any_device), no autograd, not in training."""
        return (self.active and not compiling() and (x.is_cuda or self.any_device)
                and not (x.requires_grad and torch.is_grad_enabled())
                and not getattr(self.model_management, "in_training", False))


# ------------------------------------------------------------------------------------------------------------- norms
class _Krea2NormFused:
    """Krea 2's RMSNorm (weight `scale + 1` in fp32, x upcast, result in x's dtype) as one kernel."""

    _lowbit_fusion: Fusion

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fusion = self._lowbit_fusion
        weight = _krea2_norm_weight(self, x, fusion) if fusion.eager_on(x) else None
        if weight is not None:
            fusion.norm_calls += 1
            return fusion.kernels.rms_norm(x, weight, self.eps, 1.0)
        return super().forward(x)


def _krea2_norm_weight(norm: nn.Module, x: torch.Tensor, fusion: Fusion) -> torch.Tensor | None:
    """A Krea 2 RMSNorm's zero-centred weight on x's device as the class moves it (the kernels add the 1 in fp32),
    where the norm kernel takes x and it; None otherwise."""
    scale = getattr(norm, "scale", None)
    if not (isinstance(scale, torch.Tensor) and scale.dim() == 1 and fusion.kernels.norm_serves(x, scale.shape[0])):
        return None
    weight = fusion.model_management.cast_to(scale, device=x.device)
    return weight if weight.is_contiguous() else None


class _OpsNormFused:
    """ComfyUI's ops RMSNorm (torch.nn.RMSNorm: x̂ times the weight in fp32, one rounding to x's dtype; eps None is
    fp32's epsilon) as one kernel, with the weight as the class gets it."""

    _lowbit_fusion: Fusion

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        fusion = self._lowbit_fusion
        shape = tuple(self.normalized_shape)
        if len(args) == 1 and not kwargs and len(shape) == 1 and fusion.eager_on(args[0]) \
                and fusion.kernels.norm_serves(args[0], shape[0]):
            x = args[0]
            eps = self.eps if self.eps is not None else _FP32_EPS
            if self.weight is not None and not (self.comfy_cast_weights or self.weight_function or self.bias_function):
                if self.weight.device == x.device and self.weight.is_contiguous():  # the weight as it is
                    fusion.ops.run_every_op()
                    fusion.norm_calls += 1
                    return fusion.kernels.rms_norm(x, self.weight, eps)
            else:  # ComfyUI casts the weight for this call (dynamic VRAM, offload, weight patches) and takes it back
                fusion.ops.run_every_op()
                weight, bias, stream = (fusion.ops.cast_bias_weight(self, x, offloadable=True)
                                        if self.weight is not None else (None, None, None))
                if weight is None or (type(weight) in (torch.Tensor, nn.Parameter) and weight.device == x.device
                                      and weight.is_contiguous() and tuple(weight.shape) == shape):
                    fusion.norm_calls += 1
                    out = fusion.kernels.rms_norm(x, weight, eps)
                else:  # a weight the kernel cannot read (a tensor subclass): torch's op, as the class runs it
                    out = torch.nn.functional.rms_norm(x, self.normalized_shape, weight, self.eps)
                if weight is not None:
                    fusion.ops.uncast_bias_weight(self, weight, bias, stream)
                return out
        return super().forward(*args, **kwargs)


# -------------------------------------------------------------------------------------------------------------- RoPE
class FusedComfyRope:
    """ComfyUI's `apply_rope(xq, xk, freqs_cis)` (`pair`) or `apply_rope1(x, freqs_cis)`: `rope_pairs` for what it
    computes (x [B, H, L, D] contiguous; freqs [B or 1, 1, L' >= L or 1, D/2, 2, 2], last three dims contiguous,
    on x's device), the stock function for everything else, with the stock arguments."""

    def __init__(self, stock: Callable[..., Any], fusion: Fusion, pair: bool) -> None:
        self.stock = stock
        self.fusion = fusion
        self.pair = pair

    def serves(self, x: Any, freqs: Any) -> bool:
        if not (isinstance(x, torch.Tensor) and isinstance(freqs, torch.Tensor) and x.dim() == 4 and freqs.dim() == 6
                and x.is_contiguous() and self.fusion.eager_on(x)):
            return False
        b, _, seq, d = x.shape
        fb, fh, fl = freqs.shape[:3]
        kernels = self.fusion.kernels
        return (x.dtype in kernels.DTYPES and freqs.dtype in kernels.DTYPES and d % 2 == 0 and 0 < d <= kernels.MAX_DIM
                and x.numel() > 0 and tuple(freqs.shape[3:]) == (d // 2, 2, 2) and fh == 1 and fb in (1, b)
                and (fl == seq or fl == 1 or fl > seq > 1) and tuple(freqs.stride()[3:]) == (4, 2, 1)
                and freqs.device == x.device)

    def __call__(self, *args: Any) -> Any:
        rope = self.fusion.kernels.rope_pairs
        if self.pair and len(args) == 3:
            xq, xk, freqs = args
            if self.serves(xq, freqs) and self.serves(xk, freqs):
                self.fusion.rope_calls += 2
                return rope(xq, freqs), rope(xk, freqs)
        elif not self.pair and len(args) == 2 and self.serves(*args):
            self.fusion.rope_calls += 1
            return rope(*args)
        return self.stock(*args)


# ------------------------------------------------------------------------------------- Krea 2's grouped attention
def _groups(module: nn.Module, x: torch.Tensor, transformer_options: Any, fusion: Fusion) -> bool:
    """Whether this Krea 2 attention call may hand k / v to the attention function with their own heads: fewer k / v
    heads than q heads; CUDA (or any_device), no autograd, not in training, eager or under torch.compile (plain
    torch code: Inductor cannot drop a repeat's copy either); no attention patch that expects the repeated heads
    (attn1_patch sees k / v), and no attention override but ours (lowbit_pipe.comfy.attention; another pack's may
    ignore `enable_gqa`)."""
    if not (module.kvheads != module.heads and module.heads % module.kvheads == 0 and fusion.active
            and (x.is_cuda or fusion.any_device) and not (x.requires_grad and torch.is_grad_enabled())
            and not getattr(fusion.model_management, "in_training", False) and isinstance(transformer_options, dict)):
        return False
    patches = transformer_options.get("patches") or {}
    override = transformer_options.get("optimized_attention_override")
    return ("attn1_patch" not in patches and "attn1_output_patch" not in patches
            and (override is None or getattr(override, "takes_enable_gqa", False)))


def _krea2_grouped_forward(stock_forward: Callable[..., Any], attend: Callable[..., Any], rope: "FusedComfyRope",
                           fusion: Fusion, qualname: str) -> Callable[..., Any]:
    """Krea 2's Attention.forward (ComfyUI 0.29.0's arithmetic) with k / v given to ComfyUI's attention function
    with their own 12 heads and `enable_gqa`, where `_groups` allows; the stock forward (RoPE rebound) otherwise.
    The stock code repeats k / v to 48 heads first: two copies of 4x k / v per block. Every attention function of
    ComfyUI 0.29.0 takes `enable_gqa` (torch SDPA and flash-attn group the heads in the kernel; the others repeat
    them themselves)."""

    def forward(self: nn.Module, x: torch.Tensor, freqs: Any = None, mask: Any = None,
                transformer_options: Any = None) -> torch.Tensor:
        if transformer_options is None:  # the stock default, a fresh dict
            transformer_options = {}
        if not _groups(self, x, transformer_options, fusion):
            return stock_forward(self, x, freqs, mask, transformer_options)
        q, k, v, gate = self.wq(x), self.wk(x), self.wv(x), self.gate(x)
        # [B, L, H * D] -> [B, H, L, D] views, as the stock code's rearrange
        q = q.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        k = k.unflatten(-1, (self.kvheads, -1)).transpose(1, 2)
        v = v.unflatten(-1, (self.kvheads, -1)).transpose(1, 2)
        q, k = self.qknorm(q, k)
        if freqs is not None:
            q, k = rope(q, k, freqs)
        if not compiling():  # counted per call (a compiled graph would count per trace)
            fusion.grouped_calls += 1
        out = attend(q, k, v, self.heads, mask=mask, skip_reshape=True, transformer_options=transformer_options,
                     enable_gqa=True)
        return self.wo(out * torch.sigmoid(gate))

    forward.__qualname__ = forward.__name__ = qualname
    forward.__wrapped__ = stock_forward
    return forward


# ------------------------------------------------------------------------------ Krea 2's modulation and residuals
def _krea2_block_forward(stock_forward: Callable[..., Any], fusion: Fusion, qualname: str) -> Callable[..., Any]:
    """Krea 2's SingleStreamBlock.forward (ComfyUI 0.29.0's arithmetic): `(1 + scale) * norm(x) + shift` as one
    kernel (norm_rope.modulated_rms_norm, three torch passes) and `x + gate * y` as one (gated_residual, two), each
    op's rounding kept; eager on CUDA (or any_device) only, the stock forward otherwise and for a reference image's
    timestep-zero tokens (their own modulation rows)."""

    def forward(self: nn.Module, x: torch.Tensor, vec: torch.Tensor, freqs: Any, mask: Any = None,
                timestep_zero_index: Any = None, transformer_options: Any = None) -> torch.Tensor:
        if transformer_options is None:  # the stock default, a fresh dict
            transformer_options = {}
        if timestep_zero_index is not None or not fusion.eager_on(x) or x.dim() != 3 or not x.is_contiguous():
            return stock_forward(self, x, vec, freqs, mask, timestep_zero_index, transformer_options)
        prescale, preshift, pregate, postscale, postshift, postgate = self.mod(vec)
        pre = _modulated_norm(self.prenorm, x, prescale, preshift, fusion)
        x = _gated_residual(x, pregate, self.attn(pre, freqs, mask, transformer_options=transformer_options), fusion)
        del pre
        post = _modulated_norm(self.postnorm, x, postscale, postshift, fusion)
        return _gated_residual(x, postgate, self.mlp(post), fusion)

    forward.__qualname__ = forward.__name__ = qualname
    forward.__wrapped__ = stock_forward
    return forward


def _modulated_norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                    fusion: Fusion) -> torch.Tensor:
    """`(1 + scale) * norm(x) + shift` for a Krea 2 RMSNorm (weight `scale + 1` in fp32, as the class casts it)."""
    kernels, mult = fusion.kernels, 1 + scale
    if kernels.batch_rows(mult, x) is not None and kernels.batch_rows(shift, x) is not None:
        weight = _krea2_norm_weight(norm, x, fusion)
        if weight is not None:
            fusion.modulation_calls += 1
            return kernels.modulated_rms_norm(x, weight, norm.eps, 1.0, mult, shift)
    return mult * norm(x) + shift


def _gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, fusion: Fusion) -> torch.Tensor:
    """`x + gate * y` (Krea 2's block residuals)."""
    if (y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous() and y.device == x.device
            and fusion.kernels.batch_rows(gate, x) is not None):
        fusion.modulation_calls += 1
        return fusion.kernels.gated_residual(x, gate, y)
    return x + gate * y


def _comfy_function(func: Any, module: str, name: str) -> bool:
    """Whether `func` is ComfyUI's own function `module.name` (not another pack's replacement of that global)."""
    return getattr(func, "__module__", None) == module and getattr(func, "__qualname__", None) == name \
        and hasattr(func, "__code__")


# ------------------------------------------------------------------------------------------------------ application
@dataclass
class ComfyFusion:
    """What got the fused kernels (module names per stock class) and the kernels' calls since."""

    fusion: Fusion
    norms: dict[str, str] = field(default_factory=dict)  # module name -> stock class name
    ropes: dict[str, str] = field(default_factory=dict)
    shares: dict[str, str] = field(default_factory=dict)  # modules whose layers quantize a shared input once
    grouped: dict[str, str] = field(default_factory=dict)  # attention modules handing k / v over ungrouped
    modulated: dict[str, str] = field(default_factory=dict)  # blocks whose modulation / residuals are kernels

    def as_dict(self) -> dict[str, Any]:
        """report.json's attention.fused_norm_rope for a ComfyUI model."""
        return {"code": "ComfyUI's (comfy/ldm)", "norm_modules": len(self.norms), "rope_modules": len(self.ropes),
                "shared_input_modules": len(self.shares), "grouped_kv_modules": len(self.grouped),
                "modulated_blocks": len(self.modulated),
                "classes": dict(Counter({**self.norms, **self.ropes, **self.shares, **self.modulated}.values())),
                "norm_kernel_calls": self.fusion.norm_calls, "rope_kernel_calls": self.fusion.rope_calls,
                "grouped_kv_calls": self.fusion.grouped_calls, "modulation_kernel_calls": self.fusion.modulation_calls}


# (kind, what its fused class needs, shared arguments, attention function)
Stock = tuple[str, Any, tuple[str, ...], Any]


def _stock_classes() -> tuple[dict[type, Stock], type | None]:
    """ComfyUI's classes this module fuses, from the ComfyUI modules already imported (none outside ComfyUI):
    ({class: (kind, what its fused class needs, the forward's arguments it passes unchanged to several quantized
    layers, ComfyUI's attention function where the fused forward hands it ungrouped k / v, else None)}, comfy.ops'
    base RMSNorm class or None). The shared arguments are read off ComfyUI 0.29.0's code: each goes to its
    projections before anything could change it (tests/comfy/test_comfy_fused.py runs that code)."""
    found: dict[type, Stock] = {}
    krea2, layers, qwen, ops = (sys.modules.get(m) for m in (KREA2_MODULE, FLUX_LAYERS, QWEN_MODULE, "comfy.ops"))
    if krea2 is not None:
        found[krea2.RMSNorm] = ("krea2_norm", None, (), None)
        stock = krea2.Attention.forward.__globals__.get("apply_rope")
        attend = krea2.Attention.forward.__globals__.get("optimized_attention_masked")
        if not (_comfy_function(attend, ATTENTION_MODULE, getattr(attend, "__qualname__", ""))
                and attend.__qualname__.startswith("attention_") and hasattr(attend, "__wrapped__")):
            attend = None  # not one of ComfyUI's wrapped attention functions (which all take enable_gqa)
        if _comfy_function(stock, FLUX_MATH, "apply_rope"):  # x -> wq, wk, wv, gate
            found[krea2.Attention] = ("rope", {"apply_rope": (stock, True)}, ("x",), attend)
        found[krea2.SwiGLU] = ("share", None, ("x",), None)  # x -> gate, up
        found[krea2.SingleStreamBlock] = ("krea2_block", None, (), None)
    if layers is not None:
        attention = layers.DoubleStreamBlock.forward.__globals__.get("attention")
        stock = getattr(attention, "__globals__", {}).get("apply_rope")
        if _comfy_function(attention, FLUX_MATH, "attention") and _comfy_function(stock, FLUX_MATH, "apply_rope"):
            for cls in (layers.DoubleStreamBlock, layers.SingleStreamBlock):  # one packed qkv layer: nothing to share
                found[cls] = ("rope", {"attention": (attention, {"apply_rope": (stock, True)})}, (), None)
    if qwen is not None:
        stock = qwen.Attention.forward.__globals__.get("apply_rope1")
        if _comfy_function(stock, FLUX_MATH, "apply_rope1"):  # each stream -> its q, k, v projections
            found[qwen.Attention] = ("rope", {"apply_rope1": (stock, False)},
                                     ("hidden_states", "encoder_hidden_states"), None)
    return found, (ops.disable_weight_init.RMSNorm if ops is not None else None)


def _kind(cls: type, stock: dict[type, Stock], ops_norm: type | None) -> Stock | None:
    if cls in stock:
        return stock[cls]
    if ops_norm is not None and issubclass(cls, ops_norm) and cls.forward is ops_norm.forward \
            and cls.forward_comfy_cast_weights is ops_norm.forward_comfy_cast_weights:
        return "ops_norm", None, (), None  # a comfy.ops RMSNorm of any op set whose arithmetic is the base class's
    return None


def _rebinds(spec: dict[str, Any], fusion: Fusion) -> dict[str, Any]:
    """The globals a fused forward sees: a FusedComfyRope for each RoPE function, a rebound copy of each function
    that calls one (FLUX's `attention`)."""
    out = {}
    for name, (stock, inner) in spec.items():
        out[name] = (rebound_function(stock, _rebinds(inner, fusion), f"{stock.__qualname__} (FusedRope)")
                     if isinstance(inner, dict) else FusedComfyRope(stock, fusion, pair=inner))
    return out


def _fused_class(stock_cls: type, kind: str, spec: Any, shares: tuple[str, ...], attend: Any, fusion: Fusion) -> type:
    """The subclass a module of `stock_cls` becomes: rope, a forward of the stock code with its RoPE function
    rebound (Krea 2's, with `attend`: the grouped forward around it); share, the stock forward; a norm, the kernel
    forward before the stock class in the MRO. rope and share open their `shares` arguments to one activation
    quantization (dispatch.sharing_forward)."""
    body: dict[str, Any] = {"_lowbit_fusion": fusion, "__module__": __name__}
    if kind == "krea2_block":
        name = f"{stock_cls.__name__}Modulated"
        body["forward"] = _krea2_block_forward(stock_cls.forward, fusion, f"{name}.forward")
        body["__doc__"] = f"ComfyUI's {stock_cls.__name__} with its modulation and residuals as kernels (lowbit_pipe)."
        return type(name, (stock_cls,), body)
    if kind in ("rope", "share"):
        name = f"{stock_cls.__name__}{'FusedRope' if kind == 'rope' else 'SharedInput'}"
        forward = (rebound_function(stock_cls.forward, _rebinds(spec, fusion), f"{name}.forward") if kind == "rope"
                   else stock_cls.forward)
        if attend is not None:
            forward = _krea2_grouped_forward(forward, attend, forward.__globals__["apply_rope"], fusion,
                                             f"{name}.forward")
        body["forward"] = (sharing_forward(forward, shares, lambda module: fusion.active, f"{name}.forward")
                           if shares else forward)
        body["__doc__"] = (f"ComfyUI's {stock_cls.__name__} with its RoPE as one kernel in eager (lowbit_pipe)."
                           if kind == "rope" else f"ComfyUI's {stock_cls.__name__}, its input quantized once for "
                           "its layers in eager (lowbit_pipe).")
        return type(name, (stock_cls,), body)
    mixin = _Krea2NormFused if kind == "krea2_norm" else _OpsNormFused
    body["__doc__"] = f"ComfyUI's {stock_cls.__name__} as one kernel in eager (lowbit_pipe)."
    return type(f"{stock_cls.__name__}Fused", (mixin, stock_cls), body)


def _swap_class(ledger: Ledger, module: nn.Module, cls: type, name: str) -> None:
    """module.__class__ = cls, recorded: the undo puts the stock class back (checked by identity); a class changed
    since by someone else is left as it is and reported."""
    stock = type(module)
    object.__setattr__(module, "__class__", cls)
    ref = weakref.ref(module)

    def undo() -> None:
        target = ref()
        if target is None:
            return
        if type(target) is not cls:
            raise RuntimeError(f"{name}: its class was changed by someone else after ours ({type(target).__name__}); "
                               "left as is")
        object.__setattr__(target, "__class__", stock)

    def check() -> Any:
        target = ref()
        return True if target is None or type(target) is stock else f"class is {type(target).__name__}"

    ledger.record("comfy_fused_class", name, undo, check=check)


def apply_comfy_fused_norm_rope(root: nn.Module, ledger: Ledger, *, any_device: bool = False) -> ComfyFusion:
    """Give the ComfyUI norm and attention modules under `root` the one-pass kernels (module docstring), every
    change in `ledger`. `any_device` (tests only): the kernels on CPU tensors too, under TRITON_INTERPRET=1."""
    try:
        from lowbit_pipe.kernels import norm_rope  # Triton's import: the kernels and their torch forms
    except ImportError as err:
        raise ImportError(f"attention.fused_norm_rope needs triton (lowbit_pipe.kernels.norm_rope): {err}") from None
    fusion = Fusion(norm_rope, sys.modules.get("comfy.ops"), sys.modules.get("comfy.model_management"), any_device)
    applied = ComfyFusion(fusion)
    stock, ops_norm = _stock_classes()
    made: dict[type, type] = {}
    for name, module in root.named_modules():
        cls = type(module)
        kind = _kind(cls, stock, ops_norm)
        if kind is None or "forward" in vars(module):  # not ComfyUI's, already fused, or another instance forward
            continue
        if cls not in made:
            made[cls] = _fused_class(cls, *kind, fusion)
        _swap_class(ledger, module, made[cls], f"{name or '<root>'} ({cls.__name__} -> {made[cls].__name__})")
        if kind[0] == "krea2_block":
            applied.modulated[name] = cls.__name__
        elif kind[0] != "share":
            (applied.ropes if kind[0] == "rope" else applied.norms)[name] = cls.__name__
        if kind[2]:
            applied.shares[name] = cls.__name__
        if kind[3] is not None and module.kvheads != module.heads:
            applied.grouped[name] = cls.__name__

    def off() -> None:
        fusion.active = False

    ledger.record("comfy_fused_kernels", "the fused kernels' switch (off: copies still holding a fused class run "
                  "ComfyUI's code)", off, check=lambda: True if not fusion.active else "still on")
    return applied
