"""The GPU kernels on a real GPU (skipped without CUDA; run on the device machine:
`python3 -m pytest -q tests/test_gpu_kernels.py`). The interpreter tests check the same kernels'
logic on the CPU; these check what only the hardware does: TMA loads with zero padding, fp8 wgmma
with fast accumulation, the branch as the initial accumulator, short calls (M=1), and the bf16
Hadamard dots on the tensor cores, whose fused-down and plain row amax must still be bit-equal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _hopper() -> bool:
    from lowbit_pipe.kernels import dispatch

    return dispatch.fp8_triton_gemm(torch.empty(1, device="cuda"))


@pytest.mark.parametrize("m,k,n", [(1, 96, 72), (40, 1024, 200), (300, 2048, 768), (1500, 256, 4096)])
def test_fp8_gemm_matches_the_oracle(m, k, n):
    if not _hopper():
        pytest.skip("the Triton fp8 GEMM runs on sm90")
    from lowbit_pipe.kernels.fp8_gemm import fp8_gemm, reference_fp8_gemm

    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    a = (torch.randn(m, k, device="cuda", generator=gen) * 60).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 60).to(torch.float8_e4m3fn)
    a_s = (torch.rand(m, 1, device="cuda", generator=gen) + 0.5) * 1e-3
    w_row = (torch.rand(n, 1, device="cuda", generator=gen) + 0.5) * 1e-2
    bias = torch.randn(n, device="cuda", generator=gen)
    xa = torch.randn(m, 24, device="cuda", generator=gen)
    up = torch.randn(n, 24, device="cuda", generator=gen) * 0.1
    for w_scale in (w_row, torch.tensor(3e-3, device="cuda")):
        ref = reference_fp8_gemm(a, w, a_s, w_scale, bias)
        # fast accumulation: ~1e-3 of |y| at these K (2.4e-3 at K=6144 on the H200)
        assert _rel(fp8_gemm(a, w, a_s, w_scale, bias, torch.float32), ref) < 4e-3
        assert _rel(fp8_gemm(a, w, a_s, w_scale, bias, torch.bfloat16), ref) < 6e-3
        ref_l = reference_fp8_gemm(a, w, a_s, w_scale, bias, torch.float32, xa, up.t())
        y = fp8_gemm(a, w, a_s, w_scale, bias, torch.float32, xa, up.t())
        assert _rel(y, ref_l) < 4e-3
        # the branch alone: the same GEMM without it, subtracted (fp32 factors: exact products)
        delta = y - fp8_gemm(a, w, a_s, w_scale, bias, torch.float32)
        assert _rel(delta, xa @ up.t()) < 2e-2


@pytest.mark.parametrize("rot,gran,static,dtype", [("none", "tensor", False, torch.bfloat16),
                                                   ("convrot", "row", False, torch.bfloat16),
                                                   ("none", "tensor", True, torch.float32),
                                                   ("none", "row", False, torch.float16)])
def test_fp8_linear_with_branch_equals_unfused(rot, gran, static, dtype):
    """QuantLinear(fp8) + LoraStack on the GPU path vs the format's linear + the unfused branch."""
    from lowbit_pipe.formats import FormatSpec
    from lowbit_pipe.lora.branches import LoraBranch, LoraStack
    from lowbit_pipe.nn import QuantLinear

    gen = torch.Generator().manual_seed(3)
    k, n, rank = 1024, 768, 24
    linear = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    q = QuantLinear.from_linear(linear, FormatSpec("fp8", rotation=rot, granularity=gran))
    if static:
        qw = q.format.attach_input_scale(q.qweight, 4.0)
        q.register_buffer("input_scale", qw.tensors["input_scale"])
        q._quant_names = q._quant_names + ("input_scale",)
    q = q.to("cuda", dtype)
    stack = LoraStack(k, n)
    stack.branches = (LoraBranch("a", torch.randn(rank, k, generator=gen) * 0.05, torch.randn(n, rank, generator=gen) * 0.05,
                                 alpha=8.0, strength=0.7),)
    stack.to("cuda", dtype)
    for shape in ((2, 150, k), (1, k)):  # tokens, and one row (the time-embedding case)
        x = torch.randn(*shape, generator=gen).to("cuda", dtype)
        with torch.inference_mode():
            base = q(x)
            unfused = (q.format.linear(x, q.qweight, q.bias) + stack(x)).float()
            q.add_module("lora", stack)
            y = q(x)
            del q.lora
        assert y.shape == base.shape == x.shape[:-1] + (n,) and y.dtype == dtype
        assert _rel(y.float(), unfused) < 5e-3
        # removing the branch gives back the layer's own output, bit for bit
        with torch.inference_mode():
            assert torch.equal(q(x), base)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rot,group", [("none", None), ("convrot", 256), ("quarot", 128)])
