"""The recipe's `attention:` section: 8-bit attention through the diffusers attention processors of the tiny Krea 2
and FLUX.1, recorded in the ledger and undone by teardown; evaluate's report of the attention's own error."""

from __future__ import annotations

import pytest
import torch

import lowbit_pipe
from lowbit_pipe.arch import detect_model
from lowbit_pipe.attention import apply_attention
from lowbit_pipe.attention.processors import attention_modules
from lowbit_pipe.config.compose import compose_recipe
from lowbit_pipe.errors import RecipeError, StageError
from lowbit_pipe.kernels.attention8 import exact_attention, reference_attention8
from lowbit_pipe.ledger import Ledger


def _inputs(model, tokens: int = 16, seed: int = 3):
    arch = detect_model(model)
    return arch, arch.example_inputs(dict(model.config), batch=1, image_tokens=tokens, text_tokens=4,
                                     generator=torch.Generator().manual_seed(seed), dtype=torch.float32, device="cpu")


def _out(model, arch, inputs):
    with torch.no_grad():
        return arch.output_tensor(model(**inputs))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------------------ recipe
def test_default_recipe_keeps_the_models_attention():
    recipe = compose_recipe("default")
    assert recipe.attention.format == "bf16" and recipe.attention.layers == ["*"]
    assert compose_recipe("default", ["attention.format=fp8"]).attention.format == "fp8"


@pytest.mark.parametrize("override, path, words", [
    (["attention.format=int4"], "attention.format", "bf16, int8, fp8"),
    (["attention.layers=['re:(']"], "attention.layers[0]", "invalid regex"),
    (["attention.layers=[]"], "attention.layers", "at least one"),
    (["attention.format=int8", "pipeline=[load,detect,export]"], "attention.format", "quantize"),
    (["attention.scale=2"], "attention.scale", "no such key"),
    (["attention.fused_norm_rope=true", "pipeline=[load,detect,export]"], "attention.fused_norm_rope", "quantize"),
])
def test_bad_attention_values_name_the_recipe_path(override, path, words):
    with pytest.raises(RecipeError) as err:
        compose_recipe("default", override)
    assert err.value.path == path and words in err.value.problem


# ------------------------------------------------------------------------------------------------------ processors
@pytest.mark.parametrize("arch_id, n_modules", [("krea2", 4), ("flux1", 3)])
def test_processors_run_the_stock_code_with_8bit_attention_and_teardown_restores_them(tiny_model, arch_id, n_modules):
    model = tiny_model(arch_id)
    arch, inputs = _inputs(model)
    stock = {name: m.processor for name, m in attention_modules(model).items()}
    stock_globals = {name: type(p).__call__.__globals__["dispatch_attention_fn"] for name, p in stock.items()}
    before = _out(model, arch, inputs)
    ledger = Ledger()
    applied = apply_attention(model, "int8", ledger)
    assert len(applied.modules) == n_modules == len(stock) and not applied.kept
    for name, module in attention_modules(model).items():
        assert isinstance(module.processor, type(stock[name])) and module.processor is not stock[name]
        # the stock __call__'s own code (norms, RoPE, joint concat and split are diffusers'), one global rebound
        assert type(module.processor).__call__.__code__ is type(stock[name]).__call__.__code__
        assert type(stock[name]).__call__.__globals__["dispatch_attention_fn"] is stock_globals[name]
    after = _out(model, arch, inputs)
    assert sum(applied.calls.values()) == applied.calls["int8"] == n_modules  # every call 8-bit, none stock
    # The 8-bit error of the whole model: present, and small (a transposed layout would be far off).
    assert 1e-6 < _rel(after, before) < 5e-3
    report = ledger.unwind()
    assert report.errors == [] and report.unfreed == [] and report.undone["attention_processor"] == n_modules
    assert all(m.processor is stock[n] for n, m in attention_modules(model).items())
    assert torch.equal(_out(model, arch, inputs), before)  # bit-equal to the float model's output


