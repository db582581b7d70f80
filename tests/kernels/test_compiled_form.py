"""What the GPU compiler makes of kernels whose arithmetic must round as torch's ops round, checked on a CPU.

Triton compiles for the H100 (sm90) without a GPU: the PTX it emits is the program the GPU runs. The interpreter
(tests/kernels/test_kernels.py) cannot see a fused multiply-add: with Triton's default `enable_fp_fusion`, LLVM turns
`bf16(x + bf16(g * y))` into one `fma.rn.bf16` (a single rounding), which on an H100 changed 10 % of the gated
residual's outputs and 28 % of the modulated norm's against torch's ops (bench/results/pytest_modulation_h100_s56.log).
Such kernels launch with `lowbit_pipe.kernels.ROUND_EACH_OP` (no fp fusion).
"""

from __future__ import annotations

import collections

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton's CUDA backend compiles the PTX")


def _ptx_ops(fn, signature: dict[str, str], constexprs: dict[str, object], **launch_options) -> collections.Counter:
    """The PTX instructions (opcode -> count) of `fn` compiled for sm90 with the options its launch passes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                            options=launch_options)
    return collections.Counter(line.split()[0] for line in kernel.asm["ptx"].splitlines()
                               if line.strip() and not line.lstrip().startswith(("//", ".", "{", "}", "$")))


@pytest.mark.parametrize("ty", ["bf16", "fp16"])
def test_the_modulation_kernels_round_each_op(ty):
    """The gated residual and the modulated norm as launched: a multiply and an add per op, no fused multiply-add in
    the 16-bit steps (and the launch options they pass are the ones that make it so: with fusion, an fma appears)."""
    from lowbit_pipe.kernels import ROUND_EACH_OP
    from lowbit_pipe.kernels import norm_rope as R

    gated = {n: f"*{ty}" for n in ("x_ptr", "g_ptr", "y_ptr", "out_ptr")} | dict.fromkeys(("M", "D", "L", "SGB"), "i32")
    norm = {n: f"*{ty}" for n in ("x_ptr", "out_ptr", "mult_ptr", "shift_ptr")} | {"w_ptr": "*fp32"}
    norm |= dict.fromkeys(("M", "D", "N1", "N2", "SX0", "SX1", "SX2", "L", "SMB", "SSB"), "i32")
    norm |= {"eps": "fp32", "offset": "fp32"}
    modulate = dict(WEIGHT=True, ROUND_FIRST=False, STRIDED=False, MODULATE=True, BLOCK_M=1, BLOCK_D=256)
    half_fma = f"fma.rn.{ty.replace('fp', 'f')}"
    for fn, sig, cx in ((R._gated_residual_kernel, gated, dict(BLOCK_M=16, BLOCK_D=256)),
                        (R._rms_norm_kernel, norm, modulate)):
        ops = _ptx_ops(fn, sig, cx, **ROUND_EACH_OP)
        assert not any(op.startswith("fma") for op in ops), (fn.__name__, ty, sorted(ops.items()))
        assert any(op.startswith("mul.rn") for op in ops) and any(op.startswith("add.rn") for op in ops), ops
        fused = _ptx_ops(fn, sig, cx, enable_fp_fusion=True)
        assert any(op.startswith(("fma.rn.f32", half_fma)) for op in fused), (fn.__name__, ty, "the check sees fmas")


@pytest.mark.parametrize("ty", ["bf16", "fp16"])
def test_the_awq_decode_rounds_the_product_before_the_zero(ty):
    """awq_decode's `(u - 8) * scale + zero`, each op rounded to the scales' dtype as formats.awq_w4a16.decode's torch
    ops round: the product (up to 11 significant bits) rounded before the zero is added. Triton 3.9 with fp fusion
    contracts the two into one fma.rn.bf16 / f16 (the GPU test passed bit-exact with Triton 3.6 on the H200)."""
    from lowbit_pipe.kernels import ROUND_EACH_OP
    from lowbit_pipe.kernels import decode as D

    sig = {"w_ptr": "*u8", "s_ptr": f"*{ty}", "z_ptr": f"*{ty}", "out_ptr": f"*{ty}"}
    sig |= dict.fromkeys(("N", "K", "stride_wn", "stride_sg", "stride_on"), "i32")
    cx = dict(AWQ=True, GROUP=64, BLOCK_N=D.BLOCK_N, BLOCK_K=D.BLOCK_K)
    ops = _ptx_ops(D._int4_group_decode_kernel, sig, cx, **ROUND_EACH_OP)
    assert not any(op.startswith("fma") for op in ops), (ty, sorted(ops.items()))
    assert any(op.startswith("mul.rn") for op in ops) and any(op.startswith("add.rn") for op in ops), ops
