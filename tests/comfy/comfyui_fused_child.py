"""Child process of test_comfy_fused.py: `attention.fused_norm_rope` on ComfyUI's own model code, in a real
ComfyUI imported on the CPU, the kernels run by Triton's interpreter.

    python comfyui_fused_child.py job.json result.json

job: {"comfyui": folder, "models": {arch: float file (native names)}}

TRITON_INTERPRET=1 is set here, before anything imports Triton. The interpreter's fp32 -> bf16 cast truncates
(the GPU rounds to nearest even): it is made to round here, so bf16 outputs compare bit for bit where the fp32
arithmetic agrees. Checks, per architecture (Krea 2, FLUX.1, Qwen-Image: tiny models of ComfyUI's own classes,
random weights), with the kernels let run on CPU tensors (apply_comfy_fused_norm_rope(any_device=True)):
- each fused norm module against its own class's forward, on inputs laid out as the model lays them (strided
  views), per dtype; each fused RoPE (the very object the fused forward calls) against ComfyUI's apply_rope /
  apply_rope1 and its torch form `_apply_rope1`; lowbit_pipe's torch form of the kernel against ComfyUI's;
- the whole forward fused against unfused (fp32, bf16; FLUX.1 also with comfy.ops.manual_cast, whose norms cast
  their weight through comfy.ops.cast_bias_weight, and with a weight patch on a q norm), then the ledger unwound:
  every module's class the stock one again (by identity) and the forward bit-equal to before;
- Krea 2's attention handing k / v over with their own heads (enable_gqa), and the stock code where an attn1_patch
  or another pack's attention override could expect them repeated;
- torch.compile of the fused model: ComfyUI's code traced (the unfused model's graphs and breaks, no kernel call);
- the Quantize node with the recipe key on Krea 2 and FLUX.1 files: the report and summary, the fused classes on
  the node's tree only (the float MODEL upstream untouched), sampling on the CPU (ComfyUI's code: bit-equal to the
  node without the key), and Purge restoring every class.
Results go to result.json; the parent asserts.
"""

from __future__ import annotations

import inspect
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton's import (lowbit_pipe.kernels, comfy-kitchen)

import json
import sys
from typing import Any

from comfyui_child import example_sampler, run_child


def _round_bf16_to_nearest() -> None:
    """The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even. Make it round (torch's
    cast), so the kernels' bf16 results compare exactly here."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).bfloat16().view(torch.int16).numpy()
            return interpreter.TensorHandle(data.view(np.uint16).reshape(src.data.shape), dst_type.scalar)
        return original(self, src, dst_type)

    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)


def _ulps(a: Any, b: Any) -> dict[str, Any]:
    """Distance in units in the last place (bit patterns, same dtype): the largest, and the share of elements
    that differ at all."""
    import torch

    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]

    def ordered(t: Any) -> Any:
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)), i)

    d = (ordered(a) - ordered(b)).abs()
    scaled = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
    return {"max_ulps": int(d.max()), "share_diff": float((d > 0).float().mean()), "n": a.numel(),
            "max_err_over_max": scaled}


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------------ tiny native models
def _init(model: Any, seed: int) -> Any:
    """Random weights (ComfyUI's ops leave them uninitialized): matrices ~ 1/sqrt(fan-in), vectors small."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        scale = 0.2 if p.dim() == 1 else p.shape[-1] ** -0.5
        p.data = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
    return model


def build(arch: str, dtype: Any, ops: Any = None, seed: int = 0) -> tuple[Any, tuple, dict]:
    """A tiny ComfyUI model of `arch` (its own classes), and inputs for its forward."""
    import comfy.ops
    import torch

    ops = ops or comfy.ops.disable_weight_init
    gen = torch.Generator().manual_seed(seed + 1)
    t = torch.tensor([0.6])
    if arch == "krea2":
        from comfy.ldm.krea2.model import SingleStreamDiT

        model = SingleStreamDiT(features=256, tdim=256, txtdim=160, heads=2, kvheads=1, multiplier=2, layers=2,
                                patch=2, channels=16, txtlayers=3, txtheads=2, txtkvheads=2, dtype=dtype,
                                operations=ops)
        args = (torch.randn(1, 16, 8, 8, generator=gen).to(dtype), t, torch.randn(1, 5, 3 * 160, generator=gen).to(dtype))
        return _init(model, seed), args, {}
    if arch == "flux1":
        from comfy.ldm.flux.model import Flux

        model = Flux(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=48, hidden_size=256, mlp_ratio=2.0,
                     num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
                     qkv_bias=True, guidance_embed=True, txt_ids_dims=[], dtype=dtype, operations=ops)
        args = (torch.randn(1, 16, 8, 8, generator=gen).to(dtype), t, torch.randn(1, 5, 48, generator=gen).to(dtype))
        return _init(model, seed), args, {"y": torch.randn(1, 32, generator=gen).to(dtype),
                                          "guidance": torch.tensor([3.5])}
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=48,
                                        axes_dims_rope=(16, 56, 56), dtype=dtype, operations=ops)
    args = (torch.randn(1, 16, 1, 8, 8, generator=gen).to(dtype), t, torch.randn(1, 5, 48, generator=gen).to(dtype))
    return _init(model, seed), args, {}