def test_one_call_is_sdpa8_on_the_stock_processors_q_k_v(tiny_model):
    """FLUX.1's double block: the 8-bit processor's attention output is reference_attention8 of the very q, k, v the
    stock processor attends over (text + image joint, RoPE applied): captured by running the stock processor with a
    dispatch that records them."""
    from lowbit_pipe.attention.processors import Dispatch8, processor_class, processor_for

    model = tiny_model("flux1")
    attn = model.transformer_blocks[0].attn
    stock = attn.processor
    seen = {}

    class Capture(Dispatch8):
        def __call__(self, query, key, value, *args, **kwargs):
            seen["qkv"] = [t.transpose(1, 2).clone() for t in (query, key, value)]
            seen["out"] = super().__call__(query, key, value, *args, **kwargs)
            return seen["out"]

    from collections import Counter

    cls = processor_class(type(stock), Capture("fp8", type(stock).__call__.__globals__["dispatch_attention_fn"],
                                               Counter()))
    attn.set_processor(processor_for(stock, cls))
    gen = torch.Generator().manual_seed(0)
    hidden, text = torch.randn(1, 16, 256, generator=gen), torch.randn(1, 4, 256, generator=gen)
    ids = torch.cat([torch.zeros(4, 3), _inputs(model)[1]["img_ids"]])
    rope = model.pos_embed(ids)
    with torch.no_grad():
        attn(hidden_states=hidden, encoder_hidden_states=text, image_rotary_emb=rope)
    q, k, v = seen["qkv"]
    assert q.shape == (1, 4, 20, 64)  # joint: 4 text + 16 image tokens, 4 heads of 64
    expected = reference_attention8(q, k, v, "fp8")
    assert torch.equal(seen["out"].transpose(1, 2), expected)
    assert 1e-5 < _rel(expected, exact_attention(q, k, v)) < 0.05


def test_key_padding_masks_are_served_and_honoured(tiny_model):
    """Krea 2 with a text padding mask (diffusers passes a [B, 1, 1, N] boolean key mask to every attention): the
    8-bit attention serves the masked calls too and leaves the padded key out; the 8-bit output stays near the
    stock masked output, several times nearer than the output without the mask is."""
    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    unmasked = _out(model, arch, inputs)
    inputs["encoder_attention_mask"] = torch.tensor([[True, True, False, False]])
    masked = _out(model, arch, inputs)
    ledger = Ledger()
    applied = apply_attention(model, "fp8", ledger)
    out8 = _out(model, arch, inputs)
    assert dict(applied.calls) == {"fp8": 4}  # refiner and joint blocks masked, the layerwise block not
    assert _rel(out8, masked) < 5e-3 and _rel(unmasked, masked) > 5 * _rel(out8, masked)
    ledger.unwind()
    assert torch.equal(_out(model, arch, inputs), masked)


def test_masks_other_than_key_padding_run_the_stock_attention():
    """A float (additive) mask, or one that differs per query, is not a key-padding mask: stock, with the reason."""
    from lowbit_pipe.attention.route import key_padding, route_call

    def stock_reason(q, k, v, mask):
        return route_call(q, k, v, mask=mask)[0]

    q = torch.randn(2, 4, 8, 64)
    reason = "attention mask other than a boolean key-padding mask"
    assert stock_reason(q, q, q, mask=torch.zeros(2, 1, 1, 8)) == reason
    assert stock_reason(q, q, q, mask=torch.ones(2, 1, 8, 8, dtype=torch.bool)) == reason
    assert stock_reason(q, q, q, mask=torch.ones(2, 1, 1, 7, dtype=torch.bool)) == reason
    assert stock_reason(q, q, q, mask=torch.ones(2, 1, 1, 8, dtype=torch.bool)) is None
    assert key_padding(torch.ones(1, 8, dtype=torch.bool), 2, 8).shape == (2, 8)


