"""Triton kernels vs the torch reference, on the CPU under TRITON_INTERPRET=1.

The interpreted cases run in ONE child process (`python tests/kernels/test_kernels.py CASE...`, started
once per module for the selected cases), so the interpreter variable is set before triton and the
kernel modules are imported and never leaks into the other tests, and torch is imported once
rather than once per case. The child reports each case's result and time; each parametrization
checks its own. Small shapes, large blocks: the interpreter runs every program of the grid in
Python, so its cost grows with the number of programs. Interpreter traps handled here:
- bf16 tl.dot returns garbage: rotation and NVFP4 GEMM cases use fp32 operands;
- the fp32 -> fp8e4nv cast mis-rounds ~2% of values (some by a whole binade): fp8 codes
  are compared through their bit patterns with a 5% mismatch budget (the GPU run in
  bench/linear_speed.py checks the real cast against the reference);
- the fp32 -> bf16 store cast does not round to nearest: one bf16 ulp of tolerance;
- triton 3.6's interpreter does `int(ndarray)` on 1-element arrays for `range(0, K, BK)`
  with a runtime K, which numpy >= 2.4 refuses: the child patches that one conversion.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout (not conftest's: this file also runs as a script)
CASES = ("int8_gemm", "int8_lora", "quantize_down", "fp8_gemm", "quantize_act", "nvfp4", "nvfp4_rows", "decode", "svdquant",
         "mxfp8", "formats", "compile", "attention8", "norm_rope", "shared_activations")
CHILD_TIMEOUT_S = 600


def _run_cases(cases: list[str]) -> dict[str, tuple[bool, float, str]]:
    """Run `cases` in one interpreter child: {case: (passed, seconds, its output or the child's)}."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, __file__, *cases], capture_output=True, text=True, env=env,
                          timeout=CHILD_TIMEOUT_S)
    results, block = {}, []
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            _, case, status, secs = line.split()
            results[case] = (status == "OK", float(secs), "\n".join(block))
            block = []
        else:
            block.append(line)
    died = f"child exited {proc.returncode} before reporting:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {case: results.get(case, (False, 0.0, died)) for case in cases}


@pytest.fixture(scope="module")
def interpreted(request) -> dict[str, tuple[bool, float, str]]:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    wanted = [c for c in CASES if any(getattr(item, "function", None) is test_kernel_interpreted
                                      and item.callspec.params.get("case") == c for item in request.session.items)]
    return _run_cases(wanted or list(CASES))


@pytest.mark.parametrize("case", CASES)
def test_kernel_interpreted(case, interpreted):
    passed, secs, output = interpreted[case]
    print(f"{case}: {secs:.2f} s in the interpreter child")
    assert passed, f"case {case} failed:\n{output}"


def test_fake_impls_give_shapes():
    """The custom ops' fake impls (what torch.compile traces) need no kernel and no GPU."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowbit_pipe.kernels.int8_gemm import int8_gemm_op
    from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_act_quant_op, nvfp4_gemm_op
    from lowbit_pipe.kernels.rotation import rotate_groups_op

    with FakeTensorMode():
        x = torch.empty(8, 256)
        assert rotate_groups_op(x, "convrot", 256).shape == (8, 256)
        s = torch.empty(8, 1)
        w = torch.empty(24, 128, dtype=torch.int8)
        y = int8_gemm_op(torch.empty(8, 256, dtype=torch.int8), w, s, torch.empty(24), None, torch.bfloat16, 1)
        assert y.shape == (8, 24) and y.dtype == torch.bfloat16
        y = int8_gemm_op(torch.empty(8, 256, dtype=torch.int8), w, s, torch.empty(24), None, torch.bfloat16, 1,
                         torch.empty(8, 32, dtype=torch.bfloat16), torch.empty(32, 24, dtype=torch.bfloat16))
        assert y.shape == (8, 24) and y.dtype == torch.bfloat16
        a = nvfp4_act_quant_op(x, torch.empty(()), 256, torch.bfloat16)
        assert a.shape == (8, 256)
        y = nvfp4_gemm_op(a, torch.empty(32, 128, dtype=torch.uint8), torch.empty(128, 16, dtype=torch.float8_e4m3fn),
                          torch.empty(()), 30, None, torch.float16)
        assert y.shape == (8, 30) and y.dtype == torch.float16
        from lowbit_pipe.kernels.fp8_gemm import fp8_gemm_op

        y = fp8_gemm_op(torch.empty(8, 256, dtype=torch.float8_e4m3fn), torch.empty(24, 256, dtype=torch.float8_e4m3fn),
                        s, torch.empty(24), None, torch.float16, torch.empty(8, 32), torch.empty(32, 24))
        assert y.shape == (8, 24) and y.dtype == torch.float16
        from lowbit_pipe.kernels.decode import awq_decode_op, mxfp8_decode_op

        y = awq_decode_op(torch.empty(24, 64, dtype=torch.int8), torch.empty(2, 24, dtype=torch.bfloat16),
                          torch.empty(2, 24, dtype=torch.bfloat16), 128, torch.float16)
        assert y.shape == (24, 128) and y.dtype == torch.float16
        y = mxfp8_decode_op(torch.empty(32, 64, dtype=torch.float8_e4m3fn), torch.empty(128, 4, dtype=torch.uint8),
                            torch.bfloat16)
        assert y.shape == (32, 64) and y.dtype == torch.bfloat16


def test_cpu_inputs_take_the_reference():
    """On CPU tensors every family says 'not supported': the formats run their reference."""
    from lowbit_pipe.kernels import dispatch

    x = torch.randn(32, 64)
    assert not dispatch.int8_supported(x, "none")
    assert not dispatch.fp8_supported(x, torch.empty(48, 64), "none")
    assert not dispatch.nvfp4_supported(x, "none")


# ---------------------------------------------------------------------------
# child side: runs under TRITON_INTERPRET=1
# ---------------------------------------------------------------------------

def _patch_interpreter_index() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    err = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol}"


def _tol(rotation: str) -> float:
    """Linear output vs the format's reference: 1e-5, or 3e-4 when rotating -- the kernel's and torch's
    fp32 rotation sums may differ in the last bit, moving a code by one (~7e-5 each at these shapes)."""
    return 1e-5 if rotation in ("none", None) else 3e-4


def _fp8_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance between e4m3 codes through their bit patterns (99 for a sign flip)."""
    ia, ib = a.view(torch.uint8).int(), b.view(torch.uint8).int()
    sign = ((ia ^ ib) & 0x80) != 0
    return torch.where(sign & ((ia & 0x7F) + (ib & 0x7F) > 1), torch.full_like(ia, 99), ((ia & 0x7F) - (ib & 0x7F)).abs())


def case_int8_gemm() -> None:
    from lowbit_pipe.formats import common
    from lowbit_pipe.kernels.int8_gemm import int8_gemm, reference_int8_gemm

    gen = torch.Generator().manual_seed(0)
    m, k, n = 32, 96, 48  # K not a multiple of BLOCK_K=64: exercises the K mask
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    a_s = torch.rand(m, 1, generator=gen) + 0.5
    w_row = torch.rand(n, 1, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64}
    for w_scale in (w_row, torch.tensor(0.37)):
        for b in (None, bias):
            y = int8_gemm(a, w, a_s, w_scale, b, torch.float32, 0, cfg)
            ref = reference_int8_gemm(a, w, a_s, w_scale, b)
            _close(y, ref, 1e-6, "int8 fp32 out")
    for dt in (torch.bfloat16, torch.float16):
        small = a_s * 1e-3  # keep fp16 outputs finite
        y = int8_gemm(a, w, small, w_row, bias, dt, 0)  # default: the interpreter config
        assert y.dtype == dt
        # one output ulp (the interpreter's fp32 -> bf16 store cast does not round to nearest)
        _close(y, reference_int8_gemm(a, w, small, w_row, bias, torch.float32), 8e-3 if dt == torch.bfloat16 else 1e-3,
               f"int8 {dt} out")
    codes = torch.randint(-7, 8, (n, k), generator=gen)
    packed = common.pack_nibbles(codes, even_high=False).view(torch.int8)
    a4 = torch.randint(-7, 8, (m, k), dtype=torch.int8, generator=gen)
    y = int8_gemm(a4, packed, a_s, w_row.reshape(n), bias, torch.float32, 1, cfg)
    _close(y, reference_int8_gemm(a4, packed, a_s, w_row, bias, torch.float32, 1), 1e-6, "packed int4")
    ref = (a4.long() @ codes.long().t()).float() * a_s * w_row.reshape(1, n) + bias
    _close(y, ref, 1e-6, "packed int4 vs unpacked")
    # the TMA kernel (Hopper's path for int8 weights): K=96 is not a multiple of BLOCK_K=64, so the descriptors'
    # zero padding carries the ragged tail, with the low-rank epilogue too
    tma_cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    xa, up_t = torch.randn(m, 8, generator=gen), torch.randn(8, n, generator=gen) * 0.1
    for w_scale in (w_row, torch.tensor(0.37)):
        for b in (None, bias):
            y = int8_gemm(a, w, a_s, w_scale, b, torch.float32, 0, tma_cfg, tma=True)
            _close(y, reference_int8_gemm(a, w, a_s, w_scale, b), 1e-6, "int8 TMA")
    y = int8_gemm(a, w, a_s, w_row, bias, torch.float32, 0, tma_cfg, xa, up_t, tma=True)
    _close(y, reference_int8_gemm(a, w, a_s, w_row, bias, torch.float32, 0, xa, up_t), 1e-6, "int8 TMA + lora")
    for bad, w_mode, what in (((a[:, :40], w[:, :40]), 0, "K=40"), ((a4, packed), 1, "w_mode 1")):
        try:
            int8_gemm(*bad, a_s, w_row, None, torch.float32, w_mode, tma=True)
        except ValueError as e:
            assert "TMA" in str(e) and what in str(e), e
        else:
            raise AssertionError(f"int8_gemm took {what} through TMA")


def case_int8_lora() -> None:
    """Low-rank epilogue of the int8 GEMM (fp32 factors: the interpreter's bf16 dot is broken) vs the
    unfused reference, and dispatch.int8_linear(lora_down, lora_up) vs the format's linear + the branch."""
    from torch.nn import functional as F

    from lowbit_pipe.formats import FormatSpec, common, get_format
    from lowbit_pipe.kernels import dispatch
    from lowbit_pipe.kernels.int8_gemm import int8_gemm, reference_int8_gemm

    gen = torch.Generator().manual_seed(5)
    m, k, n = 40, 96, 48  # M, N not multiples of the 64 / 32 tiles: row / column masks
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    a_s = (torch.rand(m, 1, generator=gen) + 0.5) * 1e-3
    w_row = torch.rand(n, 1, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64}  # 2 programs
    for r in (8, 20, 32):  # R padded to 16 / 32 (masked), and exact
        xa = torch.randn(m, r, generator=gen)
        up = torch.randn(n, r, generator=gen) * 0.1  # up_t as the transposed view, like the dispatch passes it
        for b in (None, bias):
            y = int8_gemm(a, w, a_s, w_row, b, torch.float32, 0, cfg, xa, up.t())
            ref = reference_int8_gemm(a, w, a_s, w_row, b, torch.float32, 0, xa, up.t())
            _close(y, ref, 1e-6, f"int8 + lora r={r}")
            unfused = reference_int8_gemm(a, w, a_s, w_row, b) + xa @ up.t()
            _close(y, unfused, 1e-6, f"int8 + lora r={r} vs unfused")
    y = int8_gemm(a, w, a_s, w_row, bias, torch.bfloat16, 0, None, xa, up.t().contiguous())
    _close(y, reference_int8_gemm(a, w, a_s, w_row, bias, torch.float32, 0, xa, up.t()), 8e-3, "int8 + lora bf16 out")
    x = torch.randn(2, 20, 512, generator=gen)
    wf = torch.randn(n, 512, generator=gen) * 0.02
    down, upf = torch.randn(32, 512, generator=gen) * 0.01, torch.randn(n, 32, generator=gen) * 0.01
    for spec in (FormatSpec("int8"), FormatSpec("int8", rotation="convrot")):
        fmt = get_format("int8")
        q = fmt.quantize(wf, spec)
        kind, group = common.record_rotation(q.record, q.format)
        ref = fmt.linear(x, q, bias) + F.linear(F.linear(x, down), upf)  # CPU: reference + unfused branch
        assert torch.equal(fmt.linear(x, q, bias, lora=(down, upf)), ref)  # CPU fallback: exactly the old path
        t = q.tensors
        y = dispatch.int8_linear(x, t["weight"], t["weight_scale"], bias, kind, group, lora_down=down, lora_up=upf)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        # the branch alone: the same kernels without it (same codes) plus the unfused branch
        base = dispatch.int8_linear(x, t["weight"], t["weight_scale"], bias, kind, group)
        _close(y, base + F.linear(F.linear(x, down), upf), 1e-6, f"int8 {spec.rotation} fused lora vs base + branch")
        _close(y, ref, _tol(kind), f"int8 {spec.rotation} fused lora")


def case_shared_activations() -> None:
    """Layers reading one input quantize it once inside a `shared_inputs` scope (dispatch.shared_activations): each
    layer's output equal to its own quantization's, one pass per (input version, mode, rotation), a new one after
    an in-place change through a view, none for a LoRA layer, none outside a scope (an input the caller holds keeps
    nothing), and nothing left on the input when the scope closes, inference tensors included."""
    from torch.nn import functional as F

    from lowbit_pipe.kernels import dispatch
    from lowbit_pipe.kernels import quantize_act as qa

    gen = torch.Generator().manual_seed(11)
    n, k = 48, 96
    x = torch.randn(2, 20, k, generator=gen)
    layers = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
               torch.rand(n, 1, generator=gen) * 1e-2 + 1e-3) for _ in range(3)]
    calls = []
    real = qa.quantize_act

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def run(inp, rot="none", group=None):
        return [dispatch.int8_linear(inp, w, s, None, rot, group) for w, s in layers]

    def left(t):
        return [key for key in t.__dict__ if key.startswith("_lowbit")]

    qa.quantize_act = counted
    try:
        own = run(x)  # outside a scope: every layer for itself, nothing kept on x
        assert len(calls) == 3 and not left(x), (calls, left(x))
        calls.clear()
        with dispatch.shared_inputs(x, None, 3):
            shared = run(x)
            assert len(calls) == 1, calls
            for got, want in zip(shared, own):
                assert torch.equal(got, want)
            calls.clear()
            rotated = run(x, "convrot", 16)  # another rotation: its own pass, then shared
            assert len(calls) == 1 and not torch.equal(rotated[0], shared[0]), calls
            for got, (w, s) in zip(rotated, layers):
                assert torch.equal(got, dispatch.int8_linear(x.clone(), w, s, None, "convrot", 16))
            calls.clear()
            run(x)
            assert len(calls) == 1, calls  # one entry per tensor, the last: back to no rotation is a new pass
            calls.clear()
            x.view(-1)[0] += 1.0  # in place, through a view: the version counter moves
            changed = run(x)
            assert len(calls) == 1, calls
            for got, (w, s) in zip(changed, layers):
                assert torch.equal(got, dispatch.int8_linear(x.clone(), w, s, None))
            calls.clear()
            down, up = torch.randn(8, k, generator=gen) * 0.1, torch.randn(n, 8, generator=gen) * 0.1
            w, s = layers[0]
            y = dispatch.int8_linear(x, w, s, None, lora_down=down, lora_up=up)
            assert len(calls) == 1, calls  # a LoRA branch's pass reads its own down factor: never shared
            _close(y, changed[0] + F.linear(F.linear(x, down), up), 1e-5, "shared input + LoRA branch")
        assert not left(x), left(x)
        with torch.inference_mode():  # ComfyUI's tensors: no version counter, the scope's word stands
            xi = x.clone()
            calls.clear()
            run(xi)
            assert len(calls) == 3, calls
            calls.clear()
            with dispatch.shared_inputs(xi):
                for got, want in zip(run(xi), changed):
                    assert torch.equal(got, want)
                assert len(calls) == 1, calls
            assert not left(xi), left(xi)
    finally:
        qa.quantize_act = real


