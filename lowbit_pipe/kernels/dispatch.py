"""GPU paths of the quantized linear, one pair of functions per format family.

`<family>_supported(...)` is the decision (device, dtype, rotation kind, shapes): a pure
check, never a try/except around a kernel. `<family>_linear(...)` runs the GPU path. A
Format.linear calls `<family>_linear` when `<family>_supported` says yes and otherwise runs
its torch reference (the CPU path and the oracle the GPU paths are tested against).

| format (rotation)                     | GPU path                                                        |
|---------------------------------------|-----------------------------------------------------------------|
| int8 (none / convrot / quarot)        | rotation + per-token int8 quant (`quantize_activations`) +      |
|                                       | Triton INT8 GEMM                                                |
| fp8  (none / convrot / quarot)        | rotation + per-token fp8 quant + on Hopper the Triton TMA fp8   |
|                                       | GEMM (K % 16 == 0), elsewhere torch._scaled_mm (row-wise        |
|                                       | scales; K, N % 16 == 0 and M >= 16)                             |
| convrot_w4a4                          | rotation + int4 quant + INT8 GEMM unpacking int4                |
| w4a8 / w6a8 (no weight_correction)    | Triton int8-grid decode per call (or the prepacked grid) + the   |
|                                       | int8 path above                                                 |
| nvfp4 (none / convrot / quarot)       | [rotation] + Triton NVFP4 act emulation (global scale per row,  |
|                                       | or per tensor / static: one scalar), then M < 256:              |
|                                       | Triton GEMM decoding e2m1/e4m3 in registers (bf16 tensor cores); |
|                                       | M >= 256: Triton decode of the layer's weight + cuBLAS           |
| nvfp4 weight-only (activations none)  | the same two paths on x as it is (W4A16)                         |
| hadanorm rotation: int8, fp8          | torch centring + rotation, the path above on the rotated input,  |
|                                       | the mean term from the layer's precomputed group row sums        |
| hadanorm rotation: other formats      | torch reference                                                  |
| awq_w4a16, mxfp8 weight-only (mxfp8   | Triton decode of the layer's weight into x's dtype + cuBLAS      |
| unrotated)                            | (`decode_supported`, Format.dequantize_like)                     |
| mxfp8 dynamic (none / convrot /       | [rotation] + Triton MXFP8 act quant-dequant and weight decode,  |
| quarot; hadanorm via hadanorm_linear) | both exact in bf16, + the 16-bit Triton TMA GEMM                 |
| svdquant_w4a4                         | Triton int4 act quant-dequant + Triton residual decode, both in  |
|                                       | the layer's dtype, + a 16-bit Triton TMA GEMM with the SVD branch |
|                                       | (and LoRA) as its initial accumulator (`svdquant_linear`)        |

Rotation (convrot / quarot): x @ H per group as one tensor-core matmul in x's dtype (`rotate`), before
anything else reads x: about one read and one write of x, where the quantize kernel's in-register rotation
cost five times its plain pass (bench/results/linear_speed_h200*.md). Activation quantization: in eager
the Triton kernel, launched directly; under torch.compile the reference's torch ops, which Inductor fuses
into the op that produced x (see `quantize_activations`). Every kernel is a custom op inside torch.compile
(one opaque node) and a direct call in eager (`launcher`).

Activations: "dynamic" and "static" (one calibrated `input_scale` for every row) run the paths
above (the quantize kernel takes the static scale); "none" (weight-only) runs nvfp4's two paths on the
unquantized input (what stock ComfyUI computes on GPUs without FP4 tensor cores); other formats'
weight-only layers never reach this module: Format.weight_only_linear dequantizes and calls F.linear, the
same on every device. nvfp4's fp8 compute (quantize.nvfp4_compute=fp8) decodes its weight to e4m3 per row
(kernels.decode) and runs the fp8 path below.
No module state, no environment switches: each call decides from its arguments. What depends on the device
alone (`DeviceFacts`) a caller may settle once and pass in: a quantized layer does (formats.base.LinearPlan).

LoRA residual (`lora_down` [R, K], `lora_up` [N, R], activation dtype, strengths folded in):
`int8_linear` / `fp8_linear` add `(x @ down^T) @ up^T` (x unrotated) inside the linear. A branch
must read x once more (as large as the layer's whole input), so in eager xa = x @ down^T rides the
quantize's read of x: one kernel reads x for the row amax and the down projection together (per K slice),
and the codes kernel then needs one pass over x, not two (quantize_act with `down`; rotated, it reads the
rotated x against the rotated factor). Under torch.compile xa is one cuBLAS product. int8 adds xa @ up^T in
the GEMM's epilogue (fp32, before the output cast). fp8 on Hopper: the Triton fp8 GEMM starts its accumulator at xa @ up^T (in the
accumulator's units), so the branch costs no pass over y (bench/results/fp8_lora_gemm_h200.md);
elsewhere cuBLAS (no epilogue hook) and an in-place `addmm_` into its output.
Ranks above 128 take the plain quantize and a cuBLAS x @ down^T.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.nn import functional as F

from lowbit_pipe.kernels import reference, rotation

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FUSED_ROTATIONS = ("none", "convrot", "quarot")
# cuBLASLt fp8 (torch._scaled_mm): K and N must be multiples of 16. Very short M (the
# time-embedding linears, M = batch) crashed cuBLAS on the H200 (torchao fp8-row on every
# Linear of Krea 2): those go to the reference, which costs nothing at that size.
FP8_MIN_M = 16


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _gpu_input(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in FLOAT_DTYPES and x.dim() >= 1 and x.shape[-1] > 0


@dataclass(frozen=True)
class DeviceFacts:
    """What the paths below decide from a device alone. torch.cuda.get_device_properties costs host time on
    every eager call, so a quantized layer settles these once for its device and passes them in; None
    (every bare call) decides per call, with the same answers."""
    fp8_triton_gemm: bool  # `fp8_triton_gemm` of an input on this device
    lacks_fp4: bool  # `lacks_fp4` of this device


def device_facts(device: torch.device) -> DeviceFacts:
    """The DeviceFacts of `device`: the same answers as fp8_triton_gemm / lacks_fp4 for an input on it."""
    if device.type != "cuda":
        return DeviceFacts(fp8_triton_gemm=True, lacks_fp4=False)
    major = torch.cuda.get_device_properties(device).major
    return DeviceFacts(fp8_triton_gemm=major == 9, lacks_fp4=major < 10)


# ---------------------------------------------------------------------------
# int8 family: int8_tensorwise, w4a8 / w6a8 (after decode), convrot_w4a4 (int4 codes)
# ---------------------------------------------------------------------------

def int8_supported(x: torch.Tensor, rot: str) -> bool:
    return _gpu_input(x) and rot in FUSED_ROTATIONS


def _lora_pair(x: torch.Tensor, lora_down: torch.Tensor | None, lora_up: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(down, up) in x's dtype, or None without a branch."""
    if (lora_down is None) != (lora_up is None):
        raise ValueError("LoRA branch: lora_down and lora_up go together")
    if lora_down is None:
        return None
    if lora_down.dtype != x.dtype:
        lora_down, lora_up = lora_down.to(x.dtype), lora_up.to(x.dtype)
    return lora_down, lora_up


