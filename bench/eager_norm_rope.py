"""The uncompiled path with `attention.fused_norm_rope`: full-width Krea 2 blocks, eager, stock against fused.

    python bench/eager_norm_rope.py --out bench/results/eager_norm_rope_h200.json        # GPU: 2 blocks, ~1 min
    python bench/eager_norm_rope.py --device cpu --small --out /tmp/eager_norm_rope.json  # smoke: the torch path

Builds `--layers` Krea2TransformerBlocks at the released width (hidden 6144 = 48 heads x 128, 12 KV heads, SwiGLU
16384; 4096 image + 512 text tokens, 77 text tokens attended, fp32 RoPE tables as Krea2RotaryPosEmbed gives them),
bf16, on the device. Each variant runs the same blocks, one after the other, in one process:

- bf16 and fp8 (every block Linear, per-token dynamic activations) without compile,
- each with and without the fused norms and RoPE (lowbit_pipe.attention.fused, through a ledger, undone after),
- fp8 + fused once more with every layer quantizing its own input (dispatch.shared_activations off; with the
  fusion, Krea 2's attention and SwiGLU open their input to one quantization for q / k / v / gate and gate / up),
  its output bit-equal to the shared run's.

Checks first, on the same shapes: each kernel against its torch form (share of output elements bit-equal, max
error in output ulps), and each fused variant's block output against the stock one. Timing: CUDA events around
`--iters` forwards after warm-up, median of `--repeats`; every ratio is to bf16 stock in this run.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers.models.transformers.transformer_krea2 import Krea2TransformerBlock
from outputs import save_outputs

from lowbit_pipe.arch.base import LayerPolicy
from lowbit_pipe.attention.fused import apply_fused_norm_rope
from lowbit_pipe.kernels import dispatch, norm_rope
from lowbit_pipe.ledger import Ledger
from lowbit_pipe.measure.timing import TimingSettings, time_ms
from lowbit_pipe.plan.policy import plan_layers
from lowbit_pipe.recipe import FormatChoice, QuantizeConfig
from lowbit_pipe.stages.detect import linear_shapes
from lowbit_pipe.stages.quantize import quantize_module

FULL = {"hidden": 6144, "heads": 48, "kv_heads": 12, "mlp": 16384, "image": 4096, "text": 512, "attended": 77}
SMALL = {"hidden": 256, "heads": 4, "kv_heads": 2, "mlp": 512, "image": 48, "text": 16, "attended": 5}


class Blocks(nn.Module):
    """Krea 2 joint blocks under the name the arch policy uses, run with the text padding mask."""

    def __init__(self, dims: dict[str, int], layers: int):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(
            Krea2TransformerBlock(dims["hidden"], dims["mlp"], dims["heads"], dims["kv_heads"], 1e-5)
            for _ in range(layers))

    def forward(self, hidden: torch.Tensor, temb: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        for block in self.transformer_blocks:
            hidden = block(hidden, temb, rope, attention_mask=mask)
        return hidden


def inputs(dims: dict[str, int], device: torch.device) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    s, h, d = dims["image"] + dims["text"], dims["hidden"], dims["hidden"] // dims["heads"]
    hidden = torch.randn(1, s, h, generator=gen, device=device, dtype=torch.bfloat16)
    temb = torch.randn(1, 1, 6 * h, generator=gen, device=device, dtype=torch.bfloat16) * 0.1
    angle = torch.rand(s, d // 2, generator=gen, device=device, dtype=torch.float64) * 6.283
    rope = (angle.cos().repeat_interleave(2, 1).float(), angle.sin().repeat_interleave(2, 1).float())
    mask = torch.ones(1, s, dtype=torch.bool, device=device)
    mask[0, dims["attended"]:dims["text"]] = False  # text first, as Krea 2 joins them; padding masked
    return hidden, temb, rope, mask[:, None, None, :]


def ulps(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Share of elements bit-equal, and the largest difference in units of the output's last place."""
    eq = float((got == want).float().mean())
    spacing = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return {"bit_equal": eq, "max_ulps": float(((got.float() - want.float()).abs() / spacing).max())}