def case_quantize_down() -> None:
    """quantize_act with a LoRA `down` (slice kernel + one-pass codes kernel) against the plain call:
    scales and codes EQUAL, bit for bit, dynamic and static, across slice / block shapes (the row amax is
    max |x|, exact in any chunking); xa against x @ down^T."""
    from lowbit_pipe.kernels.quantize_act import quantize_act

    gen = torch.Generator().manual_seed(6)

    def same(plain, fused, what):
        (q0, s0), (q1, s1) = plain, fused[:2]
        assert torch.equal(s0, s1), f"{what}: scales differ in {int((s0 != s1).sum())} rows"
        assert torch.equal(q0.view(torch.int8), q1.view(torch.int8)), f"{what}: codes differ"

    # M not a multiple of the 16 / 64 rows, K of the 128 chunk / 2048 slice. The plain calls take
    # 16-row programs, the fused ones 8 (the interpreter's time grows with the programs)
    xq = torch.randn(36, 520, generator=gen) * 2
    xq[4, 9] = 30.0
    dq = torch.randn(8, 520, generator=gen) * 0.1
    one_slice = {"BLOCK_M": 8}  # the default slice kernel: one 64-row block, one K slice
    ragged = {"DOWN_BLOCK_M": 32, "DOWN_BLOCK_K": 64, "DOWN_SLICE": 192, "BLOCK_M": 8}  # 2 x 3 blocks, ragged
    st = torch.tensor(0.05)
    for mode, static in (("int8", None), ("int8", st), ("int4", st), ("fp8", None), ("fp8", st)):
        plain = quantize_act(xq, mode, static_scale=static, config={"BLOCK_M": 16})
        for cfg, d in ((ragged, dq.t().contiguous().t()), (one_slice, dq)):  # down stored as [K, R] / [R, K]
            if cfg is one_slice and (mode, static) not in (("int8", None), ("fp8", st)):
                continue
            fused = quantize_act(xq, mode, static_scale=static, down=d, config=cfg)
            same(plain, fused, f"{mode} static={static} {cfg}")
            _close(fused[2], xq @ dq.t(), 1e-6, f"xa {mode} static={static} {cfg}")
    xb = xq.bfloat16()  # bf16 codes (xa skipped: the interpreter's bf16 dot is the garbage one)
    same(quantize_act(xb, "int8", config={"BLOCK_M": 16}), quantize_act(xb, "int8", down=dq, config=ragged), "int8 bf16")
    try:
        quantize_act(xq, "int8", down=dq, config={"DOWN_BLOCK_M": 8})
    except ValueError as e:
        assert "DOWN_BLOCK_M" in str(e), e
    else:
        raise AssertionError("an 8-row slice block was accepted")


