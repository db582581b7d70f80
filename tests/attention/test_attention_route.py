"""The attention router (lowbit_pipe.attention.crossover) with simulated tables and clocks, the per-tensor fp8
quantization of q, k, v for cuDNN (lowbit_pipe.kernels.qkv_fp8: its Triton kernels under TRITON_INTERPRET in a
child process, against their torch forms) and the torch model of cuDNN's FP8 attention. No GPU, no cuDNN:
tests/attention/test_gpu_cudnn_attention.py runs the kernel itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout (not conftest's: this file also runs as a script)

pytest.importorskip("triton")

from lowbit_pipe.attention import crossover as X  # noqa: E402
from lowbit_pipe.attention.route import NO_KERNEL  # noqa: E402
from lowbit_pipe.plan import speed_table  # noqa: E402

# ------------------------------------------------------------------------------------------------------ router
K48 = X.CallShape(1, 48, 4608, 128, False, "bfloat16")
K48_2048 = X.CallShape(1, 48, 16896, 128, False, "bfloat16")
K48_MASKED = X.CallShape(1, 48, 4608, 128, True, "bfloat16")
F24_512 = X.CallShape(1, 24, 1280, 128, False, "bfloat16")


def _paths(cudnn_refuses=lambda s: None, triton_dims=(64, 128)):
    def never(*args):
        raise AssertionError("a path's call ran where only its time was wanted")

    return [X.Path8(X.CUDNN, "cudnn", "cudnn_fp8 (fe 1.20.0)", cudnn_refuses, never),
            X.Path8("fp8", "triton", "triton_fp8", lambda s: None if s.head_dim in triton_dims else NO_KERNEL, never)]


def _table(tmp_path, times: dict[tuple[X.CallShape, str], float]) -> speed_table.SpeedTable:
    key = speed_table.TableKey("NVIDIA H100 80GB HBM3 (simulated)", "2.11", "3.6", "0.1.0")
    table = speed_table.SpeedTable(key, speed_table.table_path(tmp_path, key))
    labels = {X.CUDNN: "cudnn_fp8 (fe 1.20.0)", "fp8": "triton_fp8", X.STOCK: X.STOCK}
    table.times_ms = {shape.entry(labels[path]): ms for (shape, path), ms in times.items()}
    return table


def _router(paths, table=None, measure=False, **kw) -> X.AttentionRouter:
    return X.AttentionRouter(paths, torch.device("cuda", 0), table, measure=measure, **kw)


# Simulated H100 times (ms), per shape: cuDNN wins at 48 x 4608 and 2048², the model's own at 512², Triton nowhere
SIMULATED = {(K48, X.CUDNN): 0.70, (K48, "fp8"): 0.93, (K48, X.STOCK): 0.787,
             (K48_2048, X.CUDNN): 8.4, (K48_2048, "fp8"): 9.7, (K48_2048, X.STOCK): 11.2,
             (F24_512, X.CUDNN): 0.06, (F24_512, "fp8"): 0.19, (F24_512, X.STOCK): 0.042,
             (K48_MASKED, X.CUDNN): 0.66, (K48_MASKED, "fp8"): 0.86, (K48_MASKED, X.STOCK): 2.9}


@pytest.mark.parametrize("shape, path", [(K48, X.CUDNN), (K48_2048, X.CUDNN), (F24_512, X.STOCK),
                                         (K48_MASKED, X.CUDNN)])
def test_the_measured_table_picks_the_fastest_path(tmp_path, shape, path):
    router = _router(_paths(), _table(tmp_path, SIMULATED))
    choice = router.choose(shape)
    assert choice.path == path and choice.by == "measured", choice
    assert choice.ms[X.STOCK] == SIMULATED[(shape, X.STOCK)]
    if path == X.STOCK:
        assert choice.why == "faster at this shape (measured)"
    assert router.as_dict()["shapes"][shape.label()]["path"] == path


def test_a_path_must_beat_the_models_attention_by_the_margin(tmp_path):
    """Within timing noise of the stock time the model's own attention stays: never slower than bf16."""
    times = dict(SIMULATED)
    times[(K48, X.CUDNN)] = 0.787 * 0.99  # 1 % faster: inside the 2 % margin
    assert _router(_paths(), _table(tmp_path, times)).choose(K48).path == X.STOCK
    times[(K48, X.CUDNN)] = 0.787 * 0.97
    assert _router(_paths(), _table(tmp_path, times)).choose(K48).path == X.CUDNN
    times[(K48, "fp8")] = 0.787 * 0.90  # Triton faster still: the fastest wins, not the first listed
    assert _router(_paths(), _table(tmp_path, times)).choose(K48).path == "fp8"


