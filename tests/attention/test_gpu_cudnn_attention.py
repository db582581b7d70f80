"""cuDNN's FP8 attention and the attention router on a GPU (Hopper or newer, with `pip install
'lowbit_pipe[cudnn]'`; skipped otherwise): the kernel against the torch model of its arithmetic (same codes) within
the fp8 bound and against torch's bf16 attention, key-padding masks, a batch without an attended key, the
router's choice per shape, and the path on the tiny models through their diffusers processors, eager and compiled,
with teardown.

    python3 -m pytest -q tests/attention/test_gpu_cudnn_attention.py
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a Hopper (or newer) GPU")


@pytest.fixture(scope="module")
def runner():
    from lowbit_pipe.kernels.cudnn_fp8_attention import CudnnFP8Attention

    try:
        r = CudnnFP8Attention()
    except ImportError as err:
        pytest.skip(f"no cuDNN frontend: {err}")
    yield r
    r.close()


def _qkv(b, h, n, d, seed=0):
    """bf16 [B, H, N, D] views of [B, N, H, D]: peaky scores (std 3), channel offsets on k (2) and v (1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, b, n, h, d, device="cuda", generator=gen)
    x[:2] *= math.sqrt(3.0)
    x[1] += torch.randn(1, 1, h, d, device="cuda", generator=gen) * 2
    x[2] += torch.randn(1, 1, h, d, device="cuda", generator=gen)
    return tuple(t.to(torch.bfloat16).transpose(1, 2) for t in x)


def _cos(a, b):
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :] if mask is not None else None)


@pytest.mark.parametrize("b,h,n,d", [(1, 4, 1024, 128), (2, 3, 300, 64), (1, 8, 4608, 128), (1, 2, 77, 64)])
def test_the_kernel_matches_its_torch_model_and_bf16_attention(runner, b, h, n, d):
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes

    q, k, v = _qkv(b, h, n, d, seed=n)
    sm = d ** -0.5
    key = runner.plan_key(q, False)
    assert runner.why_not(key) is None, runner.why_not(key)
    out = runner(q, k, v)
    assert out.dtype == torch.bfloat16 and out.stride() == q.stride() and not torch.isnan(out).any()
    qkv = Q.quantize_qkv_fp8(q, k, v)
    ref = Q.reference_qkv_fp8(q, k, v)
    # the GPU's quantization is the torch form's (a code may move by one where the fp32 means round apart)
    for name in ("q8", "k8", "v8"):
        differ = (getattr(qkv, name).view(torch.uint8) != getattr(ref, name).view(torch.uint8)).float().mean()
        assert differ < 1e-3, (name, float(differ))
    torch.testing.assert_close(qkv.scales[:Q.DESCALE_O + 1, 0], ref.scales[:Q.DESCALE_O + 1, 0], rtol=1e-6, atol=0)
    # cuDNN vs the torch model of its arithmetic on the same codes: P and O rounding flips only
    model = reference_from_codes(qkv, sm, torch.float32)
    assert _rel(out, model) < 0.03, _rel(out, model)
    # the accuracy target against the model's own attention, and near the float64 oracle
    assert _cos(out, _sdpa(q, k, v)) > 0.999, _cos(out, _sdpa(q, k, v))


def test_masked_keys_are_left_out_whatever_they_hold(runner):
    """Krea 2's text padding (77 of 512 text tokens attend) as cuDNN's padding mask over reordered keys: the output
    is torch's masked attention within the fp8 bound, and bit-equal when the masked keys hold garbage."""
    q, k, v = _qkv(2, 4, 1536, 128, seed=5)
    mask = torch.ones(2, 1536, dtype=torch.bool, device="cuda")
    mask[0, 77:512] = False
    mask[1, 300:512] = False
    key = runner.plan_key(q, True)
    why = runner.why_not(key)
    if why is not None:
        pytest.fail(f"cuDNN refused the padding mask: {why} (the router then sends masked calls to the Triton kernel)")
    out = runner(q, k, v, key_mask=mask)
    assert _cos(out, _sdpa(q, k, v, mask)) > 0.999
    assert _cos(_sdpa(q, k, v), _sdpa(q, k, v, mask)) < 0.99  # the mask matters at these inputs
    masked = ~mask[:, None, :, None]  # [B, 1, N, 1]: only the keys each batch leaves out hold garbage
    k2, v2 = torch.where(masked, 1e4, k).to(k.dtype), torch.where(masked, -3e3, v).to(v.dtype)
    assert torch.equal(runner(q, k2, v2, key_mask=mask), out)


