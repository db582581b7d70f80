"""Compile (lowbit_pipe): regional torch.compile of a ComfyUI MODEL's repeated blocks.

Without ComfyUI (fast): which blocks each architecture compiles, and the compile itself on a tiny model called the
way ComfyUI's APPLY_MODEL wrapper calls it (blocks compiled for the call only, one graph per block class, the
ledger's teardown dropping and proving everything). In a real ComfyUI 0.29.0 imported in a child process (slow):
the node through ComfyUI's own sampling path on tiny Krea 2 and FLUX.1 in ComfyUI's layout, with dynamo's own
counters (graphs, graph breaks, frames) around each sampling, quantized files opened with Load Diffusion Model, and
ComfyUI's own Qwen-Image class.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.arch import get_arch
from lowbit_pipe.comfy.compile_node import CompileReport, RegionalCompile, _record, block_lists
from lowbit_pipe.comfy.node_runs import NodeRun, PurgedModelError
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.stages.compile import dynamo_counters


# ---------------------------------------------------------------------------------------------- without ComfyUI
@pytest.mark.parametrize("arch", ["krea2", "flux1", "qwen_image", "wan"])
def test_the_blocks_are_the_architectures_repeated_blocks(tiny_model, arch):
    model = tiny_model(arch)
    found, paths = block_lists(model)
    assert found == arch and paths == get_arch(arch).policy.block_paths


def test_a_class_named_as_diffusers_but_without_its_config_is_detected_by_its_keys(tiny_model):
    """ComfyUI's Qwen-Image class has the diffusers class's name: no `config`, so its keys decide."""
    from lowbit_pipe.arch import detect_module

    model = tiny_model("qwen_image")
    comfy_like = type("QwenImageTransformer2DModel", (nn.Module,), {"forward": lambda self, x: x})()
    comfy_like.transformer_blocks = model.transformer_blocks
    for name, child in model.named_children():
        if name != "transformer_blocks":
            comfy_like.add_module(name, child)
    found = detect_module(comfy_like)
    assert found is not None and found.arch.id == "qwen_image" and found.config.num_layers == 2
    assert block_lists(comfy_like) == ("qwen_image", ("transformer_blocks",))


def test_an_unknown_model_compiles_its_lists_of_alike_blocks():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    root = nn.Module()
    root.layers = nn.ModuleList([Block() for _ in range(3)])
    root.mixed = nn.ModuleList([Block(), nn.GELU()])
    root.acts = nn.ModuleList([nn.GELU(), nn.GELU()])  # no layers inside: nothing worth a graph of its own
    assert block_lists(root) == (None, ("layers",))


class _Base(nn.Module):
    """ComfyUI's BaseModel as the APPLY_MODEL wrapper sees it (`executor.class_obj`)."""

    def __init__(self, tree: nn.Module) -> None:
        super().__init__()
        self.diffusion_model = tree


class _Executor:
    """ComfyUI's WrapperExecutor for APPLY_MODEL: `class_obj` is the BaseModel; calling it runs the model."""

    def __init__(self, base: _Base) -> None:
        self.class_obj = base

    def __call__(self, *args, **kwargs):
        return self.class_obj.diffusion_model(*args, **kwargs).sample


def _dynamo_codes() -> int:
    from torch._dynamo import convert_frame

    return len(convert_frame.input_codes.seen)