def compiling() -> bool:
    """Inside torch.compile the kernels are called through their custom ops (one opaque graph node each, with
    a fake impl for shapes); outside, their Python launchers are called directly, since a custom op's
    dispatcher costs host time on every eager call."""
    return torch.compiler.is_compiling()


def launcher(op: Callable, fn: Callable) -> Callable:
    """A kernel's custom op inside torch.compile, its plain launcher (same arguments) in eager."""
    return op if compiling() else fn


def rotate(x2: torch.Tensor, rot: str, group: int | None) -> torch.Tensor:
    """x2 @ H per group as a tensor-core matmul (rotation.rotate_groups), or x2 itself for rot "none"."""
    if rot == "none":
        return x2
    return launcher(rotation.rotate_groups_op, rotation.rotate_groups)(x2, rot, rotation.resolve_group(rot, group))


@dataclass(frozen=True)
class Activations:
    """The A operand of the int8 / fp8 GEMMs: codes [M, K] (int8 for int8 / int4 codes, else float8_e4m3fn),
    fp32 per-token scales [M, 1], and xa = x @ down^T [M, R] (unrotated x, x's dtype) with a LoRA branch."""
    codes: torch.Tensor
    scale: torch.Tensor
    xa: torch.Tensor | None = None


def quantize_activations(x2: torch.Tensor, mode: str, rot: str, group: int | None, static: torch.Tensor | None,
                         down: torch.Tensor | None = None) -> Activations:
    """x2 [M, K] -> Activations for `mode` (int8 / int4 / fp8), per token or with one `static` scale.

    The rotation runs first, on tensor cores (`rotate`); with a LoRA branch its down factor is rotated the same
    way, since x @ down^T = (x H)(down H)^T for the orthogonal, symmetric H. Under torch.compile the
    quantization is the reference's torch ops, which Inductor fuses into the kernel that produced x (a DiT
    block's norm and modulation) instead of reading x once more, and xa is one cuBLAS product. In eager, one
    Triton kernel quantizes, and with a branch (R <= 128) reads x once for both the row amax and xa."""
    from lowbit_pipe.kernels.quantize_act import quantize_act, reference_quantize_act

    xr = rotate(x2, rot, group)
    if compiling():
        codes, scale = reference_quantize_act(xr, mode, static)
        return Activations(codes, scale, F.linear(x2, down) if down is not None else None)
    if down is None:
        return Activations(*quantize_act(xr, mode, static))
    if down.shape[0] > FUSED_DOWN_MAX_R:  # many stacked LoRAs: the plain quantize and one cuBLAS call
        return Activations(*quantize_act(xr, mode, static), F.linear(x2, down))
    return Activations(*quantize_act(xr, mode, static, down=rotate(down, rot, group)))