def _classes(model: Any) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


# ---------------------------------------------------------------------------------------------- norms and RoPE
def _norm_cases(arch: str, model: Any, dtype: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (a fused norm module, an input laid out as the model lays it out there)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    b, seq, heads, d = 2, 24, 2, 128
    if arch == "krea2":  # q / k: rearrange "B L (H D) -> B H L D" of wq(x) (a permuted view); prenorm: [B, L, F]
        q = (torch.randn(b, seq, heads * d, generator=gen) * 3).to(dtype).view(b, seq, heads, d).permute(0, 2, 1, 3)
        return {"qknorm.qnorm": (model.blocks[0].attn.qknorm.qnorm, q),
                "prenorm": (model.blocks[0].prenorm, (torch.randn(b, seq, 256, generator=gen) * 3).to(dtype)),
                "txtmlp.0": (model.txtmlp[0], (torch.randn(b, 5, 160, generator=gen) * 3).to(dtype))}
    if arch == "flux1":  # q / k: the packed qkv viewed [B, L, 3, H, D], permuted, q = [0] (a strided slice)
        qkv = (torch.randn(b, seq, 3 * heads * d, generator=gen) * 3).to(dtype)
        q, k, _ = qkv.view(b, seq, 3, heads, d).permute(2, 0, 3, 1, 4)
        return {"img_attn.norm.query_norm": (model.double_blocks[0].img_attn.norm.query_norm, q),
                "single.norm.key_norm": (model.single_blocks[0].norm.key_norm, k)}
    q = (torch.randn(b, seq, heads * d, generator=gen) * 3).to(dtype)  # Qwen-Image: .transpose(1, 2).contiguous()
    q = q.view(b, seq, heads, d).transpose(1, 2).contiguous()
    return {"attn.norm_q": (model.transformer_blocks[0].attn.norm_q, q),
            "attn.norm_added_k": (model.transformer_blocks[0].attn.norm_added_k, q[:, :, :5].contiguous()),
            "txt_norm": (model.txt_norm, (torch.randn(b, 5, 48, generator=gen) * 3).to(dtype))}


def _rope_of(arch: str, model: Any) -> Any:
    """The FusedComfyRope the fused forward of the arch's attention calls."""
    if arch == "krea2":  # under the wrapper that opens x to one quantization for wq, wk, wv, gate
        return inspect.unwrap(type(model.blocks[0].attn).forward).__globals__["apply_rope"]
    if arch == "flux1":
        return type(model.double_blocks[0]).forward.__globals__["attention"].__globals__["apply_rope"]
    return inspect.unwrap(type(model.transformer_blocks[0].attn).forward).__globals__["apply_rope1"]


def _freqs(model: Any, seq: int) -> Any:
    """The model's own RoPE tensor [2, 1, seq, D/2, 2, 2] (its pe_embedder on ids as the models make them)."""
    import torch

    ids = torch.zeros(2, seq, 3)
    ids[:, :, 1] = torch.arange(seq).float().div(4).floor()
    ids[:, :, 2] = torch.arange(seq).float().remainder(4) - 2
    return model.pe_embedder(ids)


def _ropes_vs_comfy(arch: str, model: Any, fusion: Any) -> dict[str, Any]:
    """The fused RoPE against ComfyUI's apply_rope / apply_rope1 (comfy-kitchen's eager code on the CPU) and its
    torch form `_apply_rope1`, per freqs dtype (fp32: FLUX.1, Krea 2; bf16: Qwen-Image casts them to the
    model's dtype) and x dtype; lowbit_pipe's torch form of the kernel against ComfyUI's, bit for bit."""
    import comfy.ldm.flux.math as fmath
    import torch

    from lowbit_pipe.kernels.norm_rope import reference_rope_pairs

    out: dict[str, Any] = {}
    rope = _rope_of(arch, model)
    gen = torch.Generator().manual_seed(8)
    for fdtype in (torch.float32, torch.bfloat16):
        freqs = _freqs(model, 30).to(fdtype).contiguous()  # 30 tokens of freqs for 24 of x: ComfyUI trims them
        for xdtype in (torch.float32, torch.bfloat16):
            q = (torch.randn(2, 2, 24, 128, generator=gen) * 2).to(xdtype)
            k = (torch.randn(2, 1, 24, 128, generator=gen) * 2).to(xdtype)  # Krea 2's GQA: fewer k heads
            calls = fusion.rope_calls
            with torch.no_grad():
                if rope.pair:
                    got = rope(q, k, freqs)
                    want = fmath.apply_rope(q, k, freqs)
                    torch_form = (fmath._apply_rope1(q, freqs), fmath._apply_rope1(k, freqs))
                else:
                    got = (rope(q, freqs),)
                    want, torch_form = (fmath.apply_rope1(q, freqs),), (fmath._apply_rope1(q, freqs),)
            name = f"rope freqs {str(fdtype).split('.')[-1]} x {str(xdtype).split('.')[-1]}"
            out[name] = {"kernel": fusion.rope_calls == calls + len(got),
                         "vs_apply_rope": [_ulps(g, w) for g, w in zip(got, want)],
                         "vs_torch_form": [_ulps(g, w) for g, w in zip(got, torch_form)],
                         "reference_equals_torch_form": all(torch.equal(reference_rope_pairs(x, freqs), w)
                                                            for x, w in zip((q, k), torch_form))}
    return out


def kernels_vs_comfy(arch: str) -> dict[str, Any]:
    """Each fused norm against its own class's forward, per model dtype; the RoPE (_ropes_vs_comfy); the unwind."""
    import torch

    from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope
    from lowbit_pipe.ledger import Ledger

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).split(".")[-1]
        model, _, _ = build(arch, dtype)
        stock = _classes(model)
        ledger = Ledger()
        applied = apply_comfy_fused_norm_rope(model, ledger, any_device=True)
        fusion = applied.fusion
        with torch.no_grad():
            for name, (module, x) in _norm_cases(arch, model, dtype).items():
                calls = fusion.norm_calls
                got = module(x)
                want = stock_forward = type(module).__mro__[2].forward(module, x)  # (mixin, fused class's base)
                assert type(module).__mro__[2] is stock[_name_of(model, module)]
                out[f"norm {name} {dname}"] = {**_ulps(got, want), "kernel": fusion.norm_calls == calls + 1,
                                              "contiguous": got.is_contiguous() == stock_forward.is_contiguous(),
                                              "strided_input": not x.is_contiguous()}
            if dtype == torch.bfloat16:  # RoPE: one model is enough; freqs in both dtypes (the kernel's two modes)
                out.update(_ropes_vs_comfy(arch, model, fusion))
        report = ledger.unwind()
        out[f"unwind {dname}"] = {"errors": report.errors, "unfreed": report.unfreed,
                                  "classes_restored": all(type(m) is stock[n] for n, m in model.named_modules())}
    return out


