"""kernels.launch.FastLaunch on the CPU: its key separates everything Triton's specialization reads, and a memo
hit hands the compiled launcher the arguments in the kernel's parameter order. The GPU test
(tests/kernels/test_gpu_kernels.py::test_a_fast_launch_runs_the_kernel_tritons_own_launch_picks) checks each hit
against the kernel Triton itself picks, and its output against Triton's own launch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton", reason="the launch helper wraps Triton kernels (Linux)")
tl = pytest.importorskip("triton.language")

from lowbit_pipe.kernels import launch  # noqa: E402


def test_the_key_separates_what_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.bfloat16)
    assert buf.data_ptr() % 16 == 0

    def key(*args, **kwargs):
        return launch._key(args, kwargs)

    for spec in (launch._spec, key):
        assert spec(buf) != spec(buf[1:])  # 16-byte alignment
        assert spec(buf) == spec(torch.ones(8, dtype=torch.bfloat16))
        assert spec(buf) != spec(buf.float())
        assert spec(torch.nn.Parameter(buf)) == spec(buf)
        # integers by value: Triton specializes 1 and multiples of 16, the autotuner keys read values
        specs = [spec(v) for v in (1, 2, 16, 32, True, 1.0, None)]
        assert len(set(specs)) == len(specs)
        with pytest.raises(launch._Unkeyable):
            spec(object())
    assert key(buf, BLOCK=1) != key(buf, BLOCK=True) != key(buf, STEP=1)


def test_a_tensor_descriptors_key_holds_its_block_shape_and_alignment():
    from triton.tools.tensor_descriptor import TensorDescriptor

    a = torch.zeros(64, 64, dtype=torch.bfloat16)
    d1 = TensorDescriptor(a, [64, 64], [64, 1], [16, 32])
    d2 = TensorDescriptor(a, [64, 64], [64, 1], [32, 32])
    assert launch._spec(d1) != launch._spec(d2)
    assert launch._spec(d1) == launch._spec(TensorDescriptor(a.clone(), [64, 64], [64, 1], [16, 32]))


@triton.jit
def _layout_kernel(a_ptr, b_ptr, n, scale, STEP: tl.constexpr, BLOCK: tl.constexpr, offset=3):
    pass


def test_a_memo_hit_passes_the_arguments_in_the_kernels_order():
    """What Triton's run ends with: compiled.run(grid, stream, function, metadata, hooks, *bound values), the
    values in parameter order with defaults filled; constexprs are skipped by the launcher."""
    fast = launch.FastLaunch(_layout_kernel)
    seen = []
    compiled = SimpleNamespace(packed_metadata="meta", function="fn",
                               run=lambda *a: seen.append(a))
    a, b = torch.zeros(4), torch.zeros(4)
    args, kwargs = (a, b, 5), {"scale": 0.5, "BLOCK": 64, "STEP": 2}
    fast._remember("key", compiled, args, kwargs)
    fast.stream = lambda device: "stream"
    fast._run(fast.memo["key"], (7,), args, kwargs, 0)
    assert seen == [(7, 1, 1, "stream", "fn", "meta", None, None, None, a, b, 5, 0.5, 2, 64, 3)]
    # a grid function sees the call's values by name
    fast._run(fast.memo["key"], lambda meta: (meta["n"] * meta["BLOCK"], 2), args, kwargs, 0)
    assert seen[-1][:3] == (320, 2, 1)


def test_a_call_missing_an_argument_is_not_remembered():
    fast = launch.FastLaunch(_layout_kernel)
    fast._remember("key", SimpleNamespace(packed_metadata="meta"), (torch.zeros(4),), {"n": 5})
    assert fast.memo == {}