FUSED_DOWN_MAX_R = 128

# An input several layers read (a DiT block's q / k / v / gate projections, SwiGLU's gate and up) is rotated and
# quantized once per mode, inside a `shared_inputs` scope opened by code that passes that input unchanged to those
# layers (read off that code: lowbit_pipe.attention.comfy_fused for ComfyUI's Krea 2 and Qwen-Image blocks,
# lowbit_pipe.attention.fused for diffusers' Krea 2 attention and SwiGLU). The
# Activations ride on the input tensor object (identity, not the address: storage reused by a later tensor is a
# new object) and the scope takes them off on exit, so nothing outlives the block, and nothing is ever left on a
# tensor the caller holds. Inside the scope the version counter still catches an in-place change (an inference
# tensor, as ComfyUI makes every one, has none: the scope's word stands). Never under torch.compile (Inductor
# fuses the quantization into x's producer), nor with a static scale or a LoRA down factor fused into the pass
# (both belong to one layer).
SHARED_ACTIVATIONS_ATTR = "_lowbit_activations"
SHARED_INPUT_TAG = "_lowbit_shared_input"


def shared_activations(x: torch.Tensor, x2: torch.Tensor, mode: str, rot: str, group: int | None,
                       static: torch.Tensor | None, down: torch.Tensor | None) -> Activations:
    """`quantize_activations(x2, ...)` for x2 = x.reshape(-1, K); inside a `shared_inputs` scope for x, reusing
    what an earlier layer computed from the same, unchanged x with the same mode and rotation."""
    if (down is not None or static is not None or type(x) is not torch.Tensor or compiling()
            or not x.__dict__.get(SHARED_INPUT_TAG)):
        return quantize_activations(x2, mode, rot, group, static, down)
    key = (mode, rot, group, -1 if x.is_inference() else x._version, tuple(x2.shape))
    memo = x.__dict__.get(SHARED_ACTIVATIONS_ATTR)
    if memo is not None and memo[0] == key:
        return memo[1]
    a = quantize_activations(x2, mode, rot, group, None)
    x.__dict__[SHARED_ACTIVATIONS_ATTR] = (key, a)
    return a


