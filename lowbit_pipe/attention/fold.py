"""q and k written in e4m3 by their RoPE kernel, for cuDNN's FP8 attention in eager: the quantization folded away.

In a known processor (FOLD_FORMS: Krea 2's, FLUX's) q and k are RMSNorm outputs rotated by RoPE and handed to the
attention call unchanged (GQA's repeat of k's heads aside). An RMSNorm's output is bounded by its weight alone
(|y| <= sqrt(D) max|w + offset|, and RoPE keeps pair norms: lowbit_pipe.kernels.norm_rope.norm_bound), so the
scale of a per-tensor e4m3 code is known before the tensor exists: the RoPE kernel writes e4m3 codes straight
away (norm_rope.rope_e4m3), in cuDNN's layout, the keys of a masked call already in key order. e4m3 is a float
format: a bound above the true amax costs precision only for values below bound / 2^15 (measured: the bound sits
~3x above the amax, the cosine vs bf16 unchanged). k is not smoothed by its mean in this form (the mean is not
known in advance): after RMSNorm and RoPE that costs ~1e-5 of cosine (bench/attention_fold_gpu.py measures it).
Only v keeps a statistics pass and a quantize pass (qkv_fp8.quantize_folded).

Mechanism, per call of a processor whose class is in FOLD_FORMS (`wrap_call`): the call's attention module and
mask are noted (`FoldCall`); the processor's `apply_rotary_emb` global (`rope`) decides at its first call (q) by
the router's choice for the call's shape (CallShape.folded: the folded cuDNN path is one of the router's paths,
measured as v's passes + kernel + output conversion) whether to fold; then q and k come back as e4m3 tensors and
the dispatch (`attend`, from processors.Dispatch8) runs cuDNN on them. An e4m3 tensor cannot flow into any torch
arithmetic unnoticed (torch refuses most float8 ops), and the dispatch accepts only the tensors this call wrote.
Anything else -- compiling, another layout, a mask that is not a key-padding mask -- leaves RoPE to the previous
function (the fused kernel or diffusers' own) and the call to the router.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from lowbit_pipe.attention.norm_kinds import norm_kind
from lowbit_pipe.attention.route import count_call, key_padding
from lowbit_pipe.kernels.dispatch import compiling

CUDNN_FOLDED = "cudnn_fp8_folded"
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class FoldForm:
    """The norms whose outputs reach q's and k's RoPE in a processor class (attribute names of the attention
    module; absent or None ones are skipped, all must be known RMSNorms)."""

    q_norms: tuple[str, ...]
    k_norms: tuple[str, ...]


FOLD_FORMS = {
    "diffusers.models.transformers.transformer_krea2.Krea2AttnProcessor": FoldForm(("norm_q",), ("norm_k",)),
    "diffusers.models.transformers.transformer_flux.FluxAttnProcessor": FoldForm(("norm_q", "norm_added_q"),
                                                                                ("norm_k", "norm_added_k")),
}


def fold_form(processor_cls: type) -> FoldForm | None:
    """The form of the first class in `processor_cls`'s MRO that FOLD_FORMS knows (the fused / 8-bit subclasses
    keep the stock class's code), or None."""
    for cls in processor_cls.__mro__:
        form = FOLD_FORMS.get(f"{cls.__module__}.{cls.__qualname__}")
        if form is not None:
            return form
    return None


def norm_offset(norm: nn.Module) -> float | None:
    """y = x̂ * (weight + offset) for a known RMSNorm without a bias: its offset; None for anything else."""
    if getattr(norm, "bias", None) is not None:
        return None
    if isinstance(norm, nn.RMSNorm):
        return 0.0
    kind = norm_kind(norm)
    return kind.offset if kind is not None else None


@dataclass
class FoldCall:
    """One processor call: its attention module, form, attention mask, and what the fold wrote."""

    module: nn.Module
    form: FoldForm
    mask: Any
    ropes: int = 0
    folded: bool = False
    key_mask: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # [2] fp32: q's and k's code scales (448 / bound)
    amax: torch.Tensor | None = None  # [2] fp32: the largest |q|, |k| seen (QKFold.check_bounds only)
    q8: torch.Tensor | None = None
    k8: torch.Tensor | None = None