def _name_of(model: Any, module: Any) -> str:
    return next(n for n, m in model.named_modules() if m is module)


# ---------------------------------------------------------------------------------------------- whole forwards
def forward_fused_vs_unfused(arch: str, dtype: Any, ops_name: str = "disable_weight_init",
                             weight_patch: bool = False) -> dict[str, Any]:
    import comfy.ops
    import torch

    from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope
    from lowbit_pipe.ledger import Ledger

    model, args, kwargs = build(arch, dtype, getattr(comfy.ops, ops_name), seed=3)
    if weight_patch:  # what a ComfyUI weight patch on a q norm looks like to the module: a weight_function
        norm = model.double_blocks[0].img_attn.norm.query_norm
        norm.weight_function = [lambda w: w * 1.5]
    stock = _classes(model)
    forwards = {n: m.forward.__func__ for n, m in model.named_modules()}
    with torch.no_grad():
        before = model(*args, **kwargs)
        ledger = Ledger()
        applied = apply_comfy_fused_norm_rope(model, ledger, any_device=True)
        fused_classes = {n: type(m).__name__ for n, m in model.named_modules() if type(m) is not stock[n]}
        after = model(*args, **kwargs)
        calls = applied.as_dict()
        report = ledger.unwind()
        again = model(*args, **kwargs)
    return {"rel": _rel(after, before), "ulps": _ulps(after, before), "calls": calls, "fused": fused_classes,
            "errors": report.errors, "unfreed": report.unfreed, "restored": report.patches_restored,
            "classes_restored": all(type(m) is stock[n] for n, m in model.named_modules()),
            "forwards_restored": all(m.forward.__func__ is forwards[n] and "forward" not in vars(m)
                                     for n, m in model.named_modules()),
            "after_undo_equal": bool(torch.equal(again, before))}