@contextmanager
def shared_inputs(*tensors: Any) -> Iterator[None]:
    """Open `tensors` (others in the list: None, non-tensors, tensor subclasses, tensors that need grad are left
    alone) to one activation quantization for all the quantized layers that read them while the scope lasts: for
    a caller whose code passes each unchanged to several layers. On exit the tag and the activations are taken off
    again. A tensor an enclosing scope opened stays that scope's."""
    tagged = [t for t in tensors if type(t) is torch.Tensor and not (t.requires_grad and torch.is_grad_enabled())
              and SHARED_INPUT_TAG not in t.__dict__]
    for t in tagged:
        t.__dict__[SHARED_INPUT_TAG] = True
    try:
        yield
    finally:
        for t in tagged:
            t.__dict__.pop(SHARED_INPUT_TAG, None)
            t.__dict__.pop(SHARED_ACTIVATIONS_ATTR, None)


def sharing_forward(forward: Callable[..., Any], shares: tuple[str, ...], enabled: Callable[[Any], bool],
                    qualname: str) -> Callable[..., Any]:
    """`forward(module, ...)` with its arguments named `shares` (positional or keyword) inside a `shared_inputs`
    scope, in eager where `enabled(module)`; as it is otherwise. For the modules whose code was read to pass those
    arguments unchanged to several quantized layers (lowbit_pipe.attention.fused, .comfy_fused)."""
    params = list(inspect.signature(forward).parameters)[1:]  # after the module
    where = {name: params.index(name) for name in shares}

    def shared(module: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling() or not enabled(module):
            return forward(module, *args, **kwargs)
        inputs = [kwargs[n] if n in kwargs else args[i] if i < len(args) else None for n, i in where.items()]
        with shared_inputs(*inputs):
            return forward(module, *args, **kwargs)

    shared.__qualname__ = shared.__name__ = qualname
    shared.__wrapped__ = forward  # inspect.unwrap: the forward it runs
    return shared


def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                rot: str = "none", group: int | None = None, int4: bool = False,
                lora_down: torch.Tensor | None = None, lora_up: torch.Tensor | None = None,
                input_scale: torch.Tensor | None = None, packed_weight: bool | None = None) -> torch.Tensor:
    """y = quant(rotate(x)) @ w^T with per-token activation scales (or one static `input_scale`);
    returns x.dtype [..., N].

    int4=False: int8 activations, w int8 [N, K]; int4=True: int4 activations (+-7), w packed
    int4 [N, K/2] (low nibble first), or with packed_weight=False int4 codes held in int8 [N, K]
    (convrot_w4a4 prepacked); all through the same int8 tensor-core GEMM; a LoRA branch's
    xa @ up^T runs in the GEMM's epilogue.
    """
    from lowbit_pipe.kernels.int8_gemm import int8_gemm, int8_gemm_op

    x2 = x.reshape(-1, x.shape[-1])
    pair = _lora_pair(x, lora_down, lora_up)
    a = shared_activations(x, x2, "int4" if int4 else "int8", rot, group, input_scale, pair[0] if pair else None)
    lora = {"xa": a.xa, "up_t": pair[1].t()} if pair is not None else {}
    w_mode = 1 if (int4 if packed_weight is None else packed_weight) else 0
    y = launcher(int8_gemm_op, int8_gemm)(a.codes, w, a.scale, w_scale, bias, x.dtype, w_mode, **lora)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def nvfp4_fp8_weight(w_packed: torch.Tensor, w_block: torch.Tensor, w_global: torch.Tensor, row_scale: torch.Tensor,
                     n: int, k: int) -> torch.Tensor:
    """nvfp4's fp8 compute: the weight decoded straight to e4m3 [n, k] under `row_scale` (kernels.decode)."""
    from lowbit_pipe.kernels.decode import nvfp4_decode, nvfp4_decode_op

    decode = launcher(nvfp4_decode_op, nvfp4_decode)
    return decode(w_packed, w_block, w_global.float().reshape(()), n, k, torch.float8_e4m3fn, row_scale)