@dataclass
class QKFold:
    """The fold for one applied attention: `router` (lowbit_pipe.attention.crossover.AttentionRouter, which must
    have the folded path), `cudnn` (CudnnFP8Attention), `calls` (the applied attention's counter, `count_key` its
    traced-counting key). `active`: the processor call under way (eager runs one at a time)."""

    router: Any
    cudnn: Any
    calls: Counter
    count_key: int
    active: FoldCall | None = None
    devices: tuple[str, ...] = ("cuda",)  # where rope_e4m3 runs (tests add "cpu" under TRITON_INTERPRET)
    bounds: dict[tuple, tuple[tuple, torch.Tensor]] = field(default_factory=dict)
    folded_calls: int = 0
    check_bounds: bool = False  # track q's and k's amax against their bounds (tests; an atomic per 4 rows)
    last_amax: torch.Tensor | None = None  # the last folded call's [2] amax (with check_bounds)

    def wrap_call(self, call: Callable[..., Any], form: FoldForm) -> Callable[..., Any]:
        """The processor's __call__ (signature kept: diffusers filters kwargs by it) noting each call's module and
        attention mask for `rope`."""
        names = list(inspect.signature(call).parameters)
        at = names.index("attention_mask") - 2 if "attention_mask" in names else None  # after self, attn

        @functools.wraps(call)
        def folding_call(proc: Any, attn: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if compiling() or getattr(proc, "_parallel_config", None) is not None:
                return call(proc, attn, *args, **kwargs)
            mask = kwargs.get("attention_mask", args[at] if at is not None and len(args) > at else None)
            outer, self.active = self.active, FoldCall(attn, form, mask)
            try:
                return call(proc, attn, *args, **kwargs)
            finally:
                self.active = outer

        return folding_call

    def rope(self, inner: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`apply_rotary_emb` for the folding processors: q's and k's e4m3 codes where the call folds, `inner` (the
        previous global) otherwise."""

        def folding_rope(x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1,
                         sequence_dim: int = 2) -> torch.Tensor:
            call = self.active
            if call is not None:
                call.ropes += 1
                if use_real and use_real_unbind_dim == -1 and sequence_dim == 1 and _serves(x, freqs_cis, self.devices):
                    out = self._fold_q(call, x, freqs_cis) if call.ropes == 1 else (
                        self._fold_k(call, x, freqs_cis) if call.ropes == 2 and call.folded else None)
                    if out is not None:
                        return out
            return inner(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim,
                         sequence_dim=sequence_dim)

        return folding_rope

    def _fold_q(self, call: FoldCall, x: torch.Tensor, freqs: Any) -> torch.Tensor | None:
        from lowbit_pipe.attention.crossover import CallShape, dtype_name
        from lowbit_pipe.kernels import norm_rope
        from lowbit_pipe.kernels.qkv_fp8 import key_order

        b, n, h, d = x.shape
        key_mask = key_padding(call.mask, b, n) if call.mask is not None else None
        if call.mask is not None and key_mask is None:
            return None  # another mask: the router's unfolded paths or the model's own attention
        bound_q = self._bound(call.module, call.form.q_norms, d, x.device)
        bound_k = self._bound(call.module, call.form.k_norms, d, x.device)
        if bound_q is None or bound_k is None:
            return None
        shape = CallShape(b, h, n, d, key_mask is not None, dtype_name(x.dtype), folded=True)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if self.router.choose(shape, allow_measure=not capturing).path != CUDNN_FOLDED:
            return None
        call.folded, call.key_mask = True, key_mask
        if key_mask is not None:
            call.key_mask = key_mask.contiguous()
            call.pos = key_order(call.key_mask)[0]
        call.scale = 448.0 / torch.cat([bound_q, bound_k])
        call.amax = torch.zeros(2, dtype=torch.float32, device=x.device) if self.check_bounds else None
        call.q8 = norm_rope.rope_e4m3(x, *freqs, call.scale[0:1], None if call.amax is None else call.amax[0:1])
        return call.q8

    def _fold_k(self, call: FoldCall, x: torch.Tensor, freqs: Any) -> torch.Tensor | None:
        from lowbit_pipe.kernels import norm_rope

        if x.shape[0] != call.q8.shape[0] or x.shape[1] != call.q8.shape[1] or call.q8.shape[2] % x.shape[2]:
            return None
        call.k8 = norm_rope.rope_e4m3(x, *freqs, call.scale[1:2], None if call.amax is None else call.amax[1:2],
                                      call.key_mask, call.pos)
        return call.k8

    def _bound(self, module: nn.Module, names: tuple[str, ...], d: int, device: torch.device) -> torch.Tensor | None:
        """The largest of the named norms' bounds ([1] fp32), cached per weight version; None if one is unknown."""
        from lowbit_pipe.kernels.norm_rope import norm_bound

        norms = [getattr(module, name, None) for name in names]
        norms = [m for m in norms if m is not None]
        if not norms or any(norm_offset(m) is None for m in norms):
            return None
        weights = [getattr(m, "weight", None) for m in norms]
        version = tuple((w.data_ptr(), w._version) if w is not None else None for w in weights) + (d, str(device))
        key = (id(module), names)
        hit = self.bounds.get(key)
        if hit is None or hit[0] != version:
            bound = torch.stack([norm_bound(w, norm_offset(m), d, device) for m, w in zip(norms, weights)]).amax(0)
            self.bounds[key] = hit = (version, bound)
        return hit[1]

    # ----------------------------------------------------------------------------------------------- the call
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
               ) -> torch.Tensor:
        """Dispatch8's call for e4m3 q and k from `rope`: [B, N, H, D] in, [B, N, H, D] in v's dtype out."""
        call = self._call_of(query)
        if call.k8 is None or key.dtype != FP8 or key.shape != query.shape or key.shape[2] % call.k8.shape[2]:
            raise RuntimeError("lowbit_pipe fold: the attention call got e4m3 k that this processor call's RoPE did "
                               f"not write, or of another shape ({list(key.shape)} vs q {list(query.shape)})")
        out = folded_attention(self.cudnn, query, key.contiguous(), call.scale, value, scale, call.key_mask)
        count_call(self.calls, CUDNN_FOLDED, self.count_key)
        self.folded_calls += 1
        self.last_amax = call.amax
        return out

    def decode_q(self, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """q's values from its codes, for a call whose k did not fold (another layout at k's RoPE): the call then
        takes the router's unfolded paths, with q rounded to e4m3 once."""
        call = self._call_of(query)
        call.folded = False
        return (query.float() / call.scale[0]).to(dtype)

    def _call_of(self, query: torch.Tensor) -> FoldCall:
        call = self.active
        if call is None or query is not call.q8:
            raise RuntimeError("lowbit_pipe fold: the attention call got e4m3 q that this processor call's RoPE did "
                               "not write (the processor changed q between RoPE and attention)")
        return call

    def as_dict(self) -> dict[str, Any]:
        return {"folded_calls": self.folded_calls, "forms": sorted(FOLD_FORMS)}


def _serves(x: torch.Tensor, freqs: Any, devices: tuple[str, ...]) -> bool:
    """rope_e4m3 takes x [B, S, H, D] on `devices`, contiguous 16/32-bit with an even power-of-two head dim, cos / sin fp32
    [S, D] contiguous on x's device."""
    if not (x.dim() == 4 and x.device.type in devices and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16,
                                                                             torch.float32)):
        return False
    d = x.shape[-1]
    if d < 16 or d & (d - 1) or not isinstance(freqs, (tuple, list)) or len(freqs) != 2:
        return False
    want = (x.shape[1], d)
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == want
               and t.device == x.device and t.is_contiguous() for t in freqs)