def case_fp8_gemm() -> None:
    """Triton fp8 GEMM (TMA: ragged M, N and K come back zero-padded) vs the float64 oracle, with the
    branch as the initial accumulator; then dispatch.fp8_linear with a branch against the same linear
    without one (same activation codes, so their difference is the branch alone)."""
    from torch.nn import functional as F

    from lowbit_pipe.formats import FormatSpec, common, get_format
    from lowbit_pipe.kernels import dispatch
    from lowbit_pipe.kernels.fp8_gemm import fp8_gemm, reference_fp8_gemm

    gen = torch.Generator().manual_seed(7)
    m, k, n = 40, 96, 72  # none a multiple of the 64 tiles
    a = (torch.randn(m, k, generator=gen) * 60).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=gen) * 60).to(torch.float8_e4m3fn)
    a_s = (torch.rand(m, 1, generator=gen) + 0.5) * 1e-3
    w_row = torch.rand(n, 1, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    cfg = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}  # 2 programs
    for w_scale in (w_row, torch.tensor(0.37)):
        for b in (None, bias):
            for promote in (0, 2):
                y = fp8_gemm(a, w, a_s, w_scale, b, torch.float32, config=cfg, promote=promote)
                _close(y, reference_fp8_gemm(a, w, a_s, w_scale, b), 1e-6, f"fp8 promote={promote}")
    for r in (8, 20, 32):
        xa = torch.randn(m, r, generator=gen)
        up = torch.randn(n, r, generator=gen) * 0.1  # up_t as the transposed view, like the dispatch passes it
        for w_scale in (w_row, torch.tensor(0.37)):
            y = fp8_gemm(a, w, a_s, w_scale, bias, torch.float32, xa, up.t(), config=cfg)
            _close(y, reference_fp8_gemm(a, w, a_s, w_scale, bias, torch.float32, xa, up.t()), 1e-6, f"fp8 + lora r={r}")
    y = fp8_gemm(a, w, a_s, w_row, bias, torch.bfloat16, xa, up.t().contiguous())  # default (short-M) launch shape
    assert y.dtype == torch.bfloat16
    _close(y, reference_fp8_gemm(a, w, a_s, w_row, bias, torch.float32, xa, up.t()), 8e-3, "fp8 + lora bf16 out")
    for bad, what in (((a[:, :40], w[:, :40]), "K=40"), ((a.view(torch.int8), w), "float8_e4m3fn")):
        try:
            fp8_gemm(*bad, a_s, w_row)
        except ValueError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"fp8_gemm accepted {what}")

    x = torch.randn(2, 20, 512, generator=gen)
    wf = torch.randn(n, 512, generator=gen) * 0.02
    down, upf = torch.randn(32, 512, generator=gen) * 0.05, torch.randn(n, 32, generator=gen) * 0.05
    fmt = get_format("fp8")
    for spec in (FormatSpec("fp8"), FormatSpec("fp8", granularity="tensor", rotation="convrot")):
        q = fmt.quantize(wf, spec)
        kind, group = common.record_rotation(q.record, q.format)
        t = q.tensors
        for static in (None, torch.tensor(0.02)):
            base = dispatch.fp8_linear(x, t["weight"], t["weight_scale"], static, bias, kind, group)
            y = dispatch.fp8_linear(x, t["weight"], t["weight_scale"], static, bias, kind, group,
                                    lora_down=down, lora_up=upf)
            assert y.shape == (2, 20, n) and y.dtype == x.dtype
            _close(y - base, F.linear(F.linear(x, down), upf), 1e-5, f"fp8 {spec.rotation} branch, static={static}")
            # the interpreter's fp8 cast mis-rounds some activation codes: a loose check of the wiring
            ref = fmt.linear(x, q if static is None else fmt.attach_input_scale(q, 0.02 * 448), bias)
            _close(base, ref, 5e-2, f"fp8 {spec.rotation} GEMM vs the format's reference, static={static}")


def case_quantize_act() -> None:
    from lowbit_pipe.kernels.quantize_act import quantize_act, reference_quantize_act

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 512, generator=gen) * 3
    x[3] = 0.0  # all-zero row: scale rules (eps / 1)
    x[5, 7] = 40.0  # outlier
    for mode in ("int8", "int4", "fp8"):
        for dtype in (torch.float32, torch.bfloat16):
            xi = x.to(dtype)
            q, s = quantize_act(xi, mode, config={"BLOCK_M": 16})
            qr, sr = reference_quantize_act(xi, mode)
            _close(s, sr, 1e-6, f"{mode}/{dtype} scale")
            if mode == "fp8":
                # the interpreter's fp8 cast mis-rounds ~2% of values (some by a binade): a budget
                assert float((_fp8_steps(q, qr) > 0).float().mean()) < 0.05, f"{mode} codes"
            else:
                assert torch.equal(q, qr), f"{mode}/{dtype} codes: {int((q != qr).sum())} differ"
    static = torch.tensor(0.05)
    q, s = quantize_act(x, "fp8", static_scale=static)
    qr, _ = reference_quantize_act(x, "fp8", static_scale=static)
    assert float((_fp8_steps(q, qr) > 0).float().mean()) < 0.05 and torch.all(s == 0.05)

    # static per-tensor scale, int8 / int4: codes = clamp(rne(x / s), +-qmax), EXACTLY the
    # reference's. Small s: many codes clamp, many land on .5 ties (x = 3 * 2^-5 with s = 2^-4).
    xi = (torch.randint(-40, 41, (20, 512), generator=gen) * 2.0**-5)
    xi[:, :8] = torch.tensor([3, -3, 5, -5, 1, -1, 7, -7]) * 2.0**-5  # exact ties 1.5, 2.5, 0.5, 3.5
    for mode in ("int8", "int4"):
        for static in (torch.tensor(2.0**-4), torch.tensor(0.0371)):
            for dtype in (torch.float32, torch.bfloat16):
                q, s = quantize_act(xi.to(dtype), mode, static_scale=static)
                qr, sr = reference_quantize_act(xi.to(dtype), mode, static_scale=static)
                assert torch.equal(s, sr) and s.shape == (20, 1) and torch.all(s == static), f"{mode} static scale"
                assert torch.equal(q, qr), f"{mode} static {float(static)} {dtype}: {int((q != qr).sum())} codes differ"
    try:
        quantize_act(x, "int8", static_scale=torch.ones(2))
    except ValueError as e:
        assert "one value" in str(e), e
    else:
        raise AssertionError("a two-value static scale was accepted")