def test_sdpa8_key_mask_against_the_float64_oracle():
    """sdpa8's reference path with a key mask against exact attention over the attended keys only: as close as
    without a mask; masked keys are out of the means and scales too, so what they hold (however large) changes
    no bit of the output."""
    from lowbit_pipe.kernels.attention8 import sdpa8

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 64, generator=gen) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 30:] = False
    mask[1, :5] = False
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 33], v2[0, :, 35], v2[1, :, 2] = 1e3, 1e3, -1e4
    for fmt in ("int8", "fp8"):
        out = sdpa8(q, k, v, fmt, key_mask=mask)
        exact = exact_attention(q, k, v, key_mask=mask).float()
        assert torch.allclose(exact[:1], exact_attention(q[:1], k[:1, :, :30], v[:1, :, :30]).float(), atol=1e-6)
        assert _rel(out, exact) < 1.1 * _rel(sdpa8(q, k, v, fmt), exact_attention(q, k, v)), fmt
        assert torch.equal(sdpa8(q, k2, v2, fmt, key_mask=mask), out)
    with pytest.raises(ValueError, match="key_mask must be"):
        sdpa8(q, k, v, "fp8", key_mask=mask.float())


def test_layers_restrict_it_and_name_the_rest(tiny_model):
    model = tiny_model("krea2")
    ledger = Ledger()
    applied = apply_attention(model, "int8", ledger, ["transformer_blocks.*"])
    assert sorted(applied.modules) == ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]
    assert applied.kept == {"text_fusion.layerwise_blocks.0.attn": "not in attention.layers",
                            "text_fusion.refiner_blocks.0.attn": "not in attention.layers"}
    assert apply_attention(model, "bf16", ledger) is None
    ledger.unwind()
    with pytest.raises(ValueError, match="attention.format must be one of"):
        apply_attention(model, "int4", ledger)


def test_a_compiled_attention_module_is_one_graph(tiny_model):
    """torch.compile (fullgraph) traces the 8-bit processor: the custom op is one node, no graph break."""
    model = tiny_model("krea2")
    arch, inputs = _inputs(model, tokens=16)
    ledger = Ledger()
    apply_attention(model, "int8", ledger)
    block = model.transformer_blocks[0]
    eager_out = {}
    handle = block.attn.register_forward_hook(lambda m, a, o: eager_out.setdefault("y", o))
    kwargs = {}
    handle2 = block.attn.register_forward_pre_hook(lambda m, a, k: kwargs.update(args=a, kw=k), with_kwargs=True)
    _out(model, arch, inputs)
    handle.remove(), handle2.remove()
    torch._dynamo.reset()
    compiled = torch.compile(block.attn, backend="eager", fullgraph=True)
    with torch.no_grad():
        y = compiled(*kwargs["args"], **kwargs["kw"])
    assert torch.equal(y, eager_out["y"])
    torch._dynamo.reset()
    ledger.unwind()


def test_compiled_blocks_with_8bit_attention_compile_once(tiny_model):
    """Every Krea 2 block compiled (regionally, as the compile stage does) with 8-bit attention: repeated forwards
    reuse one graph. The call counter is updated when the graph is traced, not by the graph: counted inside it,
    dynamo guarded on its value and recompiled on every call until its limit (8) sent the blocks back to eager."""
    from lowbit_pipe.stages.compile import dynamo_counters

    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    ledger = Ledger()
    applied = apply_attention(model, "fp8", ledger)
    eager = _out(model, arch, inputs)
    torch._dynamo.reset()
    try:
        for block in model.transformer_blocks:
            block.compile(backend="eager")
        before = dynamo_counters()["graphs"]
        outs = [_out(model, arch, inputs) for _ in range(4)]
        assert dynamo_counters()["graphs"] - before == 1  # the two blocks share their code: one graph, no recompile
        assert all(torch.equal(o, eager) for o in outs)
        assert applied.calls["fp8 (traced)"] == 1 and applied.calls["fp8"] == 4 + 4 * 2  # eager: 4 calls, then the text fusion's 2
    finally:
        for block in model.transformer_blocks:
            block._compiled_call_impl = None
        torch._dynamo.reset()
        ledger.unwind()