@pytest.mark.parametrize("shape, with_cudnn, path", [
    (K48, True, X.STOCK),  # 4608 unmasked: cuDNN's kernel gain is eaten by the quantization passes
    (K48_2048, True, X.CUDNN), (F24_512, True, X.STOCK), (K48_MASKED, True, X.CUDNN),
    (K48, False, X.STOCK), (K48_2048, False, "fp8"), (K48_MASKED, False, "fp8"),
    (X.CallShape(1, 48, 8192, 128, False, "bfloat16"), True, X.CUDNN),
    (X.CallShape(1, 48, 8192, 128, False, "bfloat16"), False, X.STOCK),
])
def test_without_a_measurement_the_default_rule_decides(shape, with_cudnn, path):
    paths = _paths() if with_cudnn else _paths()[1:]
    choice = _router(paths).choose(shape)
    assert (choice.path, choice.by) == (path, "default rule"), choice


def test_a_table_missing_a_path_falls_to_the_default_rule(tmp_path):
    times = {key: ms for key, ms in SIMULATED.items() if key != (K48_2048, "fp8")}
    choice = _router(_paths(), _table(tmp_path, times)).choose(K48_2048)
    assert choice.by == "default rule" and choice.path == X.CUDNN


def test_refused_forms_and_head_dims_route_elsewhere(tmp_path):
    # cuDNN refuses masked forms (no padding mask for FP8 on this cuDNN): the masked call goes to the Triton kernel
    router = _router(_paths(cudnn_refuses=lambda s: "cuDNN refused the graph: padding" if s.masked else None),
                     _table(tmp_path, SIMULATED))
    assert router.choose(K48_MASKED).path == "fp8"
    assert router.choose(K48).path == X.CUDNN
    # head dim 96: neither kernel -> the model's own attention, saying why
    both_refuse = _paths(cudnn_refuses=lambda s: "head dim 96: ...", triton_dims=(64, 128))
    choice = _router(both_refuse).choose(X.CallShape(1, 24, 4608, 96, False, "bfloat16"))
    assert choice.path == X.STOCK and NO_KERNEL in choice.why and "head dim 96" in choice.why
    # the Triton kernel alone (int8, or no cuDNN): its refusal is the one the reports always gave
    choice = _router(_paths()[1:]).choose(X.CallShape(1, 24, 4608, 96, False, "bfloat16"))
    assert (choice.path, choice.why) == (X.STOCK, NO_KERNEL)


def test_a_forced_route_takes_that_kernel_wherever_it_serves(tmp_path):
    table = _table(tmp_path, SIMULATED)
    assert _router(_paths(), table, route="triton").choose(F24_512).path == "fp8"
    assert _router(_paths(), table, route="cudnn").choose(F24_512).path == X.CUDNN
    refusing = _paths(cudnn_refuses=lambda s: "refused" if s.masked else None)
    assert _router(refusing, table, route="cudnn").choose(K48_MASKED).path == "fp8"  # the next kernel, not stock
    with pytest.raises(ValueError, match="route"):
        _router(_paths(), route="fastest")


def test_missing_times_are_measured_once_saved_and_reused(tmp_path, monkeypatch):
    """A shape the table lacks is timed on the spot (each path once), saved through the speed table's file
    mechanism, and a router built later on the same file decides without measuring."""
    clock = {"cudnn_fp8": 0.5, "fp8": 0.9, "stock": 0.8}
    timed, saved = [], []

    def timer(fn, device):
        label = fn()  # the fake paths return their name instead of attending
        timed.append(label)
        return clock[label]

    paths = _paths()
    for p in paths:
        p.run = lambda q, k, v, sm, mask, name=p.name: name
    monkeypatch.setattr(X, "stock_attention", lambda q, k, v, sm, mask: "stock")
    real_save = speed_table.save
    monkeypatch.setattr(speed_table, "save", lambda t: (saved.append(dict(t.times_ms)), real_save(t)))
    key = speed_table.TableKey("sim GPU", "2.11", "3.6", "0.1.0")
    directory = tmp_path / "attention"
    router = _router(paths, speed_table.load(directory, key), measure=True, timer=timer,
                     inputs=lambda shape, device: (None,) * 4)
    choice = router.choose(K48)
    assert router.choose(K48) is choice  # remembered: measured once
    assert choice.path == X.CUDNN and choice.by == "measured" and sorted(timed) == ["cudnn_fp8", "fp8", "stock"]
    assert len(saved) == 1 and saved[0][K48.entry("cudnn_fp8 (fe 1.20.0)")] == 0.5
    on_disk = json.loads(speed_table.table_path(directory, key).read_text())
    assert on_disk["times_ms"][K48.entry(X.STOCK)] == 0.8
    again = _router(_paths(), speed_table.load(directory, key))  # measure=False: only the file can answer
    assert again.choose(K48).path == X.CUDNN and again.choose(K48).by == "measured"