def grouped_kv_fallbacks() -> dict[str, Any]:
    """Krea 2's fused attention hands k / v over with their own heads only where nothing expects them repeated: with
    an attn1_patch (which sees k / v) or another pack's attention override it runs the stock code; each case's
    output against the unfused model's with the same options (fp32: bf16's one-ulp flips in the fused kernels grow
    through a tiny random model's layers, which says nothing about the grouping)."""
    import torch

    from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope
    from lowbit_pipe.ledger import Ledger

    seen_heads: list[int] = []

    def patch(q: Any, k: Any, v: Any, **_: Any) -> dict:
        seen_heads.append(k.shape[1])
        return {}

    def foreign(func: Any, *args: Any, **kwargs: Any) -> Any:  # another pack's override: ignores enable_gqa
        seen_heads.append(args[1].shape[1])
        kwargs.pop("enable_gqa", None)
        return func(*args, **kwargs)

    cases = {"none": {}, "attn1_patch": {"patches": {"attn1_patch": [patch]}},
             "foreign override": {"optimized_attention_override": foreign}}
    out: dict[str, Any] = {}
    for case, options in cases.items():
        model, args, kwargs = build("krea2", torch.float32, seed=6)
        with torch.no_grad():
            seen_heads.clear()
            before = model(*args, **kwargs, transformer_options=dict(options))
            stock_heads = list(seen_heads)
            ledger = Ledger()
            applied = apply_comfy_fused_norm_rope(model, ledger, any_device=True)
            seen_heads.clear()
            after = model(*args, **kwargs, transformer_options=dict(options))
            out[case] = {"grouped_calls": applied.fusion.grouped_calls, "rel": _rel(after, before),
                         "heads_seen": [stock_heads, list(seen_heads)],
                         "grouped_modules": applied.as_dict()["grouped_kv_modules"]}
            ledger.unwind()
    return out


