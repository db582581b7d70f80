"""cuDNN's FP8 attention (`sdpa_fp8` of the cuDNN frontend's graph API) as a kernel of `attention.format=fp8`.

    out = softmax(q kᵀ * sm_scale) v     q, k, v: [B, H, N, D]; optionally a key-padding mask [B, N] (True = attend)

The optional dependency `nvidia-cudnn-frontend` (`pip install 'lowbit_pipe[cudnn]'`) gives Python the graph API
of the cuDNN library torch already ships. One call:

1. q, k, v to e4m3 with one scale per tensor, k and v smoothed by their means (lowbit_pipe.kernels.qkv_fp8: two
   Triton passes), the keys of a masked call reordered so the attended ones come first;
2. cuDNN's graph: io FP8_E4M3, fp32 intermediates and compute, descales of q, k, v and of P as [1, 1, 1, 1] fp32
   tensors, P scaled by qkv_fp8.S_SCALE, the output in e4m3 too (Hopper refuses a 16-bit output: "sdpa fp8 forward
   with HALF/BFLOAT16 output is only supported on Blackwell"), its scale v's; a masked call adds cuDNN's padding
   mask (seq_len_q = N, seq_len_kv = the attended keys per batch). cuDNN takes no bias with FP8 ("SDPA FP8 does not
   support bias"), hence the reordering;
3. the e4m3 output times its descale plus v's mean, in q's dtype and layout (qkv_fp8.finish_output).

No host synchronisation in a call: a CUDA graph can capture it once its cuDNN graph is built.

`CudnnFP8Attention` owns what cuDNN needs: a handle per device, and per call form (device, batch, heads, tokens,
head dim, masked, softmax scale) the built graph, its workspace and the constant seq_len_q. The object that
applies the attention owns one (lowbit_pipe.attention.processors.AppliedAttention) and `close()`s it at teardown;
nothing of it is process-wide but a weak registry that lets the custom op (what torch.compile sees) find its
owner by number. A form cuDNN refuses is remembered with cuDNN's reason (`refused`), and the caller routes that
call elsewhere (the Triton kernel, or the model's own attention).

`reference_from_codes` is the kernel's arithmetic in torch (online softmax over blocks of 128 keys, P rounded to
e4m3 as p * S_SCALE, O rounded to e4m3): the GPU checks' model of what cuDNN computes from the same codes.
"""

from __future__ import annotations

import itertools
import math
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lowbit_pipe.kernels import qkv_fp8 as Q

INSTALL_HINT = "pip install 'lowbit_pipe[cudnn]' (nvidia-cudnn-frontend>=1.20)"

# graph tensor uids
UID_Q, UID_K, UID_V, UID_O = 1, 2, 3, 4
UID_DESCALE_Q, UID_DESCALE_K, UID_DESCALE_V, UID_DESCALE_S, UID_SCALE_S, UID_SCALE_O = 5, 6, 7, 8, 9, 10
UID_AMAX_S, UID_AMAX_O, UID_SEQ_Q, UID_SEQ_KV = 11, 12, 13, 14
# uid -> row of the scales buffer (lowbit_pipe.kernels.qkv_fp8)
SCALE_UIDS = {UID_DESCALE_Q: Q.DESCALE_Q, UID_DESCALE_K: Q.DESCALE_K, UID_DESCALE_V: Q.DESCALE_V,
              UID_DESCALE_S: Q.DESCALE_S, UID_SCALE_S: Q.SCALE_S, UID_SCALE_O: Q.SCALE_O, UID_AMAX_S: Q.AMAX_S,
              UID_AMAX_O: Q.AMAX_O}


def import_cudnn() -> Any:
    """The cuDNN frontend's module, or an ImportError that says how to install it."""
    try:
        import cudnn
    except Exception as err:  # noqa: BLE001 - ImportError, or the library failing to load (OSError)
        raise ImportError(f"cuDNN's FP8 attention needs the cuDNN frontend's Python package: {INSTALL_HINT}. "
                          f"Importing it failed: {type(err).__name__}: {err}") from None
    if not hasattr(cudnn, "pygraph"):
        raise ImportError(f"the module `cudnn` found at {getattr(cudnn, '__file__', '?')} is not the cuDNN frontend "
                          f"(no pygraph): {INSTALL_HINT}")
    return cudnn


