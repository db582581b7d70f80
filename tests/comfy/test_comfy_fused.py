"""`attention.fused_norm_rope` on ComfyUI's own model code (lowbit_pipe.attention.comfy_fused), in a real ComfyUI 0.29.0 imported
in a child process on the CPU with the kernels run by Triton's interpreter (slow): the fused norms and RoPE equal
ComfyUI's own functions and modules for Krea 2, FLUX.1 and Qwen-Image (bf16 bit for bit, with the interpreter's
bf16 cast made to round as the GPU's does; fp32 within two ulps), whole tiny forwards fused equal unfused, the
ledger restores every class by identity, and the Quantize node applies it where its recipe asks and Purge undoes
it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from comfyui_harness import ROOT, run_child

import lowbit_pipe

pytestmark = [pytest.mark.slow, pytest.mark.comfyui]

sys.path.insert(0, str(ROOT / "bench"))
from comfy_check import TINY  # noqa: E402  (tiny configs ComfyUI's model detection accepts)

CHILD = Path(__file__).with_name("comfyui_fused_child.py")
ARCHS = ("krea2", "flux1", "qwen_image")
NODE_ARCHS = ("krea2", "flux1")  # the Quantize node's path (files ComfyUI's loader detects)


@pytest.fixture(scope="module")
def result(tmp_path_factory, comfyui_src) -> dict:
    pytest.importorskip("triton")
    tmp = tmp_path_factory.mktemp("fused")
    comfyui = comfyui_src
    models = {}
    for arch in NODE_ARCHS:
        models[arch] = str(tmp / f"{arch}.safetensors")
        lowbit_pipe.run("default", [*TINY[arch], "pipeline=[load,detect,export]", f"export.path={models[arch]}"],
                        run_dir=tmp / f"float_{arch}")
    out = run_child(CHILD, {"comfyui": str(comfyui), "models": models}, tmp / "child", timeout=1500)
    assert "error" not in out, out.get("traceback")
    return out


def _close(name: str, u: dict) -> bool:
    """bf16 outputs: ComfyUI's bit for bit but for a rare one-ulp flip (the fp32 math inside rounds differently:
    rsqrt against 1 / sqrt, a fused multiply-add). fp32 outputs: those differences themselves, a few fp32 ulps
    (RoPE's near-zero outputs, where the two products cancel, compare by the largest error over the largest
    value instead)."""
    if "bfloat16" in name.split(" x ")[-1]:
        return u["max_ulps"] <= 1 and u["share_diff"] < 0.01
    return u["max_err_over_max"] < 1e-6 and (u["max_ulps"] <= 4 or name.startswith("rope "))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_norms_equal_comfyuis_own_modules(result, arch):
    r = result[f"kernels {arch}"]
    norms = {k: v for k, v in r.items() if k.startswith("norm ")}
    assert len(norms) >= 4, norms
    for name, v in norms.items():
        assert v["kernel"] and v["contiguous"], (name, v)  # the kernel ran, and returned ComfyUI's layout
        assert _close(name, v), (name, v)
    # the real layouts: Krea 2's and FLUX.1's q / k norms read a strided view
    assert any(v["strided_input"] for v in norms.values()) == (arch != "qwen_image"), norms


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_rope_equals_comfyuis_apply_rope(result, arch):
    r = result[f"kernels {arch}"]
    ropes = {k: v for k, v in r.items() if k.startswith("rope ")}
    assert len(ropes) == 4, ropes  # freqs fp32 / bf16 x x fp32 / bf16
    for name, v in ropes.items():
        assert v["kernel"] and v["reference_equals_torch_form"], (name, v)
        for against in ("vs_apply_rope", "vs_torch_form"):
            for u in v[against]:
                assert _close(name, u), (name, against, u)
    for dtype in ("float32", "bfloat16"):
        assert r[f"unwind {dtype}"] == {"errors": [], "unfreed": [], "classes_restored": True}, r[f"unwind {dtype}"]


@pytest.mark.parametrize("case", [f"{a} {d}" for a in ARCHS for d in ("float32", "bfloat16")]
                         + ["flux1 bfloat16 manual_cast", "flux1 float32 manual_cast weight patch"])
def test_a_whole_fused_forward_equals_the_unfused_one_and_unwinding_restores_it(result, case):
    r = result[f"forward {case}"]
    calls = r["calls"]
    assert calls["norm_kernel_calls"] > 0 and calls["rope_kernel_calls"] > 0, calls
    assert calls["norm_modules"] == sum(1 for c in r["fused"].values() if c.endswith("Fused"))
    assert calls["rope_modules"] == sum(1 for c in r["fused"].values() if c.endswith("FusedRope")) > 0
    if "bfloat16" in case:
        assert r["ulps"]["share_diff"] < 0.01 and r["rel"] < 1e-2, r  # bf16: bit-equal but for rare flips
    else:
        assert r["rel"] < 1e-5, r
    if case.startswith("krea2"):  # both blocks' attention (2 q heads, 1 k / v head) hand k / v over ungrouped;
        # each block's two modulated norms and two gated residuals are kernels
        assert calls["grouped_kv_modules"] == 2 and calls["grouped_kv_calls"] == 2, calls
        assert calls["modulated_blocks"] == 2 and calls["modulation_kernel_calls"] == 8, calls
    else:
        assert calls["grouped_kv_modules"] == calls["grouped_kv_calls"] == calls["modulated_blocks"] == 0, calls
    assert r["errors"] == [] and r["unfreed"] == [] and r["restored"] == len(r["fused"]) + 1, r
    assert r["classes_restored"] and r["forwards_restored"] and r["after_undo_equal"], r


def test_krea2_attention_keeps_the_stock_code_where_something_expects_repeated_kv_heads(result):
    """Without patches the fused Krea 2 attention passes k / v with their own head (enable_gqa); with an attn1_patch
    (it sees k / v) or another pack's attention override (it may drop enable_gqa) the stock code runs, and those see
    the k / v they see without the pack; the output equals the unfused model's in every case."""
    r = result["grouped krea2"]
    assert r["none"]["grouped_calls"] == 2 and r["none"]["grouped_modules"] == 2, r["none"]
    for case in ("attn1_patch", "foreign override"):
        assert r[case]["grouped_calls"] == 0, (case, r[case])
        stock, fused = r[case]["heads_seen"]
        assert stock == fused and stock, (case, r[case])  # what they see is what they see without the pack
    # the patch sees k before the stock code repeats it (1 head); the override after (2, the q heads)
    assert set(r["attn1_patch"]["heads_seen"][0]) == {1} and set(r["foreign override"]["heads_seen"][0]) == {2}, r
    for case, v in r.items():
        assert v["rel"] < 1e-5, (case, v)  # fp32