# Layers whose input the fused forward opens to one shared quantization (True) and layers it must not (False)
SHARED_PROBES = {"krea2": {"blocks.0.attn.wq": True, "blocks.0.attn.gate": True, "blocks.0.mlp.gate": True,
                           "blocks.0.mlp.up": True, "blocks.0.attn.wo": False, "blocks.0.mlp.down": False},
                 "flux1": {"double_blocks.0.img_attn.qkv": False, "single_blocks.0.linear1": False},
                 "qwen_image": {"transformer_blocks.0.attn.to_q": True, "transformer_blocks.0.attn.to_v": True,
                                "transformer_blocks.0.attn.add_k_proj": True,
                                "transformer_blocks.0.attn.to_out.0": False}}


def shared_inputs_opened(arch: str) -> dict[str, Any]:
    """Under torch.inference_mode (as ComfyUI runs a node), which layers see their input opened to one shared
    quantization (dispatch.shared_inputs' tag) while the fused forward runs, and whether any tag or activations
    are left on those inputs afterwards."""
    import torch

    from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope
    from lowbit_pipe.kernels import dispatch
    from lowbit_pipe.ledger import Ledger

    model, args, kwargs = build(arch, torch.bfloat16, seed=4)
    ledger = Ledger()
    applied = apply_comfy_fused_norm_rope(model, ledger, any_device=True)
    modules = dict(model.named_modules())
    seen: dict[str, list[bool]] = {}
    inputs: list[Any] = []

    def probe(name: str):
        def hook(module: Any, hook_args: tuple) -> None:
            seen.setdefault(name, []).append(bool(hook_args[0].__dict__.get(dispatch.SHARED_INPUT_TAG)))
            inputs.append(hook_args[0])
        return hook

    handles = [modules[n].register_forward_pre_hook(probe(n)) for n in SHARED_PROBES[arch]]
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        ledger.unwind()
    left = [sorted(k for k in t.__dict__ if k.startswith("_lowbit")) for t in inputs]
    return {"expected": SHARED_PROBES[arch], "seen": {n: all(v) if SHARED_PROBES[arch][n] else any(v) for n, v in seen.items()},
            "calls": {n: len(v) for n, v in seen.items()}, "left": [x for x in left if x],
            "shared_input_modules": applied.as_dict()["shared_input_modules"]}


def compiled_vs_unfused(arch: str) -> dict[str, Any]:
    """torch.compile (the eager backend: Dynamo's graphs and guards, no Inductor build) of the fused model traces
    ComfyUI's own code: the same graphs and graph breaks as the unfused model, no kernel call, the same output."""
    import torch
    from torch._dynamo.utils import counters

    from lowbit_pipe.attention.comfy_fused import apply_comfy_fused_norm_rope
    from lowbit_pipe.ledger import Ledger

    seen = {}
    for fused in (False, True):
        model, args, kwargs = build(arch, torch.float32, seed=5)
        ledger = Ledger()
        applied = apply_comfy_fused_norm_rope(model, ledger, any_device=True) if fused else None
        torch._dynamo.reset()
        counters.clear()
        graphs: list = []

        def backend(gm: Any, example_inputs: Any) -> Any:  # the eager backend, keeping the graphs to read
            graphs.append(gm)
            return gm.forward

        with torch.no_grad():
            out = torch.compile(model, backend=backend)(*args, **kwargs)
        nodes = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
        methods = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_method"]
        seen[fused] = {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
                       "out": out, "calls": applied.as_dict() if applied else None,
                       "reasons": sorted(counters["graph_break"]),
                       # Krea 2's own k / v repeat is `repeat_interleave(rep, dim=1)`; ComfyUI's attention functions
                       # repeat with dim=-3 where their kernel cannot group (on the CPU: attention_basic / split)
                       "model_repeats": sum(1 for n in nodes + methods if "repeat_interleave" in str(n.target)
                                            and n.kwargs.get("dim") == 1)}
        torch._dynamo.reset()
        ledger.unwind()
    calls = seen[True]["calls"]
    return {"breaks": [seen[f]["breaks"] for f in (False, True)], "graphs": [seen[f]["graphs"] for f in (False, True)],
            "equal": bool(torch.equal(seen[False]["out"], seen[True]["out"])),
            "kernel_calls": calls["norm_kernel_calls"] + calls["rope_kernel_calls"],
            "break_reasons": [seen[f]["reasons"] for f in (False, True)], "shared_modules": calls["shared_input_modules"],
            "model_repeats": [seen[f]["model_repeats"] for f in (False, True)]}


