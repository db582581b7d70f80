"""The MODELs the nodes hand out, inside a real ComfyUI (0.29.0, imported in a child process on the CPU; slow).

Each is a MODEL of its own (its own BaseModel around the node's tree), so ComfyUI's loading state never
mixes the quantized tree with the float one: unloading the way dynamic VRAM does (its buffer backups restored
after the object patches came off) restores into the node's tree, where an object patch on a shared
BaseModel put a quantized layer's `weight` buffer onto the float Linear ("attribute 'weight' already exists",
seen on the H200). ComfyUI rebuilding a MODEL rebuilds the quantized one, never the float file; Purge seals
the rebuilt copy too, and the float MODEL computes exactly as before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from comfyui_harness import ROOT, run_child
from safetensors.torch import save_file

import lowbit_pipe
from lowbit_pipe.lora.make_example import example_lora

pytestmark = [pytest.mark.slow, pytest.mark.comfyui]

sys.path.insert(0, str(ROOT / "bench"))
from comfy_check import TINY  # noqa: E402  (tiny configs ComfyUI's model detection accepts)

CHILD = Path(__file__).with_name("comfyui_patcher_child.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory, comfyui_src) -> dict:
    tmp = tmp_path_factory.mktemp("patchers")
    comfyui = comfyui_src
    floating = lowbit_pipe.run("default", [*TINY["krea2"], "pipeline=[load,detect,export]",
                                           f"export.path={tmp / 'float.safetensors'}"], run_dir=tmp / "float")
    sd, meta = example_lora(floating.model, floating.context.arch, style="peft", rank=4, seed=5, rel=0.05)
    save_file(sd, str(tmp / "style.safetensors"), metadata=meta)
    out = run_child(CHILD, {"comfyui": str(comfyui), "model": str(tmp / "float.safetensors"),
                            "lora": str(tmp / "style.safetensors")}, tmp / "child")
    assert "error" not in out, out.get("traceback")
    return out


def test_each_node_model_has_its_own_base_model_and_one_clone_id_per_run(result):
    assert result["own_base_model"] and result["tree_is_the_base_models"] and result["float_base_model_untouched"]
    assert not result["object_patch_left"] and result["one_clone_id_per_run"]
    assert result["quantized_layers"] > 0 and result["lora_vs_float_rel"] > 0


def test_a_quantized_node_model_is_a_plain_patcher_even_from_a_dynamic_vram_one(result):
    """Dynamic VRAM copies every tensor that is not a ComfyUI layer's weight from host memory at each load (each
    queue: 1.2 s for the full-size Krea 2 in fp8 on an H100): a MODEL around QuantLinears is a plain ModelPatcher;
    one around ComfyUI's own layers keeps dynamic VRAM."""
    assert result["quantized_from_dynamic_patcher"] == ["ModelPatcher", False]
    assert result["float_from_dynamic_patcher"] == ["DynamicLike", True]


def test_unloading_in_dynamic_vrams_order_restores_into_the_nodes_tree(result):
    assert result["buffers_recorded"] > 0
    assert result["dynamic_unload"] == "ok"
    assert result["float_tree_layer_classes"] and "QuantLinear" not in result["float_tree_layer_classes"]
    assert result["after_unload_rel"] == 0.0


def test_comfyui_rebuilding_the_model_rebuilds_the_quantized_one(result):
    assert result["rebuilt_is_another_tree"]
    assert result["rebuilt_quantized_layers"] == result["quantized_layers"]
    assert result["rebuilt_max_diff"] == 0.0


def test_purge_seals_every_copy_and_leaves_the_float_model_as_it_was(result):
    assert '"proven": true' in result["purge_report"]
    for key in ("purged_forward", "purged_rebuilt_forward", "purged_rebuild"):
        assert result[key].startswith("PurgedModelError") and "Queue the workflow again" in result[key], key
    assert result["float_after_max_diff"] == 0.0 and result["float_tensors_same"]