def test_a_batch_without_an_attended_key_gives_nan_as_torch_does(runner):
    q, k, v = _qkv(2, 2, 256, 64, seed=7)
    mask = torch.ones(2, 256, dtype=torch.bool, device="cuda")
    mask[1] = False
    if runner.why_not(runner.plan_key(q, True)) is not None:
        pytest.skip("cuDNN refused the padding mask here")
    out = runner(q, k, v, key_mask=mask)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    assert _cos(out[0], _sdpa(q[:1], k[:1], v[:1])) > 0.999


def test_the_router_is_never_slower_than_the_models_attention(runner, tmp_path):
    """The router measures each shape on the spot: at 512-ish tokens the model's own attention is the faster
    (issue 43: cuDNN's kernel alone 0.84x there), at 2048² cuDNN's kernel; whatever it picks times within noise of
    the fastest path here."""
    from lowbit_pipe.attention import crossover as X
    from lowbit_pipe.attention.route import NO_KERNEL, attend8
    from lowbit_pipe.kernels.cudnn_fp8_attention import plan_key
    from lowbit_pipe.measure.timing import TimingSettings, time_ms

    dev = torch.cuda.current_device()
    paths = [X.Path8(X.CUDNN, "cudnn", "cudnn_fp8 (test)", lambda s: runner.why_not(
                plan_key(dev, s.batch, s.heads, s.tokens, s.head_dim, s.masked)), runner),
             X.Path8("fp8", "triton", "triton_fp8", lambda s: None if s.head_dim in (64, 128) else NO_KERNEL,
                     lambda q, k, v, sm, m: attend8(q, k, v, "fp8", sm, m))]
    router = X.AttentionRouter(paths, torch.device("cuda", dev), X.load_table(torch.device("cuda"), str(tmp_path)))
    short = X.CallShape(1, 24, 512, 128, False, "bfloat16")
    long = X.CallShape(1, 48, 16896, 128, False, "bfloat16")
    assert router.choose(short).path == X.STOCK, router.as_dict()
    assert router.choose(long).path == X.CUDNN, router.as_dict()
    for shape in (short, long, X.CallShape(1, 48, 4608, 128, True, "bfloat16")):
        choice = router.choose(shape)
        q, k, v, mask = X.measure_inputs(shape, torch.device("cuda"))
        run = X.stock_attention if choice.path == X.STOCK else next(p.run for p in paths if p.name == choice.path)
        chosen = time_ms(lambda: run(q, k, v, None, mask), q.device, TimingSettings(3, 20))
        stock = time_ms(lambda: X.stock_attention(q, k, v, None, mask), q.device, TimingSettings(3, 20))
        assert chosen <= 1.05 * stock, (shape, choice, chosen, stock)
    # the file holds what was measured: a new router on it decides without measuring
    again = X.AttentionRouter(paths, torch.device("cuda", dev), X.load_table(torch.device("cuda"), str(tmp_path)),
                              measure=False)
    assert again.choose(long).by == "measured" and again.choose(long).path == X.CUDNN


def _tiny(tiny_model, arch_id):
    from lowbit_pipe.arch import detect_model

    model = tiny_model(arch_id, torch.bfloat16).cuda()
    arch = detect_model(model)
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=256, text_tokens=16,
                                 generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16, device="cuda")
    return model, arch, inputs


def _out(model, arch, inputs):
    with torch.no_grad():
        return arch.output_tensor(model(**inputs)).float()