def test_blocks_are_compiled_for_the_call_only_and_the_teardown_proves_it(tiny_model):
    """A quantized tiny Krea 2: one graph for its block class (both blocks share it), output equal to eager, the
    blocks eager again after each call (an error included), a second call compiling nothing; the ledger's undo
    drops the compiled callables (proven freed), resets dynamo and leaves the compile refusing to run."""
    torch._dynamo.reset()
    model = tiny_model("krea2")
    ledger = Ledger()
    lowbit_pipe.quantize(model, {"default": {"format": "int8"}}, ledger=ledger)
    arch = get_arch("krea2")
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(2), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        eager = model(**inputs).sample
    _, paths = block_lists(model)
    blocks = [b for p in paths for b in model.get_submodule(p)]
    classes = list(dict.fromkeys(type(b) for b in blocks))
    report = CompileReport("test", "eager", "default", "krea2", paths, len(blocks), tuple(c.__name__ for c in classes))
    compiled = RegionalCompile(paths, classes, {"backend": "eager"}, report, None)
    run = NodeRun(ledger, "test", None)
    _record(run, compiled, report)
    executor = _Executor(_Base(model))

    before = dynamo_counters()
    with torch.no_grad():
        out = compiled.run(executor, (), inputs)
    first = {k: v - before[k] for k, v in dynamo_counters().items()}
    assert first == {"graphs": 1, "graph_breaks": 0, "frames": 1}
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert not any(b.__dict__.get("_compiled_call_impl") for b in blocks)
    with torch.no_grad():
        compiled.run(executor, (), inputs)
    assert dynamo_counters()["graphs"] == before["graphs"] + 1  # the second call compiled nothing
    with pytest.raises(TypeError):
        compiled.run(executor, (), {**inputs, "no_such_input": 1})
    assert not any(b.__dict__.get("_compiled_call_impl") for b in blocks)
    assert report.calls == 2 and report.graphs == 1 and report.first_call_s > 0 and report.recompiles == 0
    assert "first model call" in report.text() and "1 graphs, 0 graph breaks" in report.text()

    teardown = ledger.unwind()
    assert teardown.unfreed == [] and teardown.proven, teardown
    assert teardown.caches and teardown.caches[0]["verified"] and _dynamo_codes() == 0
    assert teardown.objects_freed >= 2  # the compiled callables (one per block class + the hooked-block one)
    with pytest.raises(PurgedModelError, match="Queue the workflow again"):
        compiled.run(executor, (), inputs)


def test_a_block_with_hooks_of_its_own_runs_them_compiled(tiny_model):
    """A block with a forward hook gets nn.Module._call_impl compiled (which runs its hooks), not its forward."""
    torch._dynamo.reset()
    model = tiny_model("flux1")
    arch = get_arch("flux1")
    inputs = arch.example_inputs(dict(model.config), batch=1, image_tokens=16, text_tokens=4,
                                 generator=torch.Generator().manual_seed(2), dtype=torch.float32, device="cpu")
    _, paths = block_lists(model)
    calls = []
    handle = model.get_submodule(paths[0])[0].register_forward_hook(lambda m, a, o: calls.append(1))
    with torch.no_grad():
        eager = model(**inputs).sample
    blocks = [b for p in paths for b in model.get_submodule(p)]
    classes = list(dict.fromkeys(type(b) for b in blocks))
    report = CompileReport("test", "eager", "default", "flux1", paths, len(blocks), tuple(c.__name__ for c in classes))
    compiled = RegionalCompile(paths, classes, {"backend": "eager"}, report, None)
    with torch.no_grad():
        out = compiled.run(_Executor(_Base(model)), (), inputs)
    handle.remove()
    assert len(calls) == 2  # eager, then compiled
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    compiled.close("closed")
    assert compiled.check() is True
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- in ComfyUI
CHILD = Path(__file__).with_name("comfyui_compile_child.py")
ARCHS = ("krea2", "flux1")
BLOCKS = {"krea2": (["blocks"], 1), "flux1": (["double_blocks", "single_blocks"], 2)}  # paths, block classes