@dataclass(frozen=True)
class PlanKey:
    """What a built cuDNN graph is specific to (`plan_key`: the softmax scale as the fp32 cuDNN takes)."""

    device: int
    batch: int
    heads: int
    tokens: int
    head_dim: int
    masked: bool
    sm_scale: float


def plan_key(device: int, batch: int, heads: int, tokens: int, head_dim: int, masked: bool,
             sm_scale: float | None = None) -> PlanKey:
    """The key of a call form; sm_scale None: 1 / sqrt(head_dim). The scale is rounded to fp32 (cuDNN's), so
    head_dim ** -0.5 and 1 / sqrt(head_dim), which differ in the last float64 bit, name one graph."""
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    return PlanKey(int(device), int(batch), int(heads), int(tokens), int(head_dim), bool(masked),
                   struct.unpack("f", struct.pack("f", sm))[0])


@dataclass
class _Plan:
    graph: Any
    workspace: torch.Tensor
    seq_len_q: torch.Tensor | None  # [B, 1, 1, 1] int32, all N (masked forms)


def head_dim_refusal(head_dim: int, capability: tuple[int, int]) -> str | None:
    """Why cuDNN's FP8 attention takes no such head dim on this GPU (its support surface, frontend 1.20)."""
    if capability < (9, 0):
        return "cuDNN's FP8 attention needs Hopper or newer"
    limit = 128 if capability[0] >= 10 else 256
    if head_dim % 16 or head_dim > limit or head_dim & (head_dim - 1):
        # multiples of 16 up to the limit for cuDNN; powers of two for qkv_fp8's kernels
        return f"head dim {head_dim}: cuDNN's FP8 attention here takes powers of two from 16 to {limit}"
    return None


_KEYS = itertools.count(1)
_RUNNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # key -> CudnnFP8Attention, for the custom op