def grid_decode(tensors: dict[str, torch.Tensor], k: int, bits: int, group_size: int) -> torch.Tensor:
    """w4a8 / w6a8's int8 grid [N, K] decoded by the Triton kernel (formats.w4a8.decode_int8_grid's values)."""
    from lowbit_pipe.kernels.decode import grid_decode_int8, grid_decode_int8_op

    decode = launcher(grid_decode_int8_op, grid_decode_int8)
    return decode(tensors["weight"], tensors["weight_s_rel"], tensors.get("weight_codebook"), k, bits, group_size)


def decode_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton weight decodes of weight-only layers (awq_w4a16, mxfp8): a GPU input in a float dtype, its layer's
    weight on the same device."""
    return _gpu_input(x) and weight.device == x.device


def awq_weight(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """awq_w4a16's weight [N, k] in `dtype` (kernels.decode.awq_decode: formats.awq_w4a16.decode's values)."""
    from lowbit_pipe.kernels.decode import awq_decode, awq_decode_op

    return launcher(awq_decode_op, awq_decode)(weight, scale, zero, k, dtype)


def mxfp8_weight(weight: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mxfp8's (unrotated) weight [N, K] in `dtype` (kernels.decode.mxfp8_decode: dequantize_blocks' values)."""
    from lowbit_pipe.kernels.decode import mxfp8_decode, mxfp8_decode_op

    return launcher(mxfp8_decode_op, mxfp8_decode)(weight, exponents, dtype)


def mxfp8_supported(x: torch.Tensor, weight: torch.Tensor, rot: str) -> bool:
    """mxfp8 dynamic's GPU path: a GPU input in a float dtype, its layer's weight on the same device, a rotation
    the dispatch applies (hadanorm goes through `hadanorm_linear` with "none")."""
    return _gpu_input(x) and weight.device == x.device and rot in FUSED_ROTATIONS


def mxfp8_linear(x: torch.Tensor, weight: torch.Tensor, exponents: torch.Tensor, bias: torch.Tensor | None,
                 rot: str = "none", group: int | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, facts: DeviceFacts | None = None) -> torch.Tensor:
    """mxfp8 with dynamic activations on a GPU without MX tensor cores (Hopper): the activations' MXFP8 fake
    quantization (kernels.act_dequant.mxfp8_act) and the weight's decode (kernels.decode.mxfp8_decode), both
    exact in bf16 (e4m3 codes times powers of two), multiplied on bf16 tensor cores: exact products, an fp32
    sum, so the format's fp32 reference up to the order of that sum. Rotation first, as for the other formats.
    `compute_dtype` fp32 exists for the CPU interpreter tests (its bf16 dot is broken)."""
    from lowbit_pipe.kernels.act_dequant import mxfp8_act, mxfp8_act_op
    from lowbit_pipe.kernels.decode import mxfp8_decode, mxfp8_decode_op
    from lowbit_pipe.kernels.fp8_gemm import float_gemm, float_gemm_op

    k = x.shape[-1]
    x2 = rotate(x.reshape(-1, k), rot, group)
    act = launcher(mxfp8_act_op, mxfp8_act)(x2, compute_dtype)
    w = launcher(mxfp8_decode_op, mxfp8_decode)(weight, exponents, compute_dtype)
    if fp8_triton_gemm(x, facts):
        y = launcher(float_gemm_op, float_gemm)(act, w, bias, x.dtype)
    else:
        y = F.linear(act, w).float()
        y = (y + bias.float() if bias is not None else y).to(x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def svdquant_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """svdquant_w4a4's GPU path: a GPU input in a float dtype, its layer's codes on the same device."""
    return _gpu_input(x) and weight.device == x.device


def svdquant_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], n: int, bias: torch.Tensor | None,
                    lora: tuple[torch.Tensor, torch.Tensor] | None = None,
                    facts: DeviceFacts | None = None) -> torch.Tensor:
    """svdquant_w4a4 on 16-bit tensor cores: the eager contract's two dequantized operands, each formed bit for bit
    by a Triton kernel (activations: kernels.act_dequant.svdquant_act, or under torch.compile the torch reference,
    which Inductor fuses; residual: kernels.decode.svdquant_decode, the layer's weight decoded per call into a
    transient buffer), multiplied with fp32 accumulation; xa = x @ proj_down by cuBLAS and xa @ proj_up^T as the GEMM's
    initial accumulator on Hopper (float_gemm), elsewhere cuBLAS and an in-place addmm_. A LoRA (down [R, K],
    up [N, R]) is concatenated to the SVD branch up to rank 128 in all, else added after. One rounding to the
    output dtype where the eager contract rounds the main product and the branch apart."""
    from lowbit_pipe.kernels.act_dequant import svdquant_act
    from lowbit_pipe.kernels.decode import svdquant_decode, svdquant_decode_op
    from lowbit_pipe.kernels.fp8_gemm import float_gemm, float_gemm_op

    dtype = tensors["weight_scale"].dtype
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(dtype)
    smooth = tensors["weight_smooth_factor"]
    act = reference.svdquant_activations(x2, smooth) if compiling() else svdquant_act(x2, smooth)
    w = launcher(svdquant_decode_op, svdquant_decode)(tensors["weight"], tensors["weight_scale"], k, dtype)
    down_t, up = tensors["weight_proj_down"], tensors["weight_proj_up"]  # [K, R], [N, R]
    if lora is not None and down_t.shape[1] + lora[0].shape[0] <= FUSED_DOWN_MAX_R:
        down_t = torch.cat([down_t, lora[0].t().to(dtype)], dim=1)
        up = torch.cat([up, lora[1].to(dtype)], dim=1)
        lora = None
    xa = x2 @ down_t
    if fp8_triton_gemm(x, facts):
        y = launcher(float_gemm_op, float_gemm)(act, w, bias, x.dtype, xa, up.t())
    else:
        y = F.linear(act, w, bias.to(dtype) if bias is not None else None)
        y = y.addmm_(xa, up.t()).to(x.dtype)
    y = y.reshape(*x.shape[:-1], n)
    return y + reference.low_rank_delta(x, *lora) if lora is not None else y