# ------------------------------------------------------------------------------------------------------ a run
def test_a_run_applies_reports_and_tears_down(tiny_model, tmp_path):
    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    before = _out(model, arch, inputs)
    stock = {n: m.processor for n, m in attention_modules(model).items()}
    result = lowbit_pipe.run("default", ["attention.format=int8", "evaluate.samples=1", "evaluate.trajectory_seeds=1",
                                         "evaluate.steps=2", "evaluate.layers=false",
                                         "pipeline=[load,detect,quantize,evaluate]"], model=model,
                             run_dir=tmp_path / "run")
    report = result.report
    # the joint blocks' two; the text fusion's two keep the model's attention (Krea 2's attention_keep)
    assert report["attention"]["applied"] and report["attention"]["modules"] == 2
    assert set(report["attention"]["kept"]) == {"text_fusion.layerwise_blocks.0.attn", "text_fusion.refiner_blocks.0.attn"}
    assert all("attention.arch_keep" in why for why in report["attention"]["kept"].values())
    ev = report["evaluate"]
    share = ev["attention"]
    assert share["format"] == "int8" and share["calls"]["int8"] > 0 and set(share["calls"]) == {"int8"}
    # the attention's own error is a part of the whole run's (int8 weights + 8-bit attention)
    assert 0 < share["rel_error"] < ev["rel_error"] and 0 < share["share_of_rel_error"] < 1
    assert share["trajectory"]["min_cosine"] > 0.999 and share["trajectory"]["diverged"] == 0
    summary = (result.run_dir / "summary.txt").read_text()
    assert "attention: int8 on 2 modules (calls: int8 " in summary and "8-bit attention (int8) alone" in summary
    proof = lowbit_pipe.teardown(result)
    assert proof["unfreed"] == [] and proof["errors"] == [] and proof["undone"]["attention_processor"] == 2
    assert all(m.processor is stock[n] for n, m in attention_modules(model).items())
    assert result.context.attention is None
    assert torch.equal(_out(model, arch, inputs), before)


def test_arch_keep_off_gives_every_module_8bit_attention(tiny_model, tmp_path):
    result = lowbit_pipe.run("default", ["attention.format=fp8", "attention.arch_keep=false",
                                         "pipeline=[load,detect,quantize]"], model=tiny_model("krea2"),
                             run_dir=tmp_path / "run")
    assert result.report["attention"]["modules"] == 4 and result.report["attention"]["kept"] == {}
    lowbit_pipe.teardown(result)


def test_the_pipelines_empty_negative_prompt_stays_finite():
    """diffusers' Krea2Pipeline pads each prompt to 512 text tokens and, with guidance, also encodes the empty
    negative prompt: its text is whole blocks of padding before the few suffix tokens, so the first key blocks of
    every attention are all masked. The online softmax must treat them as nothing (they made the image NaN), and the
    8-bit image stays close to the stock attention's."""
    from test_calibration_prompts import tiny_krea2_pipeline

    pipe = tiny_krea2_pipeline()

    def latents() -> torch.Tensor:
        with torch.no_grad():
            return pipe(prompt="a red cat on the mat", num_inference_steps=2, output_type="latent", height=64,
                        width=64, generator=torch.Generator().manual_seed(1)).images

    stock = latents()
    for fmt in ("int8", "fp8"):
        ledger = Ledger()
        applied = apply_attention(pipe.transformer, fmt, ledger)
        try:
            out = latents()
        finally:
            ledger.undo_all()
        assert applied.calls[fmt] > 0 and not any(k.startswith("stock") for k in applied.calls), applied.calls
        assert torch.isfinite(out).all(), fmt
        assert _rel(out, stock) < 0.05, (fmt, _rel(out, stock))
    assert torch.equal(latents(), stock)