class CudnnFP8Attention:
    """cuDNN's FP8 attention for one owner: handles, built graphs and workspaces, and the forms cuDNN refused."""

    def __init__(self, cudnn: Any | None = None) -> None:
        self.cudnn = cudnn if cudnn is not None else import_cudnn()
        self.version = f"cudnn-frontend {getattr(self.cudnn, '__version__', '?')}, cuDNN {self.cudnn.backend_version()}"
        self._handles: dict[int, Any] = {}
        self._plans: dict[PlanKey, _Plan] = {}
        self.refused: dict[PlanKey, str] = {}
        self.closed = False
        self.key = next(_KEYS)
        _RUNNERS[self.key] = self

    # ----------------------------------------------------------------------------------------------- plans
    @staticmethod
    def plan_key(q: torch.Tensor, masked: bool, sm_scale: float | None = None) -> PlanKey:
        b, h, n, d = q.shape
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        return plan_key(index, b, h, n, d, masked, sm_scale)

    def why_not(self, key: PlanKey) -> str | None:
        """Why cuDNN cannot run this form (None: it can). Builds its graph the first time (host work only)."""
        if self.closed:
            return "cuDNN's FP8 attention was released (teardown)"
        if key in self._plans:
            return None
        if key in self.refused:
            return self.refused[key]
        why = head_dim_refusal(key.head_dim, torch.cuda.get_device_capability(key.device))
        if why is None:
            try:
                with torch.cuda.device(key.device):
                    self._plans[key] = self._build(key)
                return None
            except Exception as err:  # noqa: BLE001 - cudnnGraphNotSupportedError, or another error of the frontend
                lines = str(err).strip().splitlines() or [""]
                why = f"cuDNN refused the graph: {type(err).__name__}: {lines[0][:200]}"
        self.refused[key] = why
        return why

    def _handle(self, device: int) -> Any:
        if device not in self._handles:
            with torch.cuda.device(device):
                self._handles[device] = self.cudnn.create_handle()
        return self._handles[device]

    def _build(self, key: PlanKey) -> _Plan:
        c = self.cudnn
        fp8, f32, i32 = c.data_type.FP8_E4M3, c.data_type.FLOAT, c.data_type.INT32
        b, h, n, d = key.batch, key.heads, key.tokens, key.head_dim
        graph = c.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self._handle(key.device))
        stride = (n * h * d, d, h * d, 1)  # [B, N, H, D] in memory, seen as [B, H, N, D]
        q, k, v = (graph.tensor(uid=uid, dim=(b, h, n, d), stride=stride, data_type=fp8)
                   for uid in (UID_Q, UID_K, UID_V))

        def scalar(uid: int) -> Any:
            return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

        mask: dict[str, Any] = {}
        if key.masked:  # padding: queries all N, keys the first seq_len_kv[b] (qkv_fp8.key_order)
            mask = {"use_padding_mask": True,
                    "seq_len_q": graph.tensor(uid=UID_SEQ_Q, dim=(b, 1, 1, 1), stride=(1, 1, 1, 1), data_type=i32),
                    "seq_len_kv": graph.tensor(uid=UID_SEQ_KV, dim=(b, 1, 1, 1), stride=(1, 1, 1, 1), data_type=i32)}
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=q, k=k, v=v, descale_q=scalar(UID_DESCALE_Q), descale_k=scalar(UID_DESCALE_K),
            descale_v=scalar(UID_DESCALE_V), descale_s=scalar(UID_DESCALE_S), scale_s=scalar(UID_SCALE_S),
            scale_o=scalar(UID_SCALE_O), generate_stats=False, attn_scale=key.sm_scale, use_causal_mask=False,
            **mask)
        o.set_uid(UID_O).set_output(True).set_dim((b, h, n, d)).set_stride(stride).set_data_type(fp8)
        for t, uid in ((amax_s, UID_AMAX_S), (amax_o, UID_AMAX_O)):
            t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        device = torch.device("cuda", key.device)
        workspace = torch.empty(max(int(graph.get_workspace_size()), 1), dtype=torch.uint8, device=device)
        seq_len_q = torch.full((b, 1, 1, 1), n, dtype=torch.int32, device=device) if key.masked else None
        return _Plan(graph, workspace, seq_len_q)

    # ----------------------------------------------------------------------------------------------- calls
    def execute(self, key: PlanKey, qkv: Q.QKVFP8, o8: torch.Tensor) -> torch.Tensor:
        """cuDNN's kernel alone: o8 [B, N, H, D] e4m3 from quantized operands (the form's graph built the first
        time; a form cuDNN refuses raises, naming it and why)."""
        why = self.why_not(key)
        if why is not None:
            raise RuntimeError(f"cuDNN FP8 attention cannot run {key}: {why}")
        plan = self._plans[key]
        base, row = qkv.scales.data_ptr(), qkv.scales.stride(0) * qkv.scales.element_size()
        pack = {UID_Q: qkv.q8.data_ptr(), UID_K: qkv.k8.data_ptr(), UID_V: qkv.v8.data_ptr(), UID_O: o8.data_ptr()}
        pack.update({uid: base + r * row for uid, r in SCALE_UIDS.items()})
        if key.masked:
            pack[UID_SEQ_Q] = plan.seq_len_q.data_ptr()
            pack[UID_SEQ_KV] = qkv.seq_len_kv.data_ptr()
        handle = self._handles[key.device]
        self.cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(key.device).cuda_stream)
        plan.graph.execute(pack, plan.workspace, handle=handle)
        return o8

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                 key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q kᵀ * sm_scale) v for [B, H, N, D] q, k, v (any strides), in q's dtype and layout."""
        key = self.plan_key(q, key_mask is not None, sm_scale)
        qkv = Q.quantize_qkv_fp8(q, k, v, key_mask)
        b, h, n, d = q.shape
        o8 = self.execute(key, qkv, torch.empty(b, n, h, d, dtype=torch.float8_e4m3fn, device=q.device))
        return Q.finish_output(o8, qkv, torch.empty_like(q))

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "graphs": len(self._plans),
                "refused": {f"{k.batch}x{k.heads}x{k.tokens}x{k.head_dim}{' masked' if k.masked else ''}": why
                            for k, why in self.refused.items()}}

    def close(self) -> None:
        """Drop the graphs and workspaces and destroy the handles; later calls are refused. Idempotent."""
        self._plans.clear()
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            self.cudnn.destroy_handle(handle)
        self.closed = True
        _RUNNERS.pop(self.key, None)