@pytest.fixture(scope="module")
def comfy(tmp_path_factory, comfyui_src) -> dict:
    from comfyui_harness import ROOT, run_child
    from safetensors.torch import save_file

    from lowbit_pipe.lora.make_example import example_lora

    sys.path.insert(0, str(ROOT / "bench"))
    from comfy_check import TINY  # tiny configs ComfyUI's model detection accepts

    tmp = tmp_path_factory.mktemp("compile")
    comfyui = comfyui_src
    job = {"comfyui": str(comfyui), "models": {}, "loras": {}, "backend": "aot_eager", "inductor": ["krea2"]}
    for arch in ARCHS:
        path = tmp / f"{arch}.safetensors"
        floating = lowbit_pipe.run("default", [*TINY[arch], "pipeline=[load,detect,export]", f"export.path={path}"],
                                   run_dir=tmp / f"float_{arch}")
        job["models"][arch] = str(path)
        job["loras"][arch] = {}
        for tag, rank, seed in (("a", 4, 5), ("b", 4, 6), ("c", 8, 7)):  # a, b: one rank; c: another
            state, meta = example_lora(floating.model, floating.context.arch, style="peft", rank=rank, seed=seed,
                                       rel=0.05)
            save_file(state, str(tmp / f"{arch}_{tag}.safetensors"), metadata=meta)
            job["loras"][arch][tag] = str(tmp / f"{arch}_{tag}.safetensors")
    job["files"] = {}
    for case, spec in FILES.items():  # quantized Krea 2 files, opened in the child with Load Diffusion Model
        path = tmp / f"krea2_{case}.safetensors"
        overrides = [f"quantize.default.{k}={v}" for k, v in spec.items()]
        lowbit_pipe.run("default", [*TINY["krea2"], "pipeline=[load,detect,quantize,export]", f"export.path={path}",
                                    "quantize.arch_keep_float=true", *overrides], run_dir=tmp / f"file_{case}")
        job["files"][case] = str(path)
    out = run_child(CHILD, job, tmp / "child", timeout=1800)
    assert "error" not in out, out.get("traceback")
    return out


NOTHING = {"graphs": 0, "graph_breaks": 0, "frames": 0}
# A lowbit kind (per-row fp8: the pack's own layout, as Load Diffusion Model loads it with the pack) and a rotated
# one (NVFP4 + ConvRot), which torch.compile cannot trace through the layout yet.
FILES = {"fp8_row": {"format": "fp8", "granularity": "row", "activations": "static"},
         "nvfp4_convrot": {"format": "nvfp4", "rotation": "convrot"}}


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_one_graph_per_block_class_no_graph_break_and_the_eager_result(comfy, arch):
    r = comfy[arch]
    paths, classes = BLOCKS[arch]
    assert r["report"]["arch"] == arch and r["report"]["paths"] == paths and len(r["report"]["classes"]) == classes
    assert r["first"] == {"graphs": classes, "graph_breaks": 0, "frames": classes}, r["first"]
    assert r["again"] == NOTHING, r["again"]
    assert r["compiled_vs_eager"] < 1e-5 and r["again_vs_first"] == 0.0
    assert r["report"]["graphs"] == classes and r["report"]["graph_breaks"] == 0 and r["report"]["first_call_s"] > 0
    assert r["blocks_left_compiled"] == 0  # compiled only while ComfyUI runs the model
    assert "compiled with aot_eager at the first model call" in r["ui_text"]


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_the_model_given_stays_eager(comfy, arch):
    r = comfy[arch]
    assert not r["given_has_wrapper"] and r["given_counts"] == NOTHING and r["given_vs_eager"] == 0.0


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_strength_change_or_a_same_rank_swap_recompiles_nothing(comfy, arch):
    r = comfy[arch]
    assert r["strength_counts"] == NOTHING, r["strength_counts"]
    assert r["strength_report"]["graphs"] == 0 and r["strength_report"]["recompiles"] == 0
    assert r["strength_changed_output"] > 1e-5 and r["strength_vs_eager"] < 1e-5  # the new strength, compiled
    assert r["swap_counts"] == NOTHING and r["swap_vs_eager"] < 1e-5
    # another rank: one graph more per block class, at most
    assert 0 < r["rank_counts"]["graphs"] <= r["block_classes"] and r["rank_counts"]["graph_breaks"] == 0
    assert r["rank_vs_eager"] < 1e-5


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_weights_moved_by_comfyui_and_its_non_dynamic_delegate_need_no_recompile(comfy, arch):
    r = comfy[arch]
    assert r["moved_counts"] == NOTHING and r["moved_vs_before"] == 0.0
    assert r["reloaded_counts"] == NOTHING and r["reloaded_vs_before"] == 0.0
    assert r["delegate_is_plain_patcher"] and r["delegate_tree_is_a_copy"]
    assert r["delegate_counts"] == NOTHING and r["delegate_vs_eager"] < 1e-5


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_with_8bit_attention_no_graph_break_and_no_recompile_on_a_strength_change(comfy, arch):
    r = comfy[arch]
    assert r["attention_counts"]["graph_breaks"] == 0 and r["attention_counts"]["graphs"] <= r["block_classes"]
    assert r["attention_calls"].get("int8 (traced)", 0) > 0, r["attention_calls"]  # the override ran, compiled
    assert r["attention_vs_eager"] < 1e-5
    assert r["attention_strength_counts"] == NOTHING, r["attention_strength_counts"]


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_purge_after_compile_gives_everything_back(comfy, arch):
    r = comfy[arch]
    for key in ("purge_text", "own_purge_text"):
        text = r[key]
        assert '"proven": true' in text and '"retained_bytes": 0' in text and '"unfreed": []' in text, text
        assert "torch.compile (dynamo caches" in text  # the reset's caveat: it ran
    assert r["dynamo_codes_after_purge"] == 0 and r["blocks_left_compiled_after_purge"] == 0
    for key in ("purged_compiled", "purged_strength", "purged_delegate", "purged_attention"):
        assert r[key].startswith("PurgedModelError") and "Queue the workflow again" in r[key], (key, r[key])