def case_nvfp4() -> None:
    from lowbit_pipe.formats import FormatSpec, common, get_format
    from lowbit_pipe.kernels import dispatch, reference, rotation
    from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_act_quant

    gen = torch.Generator().manual_seed(2)
    fmt = get_format("nvfp4")
    m, k, n = 24, 256, 48
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    g = reference.positive_scale(x.abs().amax(), 6 * 448.0)  # one scalar: the per-tensor opt-in (and static scales)
    a = nvfp4_act_quant(x, g)
    _close(a * g, reference.nvfp4_fake_quant(x, per_tensor=True), 1e-2, "nvfp4 activation emulation")  # fp8-cast trap
    for rot in ("none", "convrot"):
        q = fmt.quantize(torch.randn(n, k, generator=gen) * 0.02, FormatSpec("nvfp4", rotation=rot))
        kind, group = common.record_rotation(q.record, q.format)
        x_rot, _ = rotation.rotate_activation(x, kind, group)  # the format's GPU reference math, on the CPU
        ref = reference.nvfp4_fake_quant(x_rot) @ fmt._dequantize_rotated(q).t() + bias
        t = q.tensors
        y = dispatch.nvfp4_linear(x, t["weight"], t["weight_scale"], t["weight_scale_2"], None, n, bias, kind, group,
                                  compute_dtype=torch.float32)
        _close(y, ref, 2e-2, f"nvfp4 {rot}")  # same fp8-cast trap on the activation block scales
        ref_t = reference.nvfp4_fake_quant(x_rot, per_tensor=True) @ fmt._dequantize_rotated(q).t() + bias
        y = dispatch.nvfp4_linear(x, t["weight"], t["weight_scale"], t["weight_scale_2"], None, n, bias, kind, group,
                                  compute_dtype=torch.float32, per_tensor=True)
        _close(y, ref_t, 2e-2, f"nvfp4 {rot} per-tensor")
        # W4A16 use of the GEMM: plain activations, scale = weight global -> x @ W_deq^T exactly
        from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_gemm

        y16 = nvfp4_gemm(x_rot, t["weight"], t["weight_scale"], t["weight_scale_2"], n, None, torch.float32,
                         {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128})
        _close(y16, x_rot @ fmt._dequantize_rotated(q).t(), 1e-5, f"nvfp4 w4a16 {rot}")
        # weight-only, both paths: the register-decode GEMM (few rows) and decode + matmul (many rows)
        for rows in (m, dispatch.DECODE_MIN_ROWS):
            xs = torch.randn(rows, k, generator=gen)
            xs_rot, _ = rotation.rotate_activation(xs, kind, group)
            y = dispatch.nvfp4_weight_only_linear(xs, t["weight"], t["weight_scale"], t["weight_scale_2"], n, bias,
                                                  kind, group)
            _close(y, xs_rot @ fmt._dequantize_rotated(q).t() + bias, 1e-5, f"nvfp4 weight-only {rot} M={rows}")
        xs = torch.randn(dispatch.DECODE_MIN_ROWS, k, generator=gen)  # activations through the decode path
        xs_rot, _ = rotation.rotate_activation(xs, kind, group)
        y = dispatch.nvfp4_linear(xs, t["weight"], t["weight_scale"], t["weight_scale_2"], None, n, bias, kind, group,
                                  compute_dtype=torch.float32)
        _close(y, reference.nvfp4_fake_quant(xs_rot) @ fmt._dequantize_rotated(q).t() + bias, 2e-2,
               f"nvfp4 {rot} M={dispatch.DECODE_MIN_ROWS}")
        y = dispatch.nvfp4_linear(xs, t["weight"], t["weight_scale"], t["weight_scale_2"], None, n, bias, kind, group,
                                  compute_dtype=torch.float32, per_tensor=True)
        _close(y, reference.nvfp4_fake_quant(xs_rot, per_tensor=True) @ fmt._dequantize_rotated(q).t() + bias, 2e-2,
               f"nvfp4 {rot} per-tensor M={dispatch.DECODE_MIN_ROWS}")