# ---------------------------------------------------------------------------------------------------------------
# custom op: one opaque node for torch.compile; its owner found by number (a weak registry)


@torch.library.custom_op("lowbit_pipe::cudnn_fp8_attention", mutates_args=())
def cudnn_fp8_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                           key_mask: Optional[torch.Tensor], runner: int) -> torch.Tensor:
    owner = _RUNNERS.get(runner)
    if owner is None:
        raise RuntimeError("lowbit_pipe: this compiled graph calls a cuDNN FP8 attention that was released "
                           "(teardown); compile the model again")
    return owner(q, k, v, sm_scale, key_mask)


@cudnn_fp8_attention_op.register_fake
def _(q, k, v, sm_scale, key_mask, runner):
    return torch.empty_like(q)


def attend(runner: CudnnFP8Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None,
           key_mask: torch.Tensor | None) -> torch.Tensor:
    """The runner in eager, its custom op inside torch.compile."""
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if torch.compiler.is_compiling():
        return cudnn_fp8_attention_op(q, k, v, float(sm), key_mask, runner.key)
    return runner(q, k, v, sm, key_mask)


# ---------------------------------------------------------------------------------------------------------------
# torch model of the kernel


def reference_from_codes(qkv: Q.QKVFP8, sm_scale: float, dtype: torch.dtype, heads: slice | None = None,
                         block: int = 128, rows: int = 1024) -> torch.Tensor:
    """What cuDNN computes from these codes, in torch: [B, H', N, D] in `dtype` for the heads `heads` (all: None).
    Online softmax over key blocks of `block` (P = exp(s - running max) rounded to e4m3 as p * S_SCALE, the row
    sums unrounded), O rounded to e4m3 with O's scale, then finish_output's arithmetic. Query rows `rows` at a time."""
    heads = heads or slice(None)
    scales = qkv.scales[:, 0].float()
    q8, k8, v8 = (t.float().transpose(1, 2)[:, heads] for t in (qkv.q8, qkv.k8, qkv.v8))  # [B, H', N, D]
    b, h, n, d = q8.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=q8.device)
    if qkv.seq_len_kv is not None:
        valid = torch.arange(n, device=q8.device)[None, :] < qkv.seq_len_kv.view(b, 1)
    bias = torch.where(valid, 0.0, float("-inf"))[:, None, None, :]
    mul = scales[Q.DESCALE_Q] * scales[Q.DESCALE_K] * sm_scale
    pv = scales[Q.DESCALE_V] * scales[Q.DESCALE_S]
    o8 = torch.empty(b, h, n, d, dtype=torch.float32, device=q8.device)
    for r0 in range(0, n, rows):
        s_all = (q8[:, :, r0:r0 + rows] @ k8.transpose(-1, -2)) * mul + bias
        m = torch.full(s_all.shape[:-1] + (1,), float("-inf"), device=q8.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros(*s_all.shape[:-1], d, device=q8.device)
        for j in range(0, n, block):
            s = s_all[..., j:j + block]
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_sub = torch.where(m_new == float("-inf"), 0.0, m_new)
            alpha = torch.exp(m - m_sub)
            p = torch.exp(s - m_sub)
            l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + (Q.e4m3(p * scales[Q.SCALE_S]) @ v8[:, :, j:j + block]) * pv
            m = m_new
        o8[:, :, r0:r0 + rows] = Q.e4m3(acc / l_sum.clamp(min=1.0) * scales[Q.SCALE_O])
    v_mean = qkv.v_mean.view(qkv.q8.shape[0], qkv.q8.shape[2], 1, d)[:, heads]
    out = o8 * scales[Q.DESCALE_O] + v_mean
    if qkv.seq_len_kv is not None:
        out = torch.where(qkv.seq_len_kv.view(b, 1, 1, 1) > 0, out, float("nan"))
    return out.to(dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                        key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The whole call in torch (quantization by qkv_fp8's torch form): [B, H, N, D] in q's dtype."""
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return reference_from_codes(Q.reference_qkv_fp8(q, k, v, key_mask), sm, q.dtype)
