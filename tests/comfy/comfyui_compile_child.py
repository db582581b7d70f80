"""Child process of test_comfy_compile.py: the Compile (lowbit_pipe) node inside a real ComfyUI, on the CPU.

    python comfyui_compile_child.py job.json result.json

job: {"comfyui": folder, "models": {arch: float file (native names)}, "loras": {arch: {"a", "b": peft LoRA files
of one rank, "c": another rank}}, "backend": the backend of the graph / guard checks, "inductor": [archs to
sample once with inductor], "files": {case: quantized Krea 2 file}}

ComfyUI runs with its PyTorch attention (`--use-pytorch-cross-attention`, what it picks on a GPU; on a CPU its
default is sub-quadratic attention, which asks psutil for free memory: a graph break in ComfyUI's code, not
the pack's). Per architecture, through ComfyUI's own sampling path (comfy.sample.sample, 2 Euler steps, cfg 1):
Quantize -> LoRA residual -> Compile, with dynamo's own counters around each sampling; the MODEL given to
Compile, a strength change, a same-rank swap, another rank, weights moved the way ComfyUI's loaders move them,
a dynamic-VRAM MODEL (its non-dynamic delegate), Purge, and a MODEL no pack node made; then quantized files
opened with Load Diffusion Model. The pack's loader registration is installed, as the node pack does at
ComfyUI's start. Results go to result.json.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from comfyui_child import example_sampler, lora_name, run_child


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _per_arch(arch: str, path: str, loras: dict[str, str], backend: str, inductor: bool) -> dict[str, Any]:
    import comfy.model_management as mm
    import comfy.sample
    import comfy.sd
    import comfy.utils
    import torch
    from comfy.model_patcher import ModelPatcher

    from lowbit_pipe.comfy.attention import override_of
    from lowbit_pipe.comfy.compile_node import LowbitCompile, compile_report
    from lowbit_pipe.comfy.node_runs import PurgedModelError
    from lowbit_pipe.comfy.nodes import LowbitAttention8, LowbitLoRA, LowbitPurge, LowbitQuantize
    from lowbit_pipe.stages.compile import dynamo_counters

    out: dict[str, Any] = {}
    model = comfy.sd.load_diffusion_model(path)
    sample = example_sampler(model)

    def counted(m: Any) -> tuple[Any, dict[str, int]]:
        before = dynamo_counters()
        got = sample(m)
        return got, {k: v - before[k] for k, v in dynamo_counters().items()}

    def compiled(m: Any, node: str, use: str = backend) -> Any:
        return LowbitCompile().compile(m, use, unique_id=node)

    def tree_of(m: Any) -> Any:
        return m.get_model_object("diffusion_model")

    torch._dynamo.reset()
    floating = sample(model)
    quantized, _ = LowbitQuantize().quantize(model, "default", unique_id=f"q_{arch}")
    (with_a,) = LowbitLoRA().attach(quantized, lora_name(loras["a"]), 1.0, unique_id=f"l_{arch}")
    eager = sample(with_a)

    node = compiled(with_a, f"c_{arch}")
    out["ui_text"] = node["ui"]["text"][0]
    (comp,) = node["result"]
    got, counts = counted(comp)
    out["first"] = counts
    out["compiled_vs_eager"] = _rel(got, eager)
    out["report"] = compile_report(comp)
    again, counts = counted(comp)
    out["again"] = counts
    out["again_vs_first"] = float((again - got).abs().max())
    out["blocks_left_compiled"] = sum(b.__dict__.get("_compiled_call_impl") is not None
                                      for b in tree_of(comp).modules())

    # The MODEL given to Compile: no wrapper, samples eagerly as before (bit for bit, no graph traced).
    out["given_has_wrapper"] = compile_report(with_a) is not None
    given, counts = counted(with_a)
    out["given_counts"] = counts
    out["given_vs_eager"] = float((given - eager).abs().max())

    # A new strength, another LoRA of the same rank: the LoRA node and Compile re-run, nothing recompiles.
    def lora_then_compile(file: str, strength: float, tag: str) -> tuple[Any, Any, dict[str, int]]:
        (lora_model,) = LowbitLoRA().attach(quantized, lora_name(file), strength, unique_id=f"l{tag}_{arch}")
        eager_out = sample(lora_model)
        (comp_model,) = compiled(lora_model, f"c{tag}_{arch}")["result"]
        got_out, counts_out = counted(comp_model)
        return comp_model, (got_out, eager_out), counts_out

    strength, (s_got, s_eager), out["strength_counts"] = lora_then_compile(loras["a"], 0.5, "s")
    out["strength_vs_eager"] = _rel(s_got, s_eager)
    out["strength_changed_output"] = _rel(s_got, got)
    out["strength_report"] = compile_report(strength)
    _, (w_got, w_eager), out["swap_counts"] = lora_then_compile(loras["b"], 0.8, "w")
    out["swap_vs_eager"] = _rel(w_got, w_eager)
    # Weights moved the way ComfyUI's loaders move them: every parameter and buffer of the tree replaced by another
    # tensor of the same kind (set_attr_param / set_attr_buffer: a load to another device, dynamic VRAM's staging),
    # and ComfyUI unloading and reloading the model. The graphs read them at each call: nothing recompiles.
    tree = tree_of(strength)
    for key, param in list(tree.named_parameters()):
        comfy.utils.set_attr(tree, key, torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad))
    for key, buf in list(tree.named_buffers()):
        comfy.utils.set_attr_buffer(tree, key, buf.clone())
    moved, out["moved_counts"] = counted(strength)
    out["moved_vs_before"] = float((moved - s_got).abs().max())
    mm.unload_all_models()
    reloaded, out["reloaded_counts"] = counted(strength)
    out["reloaded_vs_before"] = float((reloaded - s_got).abs().max())
    _, (r_got, r_eager), out["rank_counts"] = lora_then_compile(loras["c"], 0.8, "r")
    out["rank_vs_eager"] = _rel(r_got, r_eager)
    out["block_classes"] = len(out["report"]["classes"])

    # Dynamic VRAM (a GPU's default, which a CPU cannot run): the clone is ComfyUI's non-dynamic delegate, rebuilt
    # through the MODEL's cached_patcher_init around a copy of its tree that the run adopts.
    with_a.is_dynamic = lambda: True
    (delegate,) = compiled(with_a, f"cd_{arch}")["result"]
    del with_a.is_dynamic
    out["delegate_is_plain_patcher"] = type(delegate) is ModelPatcher
    out["delegate_tree_is_a_copy"] = tree_of(delegate) is not tree_of(with_a)
    d_got, out["delegate_counts"] = counted(delegate)
    out["delegate_vs_eager"] = _rel(d_got, eager)

    # With the pack's 8-bit attention (an override object in transformer_options, counting its calls when traced):
    # no graph break, and a strength change under it recompiles nothing either.
    (att,) = LowbitAttention8().apply(quantized, "int8", unique_id=f"a_{arch}")
    (att_lora,) = LowbitLoRA().attach(att, lora_name(loras["a"]), 1.0, unique_id=f"la_{arch}")
    att_eager = sample(att_lora)
    (att_comp,) = compiled(att_lora, f"ca_{arch}")["result"]
    a_got, out["attention_counts"] = counted(att_comp)
    out["attention_vs_eager"] = _rel(a_got, att_eager)
    out["attention_calls"] = dict(override_of(att_comp).calls)
    (att_half,) = LowbitLoRA().attach(att, lora_name(loras["a"]), 0.5, unique_id=f"lh_{arch}")
    _, out["attention_strength_counts"] = counted(compiled(att_half, f"ch_{arch}")["result"][0])

    # Purge of the compiled MODEL: the whole run back, dynamo reset, every MODEL of the run refusing to sample.
    from torch._dynamo import convert_frame

    text = LowbitPurge().purge(comp)["result"][1]
    out["purge_text"] = text
    out["dynamo_codes_after_purge"] = len(convert_frame.input_codes.seen)
    out["blocks_left_compiled_after_purge"] = sum(b.__dict__.get("_compiled_call_impl") is not None
                                                  for m in (comp, strength, delegate, att_comp)
                                                  for b in tree_of(m).modules())
    for name, m in (("purged_compiled", comp), ("purged_strength", strength), ("purged_delegate", delegate),
                    ("purged_attention", att_comp)):
        try:
            sample(m)
            out[name] = "ran"
        except PurgedModelError as err:
            out[name] = f"PurgedModelError: {err}"

    # A MODEL no pack node made (the float file): the node's own run around a copy; Purge ends it; the float MODEL
    # samples as before.
    (own,) = compiled(model, f"cf_{arch}")["result"]
    out["own_tree_is_a_copy"] = tree_of(own) is not tree_of(model)
    o_got, out["own_counts"] = counted(own)
    out["own_vs_float"] = _rel(o_got, floating)
    out["own_purge_text"] = LowbitPurge().purge(own)["result"][1]
    out["float_after_max_diff"] = float((sample(model) - floating).abs().max())

    if inductor:  # the node's default backend, once: C++ code generated by inductor for the quantized blocks
        torch._dynamo.reset()
        q2, _ = LowbitQuantize().quantize(model, "default", unique_id=f"qi_{arch}")
        (l2,) = LowbitLoRA().attach(q2, lora_name(loras["a"]), 1.0, unique_id=f"li_{arch}")
        eager2 = sample(l2)
        (ind,) = LowbitCompile().compile(l2, "inductor", unique_id=f"ci_{arch}")["result"]
        start = time.perf_counter()
        i_got, out["inductor_counts"] = counted(ind)
        out["inductor_seconds"] = time.perf_counter() - start
        out["inductor_vs_eager"] = _rel(i_got, eager2)
        out["inductor_report"] = compile_report(ind)
        out["inductor_purge_text"] = LowbitPurge().purge(ind)["result"][1]
    return out


def _files(files: dict[str, str], backend: str) -> dict[str, Any]:
    """Quantized files opened with Load Diffusion Model (the pack registered): a lowbit kind compiles like the Quantize
    node's layers; a rotated lowbit kind is refused at the node, naming a layer."""
    import comfy.sample
    import comfy.sd

    from lowbit_pipe.comfy.compile_node import LowbitCompile
    from lowbit_pipe.comfy.nodes import LowbitPurge
    from lowbit_pipe.stages.compile import dynamo_counters

    out: dict[str, Any] = {}
    for case, path in files.items():
        model = comfy.sd.load_diffusion_model(path)
        sample = example_sampler(model)

        eager = sample(model)
        try:
            (comp,) = LowbitCompile().compile(model, backend, unique_id=f"file_{case}")["result"]
        except ValueError as err:
            out[case] = {"refused": str(err)}
            continue
        before = dynamo_counters()
        got = sample(comp)
        out[case] = {"counts": {k: v - before[k] for k, v in dynamo_counters().items()},
                     "vs_eager": _rel(got, eager), "purge_text": LowbitPurge().purge(comp)["result"][1],
                     "after_purge_max_diff": float((sample(model) - eager).abs().max())}
    return out


