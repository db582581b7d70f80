"""Soak: one process, many cycles of quantize -> LoRA attach -> strength change -> LoRA swap -> forward -> teardown,
with host memory and file handles flat, every teardown proven and the output bit-equal to float after each; and
the leaks such cycles found, each kept as a regression test.

The cycle itself is bench/soak.py's `soak()` (the GPU bench runs the same code with device memory); these tests
run it on the CPU.
"""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import save_file

sys.path.insert(0, str(ROOT / "bench"))

import soak as soak_bench

from lowbit_pipe import api, lora
from lowbit_pipe.arch import get_arch
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.lora.make_example import example_lora

CYCLES = 200
RSS_BOUND = 4 * 2**20  # growth over the post-warm-up baseline; a leak of one LoRA's tensors per cycle is ~1 MB each


@pytest.mark.slow
def test_200_api_cycles_stay_flat_proven_and_bit_equal():
    result = soak_bench.soak(CYCLES, "cpu", fmt="fp8", measure_every=20)
    assert len(result.cycles) == CYCLES
    assert result.failures() == [], result.failures()[:5]
    rss, fds = result.growth("rss"), result.growth("fds")
    seconds = sum(c.seconds for c in result.cycles)
    print(f"{CYCLES} cycles in {seconds:.1f} s; RSS growth {rss / 2**20:+.2f} MiB, fds {fds:+d}")
    assert fds == 0, f"open file descriptors grew by {fds} over {CYCLES} cycles"
    assert rss < RSS_BOUND, f"RSS grew by {rss / 2**20:.1f} MiB over {CYCLES} cycles (bound {RSS_BOUND / 2**20:.0f})"


def test_the_soak_bench_smoke_run_writes_its_table(tmp_path):
    """`python bench/soak.py --device cpu --cycles 3` (in process): exit 0, JSON and Markdown with 3 proven cycles."""
    out = tmp_path / "soak_cpu"
    assert soak_bench.main(["--device", "cpu", "--cycles", "3", "--out", str(out)]) == 0
    payload = json.loads(out.with_suffix(".json").read_text())
    assert len(payload["cycles"]) == 3 and payload["failures"] == []
    assert all(c["proven"] and c["bit_equal"] and c["memory"]["fds"] == payload["baseline"]["fds"]
               for c in payload["cycles"])
    assert "| 2 |" in out.with_suffix(".md").read_text()


# ---------------------------------------------------------------------------------------------- regressions
def _lora_file(tiny_model, tmp_path) -> tuple[torch.nn.Module, Path]:
    model = tiny_model("krea2")
    state, meta = example_lora(model, get_arch("krea2"), style="peft", rank=4, seed=1, rel=0.01)
    path = tmp_path / "a.safetensors"
    save_file(state, str(path), metadata=meta or None)
    return model, path


def test_reading_a_lora_file_again_and_again_allocates_nothing_that_stays(tiny_model, tmp_path):
    """safetensors' get_tensor (0.8) leaked two Python ints per tensor read: 32 tensors x 300 reads left 529 KiB.
    The LoRA reader reads with the project's own plain reads now."""
    from lowbit_pipe.lora.files import read_state

    _, path = _lora_file(tiny_model, tmp_path)
    for _ in range(5):
        read_state(path)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        for _ in range(300):
            tensors, metadata, _ = read_state(path)
        del tensors, metadata
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 32 * 1024, f"300 reads of a 32-tensor LoRA file left {grown} bytes allocated"


def test_a_handle_kept_past_a_ledger_teardown_keeps_nothing_alive(tiny_model):
    """A LoraHandle held stacks strongly (the proof then named every stack 'still referenced') and its bake record
    held the layer's pre-LoRA quantized tensors. Now: stacks by weakref, and the teardown makes it let go."""
    model = tiny_model("krea2")
    ledger = Ledger()
    api.quantize(model, {"default": {"format": "int8"}}, ledger=ledger)
    state, _ = example_lora(model, get_arch("krea2"), style="peft", rank=4, seed=1, rel=0.01)
    up = model.get_submodule("transformer_blocks.0.ff.up")
    dense = {"transformer_blocks.0.ff.up.diff": torch.randn(up.out_features, up.in_features) * 1e-3}
    residual = lora.attach(model, state, name="a", ledger=ledger)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "baked into the weight": expected for a dense delta
        baked = lora.attach(model, dense, name="d", ledger=ledger)
    assert residual.stacks and baked.bakes
    del up
    report = ledger.unwind()
    assert report.proven and not report.errors and report.unfreed == [] and report.retained_bytes == 0, report.as_dict()
    assert residual.stacks == [] and baked.bakes == {}
    with pytest.raises(lora.LoraRemovedError, match="no longer attached"):
        residual.set_strength(0.5)


def test_quantize_does_not_recompose_the_recipe_store(tiny_model, monkeypatch):
    """api.quantize re-read and re-registered every packaged recipe with Hydra on each call (0.12-0.16 s, the
    largest host cost of a soak cycle); it needs none of them."""
    from lowbit_pipe.config import compose

    def refuse() -> None:
        raise AssertionError("api.quantize registered the recipe schema")

    monkeypatch.setattr(compose, "register_schema", refuse)
    stats = api.quantize(tiny_model("krea2"), {"default": {"format": "int8"}})
    assert stats["layers"]