def hadanorm_linear(x: torch.Tensor, group: int, linear: Callable[[torch.Tensor], torch.Tensor],
                    rowsums: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """hadanorm on the GPU: per-group centring + rotation in torch, then `linear` (a format's fused path with
    rotation "none") on the rotated input, plus the mean term sum_g mu_g * rowsum_g(W) from the layer's row sums
    (Format.derived_tensors: no weight is dequantized per call) and a LoRA branch on the unrotated input."""
    x_rot, mu = rotation.rotate_activation(x, "hadanorm", group)
    y = linear(x_rot.to(x.dtype))
    y = y + rotation.mean_correction(mu, rowsums).to(y.dtype)
    if lora is not None:
        y = y + reference.low_rank_delta(x, *lora)
    return y


# ---------------------------------------------------------------------------
# fp8: per-token (or static) e4m3 activations; Triton fp8 GEMM on Hopper, cuBLAS elsewhere
# ---------------------------------------------------------------------------

def fp8_triton_gemm(x: torch.Tensor, facts: DeviceFacts | None = None) -> bool:
    """The Triton fp8 GEMM: TMA and fp8 wgmma need sm90; measured on the H200 only, so other GPUs
    keep cuBLAS (get_device_properties: torch.compile constant-folds it). CPU tensors reach
    fp8_linear only from the interpreter tests (fp8_supported says no to them). `facts`: x's device's, settled."""
    if facts is not None:
        return facts.fp8_triton_gemm
    return not x.is_cuda or torch.cuda.get_device_properties(x.device).major == 9


def fp8_supported(x: torch.Tensor, w: torch.Tensor, rot: str, facts: DeviceFacts | None = None) -> bool:
    return w.is_contiguous() and fp8_shape_supported(x, *w.shape, rot, facts)


def fp8_shape_supported(x: torch.Tensor, n: int, k: int, rot: str, facts: DeviceFacts | None = None) -> bool:
    """fp8_supported for an [n, k] e4m3 weight made contiguous at call time (nvfp4's fp8 compute decodes one)."""
    if not (_gpu_input(x) and rot in FUSED_ROTATIONS and k % 16 == 0):
        return False
    return fp8_triton_gemm(x, facts) or (n % 16 == 0 and _rows(x) >= FP8_MIN_M)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None,
               bias: torch.Tensor | None, rot: str = "none", group: int | None = None,
               lora_down: torch.Tensor | None = None, lora_up: torch.Tensor | None = None,
               facts: DeviceFacts | None = None) -> torch.Tensor:
    """Hopper: the Triton fp8 GEMM (scales, bias and the LoRA branch inside; any out dtype).
    Elsewhere torch._scaled_mm with row-wise scales (activation [M, 1], weight [1, N]; bf16 out), or
    tensor-wise when both scales are scalars (any out dtype); the weight goes in as w.t(): the
    column-major [K, N] operand cuBLAS wants, without a copy. `facts`: x's device's, settled by the layer."""
    from lowbit_pipe.kernels.fp8_gemm import fp8_gemm, fp8_gemm_op

    k = x.shape[-1]
    n = w.shape[0]
    x2 = x.reshape(-1, k)
    pair = _lora_pair(x, lora_down, lora_up)
    a = shared_activations(x, x2, "fp8", rot, group, input_scale, pair[0] if pair else None)
    q, s, xa = a.codes, a.scale, a.xa
    if fp8_triton_gemm(x, facts):
        y = launcher(fp8_gemm_op, fp8_gemm)(q, w, s, w_scale, bias, x.dtype,
                                            *((xa, pair[1].t()) if pair is not None else ()))
        return y.reshape(*x.shape[:-1], n)
    if input_scale is not None and w_scale.numel() == 1:
        out_dtype = x.dtype
        y = torch._scaled_mm(q, w.t(), scale_a=input_scale.float().reshape(()), scale_b=w_scale.float().reshape(()),
                             out_dtype=out_dtype)
    else:
        ws = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
        y = torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16)  # row-wise: bf16 only
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype)
    if pair is not None:  # the up-projection accumulates into y in place (cuBLAS beta = 1)
        y.addmm_(xa, pair[1].t())
    return y.reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------