@pytest.mark.parametrize("compiled", [False, True])
def test_the_cudnn_path_through_the_processors_and_teardown(runner, tiny_model, tmp_path, compiled):
    """route="cudnn" on the tiny Krea 2 (joint blocks head dim 64, the text fusion's 32): every call cuDNN's,
    counted per call, eager and compiled (the routed custom op); teardown gives back the stock attention bit for
    bit and releases cuDNN's handles."""
    from lowbit_pipe.attention import apply_attention
    from lowbit_pipe.ledger import Ledger

    model, arch, inputs = _tiny(tiny_model, "krea2")
    before = _out(model, arch, inputs)
    ledger = Ledger()
    applied = apply_attention(model, "fp8", ledger, route="cudnn", speed_cache=str(tmp_path), fold_qk=True)
    assert applied.cudnn is not None, applied.notes
    if compiled:
        torch._dynamo.reset()
        for block in model.transformer_blocks:
            block.compile(backend="inductor")
    after = _out(model, arch, inputs)
    calls = dict(applied.calls)
    # the joint blocks (head dim 64) on cuDNN -- in eager with q and k from their RoPE (the fold), compiled through
    # the routed op; the text fusion's head dim 32 too unless cuDNN refuses it (then the model's own attention,
    # saying why: the Triton kernel takes no head dim 32 either)
    joint = "cudnn_fp8" if compiled else "cudnn_fp8_folded"
    assert calls.get(joint, 0) >= 2 and all(c.startswith("cudnn_fp8") or c.startswith("stock: ") for c in calls), \
        (calls, applied.as_dict())
    assert compiled or applied.fold.folded_calls == calls[joint]
    assert 0 < _rel(after, before) < 3e-2, _rel(after, before)
    report = applied.as_dict()
    assert report["route"]["route"] == "cudnn" and report["cudnn"]["graphs"] >= 1
    cudnn = applied.cudnn
    ledger.unwind()
    assert cudnn.closed and not cudnn._handles
    if compiled:
        torch._dynamo.reset()
        for block in model.transformer_blocks:
            block._compiled_call_impl = None  # back to the plain forward
    assert torch.equal(_out(model, arch, inputs), before)