def test_a_failed_measurement_falls_to_the_default_rule_and_says_so():
    def timer(fn, device):
        raise RuntimeError("CUDA out of memory (simulated)")

    router = _router(_paths(), None, measure=True, timer=timer, inputs=lambda s, d: (None,) * 4)
    choice = router.choose(K48_2048)
    assert choice.by == "default rule" and choice.path == X.CUDNN
    assert "out of memory" in router.as_dict()["measure_errors"][K48_2048.label()]


def test_a_report_made_before_any_call_shows_the_choices_made_after(tmp_path):
    """quantize puts the applied attention's report in report.json before the model runs: the route's shapes are
    the router's own dict, filled as calls come."""
    router = _router(_paths(), _table(tmp_path, SIMULATED))
    report = router.as_dict()
    assert report["shapes"] == {}
    router.choose(K48)
    router.choose(F24_512)
    assert report["shapes"][K48.label()] == {"path": X.CUDNN, "by": "measured",
                                             "ms": {X.CUDNN: 0.7, "fp8": 0.93, X.STOCK: 0.787}}
    assert report["shapes"][F24_512.label()]["path"] == X.STOCK
    json.dumps(report)


def test_pick_reads_the_call_shape(tmp_path):
    router = _router(_paths(), _table(tmp_path, SIMULATED))
    q = torch.empty(1, 4608, 48, 128, dtype=torch.bfloat16).transpose(1, 2)  # [B, H, N, D] view, diffusers' layout
    assert router.pick(q, masked=True) == (X.CUDNN, None)
    small = torch.empty(1, 24, 1280, 128, dtype=torch.bfloat16)
    assert router.pick(small, masked=False) == (X.STOCK, "faster at this shape (measured)")


def test_under_torch_compile_a_routed_call_is_one_op_that_picks_when_it_runs(tmp_path):
    """torch.compile (fullgraph, aot_eager: the fake impl traced) sees one custom op; the router picks, counts and
    runs each call when the graph runs, per shape -- a second shape (which makes dynamo's shapes dynamic) too."""
    import torch._dynamo

    wins, loses = X.CallShape(1, 2, 64, 16, False, "float32"), X.CallShape(1, 2, 32, 16, False, "float32")
    times = {(wins, X.CUDNN): 1.0, (wins, "fp8"): 3.0, (wins, X.STOCK): 2.0,
             (loses, X.CUDNN): 1.0, (loses, "fp8"): 3.0, (loses, X.STOCK): 0.5}
    paths = _paths()
    paths[0].run = lambda q, k, v, sm, mask: q * 2  # stands for cuDNN's kernel: recognisable output
    calls = __import__("collections").Counter()
    router = _router(paths, _table(tmp_path, times), calls=calls)

    def f(q, k, v):
        return X.routed_attention_op(q, k, v, None, None, router.key)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for n in (64, 64, 32):
        q, k, v = (torch.randn(1, n, 2, 16).transpose(1, 2) for _ in range(3))  # [B, H, N, D] views
        out = compiled(q, k, v)
        assert out.stride() == q.stride()
        want = q * 2 if n == 64 else torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(out, want)
    assert dict(calls) == {X.CUDNN: 2, "stock: faster at this shape (measured)": 1}, calls
    torch._dynamo.reset()