def _qwen_image() -> dict[str, Any]:
    """ComfyUI's own Qwen-Image class (comfy/ldm/qwen_image) at a tiny size, seeded, quantized (int8) in place, its
    blocks compiled the way the node's wrapper compiles them (no Qwen-Image file of a size ComfyUI detects is small
    enough, and the pack's example inputs are Krea 2's and FLUX.1's): the blocks found, one graph, no graph break."""
    import comfy.ops
    import torch
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    import lowbit_pipe
    from lowbit_pipe.comfy.compile_node import CompileReport, RegionalCompile, _record, block_lists
    from lowbit_pipe.comfy.node_runs import NodeRun
    from lowbit_pipe.ledger import Ledger
    from lowbit_pipe.stages.compile import dynamo_counters

    torch._dynamo.reset()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tree = QwenImageTransformer2DModel(num_layers=2, attention_head_dim=32, num_attention_heads=2,
                                           joint_attention_dim=64, axes_dims_rope=(8, 12, 12), dtype=torch.float32,
                                           operations=comfy.ops.disable_weight_init)
        with torch.no_grad():
            for param in tree.parameters():
                param.normal_(0, 0.05)
        x, t, context = torch.randn(1, 16, 1, 8, 8), torch.rand(1), torch.randn(1, 8, 64)
    arch, paths = block_lists(tree)
    ledger = Ledger()
    lowbit_pipe.quantize(tree, {"default": {"format": "int8"}}, ledger=ledger)
    with torch.inference_mode():
        eager = tree(x, t, context)
    blocks = [b for p in paths for b in tree.get_submodule(p)]
    classes = list(dict.fromkeys(type(b) for b in blocks))
    report = CompileReport("qwen", "aot_eager", "default", arch, paths, len(blocks), tuple(c.__name__ for c in classes))
    compiled = RegionalCompile(paths, classes, {"backend": "aot_eager"}, report, None)
    _record(NodeRun(ledger, "qwen", None), compiled, report)

    class Executor:  # ComfyUI's APPLY_MODEL executor: class_obj is the BaseModel
        class_obj = torch.nn.Module()

        def __call__(self, *args: Any) -> Any:
            return self.class_obj.diffusion_model(*args)

    executor = Executor()
    executor.class_obj.diffusion_model = tree
    before = dynamo_counters()
    with torch.inference_mode():
        got = compiled.run(executor, (x, t, context), {})
    counts = {k: v - before[k] for k, v in dynamo_counters().items()}
    quantized = sum(type(m).__name__ == "QuantLinear" for m in blocks[0].modules())
    teardown = ledger.unwind()
    return {"arch": arch, "paths": list(paths), "quantized": quantized, "counts": counts, "max_diff": float((got - eager).abs().max()), "proven": teardown.proven,
            "unfreed": teardown.unfreed}


def check(job: dict[str, Any]) -> dict[str, Any]:
    import comfy.cli_args

    comfy.cli_args.args.use_pytorch_cross_attention = True  # read when comfy.model_management is imported
    from lowbit_pipe.comfy import install_into_comfyui

    registration = install_into_comfyui()  # as the node pack does at ComfyUI's start: lowbit kinds load
    out = {arch: _per_arch(arch, path, job["loras"][arch], job["backend"], arch in job.get("inductor", []))
           for arch, path in job["models"].items()}
    out["files"] = _files(job.get("files", {}), job["backend"])
    out["qwen_image"] = _qwen_image()
    registration.uninstall()
    return out


def main(argv: list[str]) -> int:
    return run_child(argv, lambda job, result: result.update(check(job)), archs=("krea2", "flux1"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
