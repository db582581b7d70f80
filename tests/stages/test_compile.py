"""compile stage: regional / full torch.compile through the ledger; teardown restores eager and resets dynamo."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import lowbit_pipe
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.recipe import CompileConfig
from lowbit_pipe.stages.compile import block_targets, compile_modules


def _inputs(model, tokens: int = 16):
    from lowbit_pipe.arch import detect_model

    arch = detect_model(model)
    return arch, arch.example_inputs(dict(model.config), batch=1, image_tokens=tokens, text_tokens=4,
                                     generator=torch.Generator().manual_seed(2), dtype=torch.float32, device="cpu")


def _dynamo_codes() -> int:
    from torch._dynamo import convert_frame

    return len(convert_frame.input_codes.seen)


def test_regional_compile_keeps_names_and_outputs_and_teardown_resets(tiny_model, tmp_path):
    model = tiny_model("krea2")
    keys = list(model.state_dict())
    arch, inputs = _inputs(model)
    with torch.no_grad():
        eager = arch.output_tensor(model(**inputs))
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,compile]", "compile.backend=eager"], model=model,
                             run_dir=tmp_path / "run")
    assert result.report["compile"]["names"] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert all("_compiled_call_impl" in vars(b) for b in model.transformer_blocks)
    assert list(model.state_dict()) == keys  # in place: no `_orig_mod.` in any name
    with torch.no_grad():
        compiled = arch.output_tensor(model(**inputs))
    assert torch.equal(compiled, eager)
    assert _dynamo_codes() > 0
    report = lowbit_pipe.teardown(result)
    assert not any("_compiled_call_impl" in vars(b) for b in model.transformer_blocks)
    assert _dynamo_codes() == 0  # torch.compiler.reset() ran, after the blocks were restored
    assert report["unfreed"] == [] and report["patches_restored"] == 2
    assert report["caches"][0]["name"].startswith("torch.compile") and report["caches"][0]["verified"]
    assert report["objects_freed"] == 2  # the two compiled callables


def test_full_compile_of_the_transformer(tiny_model):
    model = tiny_model("flux1")
    arch, inputs = _inputs(model)
    with torch.no_grad():
        eager = arch.output_tensor(model(**inputs))
    ledger = Ledger()
    assert compile_modules(model, [""], CompileConfig(mode="full", backend="aot_eager"), ledger) == [""]
    with torch.no_grad():
        compiled = arch.output_tensor(model(**inputs))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    report = ledger.unwind()
    assert "_compiled_call_impl" not in vars(model) and report.unfreed == []


def test_flux_blocks_and_the_repeated_blocks_fallback(tiny_model):
    model = tiny_model("flux1")
    from lowbit_pipe.arch import detect_model

    paths = detect_model(model).policy.block_paths
    named = block_targets(model, paths)
    assert named == block_targets(model, ())  # diffusers' _repeated_blocks finds the same ModuleLists
    assert len(named) == 3 and all(n.startswith(("transformer_blocks.", "single_transformer_blocks.")) for n in named)


@pytest.mark.parametrize("override, message", [("compile.mode=everything", "compile.mode"),
                                               ("compile.backend=warp_drive", "compile.backend")])
def test_bad_settings_fail_naming_the_key_before_any_work(override, message, tmp_path):
    from lowbit_pipe.errors import RecipeError

    with pytest.raises(RecipeError, match=message) as info:
        lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,compile]", override], run_dir=tmp_path / "run")
    assert info.value.path == message
    assert not (tmp_path / "run").exists()  # refused at validation: no stage ran, no run dir


def test_compiling_twice_is_refused(tiny_model):
    model = tiny_model("krea2")
    ledger = Ledger()
    compile_modules(model, ["transformer_blocks.0"], CompileConfig(backend="eager"), ledger)
    with pytest.raises(ValueError, match="already compiled"):
        compile_modules(model, ["transformer_blocks.0"], CompileConfig(backend="eager"), ledger)
    assert ledger.unwind().unfreed == []


def test_inductor_compile_of_quantized_layers_on_the_cpu():
    """One real inductor compile (C++ codegen with gcc) of quantized (fp8) layers, then a clean teardown."""
    net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    ledger = Ledger()
    lowbit_pipe.quantize(net, {"default": {"format": "fp8"}, "arch_keep_float": False}, ledger=ledger)
    x = torch.randn(4, 256)
    with torch.no_grad():
        eager = net(x)
    start = time.perf_counter()
    compile_modules(net, [""], CompileConfig(mode="full", backend="inductor"), ledger)
    with torch.no_grad():
        compiled = net(x)
    seconds = time.perf_counter() - start
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    report = ledger.unwind()
    assert report.unfreed == [] and report.patches_restored == 3 and _dynamo_codes() == 0
    assert "_compiled_call_impl" not in vars(net)
    print(f"\ninductor compile + first call: {seconds:.1f} s")


def test_lora_strength_and_same_rank_swaps_cost_no_recompile(tiny_model, tmp_path):
    """On the compiled quantized model (regional, every block): a new strength and another LoRA of the same
    rank change tensors, never the graph (0 recompiles); another rank recompiles each block shape at most
    once. Counted with dynamo's own counters."""
    from lowbit_pipe import lora
    from lowbit_pipe.arch import get_arch
    from lowbit_pipe.lora.make_example import example_lora
    from lowbit_pipe.stages.compile import dynamo_counters

    model = tiny_model("krea2")
    arch, inputs = _inputs(model)
    a, _ = example_lora(model, get_arch("krea2"), style="peft", rank=8, seed=1)
    b, _ = example_lora(model, get_arch("krea2"), style="peft", rank=8, seed=2)
    c, _ = example_lora(model, get_arch("krea2"), style="peft", rank=16, seed=3)
    result = lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,compile]", "compile.backend=aot_eager"],
                             model=model, run_dir=tmp_path / "run")
    handle = lora.attach(model, a, strength=1.0, name="a", ledger=result.context.ledger)

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return arch.output_tensor(model(**inputs))

    first = forward()
    start = dynamo_counters()["graphs"]
    handle.set_strength(0.5)
    half = forward()
    assert not torch.equal(half, first)
    handle.remove()
    lora.attach(model, b, strength=0.7, name="b", ledger=result.context.ledger)  # another file, same rank
    forward()
    assert dynamo_counters()["graphs"] - start == 0
    lora.remove(model, "b")
    lora.attach(model, c, strength=0.7, name="c", ledger=result.context.ledger)  # another rank
    forward()
    blocks = len(model.transformer_blocks)
    assert dynamo_counters()["graphs"] - start <= blocks  # at most one per compiled block (same shapes each)
    report = lowbit_pipe.teardown(result)
    assert report["unfreed"] == [] and report["proven"], report