# ------------------------------------------------------------------------------------------------------ the bench
@pytest.mark.slow
def test_the_error_bench_runs_and_writes_its_table(tmp_path):
    """bench/attention8_error.py --smoke on the tiny FLUX.1: per-layer figures against float64 attention for every
    joint call, and the trajectory rows (the attention's own share is the float-weights row)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(root / "bench" / "attention8_error.py"), "--smoke", "--archs", "flux1",
                           "--out", str(tmp_path / "err")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "err.json").read_text())
    assert "## Per attention layer" in (tmp_path / "err.md").read_text()
    layers = {r["layer"]: r for r in payload["layers"]}
    assert len(layers) == 3 and all(r["calls"] == 2 for r in layers.values())  # 1 seed x 2 steps
    for r in layers.values():
        assert r["int8"]["min_cosine"] > 0.999 and r["fp8"]["min_cosine"] > 0.999
        assert 0 < r["bf16_sdpa"]["max_rel"] < r["int8"]["max_rel"] < 0.05
        assert r["sageattention"] is None and r["sageattention_note"] == "needs CUDA"
    rows = {(r["weights"], r["attention"]): r for r in payload["trajectories"]}
    assert len(rows) == 8 and ("float", "bf16") not in rows
    assert 0 < rows[("float", "int8")]["mean_rel"] < rows[("int8", "int8")]["mean_rel"]
    assert rows[("float", "int8")]["calls"] == {"int8": 6}


# ------------------------------------------------------------------------------------------------ text padding
def test_evaluate_text_valid_runs_the_pipelines_text_padding_mask(tiny_model, tmp_path):
    """evaluate.text_valid: every forward the recipe runs carries the text padding mask diffusers' Krea2Pipeline
    always passes, the padded text states are ignored by the model, and 8-bit attention serves those calls."""
    model = tiny_model("krea2")
    masks = []
    hook = model.register_forward_pre_hook(lambda m, a, k: masks.append(k.get("encoder_attention_mask")),
                                           with_kwargs=True)
    try:
        result = lowbit_pipe.run("default", ["attention.format=int8", "evaluate.samples=1", "evaluate.text_tokens=8",
                                             "evaluate.text_valid=3", "evaluate.trajectory_seeds=1", "evaluate.steps=2",
                                             "evaluate.layers=false", "pipeline=[load,detect,quantize,evaluate]"],
                                 model=model, run_dir=tmp_path / "run")
    finally:
        hook.remove()
    assert masks and all(m is not None and m.shape == (1, 8) and m[0, :3].all() and not m[0, 3:].any() for m in masks)
    assert result.report["evaluate"]["attention"]["calls"]["int8"] > 0  # the key-padding path serves them
    inputs = result.context.example_inputs(seed=5)
    lowbit_pipe.teardown(result)
    arch = detect_model(model)
    padded = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    padded["encoder_hidden_states"][:, 3:] = 100.0  # what padding holds must not matter
    assert torch.allclose(_out(model, arch, padded), _out(model, arch, inputs), atol=1e-5)
    unmasked = {k: v for k, v in inputs.items() if k != "encoder_attention_mask"}
    assert _rel(_out(model, arch, unmasked), _out(model, arch, inputs)) > 1e-3  # the mask is not a no-op


@pytest.mark.parametrize("arch_id, overrides, words", [
    ("krea2", ["evaluate.text_tokens=8", "evaluate.text_valid=9"], "must be in [1, evaluate.text_tokens=8]"),
    ("flux1", ["evaluate.text_valid=2"], "takes no text padding mask"),
])
def test_text_valid_refusals_name_the_key(tiny_model, tmp_path, arch_id, overrides, words):
    with pytest.raises((RecipeError, StageError)) as info:
        lowbit_pipe.run("default", overrides + ["pipeline=[load,detect,quantize,evaluate]", "evaluate.samples=1",
                                                "evaluate.trajectory_seeds=0"], model=tiny_model(arch_id),
                        run_dir=tmp_path / "run")
    assert "evaluate.text_valid" in str(info.value) and words in str(info.value)


# ------------------------------------------------------------------------------------------------------ fused norm, RoPE
def test_fused_norm_rope_applies_under_8bit_attention_and_teardown_restores(tiny_model, tmp_path):
    """attention.fused_norm_rope: Krea 2's RMSNorms get the one-pass forward, every RoPE-calling processor the
    one-pass RoPE (the kernels in tests/kernels/test_kernels.py, case norm_rope); the 8-bit processors build on those, so
    evaluate's float reference keeps the same RoPE. On the CPU both run the torch code. Teardown puts every forward
    and processor back: the output is the stock model's, bit for bit."""
    from diffusers.models.transformers.transformer_krea2 import Krea2RMSNorm

    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    before = _out(model, arch, inputs)
    norms = [m for m in model.modules() if isinstance(m, Krea2RMSNorm)]
    stock = {n: m.processor for n, m in attention_modules(model).items()}
    args = ["attention.format=int8", "attention.fused_norm_rope=true", "pipeline=[load,detect,quantize]"]
    result = lowbit_pipe.run("default", args, model=model, run_dir=tmp_path / "run")
    fused = result.report["attention"]["fused_norm_rope"]
    assert fused["norm_modules"] == len(norms) > 4 and fused["rope_processors"] == len(stock) == 4
    assert all("forward" in vars(m) for m in norms)
    procs = {n: type(m.processor).__name__ for n, m in attention_modules(model).items()}
    assert procs["transformer_blocks.0.attn"] == "Krea2AttnProcessorFusedRope8bit"
    assert procs["text_fusion.refiner_blocks.0.attn"] == "Krea2AttnProcessorFusedRope"  # arch_keep: bf16 attention
    with result.context.attention.stock():  # the float reference: bf16 attention, the same fused RoPE
        assert type(model.transformer_blocks[0].attn.processor).__name__ == "Krea2AttnProcessorFusedRope"
    proof = lowbit_pipe.teardown(result)
    assert proof["unfreed"] == [] and proof["errors"] == [] and proof["undone"]["attention_processor"] == 4 + 2
    assert not any("forward" in vars(m) for m in norms)
    assert all(m.processor is stock[n] for n, m in attention_modules(model).items())
    assert torch.equal(_out(model, arch, inputs), before)