def kernel_checks(dims: dict[str, int], device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(1)
    s, h, d = dims["image"] + dims["text"], dims["hidden"], dims["hidden"] // dims["heads"]
    x = torch.randn(1, s, h, generator=gen, device=device, dtype=torch.bfloat16) * 3
    w = torch.randn(h, generator=gen, device=device) * 0.1
    q = torch.randn(1, s, dims["heads"], d, generator=gen, device=device, dtype=torch.bfloat16)
    wq = torch.randn(d, generator=gen, device=device) * 0.1
    angle = torch.rand(s, d // 2, generator=gen, device=device, dtype=torch.float64) * 6.283
    cos, sin = angle.cos().repeat_interleave(2, 1).float(), angle.sin().repeat_interleave(2, 1).float()
    if device.type != "cuda":
        return {"note": "the kernels run on CUDA only (tests/kernels/test_kernels.py interprets them on the CPU)"}
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import RMSNorm

    from lowbit_pipe.attention.fused import FusedNormForward, norm_kind

    qk_norm = RMSNorm(d, eps=1e-6).to(device=device, dtype=torch.bfloat16)  # Qwen-Image's q / k norm, bf16 weight
    with torch.no_grad():
        qk_norm.weight.copy_(1 + wq)
    fused_qk_norm = FusedNormForward(qk_norm, norm_kind(qk_norm), norm_rope)
    return {"diffusers RMSNorm q heads, bf16 weight": ulps(fused_qk_norm(q), qk_norm(q)),
            "rms_norm hidden [4608, 6144]": ulps(norm_rope.rms_norm(x, w, 1e-5, 1.0),
                                                 norm_rope.reference_rms_norm(x, w, 1e-5, 1.0)),
            "rms_norm q heads [4608, 48, 128]": ulps(norm_rope.rms_norm(q, wq, 1e-5, 1.0),
                                                     norm_rope.reference_rms_norm(q, wq, 1e-5, 1.0)),
            "rope q [1, 4608, 48, 128] vs apply_rotary_emb": ulps(norm_rope.rope(q, cos, sin, 1),
                                                                  apply_rotary_emb(q, (cos, sin), sequence_dim=1))}


def unshared_activations(x, x2, mode, rot, group, static, down):
    """dispatch.shared_activations' stand-in for the bench's unshared row: each layer's own pass."""
    return dispatch.quantize_activations(x2, mode, rot, group, static, down)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    dims = SMALL if args.small else FULL
    torch.manual_seed(0)
    with torch.device(device):
        blocks = Blocks(dims, args.layers).to(torch.bfloat16).eval()
    for m in blocks.modules():  # the zero-initialised norm weights and modulation tables of a fresh block
        if hasattr(m, "scale_shift_table"):
            nn.init.normal_(m.scale_shift_table, std=0.1)
        if type(m).__name__ == "Krea2RMSNorm":
            nn.init.normal_(m.weight, std=0.1)
            m.weight.data = m.weight.data.float()  # Krea 2 keeps its norm weights in fp32
    args_in = inputs(dims, device)
    checks = kernel_checks(dims, device)
    rows: list[dict[str, Any]] = []
    outputs: dict[str, torch.Tensor] = {}

    def measure(fmt: str, fused: bool, shared: bool = True) -> None:
        ledger = Ledger()
        applied = apply_fused_norm_rope(blocks, ledger) if fused else None
        if not shared:  # the bench's own switch, undone below: every layer quantizes its input itself
            ledger.patch_attr(dispatch, "shared_activations", unshared_activations)
        with torch.no_grad():
            out = blocks(*args_in)
        # lowbit_pipe.measure.timing: CUDA events around --iters calls (CPU: the fastest call); the median of --repeats
        ms = statistics.median(time_ms(lambda: blocks(*args_in), device, TimingSettings(warmup=3, reps=args.iters))
                               for _ in range(args.repeats))
        name = f"{fmt}{' + fused norm/RoPE' if fused else ''}{'' if shared else ', unshared activations'}"
        row = {"variant": name, "format": fmt, "fused": fused, "shared_activations": shared, "ms": ms}
        if fused:
            counted = applied.as_dict()
            with torch.no_grad():
                blocks(*args_in)
            row["kernel_calls_per_forward"] = {k: v - counted[k] for k, v in applied.as_dict().items()
                                               if k.endswith("calls")}
            row["rel_err_vs_stock"] = rel(out, outputs[fmt])
        else:
            outputs[fmt] = out
        if not shared:
            outputs["unshared"] = out
        elif fused and "unshared" in outputs:
            row["bit_equal_to_unshared"] = bool(torch.equal(out, outputs["unshared"]))
        rows.append(row)
        report = ledger.unwind()
        assert not report.errors and not report.unfreed, report
        print(f"{name:32s} {ms:9.3f} ms", flush=True)

    measure("bf16", False)
    measure("bf16", True)
    ledger = Ledger()
    plans = plan_layers(linear_shapes(blocks), QuantizeConfig(default=FormatChoice(format="fp8")),
                        LayerPolicy(block_paths=("transformer_blocks",)))
    quantize_module(blocks, plans, ledger, originals="drop")
    measure("fp8", False)
    measure("fp8", True, shared=False)
    measure("fp8", True)
    base = rows[0]["ms"]
    for row in rows:
        row["x_bf16_stock"] = base / row["ms"]
    by = {r["variant"]: r for r in rows}
    for fmt in ("bf16", "fp8"):
        by[f"{fmt} + fused norm/RoPE"]["saved_ms_per_block"] = (by[fmt]["ms"] - by[f"{fmt} + fused norm/RoPE"]["ms"]) / args.layers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    result = {"command": "python " + " ".join(sys.argv), "device": name, "torch": torch.__version__,
              "dims": dims, "layers": args.layers, "kernel_checks": checks, "rows": rows}
    lines = [f"`{result['command']}`", "",
             f"device: {name} | torch {torch.__version__} | {args.layers} Krea 2 blocks at width {dims['hidden']}, "
             f"{dims['image'] + dims['text']} tokens, eager (no compile), median of {args.repeats} x {args.iters}", "",
             "| variant | ms | x bf16 stock | saved ms per block | rel err vs its stock |", "|---|---|---|---|---|"]
    for r in rows:
        saved = f"{r['saved_ms_per_block']:.3f}" if "saved_ms_per_block" in r else "-"
        err = f"{r['rel_err_vs_stock']:.2e}" if "rel_err_vs_stock" in r else "-"
        lines.append(f"| {r['variant']} | {r['ms']:.3f} | {r['x_bf16_stock']:.3f} | {saved} | {err} |")
    lines += ["", "Kernels against their torch forms (bf16 outputs):", ""]
    for k, v in checks.items():
        lines.append(f"- {k}: {v}")
    save_outputs(args.out, "\n".join(lines) + "\n", result)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
