"""Every tensor format: round trip, error bounds, records, from_tensors error paths, linear."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit_pipe.errors import FormatError
from lowbit_pipe.formats import (
    FORMATS,
    FormatSpec,
    QuantizedWeight,
    common,
    decode_record,
    encode_record,
    format_for_record,
    get_format,
    is_stock_loadable,
    w4a8,
)
from lowbit_pipe.kernels import reference

WHERE = "model.safetensors:blocks.0.attn.wq"

# (recipe name, spec kwargs, max relative Frobenius error on N(0, 1) weights)
CASES = [
    ("fp8", {"granularity": "tensor"}, 0.04),
    ("fp8", {"granularity": "row"}, 0.04),
    ("fp8", {"rotation": "quarot"}, 0.04),
    ("int8", {"granularity": "tensor"}, 0.015),
    ("int8", {}, 0.012),
    ("int8", {"rotation": "convrot"}, 0.012),
    ("int8", {"rotation": "hadanorm"}, 0.012),
    ("nvfp4", {}, 0.11),
    ("nvfp4", {"rotation": "convrot"}, 0.11),
    ("mxfp8", {}, 0.04),
    ("mxfp8", {"rotation": "quarot"}, 0.04),
    ("awq_w4a16", {}, 0.1),
    ("svdquant_w4a4", {}, 0.1),
    ("convrot_w4a4", {"rotation": "convrot"}, 0.15),
    ("w4a8", {"rotation": "convrot"}, 0.09),
    ("w6a8", {"rotation": "convrot"}, 0.03),
]


def gaussian(n=64, k=512, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_all_formats_registered():
    assert {"fp8", "int8", "nvfp4", "mxfp8", "awq_w4a16", "svdquant_w4a4", "convrot_w4a4", "w4a8", "w6a8"} <= set(FORMATS)


@pytest.mark.parametrize("name,kw,bound", CASES)
def test_roundtrip_error_and_record(name, kw, bound):
    fmt = get_format(name)
    spec = FormatSpec(name, **kw)
    fmt.check_spec(spec)
    w = gaussian()
    q = fmt.quantize(w, spec)
    assert q.shape == (64, 512) and q.format == name
    dq = fmt.dequantize(q)
    assert dq.dtype == torch.float32 and dq.shape == (64, 512)
    err = rel_err(dq, w)
    assert err < bound, f"{name} {kw}: relative error {err:.4f} >= {bound}"
    # the record is JSON through the .comfy_quant tensor and picks this format back
    record = decode_record(encode_record(q.record), WHERE)
    assert record == json.loads(json.dumps(q.record))
    assert format_for_record(record, WHERE).comfy_name == fmt.comfy_name
    # stored tensors rebuild into the same weight
    q2 = format_for_record(record, WHERE).from_tensors(dict(q.tensors), record, WHERE)
    assert q2.shape == q.shape
    assert torch.equal(get_format(q2.format).dequantize(q2), dq)
    # logical shape from the stored weight alone (what detection code uses)
    assert format_for_record(record, WHERE).logical_shape(tuple(q.tensors["weight"].shape), record) == (64, 512)
    assert fmt.storage_bytes(64, 512, spec) == q.nbytes


def test_quantize_is_deterministic():
    w = gaussian(seed=3)
    for name, kw, _ in CASES:
        a = get_format(name).quantize(w, FormatSpec(name, **kw))
        b = get_format(name).quantize(w, FormatSpec(name, **kw))
        for key in a.tensors:
            assert torch.equal(a.tensors[key].reshape(-1).view(torch.uint8), b.tensors[key].reshape(-1).view(torch.uint8)), (name, key)


@pytest.mark.parametrize("name,kw,bound", CASES)
def test_linear_close_to_float(name, kw, bound):
    fmt = get_format(name)
    q = fmt.quantize(gaussian(), FormatSpec(name, **kw))
    x = torch.randn(3, 5, 512, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(2))
    y = fmt.linear(x, q, bias)
    assert y.shape == (3, 5, 64) and y.dtype == x.dtype
    y_w = x @ fmt.dequantize(q).t() + bias  # weight quantization only
    act_bound = {"convrot_w4a4": 0.2, "nvfp4": 0.15, "svdquant_w4a4": 0.15}.get(name, 0.06)  # 4-bit activations are coarse
    assert rel_err(y, y_w) < act_bound
    yb = fmt.linear(x.bfloat16(), q, bias.bfloat16())
    assert yb.dtype == torch.bfloat16


def test_int8_linear_matches_integer_math():
    q = get_format("int8").quantize(gaussian(), FormatSpec("int8", rotation="convrot"))
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(5))
    x_rot = (x.reshape(4, 2, 256) @ torch.kron(torch.kron(torch.kron(reference_r4(), reference_r4()), reference_r4()), reference_r4()).div(16)).reshape(4, 512)
    xq, xs = reference.quantize_rows_int8(x_rot)
    expected = (xq.double() @ q.tensors["weight"].double().t()) * xs.double() * q.tensors["weight_scale"].double().t()
    torch.testing.assert_close(get_format("int8").linear(x, q, None).double(), expected, rtol=1e-5, atol=1e-5)


def reference_r4():
    return torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)


def test_rotation_fallback_and_records():
    fmt = get_format("int8")
    q = fmt.quantize(gaussian(k=384), FormatSpec("int8", rotation="convrot"))
    assert q.record == {"format": "int8_tensorwise"}  # 384 % 256 != 0: stored unrotated
    q = fmt.quantize(gaussian(k=512), FormatSpec("int8", rotation="convrot"))
    assert q.record == {"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 256}
    assert is_stock_loadable(q.record)
    q = fmt.quantize(gaussian(k=512), FormatSpec("int8", rotation="quarot"))
    assert q.record["lowbit_rotation"] == "quarot" and q.record["lowbit_format"] == "int8"
    assert not is_stock_loadable(q.record)
    assert q.record["format"] not in ("int8_tensorwise",)  # stock ComfyUI must refuse, not misrun it
    assert format_for_record(q.record, WHERE) is fmt
    q = get_format("nvfp4").quantize(gaussian(), FormatSpec("nvfp4", rotation="convrot"))
    assert not is_stock_loadable(q.record)  # ComfyUI's nvfp4 has no rotation
    for name in ("convrot_w4a4", "w4a8", "w6a8", "fp8"):
        assert is_stock_loadable(get_format(name).quantize(gaussian(), FormatSpec(name)).record), name
    assert get_format("w6a8").quantize(gaussian(), FormatSpec("w6a8")).record == {
        "format": "asym_w4a8_int8", "group_size": 16, "convrot_groupsize": 256, "lowbit_bits": 6}


def test_layouts_and_shapes():
    w = gaussian(n=32, k=512)
    q = get_format("nvfp4").quantize(w, FormatSpec("nvfp4"))
    assert q.tensors["weight"].dtype == torch.uint8 and q.tensors["weight"].shape == (32, 256)
    assert q.tensors["weight_scale"].dtype == torch.float8_e4m3fn and q.tensors["weight_scale"].shape == (128, 32)
    assert q.tensors["weight_scale_2"].shape == () and torch.isclose(q.tensors["weight_scale_2"], w.abs().max() / 2688)
    q = get_format("convrot_w4a4").quantize(w, FormatSpec("convrot_w4a4"))
    assert q.tensors["weight"].dtype == torch.int8 and q.tensors["weight"].shape == (32, 256)
    assert q.tensors["weight_scale"].shape == (32,)
    q = get_format("w6a8").quantize(w, FormatSpec("w6a8"))
    assert q.tensors["weight"].shape == (32, 384) and q.tensors["weight_s_rel"].shape == (32, 32)
    assert "weight_codebook" not in q.tensors
    q = get_format("w4a8").quantize(w, FormatSpec("w4a8"))
    assert q.tensors["weight"].shape == (32, 256) and q.tensors["weight_codebook"].shape == (16,)
    q = get_format("int8").quantize(w, FormatSpec("int8"))
    assert q.tensors["weight_scale"].shape == (32, 1)
    q = get_format("fp8").quantize(w, FormatSpec("fp8", granularity="tensor"))
    assert q.tensors["weight_scale"].shape == () and q.tensors["weight"].dtype == torch.float8_e4m3fn


def test_nvfp4_padding_records_logical_shape():
    fmt = get_format("nvfp4")
    w = gaussian(n=40, k=100)
    q = fmt.quantize(w, FormatSpec("nvfp4"))
    assert q.tensors["weight"].shape == (48, 56)  # 16-padded, two codes a byte
    assert q.record["lowbit_shape"] == [40, 100] and is_stock_loadable(q.record)
    assert fmt.logical_shape((48, 56), q.record) == (40, 100)
    assert fmt.dequantize(q).shape == (40, 100)
    assert rel_err(fmt.dequantize(q), w) < 0.11
    assert not fmt.supports_shape(40, 100) and fmt.supports_shape(48, 112)


def test_nvfp4_nibble_order_even_column_high():
    # One block whose even columns are 6 (code 7) and odd columns 0.5 (code 1): bytes 0x71.
    w = torch.tensor([[6.0, 0.5] * 8])
    w = torch.cat([w, torch.zeros(15, 16)])
    q = get_format("nvfp4").quantize(w, FormatSpec("nvfp4"))
    assert q.tensors["weight"][0].tolist() == [0x71] * 8


def test_int4_nibble_order_even_column_low():
    codes = torch.tensor([[3, -2, 7, -7]])
    packed = common.pack_nibbles(codes, even_high=False)
    assert packed.tolist() == [[0xE3, 0x97]]
    assert common.to_signed4(common.unpack_nibbles(packed, even_high=False)).tolist() == codes.tolist()


def test_w6_pack_roundtrip():
    codes = torch.randint(1, 64, (4, 64), generator=torch.Generator().manual_seed(0))
    packed = w4a8.pack_codes(codes, 6)
    assert packed.shape == (4, 48)
    assert torch.equal(w4a8.unpack_codes(packed, 64, 6), codes.to(torch.int32))
    # column 5's top 2 bits live in byte 1 of the high plane at bit 2
    assert (packed.view(torch.uint8)[0, 32 + 1].item() >> 2) & 3 == (codes[0, 5].item() >> 4) & 3


def test_e2m1_rounding_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.1, 6.0, -6.0])
    assert reference.e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 8, 7, 15]
    assert reference.e2m1_decode(torch.arange(16)).tolist()[:8] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_swizzle_roundtrip_and_position():
    s = torch.arange(130 * 6, dtype=torch.float32).reshape(130, 6)
    sw = reference.swizzle_block_scales(s)
    assert sw.shape == (256, 8)
    assert torch.equal(reference.unswizzle_block_scales(sw, 130, 6), s)
    # element (r=33, c=2): tile 0, i=1, j=1 -> flat 16*1 + 4*1 + 2 = 22
    assert sw.flatten()[22] == s[33, 2]
    # element (r=128, c=5): row tile 1, col tile 1 -> tile index 1*2+1, i=0, j=0, c=1
    assert sw.flatten()[3 * 512 + 1] == s[128, 5]


@pytest.mark.parametrize("name", ["fp8", "int8", "nvfp4", "convrot_w4a4", "w4a8", "w6a8"])
def test_refuses_nan_inf(name):
    w = gaussian()
    w[3, 7] = float("nan")
    with pytest.raises(FormatError, match="NaN/Inf"):
        get_format(name).quantize(w, FormatSpec(name))
    w[3, 7] = float("inf")
    with pytest.raises(FormatError, match="NaN/Inf"):
        get_format(name).quantize(w, FormatSpec(name))


def test_all_zero_weight_is_finite():
    for name, kw, _ in CASES:
        q = get_format(name).quantize(torch.zeros(32, 256), FormatSpec(name, **kw))
        assert torch.equal(get_format(name).dequantize(q), torch.zeros(32, 256)), name


def test_supports_shape_and_check_spec():
    assert not get_format("convrot_w4a4").supports_shape(64, 384)
    assert get_format("convrot_w4a4").supports_shape(64, 512)
    assert not get_format("w4a8").supports_shape(64, 100)
    with pytest.raises(ValueError):
        get_format("convrot_w4a4").check_spec(FormatSpec("convrot_w4a4", rotation="quarot"))
    with pytest.raises(ValueError):
        get_format("w4a8").check_spec(FormatSpec("w4a8", rotation="convrot", rotation_group=64))
    with pytest.raises(ValueError):
        get_format("int8").check_spec(FormatSpec("int8", rotation="convrot", rotation_group=128))
    with pytest.raises(FormatError, match="in_features 384"):
        get_format("convrot_w4a4").quantize(gaussian(k=384), FormatSpec("convrot_w4a4"))


def test_static_input_scale():
    fmt = get_format("fp8")
    q = fmt.attach_input_scale(fmt.quantize(gaussian(), FormatSpec("fp8", granularity="tensor", activations="static")), 4.0)
    assert torch.isclose(q.tensors["input_scale"], torch.tensor(4.0 / 448))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)).clamp(-4, 4)
    assert rel_err(fmt.linear(x, q, None), x @ fmt.dequantize(q).t()) < 0.06
    q2 = fmt.from_tensors(dict(q.tensors), q.record, WHERE)
    assert "input_scale" in q2.tensors
    nv = get_format("nvfp4")
    qn = nv.attach_input_scale(nv.quantize(gaussian(), FormatSpec("nvfp4")), 6.0)
    assert torch.isclose(qn.tensors["input_scale"], torch.tensor(6.0 / 2688))


def test_nvfp4_activation_emulation():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    xq = reference.nvfp4_fake_quant(x)
    assert 0 < rel_err(xq, x) < 0.12


# ------------------------------------------------------------------ from_tensors error paths


def _good(name):
    q = get_format(name).quantize(gaussian(), FormatSpec(name))
    return dict(q.tensors), dict(q.record)


def _expect(name, tensors, record, key):
    with pytest.raises(FormatError) as info:
        format_for_record(record, WHERE).from_tensors(tensors, record, WHERE)
    assert WHERE in str(info.value) and key in str(info.value), str(info.value)


SCALE_KEYS = {
    "fp8": ["weight_scale"],
    "int8": ["weight_scale"],
    "nvfp4": ["weight_scale", "weight_scale_2"],
    "convrot_w4a4": ["weight_scale"],
    "w4a8": ["weight_s_rel", "weight_s_channel", "weight_codebook"],
    "w6a8": ["weight_s_rel", "weight_s_channel"],
}


@pytest.mark.parametrize("name", sorted(SCALE_KEYS))
def test_from_tensors_missing(name):
    for key in ["weight"] + [k for k in SCALE_KEYS[name] if k != "weight_codebook"]:
        tensors, record = _good(name)
        del tensors[key]
        _expect(name, tensors, record, key)


@pytest.mark.parametrize("name", sorted(SCALE_KEYS))
def test_from_tensors_wrong_dtype(name):
    for key in ["weight"] + SCALE_KEYS[name]:
        tensors, record = _good(name)
        tensors[key] = tensors[key].to(torch.float64)
        _expect(name, tensors, record, key)


@pytest.mark.parametrize("name", sorted(SCALE_KEYS))
def test_from_tensors_nan_scale(name):
    for key in SCALE_KEYS[name]:
        tensors, record = _good(name)
        t = tensors[key].float().clone()
        t.view(-1)[0] = float("nan")
        tensors[key] = t.to(tensors[key].dtype)
        _expect(name, tensors, record, key)


def test_fp8_zero_weight_scale_loads_as_one():
    """A zero scale (all-zero rows from another tool) loads as 1 with zero codes: same weight, and the
    GPU GEMM can divide by every scale. A zero static input_scale is refused, naming the key."""
    tensors, record = _good("fp8")
    w, s = tensors["weight"].clone(), tensors["weight_scale"].float().reshape(-1, 1).expand(tensors["weight"].shape[0], 1).clone()
    s[2] = 0.0  # row 2: zero scale, codes left as they were (dequantize to 0 all the same)
    fmt = get_format("fp8")
    q = fmt.from_tensors({"weight": w, "weight_scale": s}, record, "blocks.0.attn.to_q")
    expect = w.float() * s
    assert torch.equal(fmt.dequantize(q), expect)
    assert float(q.tensors["weight_scale"][2]) == 1.0 and not q.tensors["weight"][2].float().any()
    assert torch.equal(q.tensors["weight"][3].view(torch.uint8), w[3].view(torch.uint8))
    with pytest.raises(FormatError, match=r"blocks\.0\.attn\.to_q\.input_scale"):
        fmt.from_tensors({"weight": w, "weight_scale": s, "input_scale": torch.tensor(0.0)}, record, "blocks.0.attn.to_q")


@pytest.mark.parametrize("name", sorted(SCALE_KEYS))
def test_from_tensors_shape_contradiction(name):
    tensors, record = _good(name)
    key = SCALE_KEYS[name][0]
    tensors[key] = torch.cat([tensors[key].reshape(tensors[key].shape[0], -1)] * 2, dim=0) if tensors[key].dim() else tensors[key].repeat(3)
    _expect(name, tensors, record, key)
    if name in ("fp8", "int8"):
        return  # per-row/tensor scales say nothing about in_features
    tensors, record = _good(name)
    tensors["weight"] = tensors["weight"][:, :-64]  # row width no longer matches the scales/record
    with pytest.raises(FormatError) as info:
        format_for_record(record, WHERE).from_tensors(tensors, record, WHERE)
    assert WHERE in str(info.value)


def test_from_tensors_extra_and_record_errors():
    tensors, record = _good("int8")
    tensors["weight_zero"] = torch.zeros(1)
    _expect("int8", tensors, record, "weight_zero")
    tensors, record = _good("w6a8")
    record["lowbit_bits"] = 4
    _expect("w6a8", tensors, record, "lowbit_bits")
    tensors, record = _good("int8")
    record = {"format": "lowbit_int8", "lowbit_format": "int8", "lowbit_rotation": "quarot", "lowbit_rotation_group": 100}
    _expect("int8", tensors, record, "lowbit_rotation_group")
    with pytest.raises(FormatError, match=WHERE):
        format_for_record({"format": "mystery"}, WHERE)


def test_w4a8_reads_uint8_scales_and_correction():
    tensors, record = _good("w4a8")
    tensors["weight_s_rel"] = tensors["weight_s_rel"].view(torch.uint8)  # some files store fp8 as U8
    q = get_format("w4a8").from_tensors(tensors, record, WHERE)
    assert q.tensors["weight_s_rel"].dtype == torch.float8_e4m3fn
    tensors["weight_correction"] = torch.full((32, 64), 0.5)
    qc = get_format("w4a8").from_tensors(tensors, record, WHERE)
    diff = get_format("w4a8").dequantize(qc) - get_format("w4a8").dequantize(q)
    # a constant per-group offset in the rotated basis, de-rotated: row sums grow by 0.5 * K
    torch.testing.assert_close(diff.sum(dim=1), torch.full((64,), 0.5 * 512), rtol=1e-4, atol=1e-2)
    x = torch.randn(2, 512)
    torch.testing.assert_close(get_format("w4a8").linear(x, qc, None), x @ get_format("w4a8").dequantize(qc).t())


def test_quantized_weight_nbytes():
    q = get_format("nvfp4").quantize(gaussian(), FormatSpec("nvfp4"))
    assert isinstance(q, QuantizedWeight)
    assert q.nbytes == 64 * 256 + 128 * 32 + 4


def test_stochastic_rounding_int8_unbiased():
    w = torch.full((8, 256), 0.3) + torch.linspace(0, 1, 256)  # not on the grid
    fmt = get_format("int8")
    gen = torch.Generator().manual_seed(0)
    mean = sum(fmt.dequantize(fmt.quantize(w, FormatSpec("int8"), generator=gen)) for _ in range(64)) / 64
    nearest = fmt.dequantize(fmt.quantize(w, FormatSpec("int8")))
    assert rel_err(mean, w) < rel_err(nearest, w)