def test_fused_norm_rope_opens_krea2s_shared_inputs_for_one_quantization(tiny_model, tmp_path):
    """attention.fused_norm_rope on Krea 2: the attention modules (under the 8-bit processors built on the stock one)
    and the SwiGLUs open their input to one activation quantization while they run (dispatch.shared_inputs' tag,
    seen by q / k / v / gate and the MLP's gate / up; never by the output projections), inference tensors
    included, and leave nothing on it; a processor of another class gets no scope; teardown removes the forwards."""
    from lowbit_pipe.kernels import dispatch

    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    args = ["attention.format=int8", "attention.fused_norm_rope=true", "pipeline=[load,detect,quantize]"]
    result = lowbit_pipe.run("default", args, model=model, run_dir=tmp_path / "run")
    fused = result.report["attention"]["fused_norm_rope"]
    shared = [n for n, m in model.named_modules() if type(m).__name__ in ("Krea2Attention", "Krea2SwiGLU")]
    assert fused["shared_input_modules"] == len(shared) > 4
    block = model.transformer_blocks[0]
    probes = {"attn.to_q": True, "attn.to_gate": True, "ff.gate": True, "ff.up": True, "ff.down": False}
    seen: dict[str, list[bool]] = {}
    held: list[torch.Tensor] = []

    def probe(name):
        def hook(module, hook_args):
            seen.setdefault(name, []).append(bool(hook_args[0].__dict__.get(dispatch.SHARED_INPUT_TAG)))
            held.append(hook_args[0])
        return hook

    modules = dict(block.named_modules())
    handles = [modules[n].register_forward_pre_hook(probe(n)) for n in probes]
    try:
        with torch.inference_mode():
            _out(model, arch, inputs)
        assert {n: all(v) if probes[n] else any(v) for n, v in seen.items()} == probes, seen
        assert not [k for t in held for k in t.__dict__ if k.startswith("_lowbit")]
        seen.clear()
        processor = block.attn.processor
        class OtherProcessor:  # code that was not read: it calls the real one, but nothing vouches for it
            def __call__(self, *call_args, **call_kwargs):
                return processor(*call_args, **call_kwargs)

        block.attn.processor = OtherProcessor()
        with torch.inference_mode():
            _out(model, arch, inputs)
        assert seen["attn.to_q"] == [False] and all(seen["ff.up"]), seen  # unknown processor code: no scope
        block.attn.processor = processor
    finally:
        for h in handles:
            h.remove()
    proof = lowbit_pipe.teardown(result)
    assert proof["errors"] == [] and not any("forward" in vars(m) for n, m in model.named_modules() if n in shared)