def folded_attention(cudnn: Any, q8: torch.Tensor, k8: torch.Tensor, qk_scale: torch.Tensor, value: torch.Tensor,
                     sm_scale: float | None, key_mask: torch.Tensor | None) -> torch.Tensor:
    """cuDNN's FP8 attention on q8, k8 [B, N, H, D] e4m3 written with `qk_scale` [2] (k8's keys in key order for a
    masked call) and value [B, N, H, D]: v's passes (qkv_fp8.quantize_folded), the kernel, the output conversion.
    [B, N, H, D] contiguous in v's dtype. `cudnn`: a CudnnFP8Attention (it builds the form's graph once)."""
    from lowbit_pipe.kernels import qkv_fp8 as Q

    b, n, h, d = q8.shape
    qkv = Q.quantize_folded(q8, k8, qk_scale, value.transpose(1, 2), key_mask)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    plan = cudnn.plan_key(q8.transpose(1, 2), key_mask is not None, sm)
    o8 = cudnn.execute(plan, qkv, torch.empty(b, n, h, d, dtype=FP8, device=q8.device))
    out = torch.empty(b, n, h, d, dtype=value.dtype, device=q8.device)
    Q.finish_output(o8, qkv, out.transpose(1, 2))
    return out


def measure_codes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None,
                  key_mask: torch.Tensor | None) -> tuple:
    """The router's timing of the folded path: q and k [B, H, N, D] as their RoPE would hand them over (e4m3 in
    [B, N, H, D], scales from their amaxes, k's keys in key order), made before the clock starts; the arguments of
    `measured_run`."""
    from lowbit_pipe.kernels import qkv_fp8 as Q

    amax = torch.stack([q.abs().amax(), k.abs().amax()]).float().clamp(min=1e-30)
    scale = 448.0 / amax
    q8 = Q.e4m3(q.transpose(1, 2).float() * scale[0]).to(FP8).contiguous()
    k8 = Q.e4m3(k.transpose(1, 2).float() * scale[1])
    if key_mask is not None:
        pos = Q.key_order(key_mask)[0].long()
        k8 = torch.zeros_like(k8).scatter_(1, pos[:, :, None, None].expand_as(k8),
                                           torch.where(key_mask[:, :, None, None], k8, 0.0))
    return q8, k8.to(FP8).contiguous(), scale, v.transpose(1, 2), sm_scale, key_mask


def measured_run(cudnn: Any) -> Callable[..., torch.Tensor]:
    """The folded path's timed call (after `measure_codes`)."""

    def run(q8, k8, scale, value, sm_scale, key_mask):
        return folded_attention(cudnn, q8, k8, scale, value, sm_scale, key_mask)

    return run
