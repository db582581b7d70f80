"""8-bit attention on a ComfyUI MODEL (ComfyUI 0.29.0's attention override), in a real ComfyUI imported in a child
process on the CPU (slow): ComfyUI's own KSampler path samples with it, the MODEL given stays stock, removing it
or a Purge gives back the stock attention bit for bit, and a MODEL still carrying a purged override refuses to
sample."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from comfyui_harness import ROOT, run_child

import lowbit_pipe

pytestmark = [pytest.mark.slow, pytest.mark.comfyui]

sys.path.insert(0, str(ROOT / "bench"))
from comfy_check import TINY  # noqa: E402  (tiny configs ComfyUI's model detection accepts)

CHILD = Path(__file__).with_name("comfyui_attention_child.py")
ARCHS = ("krea2", "flux1")


@pytest.fixture(scope="module")
def result(tmp_path_factory, comfyui_src) -> dict:
    tmp = tmp_path_factory.mktemp("attention")
    comfyui = comfyui_src
    models = {}
    for arch in ARCHS:
        models[arch] = str(tmp / f"{arch}.safetensors")
        lowbit_pipe.run("default", [*TINY[arch], "pipeline=[load,detect,export]", f"export.path={models[arch]}"],
                        run_dir=tmp / f"float_{arch}")
    out = run_child(CHILD, {"comfyui": str(comfyui), "models": models}, tmp / "child")
    assert "error" not in out, out.get("traceback")
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_the_override_samples_in_8bit_close_to_stock(result, arch):
    r = result[arch]
    for fmt in ("int8", "fp8"):
        calls = r[f"{fmt}_calls"]
        assert calls.get(fmt, 0) > 0, calls  # ComfyUI's sampler reached the override
        # Krea 2's text fusion calls without block_index: it keeps ComfyUI's attention (blocks_only, arch_keep)
        stock = {k for k in calls if k.startswith("stock")}
        assert stock == ({"stock: outside the model's blocks (attention.arch_keep: Krea 2's text fusion)"}
                         if arch == "krea2" else set()), calls
        # differs from stock by the 8-bit error, and only by it
        assert 0 < r[f"{fmt}_rel"] < 0.05 and r[f"{fmt}_cosine"] > 0.999, (fmt, r[f"{fmt}_rel"], r[f"{fmt}_cosine"])
    # blocks_only off: every call of the model 8-bit
    assert set(r["every_call_calls"]) == {"int8"}, r["every_call_calls"]


@pytest.mark.parametrize("arch", ARCHS)
def test_comfyuis_compile_node_compiles_the_8bit_model_once(result, arch):
    """ComfyUI's TorchCompileModel on the 8-bit MODEL: a second sampling compiles nothing and samples what the
    eager 8-bit MODEL samples; the calls are counted when traced. (The node's guard filter skips guards under
    transformer_options, so the counter that made the diffusers path recompile on every call did not here.)"""
    r = result[arch]
    assert r["compiled_graphs_first"] >= 1 and r["compiled_graphs_again"] == 0, r
    assert r["compiled_max_diff"] < 1e-5, r["compiled_max_diff"]
    assert r["compiled_calls"].get("fp8 (traced)", 0) > 0, r["compiled_calls"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_original_model_and_a_removed_override_are_stock_bit_for_bit(result, arch):
    r = result[arch]
    assert r["clone_is_new"] and r["original_has_no_override"] and r["original_after_max_diff"] == 0.0
    assert r["bf16_has_no_override"] and r["bf16_max_diff"] == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_purge_drops_it_and_a_model_still_carrying_it_refuses(result, arch):
    r = result[arch]
    assert "8-bit attention (fp8)" in r["purge_text"] and "dropped" in r["purge_text"]
    assert r["purge_moves_is_changed"] and r["purged_model_has_no_override"] and r["purged_max_diff"] == 0.0
    assert r["cached_after_purge"].startswith("PurgedModelError") and "Queue the workflow again" in r["cached_after_purge"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_quantize_node_applies_the_recipes_attention_and_purge_ends_both(result, arch):
    r = result[arch]
    assert r["quantize_summary_says"] and r["quantize_calls"].get("fp8", 0) > 0 and r["quantize_cosine"] > 0.99
    assert r["quantize_purge_proven"] and r["quantize_purge_dropped_attention"]
    assert r["float_after_all_max_diff"] == 0.0