def test_the_attention_table_is_the_speed_tables_file_under_attention(tmp_path):
    table = X.load_table(torch.device("cpu"), str(tmp_path))
    assert table.path.parent == tmp_path / "attention" and table.path.name.startswith("speed_")
    assert table.key == speed_table.table_key(torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------ torch model
def _qkv(b, h, n, d, seed=0, dtype=torch.float32):
    """DiT-like: peaky scores (std 3), per-channel offsets on k (2) and v (1); [B, H, N, D] views of [B, N, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, b, n, h, d, generator=gen) * torch.tensor([3 ** 0.5, 3 ** 0.5, 1.0]).view(3, 1, 1, 1, 1)
    q, k, v = (t.transpose(1, 2) for t in x)
    k = k + torch.randn(1, h, 1, d, generator=gen) * 2
    v = v + torch.randn(1, h, 1, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def test_key_order_puts_the_attended_keys_first():
    from lowbit_pipe.kernels.qkv_fp8 import key_order

    mask = torch.tensor([[True, False, False, True, True, False], [True] * 6, [False] * 6])
    pos, count = key_order(mask)
    assert count.tolist() == [3, 6, 0]
    assert pos.tolist() == [[0, 3, 4, 1, 2, 5], list(range(6)), list(range(6))]
    assert pos.dtype == torch.int32


def test_the_cudnn_model_is_near_exact_attention_and_honours_the_mask():
    """The torch model of the cuDNN path (per-tensor e4m3 q, k, v with K / V smoothing, P and O in e4m3) is within
    the accuracy target of exact attention, masked keys are left out whatever they hold, and a batch without an
    attended key gives NaN, as torch's SDPA does."""
    from lowbit_pipe.kernels.attention8 import exact_attention
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_attention

    q, k, v = _qkv(2, 2, 384, 64)
    exact = exact_attention(q, k, v)
    out = reference_attention(q, k, v)
    assert 0.999 < _cos(out, exact) < 0.99999, _cos(out, exact)  # present and small
    mask = torch.ones(2, 384, dtype=torch.bool)
    mask[0, 20:90] = False
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 20:90] *= 50  # what masked keys hold must not matter (nor widen a scale)
    v2[0, :, 20:90] += 1e3
    masked = reference_attention(q, k2, v2, key_mask=mask)
    assert _cos(masked, exact_attention(q, k, v, key_mask=mask)) > 0.999
    torch.testing.assert_close(masked, reference_attention(q, k, v, key_mask=mask))
    mask[1] = False
    empty = reference_attention(q, k, v, key_mask=mask)
    assert torch.isnan(empty[1]).all() and not torch.isnan(empty[0]).any()


def test_smoothing_is_what_keeps_the_cosine_above_0999():
    """Without the means taken out, per-tensor e4m3 with an e4m3 output misses the target at these offsets: the
    smoothing is load-bearing (measured here 0.9990 vs 0.9996)."""
    from lowbit_pipe.kernels import qkv_fp8 as Q
    from lowbit_pipe.kernels.attention8 import exact_attention
    from lowbit_pipe.kernels.cudnn_fp8_attention import reference_from_codes

    q, k, v = _qkv(1, 4, 512, 128, seed=1)
    exact = exact_attention(q, k, v)
    smooth = Q.reference_qkv_fp8(q, k, v)
    smoothed = reference_from_codes(smooth, 128 ** -0.5, torch.float32)
    # the same arithmetic without smoothing: codes of the raw k and v, means zero
    amax = torch.stack([t.abs().amax() for t in (q, k, v)])
    codes = [Q.e4m3(t.float() * (Q.FP8_MAX / a)).transpose(1, 2).contiguous().to(torch.float8_e4m3fn)
             for t, a in zip((q, k, v), amax)]
    scales = smooth.scales.clone()
    scales[Q.DESCALE_Q:Q.DESCALE_V + 1, 0] = amax / Q.FP8_MAX
    scales[Q.SCALE_O, 0], scales[Q.DESCALE_O, 0] = Q.FP8_MAX / amax[2], amax[2] / Q.FP8_MAX
    raw = reference_from_codes(Q.QKVFP8(*codes, scales, torch.zeros_like(smooth.v_mean), None), 128 ** -0.5,
                               torch.float32)
    assert _cos(smoothed, exact) > 0.9993 > _cos(raw, exact), (_cos(smoothed, exact), _cos(raw, exact))


