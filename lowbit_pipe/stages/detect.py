"""detect: which architecture this is, its structural config, and the layer plan (printed and reported)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from lowbit_pipe.arch import Generic, ModuleArch, detect_module, generic_policy, get_arch
from lowbit_pipe.errors import RecipeError
from lowbit_pipe.formats import get_format
from lowbit_pipe.plan.plan import layer_row
from lowbit_pipe.plan.policy import LayerPlan, linear_shapes, plan_layers
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register
from lowbit_pipe.summary import fmt_bytes


def plan_bytes(plans: list[LayerPlan], float_itemsize: int) -> tuple[int, int]:
    """Weight bytes of the planned Linears before (float) and after (each layer's format, exact)."""
    before = sum(o * i for o, i in (p.shape for p in plans)) * float_itemsize
    after = sum(get_format(p.spec.format).storage_bytes(*p.shape, p.spec) if p.spec else p.shape[0] * p.shape[1] * float_itemsize
                for p in plans)
    return before, after


@register
class Detect(Stage):
    name = "detect"

    def run(self, ctx: Context) -> dict[str, Any]:
        # model.arch forces the architecture of a weights FILE; tiny models and live objects are detected
        # by class, or by their keys when they carry native names (a ComfyUI model's diffusion_model).
        forced = ctx.recipe.model.arch if ctx.recipe.model.path is not None else None
        if forced == "generic":
            found = None
        elif forced is not None:
            arch = get_arch(forced)
            found = ModuleArch(arch, arch.config_from_model(ctx.transformer), native=False)
        else:
            found = detect_module(ctx.transformer)
        if found is None:
            ctx.arch = None  # no example inputs: evaluate is skipped, budget refused
            ctx.arch_config = None
            ctx.policy = Generic.for_model(ctx.transformer).policy if forced != "generic" else generic_policy(ctx.transformer)
        else:
            ctx.arch, ctx.arch_config, ctx.native, ctx.policy = found.arch, found.config, found.native, found.arch.policy
        arch = ctx.arch
        if ctx.recipe.evaluate.text_valid is not None and (arch is None or arch.text_mask_key is None):
            raise RecipeError("evaluate.text_valid", f"the {arch.id if arch else 'generic'} model's forward takes no "
                                                     "text padding mask; leave it null")
        plans = plan_layers(linear_shapes(ctx.transformer), ctx.recipe.quantize, ctx.policy, ctx.policy_name)
        counts = Counter(p.spec.format if p.spec else "float" for p in plans)
        before, after = plan_bytes(plans, ctx.dtype.itemsize)
        arch_id = arch.id if arch else "generic"
        config = asdict(ctx.arch_config) if ctx.arch_config else {}
        result = {"arch": arch_id, "config": config, "names": "native" if ctx.native else "diffusers",
                  "plan": {"layers": dict(counts), "linear_bytes_before": before, "linear_bytes_after": after}}
        ctx.report["detect"] = result
        ctx.report["plan"] = [layer_row(p) for p in plans]
        shape = ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("arch", "extra") and v is not None)
        # A run reading model.path says whether it streams it (model.stream, stream_choice.decide_stream) and why.
        how = f"; {ctx.stream_choice.line()}" if ctx.stream_choice is not None and ctx.source.get("path") else ""
        q = ctx.recipe.quantize
        if any(getattr(q.target, k) is not None for k in ("speedup", "bytes", "ratio", "error")):
            how += "; quantize.target re-plans the quantized layers (summary: the plan it chose)"
        elif q.budget_bytes is not None or q.budget_ratio is not None:
            how += "; quantize.budget_* re-plans the quantized layers"
        ctx.console.say(f"detect: {arch_id} ({shape}){', native module names' if ctx.native else ''}\n"
                        f"plan:   {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))} layers; "
                        f"linear weights {fmt_bytes(before)} -> {fmt_bytes(after)}{how}")
        return {"arch": arch_id, **{f"layers_{k}": v for k, v in counts.items()}}