def case_nvfp4_rows() -> None:
    """The act kernel with one global scale per row (dynamic nvfp4's default) against the torch reference, and a
    sample's rows the same alone and beside loud batch-mates, through the kernel and through nvfp4_linear's two
    GEMM paths (register decode below DECODE_MIN_ROWS rows, decode + matmul from there)."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.kernels import dispatch, reference
    from lowbit_pipe.kernels.nvfp4_gemm import nvfp4_act_quant

    gen = torch.Generator().manual_seed(5)
    m, k, n = 40, 160, 48  # K: two 64-wide kernel blocks and a masked third (kp 160 < 192)
    x = torch.randn(m, k, generator=gen) * 10 ** (torch.rand(m, 1, generator=gen) * 4 - 2)  # rows 1e-2 .. 1e2
    x[7] = 0  # an all-zero row: global scale 1, zero codes
    g = reference.nvfp4_act_global_scale(x)  # [m, 1]
    a = nvfp4_act_quant(x, g.reshape(-1))
    # each row as the scalar-scale kernel computes it with that row's scale: the same interpreted casts, bit for bit
    for i in range(m):
        assert torch.equal(a[i:i + 1], nvfp4_act_quant(x[i:i + 1], g[i])), f"row {i}: per-row scale != its scalar"
    ref = reference.nvfp4_fake_quant(x)
    assert torch.equal(a[7], torch.zeros(k)) and torch.equal(ref[7], torch.zeros(k))
    amax = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # each row weighs the same, whatever its magnitude
    _close(a * g / amax, ref / amax, 1e-2, "nvfp4 per-row activation emulation")  # the fp8-cast trap, as above
    # a sample of 8 rows alone and as rows 8..15 of 3 loud samples: the same codes, the same outputs
    sample, mates = x[:8], torch.randn(24, k, generator=gen) * 100
    batch = torch.cat([mates[:8], sample, mates[8:]])
    alone_a = nvfp4_act_quant(sample, reference.nvfp4_act_global_scale(sample).reshape(-1))
    batch_a = nvfp4_act_quant(batch, reference.nvfp4_act_global_scale(batch).reshape(-1))
    assert torch.equal(alone_a, batch_a[8:16]), "act kernel: a row's codes depend on its batch-mates"
    fmt = get_format("nvfp4")
    q = fmt.quantize(torch.randn(n, k, generator=gen) * 0.02, FormatSpec("nvfp4"))
    t, bias = q.tensors, torch.randn(n, generator=gen)

    def linear(v: torch.Tensor, per_tensor: bool = False) -> torch.Tensor:
        return dispatch.nvfp4_linear(v, t["weight"], t["weight_scale"], t["weight_scale_2"], None, n, bias,
                                     compute_dtype=torch.float32, per_tensor=per_tensor)

    big = torch.cat([batch, torch.randn(dispatch.DECODE_MIN_ROWS, k, generator=gen) * 100])  # the decode path
    for what, rows in (("register-decode GEMM", batch), (f"decode + matmul (M={big.shape[0]})", big)):
        y_alone, y_batch = linear(sample), linear(rows)[8:16]
        _close(y_batch, y_alone, 1e-6, f"nvfp4_linear {what}: a sample beside loud batch-mates")
        _close(y_batch, reference.nvfp4_fake_quant(sample) @ fmt._dequantize_rotated(q).t() + bias, 2e-2,
               f"nvfp4_linear {what} vs the reference")
    # the per-tensor opt-in really is per tensor: the loud mates change the sample
    assert (linear(batch, per_tensor=True)[8:16] - linear(sample, per_tensor=True)).abs().max() > 1e-2 * \
        linear(sample).abs().max(), "per-tensor: the batch-mates should change the sample"


def case_decode() -> None:
    """Weight decode kernels vs the formats' own decode: bit-exact (bf16 within one ulp: interpreter trap)."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.formats.w4a8 import decode_int8_grid
    from lowbit_pipe.kernels import reference
    from lowbit_pipe.kernels.decode import grid_decode_int8, nvfp4_decode

    gen = torch.Generator().manual_seed(5)
    fmt = get_format("nvfp4")
    for n, k in ((48, 256), (160, 96), (130, 272)):  # 160 / 130 rows: two 128-row scale tiles, 96 / 272: odd scale cols
        q = fmt.quantize(torch.randn(n, k, generator=gen) * 0.02, FormatSpec("nvfp4"))
        t = q.tensors
        ref = fmt._dequantize_rotated(q)
        y = nvfp4_decode(t["weight"], t["weight_scale"], t["weight_scale_2"], n, k, torch.float32)
        assert torch.equal(y, ref), f"nvfp4_decode {n}x{k} fp32"
        y = nvfp4_decode(t["weight"], t["weight_scale"], t["weight_scale_2"], n, k, torch.bfloat16)
        _close(y, ref, 2 ** -7, f"nvfp4_decode {n}x{k} bf16")  # the store truncates here: one bf16 ulp
        rs = fmt.fp8_row_scale(q)  # fp8 compute: e4m3 under a per-row scale
        y8 = nvfp4_decode(t["weight"], t["weight_scale"], t["weight_scale_2"], n, k, torch.float8_e4m3fn, rs)
        ref8 = reference.fp8_quantize(ref, rs.reshape(-1, 1))
        assert float((_fp8_steps(y8, ref8) > 0).float().mean()) < 0.05, f"nvfp4_decode {n}x{k} fp8"  # cast trap
    for name, bits in (("w4a8", 4), ("w6a8", 6)):
        q = get_format(name).quantize(torch.randn(40, 512, generator=gen), FormatSpec(name))
        t = q.tensors
        y = grid_decode_int8(t["weight"], t["weight_s_rel"], t.get("weight_codebook"), 512, bits)
        assert torch.equal(y, decode_int8_grid(t, 512, bits, 16)), f"grid_decode_int8 {name}"
    # awq_w4a16: (u - 8) * scale + zero, each step rounded to the scales' dtype. fp16 scales compare exactly; the
    # interpreter's fp32 -> bf16 cast truncates, so bf16 ones only within bf16's precision (the GPU test: exact)
    from lowbit_pipe.formats import common
    from lowbit_pipe.formats.awq_w4a16 import GROUP, decode
    from lowbit_pipe.kernels.decode import awq_decode, mxfp8_decode

    awq = get_format("awq_w4a16")
    for n, k in ((48, 256), (130, 320), (7, 64)):  # 320: a ragged last 256-column block
        w = torch.randn(n, k, generator=gen) * 0.02
        w[0, :64] = 0.0  # an all-zero group
        t = awq.quantize(w, FormatSpec("awq_w4a16")).tensors
        u = common.unpack_nibbles(t["weight"], even_high=False)
        s16, z16 = t["weight_scale"].half(), t["weight_zeros"].half()
        ref16 = decode(u, s16.t().repeat_interleave(GROUP, 1), z16.t().repeat_interleave(GROUP, 1))
        assert torch.equal(awq_decode(t["weight"], s16, z16, k, torch.float32), ref16), f"awq_decode {n}x{k} fp16"
        ref = decode(u, t["weight_scale"].t().repeat_interleave(GROUP, 1), t["weight_zeros"].t().repeat_interleave(GROUP, 1))
        y = awq_decode(t["weight"], t["weight_scale"], t["weight_zeros"], k, torch.float32)
        _close(y, ref, 2 ** -7, f"awq_decode {n}x{k} bf16")
    for bad in (dict(k=100), dict(scale=torch.ones(4, 48))):
        args = {"k": 256, "scale": t["weight_scale"], **bad}
        try:
            awq_decode(t["weight"], args["scale"], t["weight_zeros"], args["k"], torch.float32)
        except ValueError as e:
            assert "awq_decode" in str(e), e
        else:
            raise AssertionError(f"awq_decode accepted {bad}")
    # mxfp8: e4m3 x 2^(e-127), exact in fp32
    mx = get_format("mxfp8")
    for n, k in ((64, 256), (160, 96), (32, 32)):  # 160 rows: two 128-row scale tiles; 96: a ragged scale tile
        w = torch.randn(n, k, generator=gen) * 0.02
        w[1, :32] = 0.0  # a zero block (e = 0)
        q = mx.quantize(w, FormatSpec("mxfp8"))
        y = mxfp8_decode(q.tensors["weight"], q.tensors["weight_scale"], torch.float32)
        assert torch.equal(y, mx._dequantize_rotated(q)), f"mxfp8_decode {n}x{k}"


