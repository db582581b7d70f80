"""The quantization of cuDNN's FP8 attention folded into q's and k's RoPE (lowbit_pipe.attention.fold,
lowbit_pipe.kernels.norm_rope.rope_e4m3, qkv_fp8.quantize_folded): the kernels under TRITON_INTERPRET against
their torch forms, the norm bound against adversarial inputs, the router's folded path, and a diffusers Krea 2
attention module whose processor folds (cuDNN stood in for by the torch model of its arithmetic) against its
stock processor, with GQA and the text padding mask. The cuDNN kernel itself: tests/attention/test_gpu_cudnn_attention.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout (not conftest's: this file also runs as a script)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


# ------------------------------------------------------------------------------------------------------ router
def test_the_folded_path_serves_only_folded_shapes_and_leads_the_default_rule():
    from lowbit_pipe.attention.crossover import AttentionRouter, CallShape, Path8

    def serve(s):
        return None

    paths = [Path8("cudnn_fp8_folded", "cudnn_folded", "f", serve, lambda *a: None),
             Path8("cudnn_fp8", "cudnn", "c", serve, lambda *a: None),
             Path8("fp8", "triton", "t", serve, lambda *a: None)]
    router = AttentionRouter(paths, torch.device("cpu"), table=None, measure=False)
    plain = CallShape(1, 48, 4608, 128, False, "bfloat16")
    folded = CallShape(1, 48, 4608, 128, False, "bfloat16", folded=True)
    assert router.choose(plain).path == "stock"  # 4608 < the unfolded cuDNN threshold; the folded path absent
    assert router.choose(folded).path == "cudnn_fp8_folded"
    assert router.choose(CallShape(1, 24, 1280, 128, False, "bfloat16", folded=True)).path == "stock"
    assert "folded" in folded.label() and folded.entry("x") == plain.entry("x")
    forced = AttentionRouter(paths, torch.device("cpu"), route="cudnn", measure=False)
    assert forced.choose(folded).path == "cudnn_fp8_folded" and forced.choose(plain).path == "cudnn_fp8"


def test_a_measured_path_times_its_prepared_arguments(tmp_path):
    from lowbit_pipe.attention.crossover import AttentionRouter, CallShape, Path8
    from lowbit_pipe.plan import speed_table

    seen = []

    def prepare(q, k, v, sm, mask):
        seen.append("prepare")
        return ("codes", v)

    def run(*args):
        seen.append(args[0])

    table = speed_table.load(tmp_path / "attention", speed_table.TableKey("sim GPU", "2.11", "3.6", "0.1.0"))
    timed = []

    def timer(fn, dev):  # the folded path first (1 ms), then the model's own attention (2 ms, not run here)
        timed.append(fn)
        if len(timed) == 1:
            fn()
        return float(len(timed))

    paths = [Path8("cudnn_fp8_folded", "cudnn_folded", "f", lambda s: None, run, prepare)]
    router = AttentionRouter(paths, torch.device("cpu"), table, timer=timer,
                             inputs=lambda s, d: (torch.zeros(1), torch.zeros(1), torch.zeros(1), None))
    router._can_measure = lambda: True
    choice = router.choose(CallShape(1, 2, 64, 64, False, "bfloat16", folded=True))
    assert seen[:2] == ["prepare", "codes"] and choice.path == "cudnn_fp8_folded" and choice.by == "measured"


def test_the_norm_bound_holds_where_it_is_tight():
    """A row with one nonzero channel puts sqrt(D) on it: the bound's worst case, met within its margin."""
    from lowbit_pipe.kernels.norm_rope import norm_bound, reference_rms_norm, reference_rope

    d = 64
    w = torch.randn(d) * 0.5
    x = torch.zeros(1, d, 1, d)
    x[0, torch.arange(d), 0, torch.arange(d)] = torch.randn(d).abs() + 0.1  # token t: channel t alone
    x = torch.cat([x, torch.randn(1, 50, 1, d) * 3 + 2], dim=1)
    y = reference_rms_norm(x, w, 1e-6, 1.0)
    ang = torch.rand(x.shape[1], d // 2) * 6
    ang[:d] = 0  # no rotation where the one-hot rows are: their value stays on their channel
    r = reference_rope(y, ang.cos().repeat_interleave(2, 1), ang.sin().repeat_interleave(2, 1), 1)
    bound = float(norm_bound(w, 1.0, d, torch.device("cpu")))
    amax = float(r.abs().max())
    assert amax <= bound <= amax * 1.02, (amax, bound)


def test_the_folded_arithmetic_keeps_the_cosine():
    """In torch: q and k of RMSNorm + RoPE written with their norm bounds' scales and k unsmoothed (the fold) against
    the unfolded per-tensor quantization with K smoothing, both through the model of cuDNN's kernel: the fold keeps
    the cosine vs bf16 attention above 0.999 and within 5e-5 of the unfolded one (channel offsets on k before its
    norm, peaky scores: norm weights ~1.7)."""
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes
    from lowbit_pipe.kernels.norm_rope import norm_bound, reference_rms_norm, reference_rope, reference_rope_e4m3

    h, n, d = 2, 1024, 128
    gen = torch.Generator().manual_seed(0)
    cos, sin = _freqs(n, d)
    normed, scales = [], []
    for offset in (0.5, 3.0):  # q, k: channel offsets before the norm
        x = torch.randn(1, n, h, d, generator=gen) + torch.randn(1, 1, h, d, generator=gen) * offset
        w = torch.randn(d, generator=gen) * 0.3 + 0.7
        normed.append(reference_rms_norm(x.bfloat16(), w, 1e-5, 1.0))
        scales.append(448.0 / float(norm_bound(w, 1.0, d, torch.device("cpu"))))
    q, k = (reference_rope(y, cos, sin, 1).transpose(1, 2) for y in normed)
    v = (torch.randn(1, n, h, d, generator=gen) + torch.randn(1, 1, h, d, generator=gen)).bfloat16().transpose(1, 2)
    sm = d ** -0.5
    bf16 = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    unfolded = Q.reference_qkv_fp8(q, k, v)
    codes = [reference_rope_e4m3(y, cos, sin, s) for y, s in zip(normed, scales)]
    folded_scales = unfolded.scales.clone()
    folded_scales[:2, 0] = 1 / torch.tensor(scales)
    folded = Q.QKVFP8(codes[0], codes[1], unfolded.v8, folded_scales, unfolded.v_mean, None)
    c_unfolded = _cos(reference_from_codes(unfolded, sm, torch.float32), bf16)
    c_folded = _cos(reference_from_codes(folded, sm, torch.float32), bf16)
    assert c_folded > 0.999 and abs(c_folded - c_unfolded) < 5e-5, (c_folded, c_unfolded)


# ------------------------------------------------------------------------------------------------------ kernels
def test_fold_kernels_interpreted():
    pytest.importorskip("numpy")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0 and "RESULT OK" in proc.stdout, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean())