@pytest.mark.comfyui
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_a_model_no_pack_node_made_gets_a_run_of_its_own(comfy, arch):
    r = comfy[arch]
    assert r["own_tree_is_a_copy"] and r["own_counts"]["graphs"] == BLOCKS[arch][1]
    assert r["own_counts"]["graph_breaks"] == 0 and r["own_vs_float"] < 1e-5
    assert r["float_after_max_diff"] == 0.0


@pytest.mark.comfyui
@pytest.mark.slow
def test_inductor_compiles_the_quantized_blocks_on_the_cpu(comfy):
    """The node's default backend once (C++ code from inductor, gcc): one graph, no graph break, eager's result
    to float tolerance; Purge proven."""
    r = comfy["krea2"]
    assert r["inductor_counts"] == {"graphs": 1, "graph_breaks": 0, "frames": 1}, r["inductor_counts"]
    assert r["inductor_vs_eager"] < 1e-4
    report = r["inductor_report"]
    assert report["backend"] == "inductor" and report["first_call_s"] > report["second_call_s"] > 0
    assert '"proven": true' in r["inductor_purge_text"] and '"retained_bytes": 0' in r["inductor_purge_text"]
    print(f"\ninductor, tiny Krea 2 on the CPU: first model call {report['first_call_s']:.1f} s (compile included), "
          f"second {report['second_call_s']:.3f} s")


@pytest.mark.comfyui
@pytest.mark.slow
def test_a_quantized_file_compiles_and_a_rotated_lowbit_kind_is_refused_naming_a_layer(comfy):
    r = comfy["files"]
    fp8 = r["fp8_row"]
    assert fp8["counts"] == {"graphs": 1, "graph_breaks": 0, "frames": 1}, fp8["counts"]
    assert fp8["vs_eager"] < 1e-5 and fp8["after_purge_max_diff"] == 0.0
    assert '"proven": true' in fp8["purge_text"] and '"retained_bytes": 0' in fp8["purge_text"]
    refused = r["nvfp4_convrot"]["refused"]
    assert "lowbit_pipe kinds with a rotation loaded from a file" in refused and "'blocks.0." in refused, refused


@pytest.mark.comfyui
@pytest.mark.slow
def test_comfyuis_qwen_image_class_compiles_its_transformer_blocks(comfy):
    r = comfy["qwen_image"]
    assert r["arch"] == "qwen_image" and r["paths"] == ["transformer_blocks"] and r["quantized"] > 0
    assert r["counts"] == {"graphs": 1, "graph_breaks": 0, "frames": 1}, r["counts"]
    assert r["max_diff"] == 0.0 and r["proven"] and r["unfreed"] == []
