"""lora: attach LoRA files after quantize, as exact residual branches or baked into the weights.

Every change goes through the ledger (teardown takes it off again). Residual mode also puts
the branches on the float originals the ledger holds, so evaluate's float reference is
float + LoRA (like with like). Files named `example:<style>[:seed=N]...` are generated for the
loaded model (lowbit_pipe.lora.make_example): runnable recipes without committed binaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lowbit_pipe.lora import apply
from lowbit_pipe.lora.make_example import example_lora, parse_spec
from lowbit_pipe.recipe import LORA_MODES
from lowbit_pipe.stages.base import Stage
from lowbit_pipe.stages.context import Context
from lowbit_pipe.stages.registry import register

MODES = LORA_MODES  # lora.mode (recipe.LORA_MODES, which config.validate checks it against)


def _source(ctx: Context, path: str) -> Any:
    """A path, or the in-memory state dict of an `example:` spec."""
    if path.startswith("example:"):
        tensors, _ = example_lora(ctx.transformer, ctx.arch, config=ctx.arch_config, **parse_spec(path))
        return tensors
    return path


@register
class Lora(Stage):
    name = "lora"

    def run(self, ctx: Context) -> dict[str, Any]:
        cfg = ctx.recipe.lora
        model = ctx.transformer
        arch = ctx.arch if ctx.arch is not None else "generic"
        if not cfg.files:
            result: dict[str, Any] = {"mode": cfg.mode, "files": [], "skipped": "no lora.files"}
            ctx.report["lora"] = result
            return result
        names = [f.name or (Path(f.path).stem if not f.path.startswith("example:") else f"lora{i}")
                 for i, f in enumerate(cfg.files)]
        if len(set(names)) != len(names):
            raise ValueError(f"lora.files: adapter names must be unique, got {names} (set lora.files[i].name)")
        if cfg.mode == "residual":
            files = []
            for spec, name in zip(cfg.files, names):
                handle = apply.attach(model, _source(ctx, spec.path), strength=spec.strength, name=name, arch=arch,
                                      config=ctx.arch_config, ledger=ctx.ledger, strict=cfg.strict,
                                      alpha=spec.alpha, dtype=ctx.dtype)
                files.append({**handle.figures(), "source": spec.path})
            result = {"mode": "residual", "files": files,
                      "layers": len({m for h in apply.attached(model).values() for m in h.layers})}
        else:
            sources = [(_source(ctx, f.path), f.strength, f.alpha) for f in cfg.files]
            figures = apply.bake_files(model, sources, mode=cfg.mode, seed=cfg.seed, arch=arch, config=ctx.arch_config,
                                       ledger=ctx.ledger, strict=cfg.strict, groups=ctx.fused_groups)
            for entry, spec, name in zip(figures["files"], cfg.files, names):
                entry.update(name=name, source=spec.path)
            result = {"mode": cfg.mode, **figures}
        ctx.report["lora"] = result
        return {"mode": result["mode"], "files": len(result["files"]),
                "layers_per_file": [f["layers"] for f in result["files"]],
                "ranks": sorted({r for f in result["files"] for r in f["ranks"]})}