def test_quantize_with_down_equals_plain(rot, group, dtype):
    """quantize_act with a LoRA `down` (slice kernel + one-pass codes kernel): scales and codes equal
    the plain call's bit for bit on the hardware too (tensor-core rotation dots included), for
    several slice-kernel shapes; xa against cuBLAS."""
    from torch.nn import functional as F

    from lowbit_pipe.kernels.quantize_act import quantize_act

    gen = torch.Generator(device="cuda").manual_seed(11)
    m, k = 1000, 4096  # M not a multiple of the 64-row blocks
    x = (torch.randn(m, k, device="cuda", generator=gen) * 2).to(dtype)
    x[::97, ::301] = 40.0  # outliers
    down = (torch.randn(32, k, device="cuda", generator=gen) * 0.02).to(dtype)
    xa_ref = F.linear(x.float(), down.float())
    for mode, static in (("int8", None), ("fp8", None), ("int4", torch.tensor(0.05, device="cuda"))):
        q0, s0 = quantize_act(x, mode, rot, group, static_scale=static)
        # 128-row slice blocks of 256-column rotation groups do not fit the H200's shared memory
        big = [{"DOWN_BLOCK_M": 128, "down_warps": 8}] if rot == "none" else []
        for cfg in [{}, {"DOWN_BLOCK_M": 16}, {"DOWN_BLOCK_M": 32, "DOWN_SLICE": 1024}] + big:
            q1, s1, xa = quantize_act(x, mode, rot, group, static_scale=static, down=down, config=cfg)
            what = f"{mode} static={static is not None} {cfg}"
            assert torch.equal(s0, s1), f"{what}: {int((s0 != s1).sum())} row scales differ"
            assert torch.equal(q0.view(torch.int8), q1.view(torch.int8)), f"{what}: codes differ"
            assert _rel(xa.float(), xa_ref) < (1e-5 if dtype == torch.float32 else 1e-2), what


@pytest.mark.parametrize("rot,group", [("none", None), ("convrot", 256), ("quarot", 128)])
def test_static_int_scale_matches_the_reference(rot, group):
    """int8 / int4 with one static per-tensor scale: clamp(rne(x_rot / s)) as the torch oracle; exact
    without rotation, a code off by one where the fp32 rotation sums differ in the last bit."""
    from lowbit_pipe.kernels.quantize_act import quantize_act, reference_quantize_act

    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(300, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    for mode in ("int8", "int4"):
        static = torch.tensor(0.03 if mode == "int8" else 0.4, device="cuda")
        q, s = quantize_act(x, mode, rot, group, static_scale=static)
        qr, sr = reference_quantize_act(x, mode, rot, group, static_scale=static)
        assert torch.equal(s, sr) and s.shape == (300, 1)
        diff = (q.int() - qr.int()).abs()
        if rot == "none":
            assert int(diff.max()) == 0, f"{mode}: {int((diff > 0).sum())} codes differ"
        else:
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3, f"{mode} {rot}"