def test_fused_rope_serves_only_what_its_kernel_computes():
    """FusedRope hands every form its kernel does not compute (CPU tensors, complex freqs, unbind -2, fp64 cos) to
    the stock function, with the stock arguments."""
    from lowbit_pipe.attention.fused import FusedRope
    from lowbit_pipe.kernels import norm_rope

    seen = []

    def stock(x, freqs, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        seen.append((use_real, use_real_unbind_dim, sequence_dim))
        return x

    rope = FusedRope(stock, norm_rope)
    x = torch.randn(1, 4, 2, 8)
    cos = torch.randn(4, 8)
    rope(x, (cos, cos), sequence_dim=1)
    rope(x, (cos, cos), use_real_unbind_dim=-2, sequence_dim=1)
    rope(x, (cos.double(), cos.double()), sequence_dim=1)
    assert seen == [(True, -1, 1), (True, -2, 1), (True, -1, 1)] and rope.calls == 0


def test_the_eager_norm_rope_bench_runs_and_writes_its_table(tmp_path):
    """bench/eager_norm_rope.py --small on the CPU: the five rows, each fused row against its stock one (the torch
    code on the CPU, so bit-equal and no kernel call), its table, and every ledger unwound clean (it asserts so)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "enr.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "eager_norm_rope.py"), "--device", "cpu", "--small",
                           "--iters", "1", "--repeats", "1", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    unshared = "fp8 + fused norm/RoPE, unshared activations"
    assert list(rows) == ["bf16", "bf16 + fused norm/RoPE", "fp8", unshared, "fp8 + fused norm/RoPE"]
    for fused in ("bf16 + fused norm/RoPE", unshared, "fp8 + fused norm/RoPE"):
        assert rows[fused]["rel_err_vs_stock"] == 0.0
        assert rows[fused]["kernel_calls_per_forward"] == {"norm_kernel_calls": 0, "rope_kernel_calls": 0}
    assert rows["fp8 + fused norm/RoPE"]["bit_equal_to_unshared"] is True  # sharing changes no output bit
    assert "| fp8 + fused norm/RoPE |" in out.with_suffix(".md").read_text()


def test_a_compiled_block_with_fused_norm_rope_is_one_graph(tiny_model):
    """torch.compile (fullgraph) traces a Krea 2 block whose norms carry the fused forward and whose processor has
    the fused RoPE under 8-bit attention: the torch code inside the graph (no graph break), the eager output."""
    from lowbit_pipe.attention.fused import apply_fused_norm_rope

    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    ledger = Ledger()
    apply_fused_norm_rope(model, ledger)
    apply_attention(model, "int8", ledger)
    block = model.transformer_blocks[0]
    seen = {}
    handle = block.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kw=k), with_kwargs=True)
    _out(model, arch, inputs)
    handle.remove()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(*seen["args"], **seen["kw"]), block(*seen["args"], **seen["kw"]))
    torch._dynamo.reset()
    assert ledger.unwind().errors == []