def test_the_custom_ops_fake_impl_gives_q_layout():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowbit_pipe.kernels.cudnn_fp8_attention import cudnn_fp8_attention_op

    with FakeTensorMode():
        q = torch.empty(1, 300, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
        out = cudnn_fp8_attention_op(q, q, q, 0.125, None, 12345)
        assert out.shape == q.shape and out.stride() == q.stride() and out.dtype == torch.bfloat16


def test_a_missing_frontend_says_how_to_install_it(monkeypatch):
    from lowbit_pipe.kernels import cudnn_fp8_attention as C

    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    with pytest.raises(ImportError, match=r"lowbit_pipe\[cudnn\]"):
        C.import_cudnn()


def test_head_dims_cudnn_takes():
    from lowbit_pipe.kernels.cudnn_fp8_attention import head_dim_refusal

    assert head_dim_refusal(128, (9, 0)) is None and head_dim_refusal(256, (9, 0)) is None
    assert head_dim_refusal(256, (10, 0)) is not None and head_dim_refusal(96, (9, 0)) is not None
    assert "Hopper" in head_dim_refusal(128, (8, 9))


# ------------------------------------------------------------------------------------------------------ Triton kernels
def test_quantization_kernels_interpreted():
    pytest.importorskip("numpy")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "RESULT OK" in proc.stdout, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def _fp8_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.view(torch.uint8) != b.view(torch.uint8)).float().mean())


def _child() -> None:
    """Under TRITON_INTERPRET=1: the statistics, codes, key order, scales and output of lowbit_pipe.kernels.qkv_fp8
    against their torch forms. The interpreter mis-rounds ~2 % of fp32 -> e4m3 casts (tests/kernels/test_kernels.py): codes
    are held to a 5 % mismatch budget, everything else tightly."""
    from lowbit_pipe.kernels import qkv_fp8 as Q

    for b, h, n, d, masked, dtype in ((2, 2, 70, 32, True, torch.float32), (1, 3, 300, 64, False, torch.bfloat16),
                                      (2, 1, 40, 16, "empty", torch.float32)):
        q, k, v = _qkv(b, h, n, d, seed=n, dtype=dtype)
        mask = None
        if masked:
            mask = torch.ones(b, n, dtype=torch.bool)
            mask[0, 5:20] = False
            if masked == "empty":
                mask[1] = False
            k[0, :, 5:20] += 100  # masked keys: out of the statistics
        what = f"{b}x{h}x{n}x{d} masked={masked} {dtype}"
        got, ref = Q.qkv_stats(q, k, v, mask), Q.reference_stats(q, k, v, mask)
        for name in ("k_mean", "v_mean", "amax"):
            torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-5, atol=1e-5,
                                       msg=f"{name}, {what}")
        got, ref = Q.quantize_qkv_fp8(q, k, v, mask), Q.reference_qkv_fp8(q, k, v, mask)
        torch.testing.assert_close(got.scales[:Q.DESCALE_O + 1, 0], ref.scales[:Q.DESCALE_O + 1, 0], rtol=1e-6, atol=0,
                                   msg=f"scales, {what}")
        for name in ("q8", "k8", "v8"):
            a, r = getattr(got, name), getattr(ref, name)
            assert a.shape == (b, n, h, d) and a.dtype == torch.float8_e4m3fn and a.is_contiguous(), (name, what)
            assert _fp8_mismatch(a, r) <= 0.05, f"{name} codes, {what}: {_fp8_mismatch(a, r):.1%} differ"
        if mask is not None:
            count = mask.sum(1)
            assert got.seq_len_kv.view(-1).tolist() == count.tolist()
            for bi in range(b):  # the masked keys' slots (past the count) hold zero codes
                assert not got.k8[bi, int(count[bi]):].float().any() and not got.v8[bi, int(count[bi]):].float().any()
        # output: a made-up e4m3 O through the finisher, into q's layout
        o8 = Q.e4m3(torch.randn(b, n, h, d, generator=torch.Generator().manual_seed(1)) * 100).to(torch.float8_e4m3fn)
        out = Q.finish_output(o8, got, torch.empty_like(q))
        want = Q.reference_finish_output(o8, got, q.dtype)
        assert out.stride() == q.stride()
        keep = ~torch.isnan(want)
        assert torch.equal(torch.isnan(out), ~keep), f"NaN rows, {what}"
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # the interpreter's bf16 store truncates
        torch.testing.assert_close(out[keep].float(), want[keep].float(), rtol=tol, atol=tol, msg=f"output, {what}")
        print(f"ok {what}", flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run through pytest (it sets TRITON_INTERPRET=1 for this child)")
    start = time.perf_counter()
    try:
        _child()
        print(f"RESULT OK {time.perf_counter() - start:.1f} s")
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        print("RESULT FAIL")
        raise SystemExit(1)