# nvfp4: activation emulation + register-decoded weight GEMM
# ---------------------------------------------------------------------------

def nvfp4_supported(x: torch.Tensor, rot: str) -> bool:
    return _gpu_input(x) and rot in FUSED_ROTATIONS


def lacks_fp4(device: torch.device) -> bool:
    """A CUDA GPU without FP4 tensor cores (compute capability below 10: Hopper and older), where stock ComfyUI
    computes nvfp4 layers weight-only. The CPU is not one: there the file's numerics are kept."""
    return device.type == "cuda" and torch.cuda.get_device_properties(device).major < 10


# From this many rows the layer's weight is decoded once into a transient buffer (kernels.decode) for cuBLAS;
# below, the register-decode GEMM reads 4.5 bits per weight instead of 16. H200, 6144 x 6144
# (bench/results/linear_speed_h200_decode.md): the decode adds 0.034 ms to cuBLAS's 0.48 ms at M=4608, while
# the register-decode GEMM takes 0.17 ms at M=256, where cuBLAS alone takes 0.037 ms, so 256 rows go to the
# decode. Fewer rows (time-embedding calls) keep the fused GEMM: not measured below 256.
DECODE_MIN_ROWS = 256


def _nvfp4_product(a: torch.Tensor, w_packed: torch.Tensor, w_block: torch.Tensor, scale: torch.Tensor, n: int,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, row_scale: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """a [M, Kp] @ (e2m1 * block)^T * scale (* row_scale [M] per row, when given) (+ bias) -> out_dtype [M, n], by
    the path M calls for. With row scales the decode path rounds a @ W^T to a's dtype before scaling its rows."""
    from lowbit_pipe.kernels.decode import nvfp4_decode, nvfp4_decode_op
    from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_gemm, nvfp4_gemm_op

    if a.shape[0] < DECODE_MIN_ROWS:
        if row_scale is None:
            return launcher(nvfp4_gemm_op, nvfp4_gemm)(a, w_packed, w_block, scale, n, bias, out_dtype)
        return launcher(nvfp4_gemm_op, nvfp4_gemm)(a, w_packed, w_block, scale, n, bias, out_dtype, row_scale=row_scale)
    w = launcher(nvfp4_decode_op, nvfp4_decode)(w_packed, w_block, scale, n, a.shape[1], a.dtype)
    if row_scale is None:
        return F.linear(a, w, bias.to(a.dtype) if bias is not None else None).to(out_dtype)
    y = F.linear(a, w).float().mul_(row_scale.float().reshape(-1, 1))
    return (y.add_(bias.float()) if bias is not None else y).to(out_dtype)


def nvfp4_linear(x: torch.Tensor, w_packed: torch.Tensor, w_block: torch.Tensor, w_global: torch.Tensor,
                 input_scale: torch.Tensor | None, n: int, bias: torch.Tensor | None, rot: str = "none",
                 group: int | None = None, compute_dtype: torch.dtype = torch.bfloat16,
                 per_tensor: bool = False) -> torch.Tensor:
    """The format's GPU math (rotate, NVFP4 activations, NVFP4 weight) on bf16 tensor cores: both operands are exact
    in bf16 once the global scales are taken out, so only the fp32 accumulation order differs from the reference.
    Activations' global scale: the static `input_scale`, else amax / (6 * 448) of each rotated row (a token's result
    never depends on the other rows), or with `per_tensor` of the whole rotated input (stock ComfyUI's).
    `compute_dtype` fp32 exists for the CPU interpreter tests (its bf16 dot is broken)."""
    from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_act_quant, nvfp4_act_quant_op

    k = x.shape[-1]
    kp = w_packed.shape[1] * 2
    x2 = x.reshape(-1, k)
    x2 = rotate(x2, rot, group)  # the global scales need the amax of the rotated rows first
    w_global = w_global.float().reshape(())
    if input_scale is not None or per_tensor:
        if input_scale is not None:
            gx = input_scale.float().reshape(())
        else:
            amax = torch.linalg.vector_norm(x2, float("inf"), dtype=torch.float32)
            gx = reference.positive_scale(amax, reference.NVFP4_GLOBAL_DIV)
        a = launcher(nvfp4_act_quant_op, nvfp4_act_quant)(x2, gx, kp, compute_dtype)
        y = _nvfp4_product(a, w_packed, w_block, gx * w_global, n, bias, x.dtype)
    else:
        amax = torch.linalg.vector_norm(x2, float("inf"), dim=-1, dtype=torch.float32)
        gx = reference.positive_scale(amax, reference.NVFP4_GLOBAL_DIV)  # [M]
        a = launcher(nvfp4_act_quant_op, nvfp4_act_quant)(x2, gx, kp, compute_dtype)
        y = _nvfp4_product(a, w_packed, w_block, w_global, n, bias, x.dtype, row_scale=gx)
    return y.reshape(*x.shape[:-1], n)


def nvfp4_weight_only_linear(x: torch.Tensor, w_packed: torch.Tensor, w_block: torch.Tensor, w_global: torch.Tensor,
                             n: int, bias: torch.Tensor | None, rot: str = "none", group: int | None = None) -> torch.Tensor:
    """Activations "none": y = x @ (e2m1 * block * global)^T, x in its own dtype (bf16/fp16 tensor cores, fp32 for
    the interpreter tests): stock ComfyUI's numerics on a GPU without FP4 (it dequantizes the weight into x's
    dtype and calls a matmul). 256+ rows: exactly that, the decode being a Triton kernel; fewer: the
    register-decode GEMM, which applies the global scale in fp32 after the accumulation instead."""
    k = x.shape[-1]
    kp = w_packed.shape[1] * 2
    x2 = x.reshape(-1, k)
    x2 = rotate(x2, rot, group)
    if kp != k:
        x2 = F.pad(x2, (0, kp - k))
    y = _nvfp4_product(x2, w_packed, w_block, w_global.float().reshape(()), n, bias, x.dtype)
    return y.reshape(*x.shape[:-1], n)
