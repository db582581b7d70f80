"""Oracle tests: our packed bytes, scales and dequantized values equal comfy-kitchen's (eager backend)."""

from __future__ import annotations

import pytest
import torch

ck = pytest.importorskip("comfy_kitchen")

from comfy_kitchen.float_utils import _f32_to_floatx_unpacked  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor, get_layout_class  # noqa: E402
from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation, _rotate_weight  # noqa: E402

from lowbit_pipe.comfy.compat import KINDS  # noqa: E402
from lowbit_pipe.formats import FormatSpec, get_format  # noqa: E402
from lowbit_pipe.kernels import reference, rotation  # noqa: E402


def needs_ck_layout(layout: str, kind: str):
    """Skip an oracle test where the installed comfy-kitchen predates the layout it compares with (the pack itself
    works from an older one), naming the release that added it."""
    import importlib.metadata

    import comfy_kitchen.tensor

    try:
        installed = importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on sys.path
        installed = "an unknown version"
    return pytest.mark.skipif(not hasattr(comfy_kitchen.tensor, layout),
                              reason=f"the oracle {layout} needs comfy-kitchen >= {KINDS[kind].comfy_kitchen}; "
                                     f"{installed} is installed")


def ck_quantize(layout: str, w: torch.Tensor, **kw):
    """comfy-kitchen's state-dict tensors (suffix -> tensor) and dequantized fp32 weight."""
    with ck.registry.use_backend("eager"):
        qt = QuantizedTensor.from_float(w, layout, **kw)
        sd = get_layout_class(layout).state_dict_tensors(qt._qdata, qt._params)
        return sd, qt.dequantize().float()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, any dtype)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def weights(n: int, k: int, seed: int, heavy: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    if heavy:  # a few large outliers, as in real DiT weights
        idx = torch.randint(0, n * k, (max(1, n * k // 500),), generator=gen)
        w.view(-1)[idx] *= 30.0
    return w


SHAPES = [(64, 512, False), (128, 1024, True), (48, 768, False)]


def test_convrot_matrix_and_orientation():
    h_ck = _build_hadamard(256, device="cpu", dtype=torch.float32)
    assert torch.equal(rotation.hadamard("convrot", 256), h_ck)
    w = weights(32, 1024, 1)
    assert torch.equal(rotation.rotate_weight(w, "convrot", 256), _rotate_weight(w, h_ck, 256))
    x = weights(7, 1024, 2)
    assert torch.equal(rotation.rotate_activation(x, "convrot", 256)[0], _rotate_activation(x, h_ck, 256))


def test_e2m1_encoder_matches_on_dense_sweep():
    x = torch.linspace(-6.0, 6.0, 48001)
    x = torch.cat([x, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.0, 1e-9, -1e-9])])
    theirs = _f32_to_floatx_unpacked(x.clone(), 2, 1).to(torch.int32)
    assert torch.equal(reference.e2m1_encode(x), theirs)
    # the table-free rounding GPTQ uses: the same values, the sign of zero included
    rounded, decoded = reference.e2m1_round(x), reference.e2m1_decode(theirs)
    assert torch.equal(rounded, decoded) and torch.equal(torch.signbit(rounded), torch.signbit(decoded))


@pytest.mark.parametrize("n,k,heavy", SHAPES)
def test_fp8_tensorwise(n, k, heavy):
    w = weights(n, k, 10, heavy)
    sd, dq = ck_quantize("TensorCoreFP8Layout", w)
    fmt = get_format("fp8")
    q = fmt.quantize(w, FormatSpec("fp8", granularity="tensor"))
    assert same_bits(q.tensors["weight"], sd[""])
    assert same_bits(q.tensors["weight_scale"], sd["_scale"])
    assert torch.equal(fmt.dequantize(q), dq)


@pytest.mark.parametrize("n,k,heavy", SHAPES + [(200, 100, False), (17, 48, True)])
def test_nvfp4(n, k, heavy):
    w = weights(n, k, 11, heavy)
    sd, dq = ck_quantize("TensorCoreNVFP4Layout", w)
    fmt = get_format("nvfp4")
    q = fmt.quantize(w, FormatSpec("nvfp4"))
    assert same_bits(q.tensors["weight"], sd[""])  # codes and nibble order
    assert same_bits(q.tensors["weight_scale"], sd["_scale"])  # e4m3 block scales, swizzled
    assert same_bits(q.tensors["weight_scale_2"], sd["_scale_2"])
    assert torch.equal(fmt.dequantize(q), dq[:n, :k])
    # comfy-kitchen decodes our tensors to the same values
    theirs = ck.dequantize_nvfp4(q.tensors["weight"], q.tensors["weight_scale_2"], q.tensors["weight_scale"], torch.float32)
    assert torch.equal(theirs[:n, :k], fmt.dequantize(q))


@pytest.mark.parametrize("n,k,heavy", [(64, 512, False), (128, 1024, True), (160, 96, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8(n, k, heavy, dtype):
    w = weights(n, k, 12, heavy).to(dtype)
    w[1, 32:64] = 0  # an all-zero block: exponent 0, zero codes
    w[2, :32] *= 1e-30  # a tiny block: a small but valid exponent
    sd, dq = ck_quantize("TensorCoreMXFP8Layout", w)
    fmt = get_format("mxfp8")
    q = fmt.quantize(w, FormatSpec("mxfp8"))
    assert same_bits(q.tensors["weight"], sd[""])  # fp8 codes
    assert same_bits(q.tensors["weight_scale"], sd["_scale"])  # E8M0 exponents, swizzled
    assert torch.equal(fmt.dequantize(q), dq)
    theirs = ck.dequantize_mxfp8(q.tensors["weight"], q.tensors["weight_scale"], torch.float32)
    assert torch.equal(theirs, fmt.dequantize(q))
    # Dynamic activations: each row quantized as comfy-kitchen quantizes an MXFP8 input.
    x = weights(24, k, 13, heavy=True)
    xq, xs = ck.quantize_mxfp8(x)
    expected = ck.dequantize_mxfp8(xq, xs, torch.float32) @ dq.t()
    torch.testing.assert_close(fmt.linear(x, q, None), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,k,heavy", [(64, 512, False), (128, 1024, True), (48, 192, True)])
def test_awq_w4a16(n, k, heavy):
    """comfy-kitchen's layout is load-only: its dequantize and eager GEMV on our tensors are our numbers."""
    from comfy_kitchen.tensor.awq_w4a16 import TensorCoreAWQW4A16Layout

    w = weights(n, k, 14, heavy)
    w[0, :64] = 0  # an all-zero group
    fmt = get_format("awq_w4a16")
    q = fmt.quantize(w, FormatSpec("awq_w4a16"))
    t = q.tensors
    assert t["weight"].dtype == torch.int8 and t["weight"].shape == (n, k // 2)
    assert t["weight_scale"].shape == t["weight_zeros"].shape == (k // 64, n)
    params = TensorCoreAWQW4A16Layout.Params(scale=t["weight_scale"], zeros=t["weight_zeros"], group_size=64,
                                             orig_dtype=torch.bfloat16, orig_shape=(n, k))
    assert torch.equal(TensorCoreAWQW4A16Layout.dequantize(t["weight"], params).float(), fmt.dequantize(q))
    assert torch.equal(fmt.dequantize(q)[0, :64], torch.zeros(64))
    x = weights(7, k, 15).bfloat16()
    with ck.registry.use_backend("eager"):
        theirs = ck.gemv_awq_w4a16(x, t["weight"], t["weight_scale"], t["weight_zeros"], group_size=64)
    assert same_bits(fmt.linear(x, q, None), theirs)


@pytest.mark.parametrize("n,k,heavy", SHAPES)
@pytest.mark.parametrize("mode", ["tensor", "row", "convrot"])
def test_int8(n, k, heavy, mode):
    w = weights(n, k, 12, heavy)
    kw = {"tensor": {}, "row": {"per_channel": True}, "convrot": {"per_channel": True, "convrot": True}}[mode]
    sd, dq = ck_quantize("TensorWiseINT8Layout", w, **kw)
    spec = {"tensor": FormatSpec("int8", granularity="tensor"), "row": FormatSpec("int8"), "convrot": FormatSpec("int8", rotation="convrot")}[mode]
    fmt = get_format("int8")
    q = fmt.quantize(w, spec)
    assert same_bits(q.tensors["weight"], sd[""])
    assert same_bits(q.tensors["weight_scale"], sd["_scale"])
    assert torch.equal(fmt.dequantize(q), dq)
    if mode == "convrot":
        assert q.record == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
        x = weights(5, k, 13) * 50
        with ck.registry.use_backend("eager"):
            y_ck = ck.int8_linear(x, q.tensors["weight"], q.tensors["weight_scale"], None, torch.float32, convrot=True, convrot_groupsize=256)
        torch.testing.assert_close(fmt.linear(x, q, None), y_ck, rtol=1e-5, atol=1e-6)


@needs_ck_layout("TensorCoreConvRotW4A4Layout", "convrot_w4a4")
@pytest.mark.parametrize("n,k,heavy", SHAPES)
def test_convrot_w4a4(n, k, heavy):
    w = weights(n, k, 14, heavy)
    if k % 256:
        pytest.skip("ConvRot W4A4 needs K % 256 == 0")
    sd, dq = ck_quantize("TensorCoreConvRotW4A4Layout", w)
    fmt = get_format("convrot_w4a4")
    q = fmt.quantize(w, FormatSpec("convrot_w4a4", rotation="convrot"))
    assert same_bits(q.tensors["weight"], sd[""])
    assert same_bits(q.tensors["weight_scale"], sd["_scale"])
    assert torch.equal(fmt.dequantize(q), dq)
    x = weights(6, k, 15) * 50
    with ck.registry.use_backend("eager"):
        y_ck = ck.tensor.convrot_w4a4_linear(x, q.tensors["weight"], q.tensors["weight_scale"], None, 256)
    torch.testing.assert_close(fmt.linear(x, q, None), y_ck, rtol=1e-5, atol=1e-6)


@needs_ck_layout("AsymW4A8Int8Layout", "asym_w4a8_int8")
@pytest.mark.parametrize("n,k,heavy", SHAPES)
@pytest.mark.parametrize("name,bits", [("w4a8", 4), ("w6a8", 6)])
def test_asym_w4a8(n, k, heavy, name, bits):
    w = weights(n, k, 16, heavy)
    sd, dq = ck_quantize("AsymW4A8Int8Layout", w, bits=bits)
    fmt = get_format(name)
    q = fmt.quantize(w, FormatSpec(name, rotation="convrot"))
    # comfy-kitchen picks its fixed Lloyd-Max table for ConvRot-rotated weights like these;
    # we always use that table (a documented choice), so everything matches.
    if bits == 4:
        assert same_bits(q.tensors["weight_codebook"], sd["_codebook"])
    else:
        assert "_codebook" not in sd and "weight_codebook" not in q.tensors
    assert same_bits(q.tensors["weight"], sd[""])
    assert same_bits(q.tensors["weight_s_rel"], sd["_s_rel"])
    assert same_bits(q.tensors["weight_s_channel"], sd["_s_channel"])
    assert torch.equal(fmt.dequantize(q), dq)
    x = weights(4, k, 17) * 50
    with ck.registry.use_backend("eager"):
        y_ck = ck.tensor.w4a8_int8_linear(
            x, q.tensors["weight"], q.tensors["weight_s_rel"], q.tensors["weight_s_channel"],
            codebook=q.tensors.get("weight_codebook"), out_dtype=torch.float32,
        )
    torch.testing.assert_close(fmt.linear(x, q, None), y_ck, rtol=1e-5, atol=1e-6)
