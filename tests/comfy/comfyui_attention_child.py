"""Child process of test_comfy_attention.py: 8-bit attention on a MODEL inside a real ComfyUI, on the CPU.

    python comfyui_attention_child.py job.json result.json

job: {"comfyui": folder, "models": {arch: float file (native names)}}

Per architecture (Krea 2, FLUX.1): ComfyUI's own KSampler path (comfy.sample.sample, 2 Euler steps, cfg 1) on
the pack's example inputs, with the float MODEL, with the MODEL from the "8-bit attention" node (int8 and fp8),
with that node set back to bf16, after Purge, on a clone made before the Purge; then the Quantize node with a
recipe whose `attention.format` is fp8, and its Purge. Results go to result.json.
"""

from __future__ import annotations

import sys
from typing import Any

from comfyui_child import example_sampler, run_child


def _cos(a: Any, b: Any) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _per_arch(path: str) -> dict[str, Any]:
    import comfy.sample
    import comfy.sd
    import torch

    from lowbit_pipe.comfy.attention import OVERRIDE_KEY, override_of
    from lowbit_pipe.comfy.node_runs import PURGES, PurgedModelError
    from lowbit_pipe.comfy.nodes import LowbitAttention8, LowbitPurge, LowbitQuantize

    out: dict[str, Any] = {}
    model = comfy.sd.load_diffusion_model(path)
    sample = example_sampler(model)

    stock = sample(model)
    for fmt in ("int8", "fp8"):
        (m8,) = LowbitAttention8().apply(model, fmt, unique_id=f"a_{fmt}")
        s8 = sample(m8)
        out[f"{fmt}_calls"] = dict(override_of(m8).calls)
        out[f"{fmt}_cosine"] = _cos(s8, stock)
        out[f"{fmt}_rel"] = _rel(s8, stock)
    (every,) = LowbitAttention8().apply(model, "int8", blocks_only=False, unique_id="a_every")
    sample(every)
    out["every_call_calls"] = dict(override_of(every).calls)
    # What ComfyUI's TorchCompileModel node does, on the fp8 MODEL: its clone, ComfyUI's compile wrapper and the
    # node's guard filter (skip_torch_compile_dict, restated: its module imports comfy_api.latest, which needs
    # PyAV); the eager backend (guards and recompiles are Inductor's, without its CPU build time). Two
    # samplings: the second compiles nothing new, and the result is the eager 8-bit one.
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from torch._dynamo.utils import counters

    def skip_torch_compile_dict(guard_entries: Any) -> list[bool]:
        return [("transformer_options" not in entry.name) for entry in guard_entries]

    torch._dynamo.reset()
    compiled = m8.clone(disable_dynamic=True)
    set_torch_compile_wrapper(model=compiled, backend="eager", options={"guard_filter_fn": skip_torch_compile_dict})
    graphs = counters["stats"]["unique_graphs"]
    first = sample(compiled)
    out["compiled_graphs_first"] = counters["stats"]["unique_graphs"] - graphs
    graphs = counters["stats"]["unique_graphs"]
    again = sample(compiled)
    out["compiled_graphs_again"] = counters["stats"]["unique_graphs"] - graphs
    out["compiled_max_diff"] = float(max((first - s8).abs().max(), (again - s8).abs().max()))
    out["compiled_calls"] = dict(override_of(compiled).calls)
    del compiled
    torch._dynamo.reset()
    out["clone_is_new"] = m8 is not model
    out["original_has_no_override"] = OVERRIDE_KEY not in model.model_options.get("transformer_options", {})
    out["original_after_max_diff"] = float((sample(model) - stock).abs().max())
    (back,) = LowbitAttention8().apply(m8, "bf16", unique_id="b")
    out["bf16_has_no_override"] = override_of(back) is None
    out["bf16_max_diff"] = float((sample(back) - stock).abs().max())

    cached = m8.clone()  # a MODEL made from m8 before the Purge (ComfyUI's cache, a LoRA node downstream)
    before = PURGES.of("a_fp8")
    text = LowbitPurge().purge(m8)["result"][1]
    out["purge_text"] = text
    out["purge_moves_is_changed"] = PURGES.of("a_fp8") == before + 1
    out["purged_model_has_no_override"] = override_of(m8) is None
    out["purged_max_diff"] = float((sample(m8) - stock).abs().max())
    try:
        sample(cached)
        out["cached_after_purge"] = "ran"
    except PurgedModelError as err:
        out["cached_after_purge"] = f"PurgedModelError: {err}"

    quantized, summary = LowbitQuantize().quantize(model, "default", "attention.format=fp8", unique_id="q")
    out["quantize_summary_says"] = "8-bit attention (fp8" in summary
    q8 = sample(quantized)
    out["quantize_calls"] = dict(override_of(quantized).calls)
    out["quantize_cosine"] = _cos(q8, stock)
    report = LowbitPurge().purge(quantized)["result"][1]
    out["quantize_purge_proven"] = '"proven": true' in report
    out["quantize_purge_dropped_attention"] = override_of(quantized) is None
    out["float_after_all_max_diff"] = float((sample(model) - stock).abs().max())
    del torch
    return out


def check(job: dict[str, Any]) -> dict[str, Any]:
    return {arch: _per_arch(path) for arch, path in job["models"].items()}


def main(argv: list[str]) -> int:
    return run_child(argv, lambda job, result: result.update(check(job)), archs=("krea2", "flux1"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