def case_svdquant() -> None:
    """svdquant_w4a4's GPU path: its two operand kernels bit-exact with the eager contract's operands, the 16-bit TMA
    GEMM against a float64 oracle, and dispatch.svdquant_linear (LoRA concatenated or added after) against the
    format's reference. fp16 layers: the interpreter's fp32 -> bf16 cast truncates (the GPU tests take bf16)."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.kernels import dispatch, reference
    from lowbit_pipe.kernels.act_dequant import svdquant_act
    from lowbit_pipe.kernels.decode import svdquant_decode
    from lowbit_pipe.kernels.fp8_gemm import float_gemm

    fmt = get_format("svdquant_w4a4")
    gen = torch.Generator().manual_seed(31)
    n, k = 72, 320  # 320: a ragged last 256-column decode block and 512-column act block
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, 5] *= 40  # an outlier input channel
    q = fmt.quantize(w, FormatSpec("svdquant_w4a4", rank=8))
    q = type(q)(q.format, q.shape, {key: v.half() if v.is_floating_point() else v for key, v in q.tensors.items()},
                q.record)
    t = q.tensors
    assert torch.equal(svdquant_decode(t["weight"], t["weight_scale"], k, torch.float32), fmt._residual(q, torch.float16))
    try:
        svdquant_decode(t["weight"], t["weight_scale"][:, :5], k, torch.float16)
    except ValueError as e:
        assert "svdquant_decode" in str(e) and "scale" in str(e), e
    else:
        raise AssertionError("svdquant_decode accepted a scale of the wrong shape")
    smooth = (torch.rand(k, generator=gen) + 0.5).half()
    for m in (1, 13):
        x = (torch.randn(m, k, generator=gen) * 3).half()
        x[0, 64:128] = 0.0  # an all-zero group
        assert torch.equal(svdquant_act(x, smooth), reference.svdquant_activations(x, smooth)), f"svdquant_act M={m}"
    # the GEMM: fp16 operands, the branch as the initial accumulator, bias, one rounding
    m = 40
    a, b = torch.randn(m, k, generator=gen).half(), torch.randn(n, k, generator=gen).half()
    xa, up_t, bias = torch.randn(m, 12, generator=gen).half(), torch.randn(12, n, generator=gen).half(), torch.randn(n, generator=gen)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    ref = a.double() @ b.double().t() + xa.double() @ up_t.double() + bias.double()
    _close(float_gemm(a, b, bias, torch.float32, xa, up_t, config=cfg), ref, 1e-6, "float_gemm fp16 + branch")
    _close(float_gemm(a, b, None, torch.float16, config=cfg), a.double() @ b.double().t(), 1e-3, "float_gemm fp16 out")
    # the whole linear against the format's reference: the same operands, one rounding instead of the contract's
    x = torch.randn(3, 5, k, generator=gen) * 2
    bias = torch.randn(n, generator=gen).half()
    ref = fmt.linear(x, q, bias)
    y = dispatch.svdquant_linear(x, t, n, bias)
    assert y.shape == ref.shape and y.dtype == x.dtype
    _close(y, ref, 2e-3, "svdquant_linear")
    for r in (6, 130):  # concatenated to the rank-8 branch; beyond 128 in all, added after
        down, up = torch.randn(r, k, generator=gen) * 0.05, torch.randn(n, r, generator=gen) * 0.05
        y = dispatch.svdquant_linear(x, t, n, bias, (down, up))
        _close(y, ref + reference.low_rank_delta(x, down, up), 2e-3, f"svdquant_linear + rank-{r} LoRA")


def case_mxfp8() -> None:
    """mxfp8 dynamic's GPU path: the activation fake-quant kernel against formats.mxfp8.fake_quant (the interpreter
    mis-rounds ~1% of its fp32 -> e4m3 casts: compared within one e4m3 step there; the GPU test is bit-exact), and
    dispatch.mxfp8_linear (unrotated, ConvRot, hadanorm) against the format's reference."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.formats.mxfp8 import fake_quant
    from lowbit_pipe.kernels import dispatch, rotation
    from lowbit_pipe.kernels.act_dequant import mxfp8_act
    from lowbit_pipe.quant.nn import QuantLinear

    gen = torch.Generator().manual_seed(32)
    x = torch.randn(9, 544, generator=gen) * 5  # 544: a ragged last 512-column block
    x[0, :32] = 0.0  # a zero block
    x[1, 32:64] *= 1e-3
    ref = fake_quant(x)
    y = mxfp8_act(x, torch.float32)
    off = y != ref
    assert float(off.float().mean()) < 0.03, f"mxfp8_act: {float(off.float().mean()):.3f} of values differ"
    # the interpreter's cast bug, and nothing else: a value that rounds up to the next power of two comes back
    # as half of it (the GPU test compares bit for bit)
    assert torch.equal(2 * y[off], ref[off]) and bool((torch.frexp(ref[off]).mantissa.abs() == 0.5).all()), \
        "mxfp8_act: differs from fake_quant beyond the interpreter's e4m3 rounding bug"
    try:
        mxfp8_act(x[:, :40])
    except ValueError as e:
        assert "mxfp8_act" in str(e) and "32" in str(e), e
    else:
        raise AssertionError("mxfp8_act accepted K=40")
    k, n = 512, 64
    xin = torch.randn(2, 8, k, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    for rot in ("none", "convrot", "hadanorm"):
        layer = QuantLinear.from_linear(torch.nn.Linear(k, n), FormatSpec("mxfp8", rotation=rot))
        q, t = layer.qweight, layer.qweight.tensors
        fmt = get_format("mxfp8")
        ref = fmt.linear(xin, q, bias)
        if rot == "hadanorm":
            y = dispatch.hadanorm_linear(xin, 128, lambda xr: dispatch.mxfp8_linear(
                xr, t["weight"], t["weight_scale"], bias, compute_dtype=torch.float32), layer.hadanorm_rowsums)
        else:
            kind, group = ("convrot", 256) if rot == "convrot" else ("none", None)
            y = dispatch.mxfp8_linear(xin, t["weight"], t["weight_scale"], bias, kind, group, torch.float32)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        # against the reference: ~2% of activation codes at half their value (the interpreter's cast bug)
        _close(y, ref, 6e-2, f"mxfp8_linear {rot}")
        if rot != "hadanorm":  # exactly: the same path's math on the kernel's own activations
            xr = rotation.rotate_groups(xin.reshape(-1, k), kind, group) if kind != "none" else xin.reshape(-1, k)
            own = mxfp8_act(xr, torch.float32) @ fmt._dequantize_rotated(q).t() + bias
            _close(y.reshape(-1, n), own, 1e-5, f"mxfp8_linear {rot} on its own activations")


def case_formats() -> None:
    """dispatch.<family>_linear on CPU tensors (interpreted kernels) vs each format's reference."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.kernels import dispatch

    gen = torch.Generator().manual_seed(3)
    m, k, n = 32, 512, 48
    x = torch.randn(2, m // 2, k, generator=gen)  # 3-D input: leading dims are kept
    bias = torch.randn(n, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.02
    for name, spec in (("int8", FormatSpec("int8")), ("int8", FormatSpec("int8", granularity="tensor")),
                       ("int8", FormatSpec("int8", rotation="convrot")), ("int8", FormatSpec("int8", rotation="quarot")),
                       ("convrot_w4a4", FormatSpec("convrot_w4a4", rotation="convrot")),
                       ("w4a8", FormatSpec("w4a8", rotation="convrot")), ("w6a8", FormatSpec("w6a8", rotation="convrot"))):
        fmt = get_format(name)
        q = fmt.quantize(w, spec)
        ref = fmt.linear(x, q, bias)  # CPU tensors: the torch reference
        t = q.tensors
        if name == "int8":
            from lowbit_pipe.formats import common

            kind, group = common.record_rotation(q.record, q.format)
            y = dispatch.int8_linear(x, t["weight"], t["weight_scale"], bias, kind, group)
        elif name == "convrot_w4a4":
            y = dispatch.int8_linear(x, t["weight"], t["weight_scale"], bias, "convrot", 256, int4=True)
            # prepacked: the same int4 codes held in int8, read as int8 weights: the same integer sums
            y8 = dispatch.int8_linear(x, fmt.codes(q), t["weight_scale"], bias, "convrot", 256, int4=True,
                                      packed_weight=False)
            assert torch.equal(y8, y), "convrot_w4a4 prepacked codes vs packed"
        else:
            from lowbit_pipe.formats.w4a8 import decode_int8_grid

            w8 = decode_int8_grid(t, k, fmt.bits, 16)
            y = dispatch.int8_linear(x, w8, t["weight_s_channel"], bias, "convrot", 256)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        _close(y, ref, _tol(spec.rotation), f"{name} {spec.rotation} {spec.granularity}")
    # hadanorm: torch centring + rotation, the int8 path unrotated, the mean term from the layer's row sums
    from lowbit_pipe.quant.nn import QuantLinear

    layer = QuantLinear.from_linear(torch.nn.Linear(k, n), FormatSpec("int8", rotation="hadanorm"))
    xm = x + 1.5  # a mean per group for the correction to carry
    q, t = layer.qweight, layer.qweight.tensors
    y = dispatch.hadanorm_linear(xm, 128, lambda xr: dispatch.int8_linear(xr, t["weight"], t["weight_scale"], layer.bias),
                                 layer.hadanorm_rowsums)
    _close(y, layer.format.linear(xm, q, layer.bias), 3e-4, "int8 hadanorm")


def case_compile() -> None:
    """torch.compile(fullgraph=True) through the custom ops: no graph break; the quantization stays visible."""
    from lowbit_pipe.formats import FormatSpec, get_format
    from lowbit_pipe.kernels import dispatch

    gen = torch.Generator().manual_seed(4)
    q = get_format("int8").quantize(torch.randn(48, 256, generator=gen) * 0.02, FormatSpec("int8", rotation="convrot"))
    t = q.tensors

    def f(x):
        return dispatch.int8_linear(x, t["weight"], t["weight_scale"], None, "convrot", 256) * 2

    x = torch.randn(16, 256, generator=gen)
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    _close(y, f(x), 1e-6, "compiled")
    # what Inductor gets: the rotation and the GEMM as opaque kernels, the activation quantization as plain
    # torch ops it can fuse into the op that produced x
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op in ("call_function", "call_method")])
        return gm.forward

    torch.compile(f, fullgraph=True, backend=record)(x)
    targets = " ".join(graphs[0])
    assert "rotate_groups" in targets and "int8_gemm" in targets and "quantize_act" not in targets, targets
    assert "amax" in targets and "round" in targets, targets


def case_attention8() -> None:
    """8-bit attention: the quantization kernels' codes and scales against the torch rules (int8 bit-exact, e4m3
    within the interpreter's cast budget), the attention kernel against reference_attention8 and exact_attention
    (head dims 64 and 128, a ragged token count that masks the last key block, both QK formats). The interpreter
    mis-rounds the P -> e4m3 cast, so the kernel-vs-reference bound here is loose; tests/kernels/test_gpu_kernels.py
    holds the real kernel to the reference tightly."""
    from lowbit_pipe.kernels.attention8 import (
        FP8_MAX,
        INT8_MAX,
        INTERPRETER_CONFIG,
        LOG2E,
        attention8,
        exact_attention,
        quantize_qkv,
        reference_attention8,
    )

    gen = torch.Generator().manual_seed(8)
    cfg = INTERPRETER_CONFIG
    for d, n in ((64, 70), (128, 40)):
        q, k, v = (torch.randn(1, 2, n, d, generator=gen) for _ in range(3))
        # per-channel offsets of k and v (as DiT activations have), for the two smoothings to remove
        k = k + torch.randn(1, 2, 1, d, generator=gen) * 4
        v = v + torch.randn(1, 2, 1, d, generator=gen) * 2
        for fmt in ("int8", "fp8"):
            qkv = quantize_qkv(q, k, v, fmt)
            grid, code = (INT8_MAX, torch.int8) if fmt == "int8" else (FP8_MAX, torch.float8_e4m3fn)
            assert qkv.q8.dtype == code and qkv.n_pad % cfg.block_m == 0 and qkv.n == n
            ks = k - k.mean(dim=2, keepdim=True)
            for x, codes, scales, mul, what in ((q, qkv.q8, qkv.q_scale, d ** -0.5 * LOG2E, "q"),
                                                (ks, qkv.k8, qkv.k_scale, 1.0, "k")):
                xp = torch.zeros(2, qkv.n_pad, d)
                xp[:, :n] = x[0]
                blocks = xp.view(2, -1, cfg.block_m, d)
                amax = blocks.abs().amax(dim=(-2, -1))
                scale = amax.clamp_min(1e-12) / grid
                torch.testing.assert_close(scales, scale * mul, rtol=1e-6, atol=0, msg=f"{what} scales, {fmt}")
                y = (blocks / scale[..., None, None]).view(2, qkv.n_pad, d)
                if fmt == "int8":
                    assert torch.equal(codes, torch.round(y.clamp(-127, 127)).to(torch.int8)), f"{what} int8 codes"
                else:
                    off = (_fp8_steps(codes, y.clamp(-448, 448).to(torch.float8_e4m3fn)) > 0).float().mean()
                    assert off <= 0.05, f"{what} e4m3 codes: {off:.1%} differ"
            assert not qkv.q8[:, n:].float().any(), "padding rows must be zero codes"
            out = attention8(q, k, v, fmt)
            ref = reference_attention8(q, k, v, fmt, config=cfg)
            exact = exact_attention(q, k, v).float()
            # measured here: kernel vs reference 0.006-0.012 (the interpreter's e4m3 cast), reference vs float64
            # 0.003-0.006 (without the v smoothing, 1.5-8x more at these offsets)
            _close(out, ref, 0.025, f"attention8 {fmt} d={d} vs its reference")
            _close(ref, exact, 0.01, f"reference_attention8 {fmt} d={d} vs float64")
            _close(out, exact, 0.025, f"attention8 {fmt} d={d} vs float64")
    # The statistics pass (kv_stats): chunked partials over [B, N, H, D] inputs seen as [B, H, N, D], three chunks
    # with a ragged last one, with and without a key mask, against torch's reductions over the attended keys.
    from lowbit_pipe.kernels.attention8 import STATS_CHUNK, key_bias_row, kv_stats

    n = 2 * STATS_CHUNK + 77
    k, v = (torch.randn(2, n, 3, 64, generator=gen).transpose(1, 2) * 3 + 1 for _ in range(2))
    mask = torch.rand(2, n, generator=gen) > 0.3
    for key_mask in (None, mask):
        w = (key_mask if key_mask is not None else torch.ones(2, n, dtype=torch.bool))[:, None, :, None]
        count = w.sum(dim=2)
        k_mean = torch.where(w, k, 0).sum(dim=2) / count
        v_mean = torch.where(w, v, 0).sum(dim=2) / count
        v_amax = torch.maximum(torch.where(w, v, -torch.inf).amax(dim=2) - v_mean,
                               v_mean - torch.where(w, v, torch.inf).amin(dim=2))
        bias = key_bias_row(key_mask, n) if key_mask is not None else None
        got = kv_stats(k, v, bias, key_mask)
        for g, want, what in zip(got, (k_mean, v_mean, v_amax / FP8_MAX), ("k mean", "v mean", "v scale")):
            torch.testing.assert_close(g, want.reshape(6, 64), rtol=1e-5, atol=1e-6, msg=f"kv_stats {what}")
    # A key-padding mask (batch 2, keys masked in the middle and at the end of a block): against the reference and
    # the float64 oracle over the attended keys; masked keys' values (garbage here) change nothing.
    q, k, v = (torch.randn(3, 2, 70, 64, generator=gen) for _ in range(3))
    k = k + torch.randn(3, 2, 1, 64, generator=gen) * 4
    v = v + torch.randn(3, 2, 1, 64, generator=gen) * 2
    mask = torch.ones(3, 70, dtype=torch.bool)
    mask[0, 50:] = False
    mask[1, 3:20] = False
    mask[2, :66] = False  # whole key blocks masked before any attended key (Krea 2's empty negative prompt)
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, None, :].expand(3, 2, 70)] = 1e4
    v2[~mask[:, None, :].expand(3, 2, 70)] = -1e4
    for fmt in ("int8", "fp8"):
        out = attention8(q, k2, v2, fmt, key_mask=mask)
        ref = reference_attention8(q, k2, v2, fmt, config=cfg, key_mask=mask)
        exact = exact_attention(q, k, v, key_mask=mask).float()
        _close(out, ref, 0.025, f"attention8 {fmt} key mask vs its reference")
        _close(out, exact, 0.03, f"attention8 {fmt} key mask vs float64")
        assert not torch.isnan(out).any()


def case_norm_rope() -> None:
    """The one-pass RMSNorm and RoPE kernels against their torch forms, diffusers' own RoPE and Krea 2's own
    RMSNorm; then the tiny Krea 2 with both applied (the kernels let run on these CPU tensors) against its stock
    forward."""
    from diffusers.models.embeddings import apply_rotary_emb

    from lowbit_pipe.kernels import norm_rope
    from lowbit_pipe.kernels.norm_rope import reference_rms_norm, reference_rope, rms_norm, rope

    gen = torch.Generator().manual_seed(0)
    # tolerances: one output ulp (the interpreter's fp32 -> 16-bit store cast truncates)
    for d, dtype, offset, tol in ((128, torch.bfloat16, 1.0, 5e-3), (384, torch.float32, 0.0, 1e-6),
                                  (96, torch.float16, 1.0, 1e-3)):
        x = (torch.randn(3, 5, d, generator=gen) * 3 + 1).to(dtype)
        w = torch.randn(d, generator=gen) * 0.1
        got, want = rms_norm(x, w, 1e-5, offset), reference_rms_norm(x, w, 1e-5, offset)
        assert got.dtype == dtype and got.shape == x.shape
        _close(got, want, tol, f"rms_norm d={d} {dtype}")
    # the modulated norm and the gated residual (ComfyUI's Krea 2 blocks): one row of mult / shift / gate per batch,
    # shift and gate strided chunks of the modulation vector as the block gets them, a batch-1 row broadcast
    from lowbit_pipe.kernels.norm_rope import (
        gated_residual,
        modulated_rms_norm,
        reference_gated_residual,
        reference_modulated_rms_norm,
    )

    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)):
        x = (torch.randn(2, 33, 96, generator=gen) * 3 + 1).to(dtype)
        y = torch.randn(2, 33, 96, generator=gen).to(dtype)
        w = torch.randn(96, generator=gen) * 0.1
        scale, shift, gate = (torch.randn(2, 1, 6 * 96, generator=gen) * 0.5).to(dtype).chunk(6, dim=-1)[:3]
        assert not shift.is_contiguous()
        for mult, sh, g, what in ((1 + scale, shift, gate, "per batch"), (1 + scale[:1], shift[:1], gate[:1], "one row")):
            got = modulated_rms_norm(x, w, 1e-5, 1.0, mult, sh)
            assert got.dtype == dtype and got.shape == x.shape
            _close(got, reference_modulated_rms_norm(x, w, 1e-5, 1.0, mult, sh), tol, f"modulated_rms_norm {dtype} {what}")
            _close(gated_residual(x, g, y), reference_gated_residual(x, g, y), tol, f"gated_residual {dtype} {what}")
        # the product is rounded before the sum, as torch's two ops: exact in fp16 (the interpreter rounds fp16)
        if dtype == torch.float16:
            assert torch.equal(gated_residual(x, gate, y), x + gate * y)
    # Krea 2's own RMSNorm module (fp32 weight, zero-centred) on bf16 input: the reference is its very code
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

    module = Krea2RMSNorm(64)
    module.weight.data = torch.randn(64, generator=gen) * 0.1
    x = torch.randn(2, 7, 3, 64, generator=gen).to(torch.bfloat16)
    _close(reference_rms_norm(x, module.weight, module.eps, 1.0), module(x), 5e-3, "reference vs Krea2RMSNorm")
    _close(rms_norm(x, module.weight, module.eps, 1.0), module(x), 5e-3, "rms_norm vs Krea2RMSNorm")
    # diffusers' RMSNorm (FLUX's, Qwen-Image's q / k norms): a 16-bit weight rounds x̂ first and sets the output
    # dtype, an fp32 weight gives fp32, no weight gives x's dtype -- through FusedNormForward's choice of arguments
    from diffusers.models.normalization import RMSNorm

    from lowbit_pipe.attention.fused import FusedNormForward, norm_kind

    saved = norm_rope.kernel_serves
    norm_rope.kernel_serves = lambda x, d: x.dtype in norm_rope.DTYPES and x.is_contiguous() and 0 < d <= 1024
    try:
        # (weight dtype, x, tolerance): bf16 rounds twice (x̂, then the product), and the interpreter's bf16 casts
        # truncate: two ulps; fp16 casts round here (numpy's float16), so the fp16 case checks the order tightly
        for wdtype, xin, tol in ((torch.bfloat16, x, 1e-2), (torch.float16, x.half(), 1e-3),
                                 (torch.float32, x, 1e-6), (None, x, 5e-3)):
            norm = RMSNorm(64, eps=1e-6, elementwise_affine=wdtype is not None)
            if wdtype is not None:
                norm.weight.data = (1 + torch.randn(64, generator=gen) * 0.1).to(wdtype)
            fused = FusedNormForward(norm, norm_kind(norm), norm_rope)
            got, want = fused(xin), norm(xin)
            assert fused.calls == 1 and got.dtype == want.dtype, (wdtype, got.dtype, want.dtype)
            _close(got, want, tol, f"rms_norm vs diffusers RMSNorm, weight {wdtype}")
            round_first = wdtype in (torch.bfloat16, torch.float16)
            torch.testing.assert_close(reference_rms_norm(xin, norm.weight, 1e-6, round_first=round_first,
                                                          out_dtype=want.dtype), want, rtol=0, atol=0)
    finally:
        norm_rope.kernel_serves = saved
    # small shapes, then more rows than a few programs take and a head dim whose half is not a power of two
    # (masked pair columns)
    for seq_dim, (s_len, h, d) in ((1, (9, 3, 64)), (2, (9, 3, 64)), (1, (70, 16, 96)), (2, (70, 16, 96))):
        shape = (2, s_len, h, d) if seq_dim == 1 else (2, h, s_len, d)
        x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        angles = torch.rand(s_len, d // 2, generator=gen, dtype=torch.float64) * 6
        cos = angles.cos().repeat_interleave(2, dim=1).float()
        sin = angles.sin().repeat_interleave(2, dim=1).float()
        stock = apply_rotary_emb(x, (cos, sin), sequence_dim=seq_dim)
        torch.testing.assert_close(reference_rope(x, cos, sin, seq_dim), stock, rtol=0, atol=0)
        _close(rope(x, cos, sin, seq_dim), stock, 5e-3, f"rope sequence_dim={seq_dim} {tuple(shape)}")
        xf = x.float()  # fp32: no store rounding to hide a wrong pair, sign or token
        _close(rope(xf, cos, sin, seq_dim), apply_rotary_emb(xf, (cos, sin), sequence_dim=seq_dim), 1e-6,
               f"rope fp32 sequence_dim={seq_dim} {tuple(shape)}")

    # ComfyUI's forms (lowbit_pipe.attention.comfy_fused; against ComfyUI's own code in tests/comfy/test_comfy_fused.py): the norm
    # reading a strided view (q sliced out of a packed qkv; a permuted [B, L, H, D]) into a contiguous result, and
    # RoPE as 2x2 matrices [B, 1, L', D/2, 2, 2] (fp32 freqs; bf16 freqs computed in bf16), trimmed to L tokens
    from lowbit_pipe.kernels.norm_rope import reference_rope_pairs, rope_pairs, row_layout

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 5e-3)):
        qkv = (torch.randn(2, 7, 3 * 2 * 64, generator=gen) * 3).to(dtype)
        q = qkv.view(2, 7, 3, 2, 64).permute(2, 0, 3, 1, 4)[0]
        perm = (torch.randn(2, 7, 2, 64, generator=gen) * 3).to(dtype).permute(0, 2, 1, 3)
        assert row_layout(q) is not None and row_layout(perm) is not None and not q.is_contiguous()
        w = torch.randn(64, generator=gen) * 0.1
        for view in (q, perm):
            got = rms_norm(view, w, 1e-6, 1.0)
            assert got.is_contiguous()
            _close(got, reference_rms_norm(view, w, 1e-6, 1.0), tol, f"rms_norm strided view {dtype}")
        angles = torch.rand(2, 1, 11, 32, generator=gen) * 6
        freqs = torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).view(2, 1, 11, 32, 2, 2)
        x = torch.randn(2, 3, 9, 64, generator=gen).to(dtype)
        for fdtype in (torch.float32, torch.bfloat16):  # bf16 freqs: four bf16 casts, each truncated here
            f = freqs.to(fdtype)
            _close(rope_pairs(x, f), reference_rope_pairs(x, f), tol if fdtype == torch.float32 else 2e-2,
                   f"rope_pairs x {dtype} freqs {fdtype}")
        _close(rope_pairs(x, freqs[:1, :, :1]), reference_rope_pairs(x, freqs[:1, :, :1]), tol,
               f"rope_pairs one batch, one token of freqs (broadcast) {dtype}")
        # many programs, D / 2 = 48 (masked pair columns), freqs per batch row
        angles = torch.rand(2, 1, 70, 48, generator=gen) * 6
        big_f = torch.stack([angles.cos(), -angles.sin(), angles.sin(), angles.cos()], -1).view(2, 1, 70, 48, 2, 2)
        big_x = torch.randn(2, 16, 70, 96, generator=gen).to(dtype)
        _close(rope_pairs(big_x, big_f), reference_rope_pairs(big_x, big_f), tol, f"rope_pairs [2, 16, 70, 96] {dtype}")

    # The whole tiny Krea 2 with both applied: the kernels on CPU tensors here (the interpreter), equal to the
    # stock forward but for rounding; teardown puts every forward and processor back.
    from lowbit_pipe.arch import detect_model
    from lowbit_pipe.arch.tiny import build_tiny, tiny_model_config
    from lowbit_pipe.attention.fused import apply_fused_norm_rope
    from lowbit_pipe.ledger import Ledger

    norm_rope.kernel_serves = lambda x, d: x.dtype in norm_rope.DTYPES and x.is_contiguous() and 0 < d <= 1024
    # Krea 2: its RMSNorms and RoPE; FLUX.1: RoPE (its q / k norms are torch.nn.RMSNorm, not a known kind);
    # Qwen-Image: diffusers' RMSNorm (its RoPE is its own function)
    for arch_id, kernels in (("krea2", ("norm", "rope")), ("flux1", ("rope",)), ("qwen_image", ("norm",))):
        model = build_tiny(arch_id, tiny_model_config(arch_id), 0, torch.float32)
        arch = detect_model(model)
        inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                     generator=torch.Generator().manual_seed(1), dtype=torch.float32, device="cpu")
        with torch.no_grad():
            before = arch.output_tensor(model(**inputs))
            ledger = Ledger()
            applied = apply_fused_norm_rope(model, ledger)
            after = arch.output_tensor(model(**inputs))
        calls = applied.as_dict()
        assert all((calls[f"{k}_kernel_calls"] > 0) == (k in kernels) for k in ("norm", "rope")), (arch_id, calls)
        _close(after, before, 1e-4, f"tiny {arch_id} with fused norms and RoPE vs stock")
        report = ledger.unwind()
        assert report.errors == [] and report.unfreed == [], report


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run through pytest (it sets TRITON_INTERPRET=1 for this child)")
    _patch_interpreter_index()
    for name in sys.argv[1:]:
        start = time.perf_counter()
        try:
            globals()[f"case_{name}"]()
            status = "OK"
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that case alone
            traceback.print_exc(file=sys.stdout)
            status = "FAIL"
        print(f"RESULT {name} {status} {time.perf_counter() - start:.2f}", flush=True)