def _folded_inputs(b, h, n, d, seed=0, masked=False):
    """Pre-norm q, k (channel offsets, k's larger), v, Krea 2-like norm weights (1 + w ~ 1.7), RoPE tables."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(3, b, n, h, d, device="cuda", generator=gen)
    x[0] += torch.randn(1, 1, h, d, device="cuda", generator=gen) * 0.5
    x[1] += torch.randn(1, 1, h, d, device="cuda", generator=gen) * 3
    x[2] += torch.randn(1, 1, h, d, device="cuda", generator=gen)
    w = torch.randn(2, d, device="cuda", generator=gen) * 0.3 + 0.7
    ang = torch.rand(n, d // 2, device="cuda", generator=gen) * 6
    cos, sin = ang.cos().repeat_interleave(2, 1).contiguous(), ang.sin().repeat_interleave(2, 1).contiguous()
    mask = None
    if masked:
        mask = torch.ones(b, n, dtype=torch.bool, device="cuda")
        mask[:, n // 8:n // 3] = False
    return x.bfloat16(), w, cos, sin, mask


@pytest.mark.parametrize("b,h,n,d,masked", [(1, 8, 4608, 128, False), (2, 4, 1000, 64, True), (1, 48, 4608, 128, True)])
def test_the_folded_call_matches_the_torch_forms_and_bf16_attention(runner, b, h, n, d, masked):
    """q and k written in e4m3 by their RoPE (norm_rope.rope_e4m3, scales from the norm weights' bound), v's passes,
    cuDNN, the output conversion (attention.fold.folded_attention): the codes are the torch form's, nothing
    saturates, the output is the torch model's on the same codes and within the target of bf16 attention."""
    from lowbit_pipe.attention.fold import folded_attention
    from lowbit_pipe.kernels import norm_rope as R
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes

    x, w, cos, sin, mask = _folded_inputs(b, h, n, d, seed=n, masked=masked)
    nq, nk = (R.rms_norm(x[i], w[i], 1e-5, 1.0) for i in (0, 1))
    scale = 448.0 / torch.cat([R.norm_bound(w[i], 1.0, d, "cuda") for i in (0, 1)])
    amax = torch.zeros(2, device="cuda")
    pos = Q.key_order(mask)[0] if masked else None
    q8 = R.rope_e4m3(nq, cos, sin, scale[0:1], amax[0:1])
    k8 = R.rope_e4m3(nk, cos, sin, scale[1:2], amax[1:2], mask, pos)
    for got, y, s, m in ((q8, nq, scale[0], None), (k8, nk, scale[1], mask)):
        ref = R.reference_rope_e4m3(y, cos, sin, float(s), m)
        differ = (got.view(torch.uint8) != ref.view(torch.uint8)).float().mean()
        assert differ < 1e-3, float(differ)
    assert bool((amax * scale <= 448).all()), (amax, scale)
    out = folded_attention(runner, q8, k8, scale, x[2], None, mask)  # [B, N, H, D]
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and not torch.isnan(out).any()
    q, k = (R.rope(t, cos, sin, 1).transpose(1, 2) for t in (nq, nk))
    v = x[2].transpose(1, 2)
    stock = _sdpa(q, k, v, mask)
    assert _cos(out.transpose(1, 2), stock) > 0.999, _cos(out.transpose(1, 2), stock)
    unfolded = runner(q, k, v, None, mask)
    assert abs(_cos(out.transpose(1, 2), stock) - _cos(unfolded, stock)) < 2e-4
    qkv = Q.quantize_folded(q8, k8, scale, v, mask)
    model = reference_from_codes(qkv, d ** -0.5, torch.float32, heads=slice(0, 2))
    assert _rel(out.transpose(1, 2)[:, :2], model) < 0.03, _rel(out.transpose(1, 2)[:, :2], model)


def test_the_fixed_statistics_pass_is_exact_on_the_gpu():
    """The statistics pass (one tensor per program, tiles reduced once) against its torch form at Krea 2's shape,
    with the text mask; v alone as the folded call runs it."""
    from lowbit_pipe.kernels import qkv_fp8 as Q

    q, k, v = _qkv(1, 48, 4608, 128, seed=5)
    mask = torch.ones(1, 4608, dtype=torch.bool, device="cuda")
    mask[:, 77:512] = False
    for m in (None, mask):
        got, ref = Q.qkv_stats(q, k, v, m), Q.reference_stats(q, k, v, m)
        for name in ("k_mean", "v_mean", "amax"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-5)
        only_v = Q.v_stats(v, m)
        torch.testing.assert_close(only_v.v_mean, ref.v_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(only_v.amax[2], ref.amax[2], rtol=1e-5, atol=1e-5)


def test_auto_route_on_the_tiny_models_reports_each_calls_path(tiny_model, tmp_path):
    """route="auto" (the default): at the tiny models' 272 tokens the model's own attention is the faster, and
    the report says so per call shape."""
    from lowbit_pipe.attention import apply_attention
    from lowbit_pipe.ledger import Ledger

    model, arch, inputs = _tiny(tiny_model, "flux1")
    before = _out(model, arch, inputs)
    ledger = Ledger()
    applied = apply_attention(model, "fp8", ledger, speed_cache=str(tmp_path), fold_qk=True)
    after = _out(model, arch, inputs)
    report = applied.as_dict()
    assert sum(applied.calls.values()) >= 3, report
    shapes = report["route"]["shapes"]
    assert shapes and all(s["by"] == "measured" for s in shapes.values()), report
    for label, s in shapes.items():  # what was chosen is never the slower of chosen vs stock by the router's times
        assert s["ms"][s["path"]] <= s["ms"]["stock"], (label, s)
    if all(s["path"] == "stock" for s in shapes.values()):
        assert torch.equal(after, before)
    ledger.unwind()
    assert torch.equal(_out(model, arch, inputs), before)


def test_the_comfyui_override_routes_by_shape_on_the_gpu(runner, tmp_path):
    """ComfyUI's attention override on a CUDA MODEL: with route=cudnn a Krea 2 1024² call runs cuDNN's FP8 kernel
    (cosine > 0.999 to bf16 SDPA, in ComfyUI's [B, N, H * D] layout); with route=auto a 512²-sized FLUX.1 call is
    measured and goes to ComfyUI's own function; Purge closes the runner."""
    from lowbit_pipe.comfy.attention import Attention8Override

    def comfy_sdpa(q, k, v, heads, *args, **kwargs):
        b, n, width = q.shape
        q, k, v = (t.reshape(b, n, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        return _sdpa(q, k, v).transpose(1, 2).reshape(b, n, width)

    device = torch.device("cuda", torch.cuda.current_device())
    forced = Attention8Override("fp8", "test", device=device, route="cudnn", speed_cache=str(tmp_path))
    assert forced.cudnn is not None, forced.notes  # the frontend is there (the `runner` fixture skips without it)
    q, k, v = (t.transpose(1, 2).reshape(1, 4608, 48 * 128) for t in _qkv(1, 48, 4608, 128, seed=4))
    out = forced(comfy_sdpa, q, k, v, 48, transformer_options={"block_index": 0})
    assert out.shape == q.shape and _cos(out, comfy_sdpa(q, k, v, 48)) > 0.999
    assert dict(forced.calls) == {"cudnn_fp8": 1}
    auto = Attention8Override("fp8", "test", device=device, speed_cache=str(tmp_path))
    q, k, v = (t.transpose(1, 2).reshape(1, 1280, 24 * 128) for t in _qkv(1, 24, 1280, 128, seed=5))
    seen = []
    auto(lambda *a, **kw: seen.append(1) or comfy_sdpa(*a, **kw), q, k, v, 24, transformer_options={"block_index": 0})
    assert seen == [1] and list(auto.calls) == ["stock: faster at this shape (measured)"], dict(auto.calls)
    forced.purge("now")
    assert forced.cudnn.closed