# ---------------------------------------------------------------------------------------------- the Quantize node
def quantize_node(path: str) -> dict[str, Any]:
    import comfy.sample
    import comfy.sd

    from lowbit_pipe.comfy import node_runs
    from lowbit_pipe.comfy.nodes import LowbitPurge, LowbitQuantize

    model = comfy.sd.load_diffusion_model(path)
    float_tree = model.get_model_object("diffusion_model")
    float_classes = _classes(float_tree)
    sample = example_sampler(model)

    plain, _ = LowbitQuantize().quantize(model, "default", "", unique_id="plain")
    fused, summary = LowbitQuantize().quantize(model, "default", "attention.fused_norm_rope=true", unique_id="fused")
    tree = fused.get_model_object("diffusion_model")
    report = node_runs.state_of(tree).run.result.report["attention"]
    out: dict[str, Any] = {
        "summary_line": next((ln for ln in summary.splitlines() if "fused norm / RoPE" in ln), None),
        "report": report,
        "fused_on_tree": sorted({type(m).__name__ for n, m in tree.named_modules() if type(m).__module__ ==
                                 "lowbit_pipe.attention.comfy_fused"}),
        "float_tree_untouched": _classes(float_tree) == float_classes,
        "max_diff_vs_unfused_node": float((sample(fused) - sample(plain)).abs().max()),
    }
    text = LowbitPurge().purge(fused)["result"][1]
    proof = json.loads(text.split("lowbit_pipe purge: ", 1)[1].split("\n8-bit attention")[0])
    out["purge"] = {k: proof.get(k) for k in ("proven", "unfreed", "patches_restored")}
    out["classes_restored"] = _classes(tree) == float_classes  # quantized layers and fused classes all undone
    out["no_fused_class_left"] = not any(type(m).__module__ == "lowbit_pipe.attention.comfy_fused" for m in tree.modules())
    LowbitPurge().purge(plain)
    return out


def check(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    _round_bf16_to_nearest()
    out: dict[str, Any] = {}
    for arch in ("krea2", "flux1", "qwen_image"):
        out[f"kernels {arch}"] = kernels_vs_comfy(arch)
        for dtype in (torch.float32, torch.bfloat16):
            out[f"forward {arch} {str(dtype).split('.')[-1]}"] = forward_fused_vs_unfused(arch, dtype)
        out[f"compiled {arch}"] = compiled_vs_unfused(arch)
        out[f"shared {arch}"] = shared_inputs_opened(arch)
    out["grouped krea2"] = grouped_kv_fallbacks()
    out["forward flux1 bfloat16 manual_cast"] = forward_fused_vs_unfused("flux1", torch.bfloat16, "manual_cast")
    out["forward flux1 float32 manual_cast weight patch"] = forward_fused_vs_unfused("flux1", torch.float32,
                                                                                      "manual_cast", weight_patch=True)
    for arch, path in job["models"].items():
        out[f"node {arch}"] = quantize_node(path)
    return out


def main(argv: list[str]) -> int:
    return run_child(argv, lambda job, result: result.update(check(job)), archs=("krea2", "flux1"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