@pytest.mark.parametrize("arch", ARCHS)
def test_under_torch_compile_comfyuis_own_code_is_traced(result, arch):
    """ComfyUI's TorchCompileModel compiles the diffusion model: the fused classes trace ComfyUI's code (Inductor
    fuses it itself), with the unfused model's graphs and graph breaks and its output; Krea 2's attention traces
    its grouped form (k / v not repeated, SDPA's enable_gqa)."""
    r = result[f"compiled {arch}"]
    # Dynamo's unique-graph count over ComfyUI's code moved by one between runs of the same model (30 / 31, 15 / 14
    # seen, equal in others); the output and the absence of kernel calls do not move. The graph breaks are the
    # unfused model's own kinds (this CPU build's: a builtin `open` in the code ComfyUI runs); a module whose
    # forward opens its input to one quantization (Krea 2's Attention and SwiGLU, Qwen-Image's Attention) runs
    # the stock forward one frame down, where a break inside is counted once more: at most one per such module.
    assert r["break_reasons"][1] == r["break_reasons"][0], r["break_reasons"]
    assert r["breaks"][0] <= r["breaks"][1] <= r["breaks"][0] + r["shared_modules"], r
    if arch == "krea2":  # its attention traces our grouped forward (no repeat): 29 graphs against 30 / 31 seen
        assert 0 < r["graphs"][1] <= r["graphs"][0] + 1, r
    else:
        assert abs(r["graphs"][0] - r["graphs"][1]) <= 1 and min(r["graphs"]) > 0, r
    assert r["equal"] and r["kernel_calls"] == 0, r
    if arch == "krea2":  # but for Krea 2's grouped k / v (plain torch, compiled too): the model repeats nothing
        assert r["model_repeats"][0] >= 2 and r["model_repeats"][1] == 0, r
    else:
        assert r["model_repeats"] == [0, 0], r


@pytest.mark.parametrize("arch", ARCHS)
def test_the_fused_forwards_open_their_inputs_to_one_quantization_and_close_them(result, arch):
    """Under inference_mode (no version counters) layers share an input's quantization only inside a forward whose
    code passes that input unchanged to them (Krea 2's q / k / v / gate and its MLP's gate / up, Qwen-Image's
    projections of either stream); the output projections and FLUX.1's packed layers never; nothing is left on
    the inputs after the forward."""
    r = result[f"shared {arch}"]
    assert r["seen"] == r["expected"], r  # True: tagged at every call; False: at none
    assert all(n > 0 for n in r["calls"].values()) and set(r["calls"]) == set(r["expected"]), r
    assert r["left"] == [], r
    assert (r["shared_input_modules"] > 0) == any(r["expected"].values()), r


@pytest.mark.parametrize("arch", NODE_ARCHS)
def test_the_quantize_node_applies_it_on_its_own_tree_and_purge_undoes_it(result, arch):
    r = result[f"node {arch}"]
    fused = r["report"]["fused_norm_rope"]
    assert fused["code"] == "ComfyUI's (comfy/ldm)" and fused["norm_modules"] > 0 and fused["rope_modules"] > 0
    assert "not ComfyUI's model code" not in str(r["report"])
    assert r["summary_line"] and f"{fused['norm_modules']} norm modules" in r["summary_line"], r["summary_line"]
    assert r["fused_on_tree"] and r["float_tree_untouched"]
    # on the CPU the kernels do not run: ComfyUI's own code, bit for bit what the node samples without the key
    assert r["max_diff_vs_unfused_node"] == 0.0
    assert r["purge"]["proven"] and r["purge"]["unfreed"] == [], r["purge"]
    assert r["no_fused_class_left"] and r["classes_restored"], r