def _freqs(s: int, d: int, seed: int = 0):
    ang = torch.rand(s, d // 2, generator=torch.Generator().manual_seed(seed)) * 6
    return ang.cos().repeat_interleave(2, 1).contiguous(), ang.sin().repeat_interleave(2, 1).contiguous()


def _child_kernels() -> None:
    """rope_e4m3, v_stats and quantize_folded against their torch forms (the interpreter mis-rounds ~2 % of fp32 ->
    e4m3 casts: codes get a 5 % budget, statistics and scales are held tightly)."""
    from lowbit_pipe.kernels import norm_rope as R
    from lowbit_pipe.kernels import qkv_fp8 as Q

    gen = torch.Generator().manual_seed(0)
    for b, s, h, d, masked in ((2, 70, 3, 32, True), (1, 130, 2, 64, False), (2, 40, 1, 16, "empty"),
                                (2, 20, 16, 32, True)):
        x = torch.randn(b, s, h, d, generator=gen).bfloat16()
        w = torch.randn(d, generator=gen) * 0.3
        y = R.reference_rms_norm(x, w, 1e-5, 1.0)
        cos, sin = _freqs(s, d)
        mask = None
        if masked:
            mask = torch.rand(b, s, generator=gen) > 0.3
            if masked == "empty":
                mask[1] = False
        what = f"{b}x{s}x{h}x{d} masked={masked}"
        pos = Q.key_order(mask)[0] if mask is not None else None
        scale = 448.0 / R.norm_bound(w, 1.0, d, torch.device("cpu"))
        amax = torch.zeros(1)
        got = R.rope_e4m3(y, cos, sin, scale, amax, mask, pos)
        ref = R.reference_rope_e4m3(y, cos, sin, float(scale), mask)
        assert got.shape == y.shape and got.dtype == torch.float8_e4m3fn
        assert _mismatch(got, ref) <= 0.05, f"rope codes, {what}: {_mismatch(got, ref):.1%}"
        exact = (y.float() * cos[None, :, None] + torch.stack([-y[..., 1::2], y[..., 0::2]], -1).flatten(3).float()
                 * sin[None, :, None]).abs().max()
        torch.testing.assert_close(amax[0], exact, rtol=1e-6, atol=0, msg=f"amax, {what}")
        assert float(amax) * float(scale) <= 448.0, what  # the bound held: nothing saturated
        untracked = R.rope_e4m3(y, cos, sin, scale, None, mask, pos)  # the fold's default: no amax atomics
        assert torch.equal(untracked.view(torch.uint8), got.view(torch.uint8)), what
        # v alone: statistics exact, codes and scales as the unfolded quantization writes them
        v = torch.randn(b, s, h, d, generator=gen).bfloat16().transpose(1, 2) + 1.5
        k8 = ref
        st, rs = Q.v_stats(v, mask), Q.reference_stats(v, v, v, mask)
        torch.testing.assert_close(st.v_mean, rs.v_mean, rtol=1e-5, atol=1e-5, msg=f"v_mean, {what}")
        torch.testing.assert_close(st.amax[2], rs.amax[2], rtol=1e-5, atol=1e-5, msg=f"v amax, {what}")
        qk_scale = torch.tensor([3.0, float(scale)])
        folded = Q.quantize_folded(got, k8, qk_scale, v, mask)
        full = Q.reference_qkv_fp8(v, v, v, mask)
        assert folded.q8 is got and folded.k8 is k8
        assert _mismatch(folded.v8, full.v8) <= 0.05, f"v codes, {what}"
        torch.testing.assert_close(folded.scales[Q.DESCALE_V:Q.DESCALE_O + 1, 0],
                                   full.scales[Q.DESCALE_V:Q.DESCALE_O + 1, 0], rtol=1e-6, atol=0, msg=what)
        torch.testing.assert_close(folded.scales[:2, 0], 1 / qk_scale, rtol=1e-6, atol=0, msg=what)
        if mask is not None:
            assert folded.seq_len_kv.view(-1).tolist() == mask.sum(1).tolist()
        print(f"ok kernels {what}", flush=True)


class _ModelCudnn:
    """cuDNN stood in for by the torch model of its arithmetic (reference_from_codes), for the CPU."""

    def __init__(self):
        self.calls = []

    def plan_key(self, q, masked, sm):
        return (tuple(q.shape), masked, sm)

    def execute(self, key, qkv, o8):
        from lowbit_pipe.kernels import qkv_fp8 as Q
        from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes

        self.calls.append(key)
        out = reference_from_codes(qkv, key[2], torch.float32)  # [B, H, N, D] after O's conversion
        b, h, n, d = out.shape
        o = (out - qkv.v_mean.view(b, h, 1, d)) / qkv.scales[Q.DESCALE_O, 0]
        o8.copy_(o.nan_to_num(0.0).transpose(1, 2).to(torch.float8_e4m3fn))
        return o8


class _AlwaysFolded:
    def __init__(self):
        self.shapes = []

    def choose(self, shape, allow_measure=True):
        from lowbit_pipe.attention.crossover import Choice

        self.shapes.append(shape)
        return Choice("cudnn_fp8_folded", None, "test")


def _child_module() -> None:
    """A diffusers Krea 2 attention module (GQA 4 -> 2 heads, head dim 64) with the folding processor: the codes its
    RoPE writes are rope_e4m3's of the module's own q and k (k's keys in key order, GQA's repeat after), and its
    output is the torch model of cuDNN on those codes, with and without the text padding mask. (The interpreter
    mis-rounds some e4m3 casts by a factor 2, so the end-to-end accuracy is tested in torch below and on the GPU.)"""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_krea2 import Krea2Attention, Krea2AttnProcessor

    from lowbit_pipe.attention import processors as P
    from lowbit_pipe.attention.fold import QKFold
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes
    from lowbit_pipe.kernels.norm_rope import reference_rope_e4m3

    torch.manual_seed(0)
    h, hkv, d, n = 4, 2, 64, 96
    attn = Krea2Attention(h * d, h, hkv).to(torch.bfloat16)
    with torch.no_grad():
        attn.norm_q.weight.normal_(0.7, 0.3)
        attn.norm_k.weight.normal_(0.7, 0.3)
    stock = attn.processor
    calls = Counter()
    cudnn, router = _ModelCudnn(), _AlwaysFolded()
    fold = QKFold(router, cudnn, calls, P.traced_counting(calls), devices=("cpu",), check_bounds=True)
    dispatch = P.Dispatch8("fp8", Krea2AttnProcessor.__call__.__globals__[P.DISPATCH_GLOBAL], calls, (), None, cudnn,
                           fold)
    proc = P.processor_for(stock, P.processor_class(Krea2AttnProcessor, dispatch))
    seen = {}
    attend = fold.attend

    def spy(q, k, v, scale):
        seen.update(q=q, k=k, v=v, scale=fold.active.scale.clone(), mask=fold.active.key_mask)
        out = attend(q, k, v, scale)
        seen["out"] = out
        return out

    fold.attend = spy
    x = torch.randn(2, n, h * d).bfloat16()
    rope = _freqs(n, d, seed=3)
    for masked in (False, True):
        mask = None
        if masked:
            mask = torch.ones(2, n, dtype=torch.bool)
            mask[0, 10:40] = False
            mask = mask[:, None, None, :]
        with torch.no_grad():
            attn.set_processor(proc)
            got = attn(x, mask, rope)
            attn.set_processor(stock)
            want = stock(attn, x, mask, rope)
            q = attn.norm_q(attn.to_q(x).unflatten(-1, (h, d)))
            k = attn.norm_k(attn.to_k(x).unflatten(-1, (hkv, d)))
        key_mask = mask.view(2, n) if masked else None
        scale = seen["scale"]
        q8 = reference_rope_e4m3(q, *rope, float(scale[0]))
        k8 = reference_rope_e4m3(k, *rope, float(scale[1]), key_mask).repeat_interleave(h // hkv, dim=2)
        assert _mismatch(seen["q"], q8) <= 0.05 and _mismatch(seen["k"], k8) <= 0.05, masked
        assert (key_mask is None) == (seen["mask"] is None)
        # the same codes through the torch model: the plumbing (layouts, GQA, key order, scales, output) is exact
        qkv = Q.reference_qkv_fp8(*(seen["v"].transpose(1, 2),) * 3, key_mask)
        scales = qkv.scales.clone()
        scales[:2, 0] = 1 / scale
        model = reference_from_codes(Q.QKVFP8(seen["q"], seen["k"], qkv.v8, scales, qkv.v_mean, qkv.seq_len_kv),
                                     d ** -0.5, torch.float32).transpose(1, 2).flatten(2)
        assert _cos(seen["out"].flatten(2), model) > 0.99, (masked, _cos(seen["out"].flatten(2), model))
        assert _cos(got, want) > 0.95 and not torch.isnan(got).any(), (masked, _cos(got, want))
        # the stock path of the same module still runs RoPE in bf16 (nothing left behind)
        assert apply_rotary_emb(q, rope, sequence_dim=1).dtype == torch.bfloat16
        shape = router.shapes[-1]
        assert (shape.heads, shape.tokens, shape.head_dim, shape.masked, shape.folded) == (h, n, d, masked, True)
        assert float(fold.last_amax[0]) * float(scale[0]) <= 448 and float(fold.last_amax[1]) * float(scale[1]) <= 448
        print(f"ok module masked={masked}", flush=True)
    assert calls["cudnn_fp8_folded"] == 2 and fold.folded_calls == 2 and len(cudnn.calls) == 2, dict(calls)
    assert fold.active is None  # the call's state is gone after it


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run through pytest (it sets TRITON_INTERPRET=1 for this child)")
    start = time.perf_counter()
    try:
        _child_kernels()
        _child_module()
        print(f"RESULT OK {time.perf_counter() - start:.1f} s")
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        print("RESULT FAIL")
        raise SystemExit(1)
