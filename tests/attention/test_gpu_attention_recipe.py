"""The recipe's `attention:` on a GPU (Hopper or newer; skipped elsewhere): the tiny models in bf16 on CUDA run the
Triton 8-bit attention kernel through their diffusers processors (route="triton": the kernel wherever it serves),
eager and compiled (regional, Inductor), and teardown gives back the stock attention bit for bit. The default
route picks per call shape (lowbit_pipe.attention.crossover); cuDNN's FP8 path: tests/attention/test_gpu_cudnn_attention.py.

    python3 -m pytest -q tests/attention/test_gpu_attention_recipe.py
"""

from __future__ import annotations

import pytest
import torch

import lowbit_pipe
from lowbit_pipe.arch import detect_model
from lowbit_pipe.attention import apply_attention
from lowbit_pipe.attention.processors import attention_modules
from lowbit_pipe.ledger import Ledger

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a Hopper (or newer) GPU")


def _inputs(model, tokens: int = 256):
    arch = detect_model(model)
    return arch, arch.example_inputs(dict(model.config), batch=1, image_tokens=tokens, text_tokens=16,
                                     generator=torch.Generator().manual_seed(3), dtype=torch.bfloat16, device="cuda")


def _out(model, arch, inputs):
    with torch.no_grad():
        return arch.output_tensor(model(**inputs)).float()


@pytest.mark.parametrize("arch_id", ["krea2", "flux1"])
@pytest.mark.parametrize("qk_format", ["int8", "fp8"])
def test_the_kernel_serves_the_joint_attention_and_teardown_restores(tiny_model, arch_id, qk_format):
    model = tiny_model(arch_id, torch.bfloat16).cuda()
    arch, inputs = _inputs(model)
    before = _out(model, arch, inputs)
    ledger = Ledger()
    applied = apply_attention(model, qk_format, ledger, route="triton")
    after = _out(model, arch, inputs)
    calls = dict(applied.calls)
    assert calls.get(qk_format, 0) >= 2, calls  # the joint blocks (head dim 64) run the kernel
    # Krea 2's text-fusion attention has head dim 32: no kernel for it, the stock attention runs
    assert set(calls) <= {qk_format, "stock: no 8-bit attention kernel for this GPU / head dim (Hopper, head dim 64 "
                                     "or 128)"}, calls
    rel = float((after - before).norm() / before.norm())
    assert 0 < rel < 3e-2, rel
    ledger.unwind()
    assert torch.equal(_out(model, arch, inputs), before)


def test_a_compiled_run_with_8bit_attention(tiny_model, tmp_path):
    model = tiny_model("krea2", torch.bfloat16).cuda()
    arch, inputs = _inputs(model)
    before = _out(model, arch, inputs)
    stock = {n: m.processor for n, m in attention_modules(model).items()}
    result = lowbit_pipe.run("default", ["attention.format=fp8", "quantize.default.format=fp8",
                                         "evaluate.samples=1", "evaluate.trajectory_seeds=1", "evaluate.steps=2",
                                         "evaluate.image_tokens=256", "evaluate.text_tokens=16",
                                         "pipeline=[load,detect,quantize,compile,evaluate]"], model=model,
                             run_dir=tmp_path / "run")
    share = result.report["evaluate"]["attention"]
    # the default route: a routed call in a compiled block is one custom op that picks, counts and runs it when
    # the graph runs (lowbit_pipe.attention.crossover), so calls are counted one by one, never as "(traced)";
    # at these 272 tokens the model's own attention may well be the faster
    assert sum(share["calls"].values()) > 0 and not any("(traced)" in c for c in share["calls"]), share
    assert share["cosine"] > 0.999, share
    assert result.report["attention"]["route"]["shapes"], result.report["attention"]
    assert result.report["evaluate"]["latency_ms"] is not None
    proof = lowbit_pipe.teardown(result)
    assert proof["unfreed"] == [] and proof["errors"] == [], proof
    assert all(m.processor is stock[n] for n, m in attention_modules(model).items())
    assert torch.equal(_out(model, arch, inputs), before)
