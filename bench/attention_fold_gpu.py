"""cuDNN's FP8 attention with its quantization folded into q's and k's RoPE, against bf16, per call, in one run.

    python3 bench/attention_fold_gpu.py --out $OUT/attention_fold.json        # ~2 minutes on an H100

Per shape (Krea 2 48 x 128 at 1024² / 2048², FLUX.1 24 x 128 at 1024² / 512², Krea 2 1024² with its text padding
mask: 77 of 512 text tokens attend), from the same pre-norm q, k (RMSNorm weights ~1.7, channel offsets on k) and
v, each path's whole call from the norms' inputs to the attention's output:

- bf16: the fused RMSNorm (lowbit_pipe.kernels.norm_rope.rms_norm) and RoPE of q and k, torch SDPA bf16;
- folded: the same RMSNorm, RoPE writing e4m3 codes (rope_e4m3, scales from the norm weights' bound), v's
  statistics and codes (qkv_fp8.quantize_folded), cuDNN's kernel, the output conversion (attention.fold's
  folded_attention);
- unfolded: the same RMSNorm and bf16 RoPE, then cuDNN's whole call (statistics + quantize passes over q, k, v);

times (ms, CUDA events, lowbit_pipe.measure.timing) of each part and of each whole, the ratios to bf16 ("attention": the
call after the producers, "with producers": norms and RoPE included), the cosine of each output vs bf16 (and bf16's
vs float64 on 2 heads), the bound's headroom (bound / amax) and saturation, the router's choice for the folded
shape (measured into a fresh table), and a device-time profile of one folded call per shape. Checks (exit status 1
when one fails): cosine >= --min-cos (0.999), no NaN, no saturation. Needs `pip install 'lowbit_pipe[cudnn]'`.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from outputs import save_outputs

TEXT, TEXT_VALID = 512, 77
OFFSET = 1.0  # Krea 2's RMSNorm: x̂ * (1 + w)


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    tokens: int
    dim: int
    masked: bool = False


SHAPES = [Shape("krea2_1024", 1, 48, 4608, 128), Shape("krea2_2048", 1, 48, 16896, 128),
          Shape("flux1_1024", 1, 24, 4608, 128), Shape("flux1_512", 1, 24, 1280, 128),
          Shape("krea2_1024_masked", 1, 48, 4608, 128, True)]


def rope_tables(n: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [n, d] fp32 of Krea 2's three axes (32, 48, 48 channels, theta 1000): text tokens along axis 0,
    the rest on a square-ish image grid."""
    text = min(TEXT, n // 4)
    img = n - text
    side = int(math.sqrt(img))
    ids = torch.zeros(n, 3, device=device, dtype=torch.float64)
    ids[:text, 0] = torch.arange(text, device=device)
    r = torch.arange(img, device=device)
    ids[text:, 1], ids[text:, 2] = r // side, r % side
    cos, sin = [], []
    for axis, dim in enumerate((32, 48, 48)):
        f = 1000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim)
        ang = ids[:, axis:axis + 1] * f[None]
        cos.append(ang.cos().repeat_interleave(2, 1))
        sin.append(ang.sin().repeat_interleave(2, 1))
    if d != 128:
        raise ValueError(f"Krea 2's RoPE axes fill head dim 128, not {d}")
    return torch.cat(cos, 1).float().contiguous(), torch.cat(sin, 1).float().contiguous()


def inputs(s: Shape, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (s.batch, s.tokens, s.heads, s.dim)

    def t(*size):
        return torch.randn(*size, device="cuda", generator=gen)

    x = {"xq": (t(*shape) + t(1, 1, s.heads, s.dim) * 0.5).bfloat16(),
         "xk": (t(*shape) + t(1, 1, s.heads, s.dim) * 3.0).bfloat16(),
         "v": (t(*shape) + t(1, 1, s.heads, s.dim)).bfloat16(),
         "wq": t(s.dim) * 0.3 + 0.7, "wk": t(s.dim) * 0.3 + 0.7}
    x["cos"], x["sin"] = rope_tables(s.tokens, s.dim, "cuda")
    x["mask"] = None
    if s.masked:
        x["mask"] = torch.ones(s.batch, s.tokens, dtype=torch.bool, device="cuda")
        x["mask"][:, TEXT_VALID:TEXT] = False
    return x


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


class Paths:
    """The three whole calls on one shape's inputs, and their parts."""

    def __init__(self, x: dict, runner):
        from lowbit_pipe.kernels import norm_rope as R
        from lowbit_pipe.kernels import qkv_fp8 as Q

        self.x, self.runner, self.R, self.Q = x, runner, R, Q
        d = x["xq"].shape[-1]
        self.scale = 448.0 / torch.cat([R.norm_bound(x["wq"], OFFSET, d, "cuda"), R.norm_bound(x["wk"], OFFSET, d, "cuda")])
        self.amax = torch.zeros(2, device="cuda")
        self.check = False  # track the amax (the bound's check) in ropes_e4m3

    def norms(self):
        x, R = self.x, self.R
        return R.rms_norm(x["xq"], x["wq"], 1e-5, OFFSET), R.rms_norm(x["xk"], x["wk"], 1e-5, OFFSET)

    def ropes_bf16(self, nq, nk):
        x = self.x
        return self.R.rope(nq, x["cos"], x["sin"], 1), self.R.rope(nk, x["cos"], x["sin"], 1)

    def ropes_e4m3(self, nq, nk):
        x, R = self.x, self.R
        mask = x["mask"]
        pos = self.Q.key_order(mask)[0] if mask is not None else None
        amax = self.amax if self.check else None  # timed as the fold runs it: no amax
        q8 = R.rope_e4m3(nq, x["cos"], x["sin"], self.scale[0:1], None if amax is None else amax[0:1])
        k8 = R.rope_e4m3(nk, x["cos"], x["sin"], self.scale[1:2], None if amax is None else amax[1:2], mask, pos)
        return q8, k8

    def sdpa(self, q, k):
        m = self.x["mask"]
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), self.x["v"].transpose(1, 2),
                                              attn_mask=m[:, None, None, :] if m is not None else None)

    def folded_attention(self, q8, k8):
        from lowbit_pipe.attention.fold import folded_attention

        return folded_attention(self.runner, q8, k8, self.scale, self.x["v"], None, self.x["mask"])

    def unfolded_attention(self, q, k):
        return self.runner(q.transpose(1, 2), k.transpose(1, 2), self.x["v"].transpose(1, 2), None, self.x["mask"])

    def bf16(self):
        return self.sdpa(*self.ropes_bf16(*self.norms()))

    def folded(self):
        return self.folded_attention(*self.ropes_e4m3(*self.norms()))

    def unfolded(self):
        return self.unfolded_attention(*self.ropes_bf16(*self.norms()))


def bench_shape(s: Shape, runner, args, timing) -> dict:
    from lowbit_pipe.kernels.cudnn_fp8_attention import plan_key
    from lowbit_pipe.measure.timing import time_ms

    row: dict = {"shape": s.name, **asdict(s), "checks": {}, "ms": {}, "x_bf16": {}, "failures": []}
    x = inputs(s)
    p = Paths(x, runner)
    why = runner.why_not(plan_key(torch.cuda.current_device(), s.batch, s.heads, s.tokens, s.dim, s.masked))
    if why is not None:
        row["failures"].append(f"cuDNN refused this form: {why}")
        return row
    c, ms = row["checks"], row["ms"]
    nq, nk = p.norms()
    q, k = p.ropes_bf16(nq, nk)
    p.amax.zero_()
    p.check = True
    q8, k8 = p.ropes_e4m3(nq, nk)
    p.check = False
    # all [B, H, N, D]: SDPA's output, the folded call's [B, N, H, D] seen so, cuDNN's whole call (q's layout)
    ref, fold, unfold = p.sdpa(q, k), p.folded_attention(q8, k8).transpose(1, 2), p.unfolded_attention(q, k)
    c["folded_cos_vs_bf16"] = cos(fold, ref)
    c["unfolded_cos_vs_bf16"] = cos(unfold, ref)
    h2 = slice(0, 2)
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2)[:, h2].double() for t in (q, k, x["v"])),
                                           attn_mask=x["mask"][:, None, None, :] if s.masked else None)
    c["bf16_cos_vs_fp64_2heads"] = cos(ref[:, h2], exact)
    c["folded_cos_vs_fp64_2heads"] = cos(fold[:, h2], exact)
    c["nan"] = int(torch.isnan(fold).sum())
    amax = p.amax.tolist()
    bound = (448.0 / p.scale).tolist()
    c["bound_over_amax_q"], c["bound_over_amax_k"] = bound[0] / amax[0], bound[1] / amax[1]
    c["saturated"] = amax[0] > bound[0] or amax[1] > bound[1]
    if c["folded_cos_vs_bf16"] < args.min_cos:
        row["failures"].append(f"folded cosine vs bf16 {c['folded_cos_vs_bf16']:.6f} < {args.min_cos}")
    if c["nan"] or c["saturated"]:
        row["failures"].append(f"NaN {c['nan']}, saturated {c['saturated']}")
    del ref, fold, unfold, exact
    parts = {"norms": lambda: p.norms(), "ropes_bf16": lambda: p.ropes_bf16(nq, nk),
             "ropes_e4m3": lambda: p.ropes_e4m3(nq, nk), "sdpa_bf16": lambda: p.sdpa(q, k),
             "folded_attention": lambda: p.folded_attention(q8, k8), "unfolded_attention": lambda: p.unfolded_attention(q, k),
             "stats_qkv": lambda: p.Q.qkv_stats(q.transpose(1, 2), k.transpose(1, 2), x["v"].transpose(1, 2), x["mask"]),
             "stats_v": lambda: p.Q.v_stats(x["v"].transpose(1, 2), x["mask"]),
             "whole_bf16": p.bf16, "whole_folded": p.folded, "whole_unfolded": p.unfolded}
    for name, fn in parts.items():
        ms[name] = time_ms(fn, q.device, timing)
    ms["attention_folded"] = ms["ropes_e4m3"] - ms["ropes_bf16"] + ms["folded_attention"]
    row["x_bf16"] = {"attention (after the producers)": ms["sdpa_bf16"] / ms["folded_attention"],
                     "attention incl. the RoPE difference": ms["sdpa_bf16"] / ms["attention_folded"],
                     "with producers (norms + RoPE)": ms["whole_bf16"] / ms["whole_folded"],
                     "unfolded, with producers": ms["whole_bf16"] / ms["whole_unfolded"],
                     "unfolded attention": ms["sdpa_bf16"] / ms["unfolded_attention"]}
    row["route"] = route_choice(s, runner)
    if not args.no_profile:
        row["profile"] = profile(p)
    return row


def route_choice(s: Shape, runner) -> dict:
    """The router's choice for the folded shape, measured into a fresh table, as apply_attention builds it."""
    from lowbit_pipe.attention import crossover as X
    from lowbit_pipe.attention.processors import _router
    from lowbit_pipe.attention.route import kernel_head_dims

    dev = torch.device("cuda", torch.cuda.current_device())
    router = _router("fp8", dev, kernel_head_dims(dev), runner, "auto", tempfile.mkdtemp(prefix="fold_route_"), True,
                     [], Counter())
    choice = router.choose(X.CallShape(s.batch, s.heads, s.tokens, s.dim, s.masked, "bfloat16", folded=True))
    return {"path": choice.path, "by": choice.by, "ms": {k: round(v, 4) for k, v in choice.ms.items()},
            "errors": router.measure_errors}


def profile(p: Paths, iters: int = 10) -> list[dict]:
    """Device time per kernel of one folded whole call (norms, e4m3 RoPE, v's passes, cuDNN, output)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        p.folded()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            p.folded()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count / iters, "ms": dev / iters / 1e3})
    return sorted(rows, key=lambda r: -r["ms"])


def table(payload: dict) -> str:
    cols = ["norms", "ropes_bf16", "ropes_e4m3", "sdpa_bf16", "folded_attention", "unfolded_attention", "stats_qkv",
            "stats_v", "whole_bf16", "whole_folded", "whole_unfolded"]
    lines = [f"device: {payload['device_name']}; {payload['versions']}", "",
             "| shape | " + " | ".join(f"{c} ms" for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for r in payload["rows"]:
        lines.append(f"| {r['shape']} | " + " | ".join(f"{r['ms'][c]:.3f}" if c in r["ms"] else "" for c in cols) + " |")
    ratio_names = list(next((r["x_bf16"] for r in payload["rows"] if r["x_bf16"]), {}))
    lines += ["", "| shape | " + " | ".join(f"x bf16: {n}" for n in ratio_names) + " | folded cos vs bf16 | unfolded "
              "cos | bf16 cos vs fp64 | bound / amax q, k | route (folded shape) | failures |",
              "|---|" + "---|" * (len(ratio_names) + 6)]
    for r in payload["rows"]:
        c, rt = r["checks"], r.get("route", {})
        cells = [f"{r['x_bf16'][n]:.2f}x" if n in r["x_bf16"] else "" for n in ratio_names]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {c.get('folded_cos_vs_bf16', float('nan')):.6f} | "
                     f"{c.get('unfolded_cos_vs_bf16', float('nan')):.6f} | {c.get('bf16_cos_vs_fp64_2heads', float('nan')):.6f} | "
                     f"{c.get('bound_over_amax_q', float('nan')):.2f}, {c.get('bound_over_amax_k', float('nan')):.2f} | "
                     f"{rt.get('path', '')} ({rt.get('by', '')}) | {'; '.join(r['failures']) or 'ok'} |")
    for r in payload["rows"]:
        if r.get("profile"):
            lines += ["", f"| kernel (one folded call, {r['shape']}) | calls | device ms |", "|---|---|---|"]
            lines += [f"| {p['kernel']} | {p['calls']:.0f} | {p['ms']:.4f} |" for p in r["profile"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/attention_fold_h100.json")
    ap.add_argument("--shapes", nargs="*", help="names from SHAPES (default: all)")
    ap.add_argument("--min-cos", type=float, default=0.999)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a Hopper (or newer) GPU", file=sys.stderr)
        return 2
    from lowbit_pipe.kernels.cudnn_fp8_attention import CudnnFP8Attention
    from lowbit_pipe.measure.timing import TimingSettings

    try:
        runner = CudnnFP8Attention()
    except ImportError as err:
        print(f"FAIL: {err}", file=sys.stderr)
        return 2
    import triton

    payload = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(),
               "versions": f"torch {torch.__version__}, triton {triton.__version__}, {runner.version}, "
                           f"python {platform.python_version()}", "min_cos": args.min_cos, "rows": []}
    timing = TimingSettings(warmup=3, reps=args.reps)
    failed = []
    start = time.perf_counter()
    for s in [s for s in SHAPES if not args.shapes or s.name in args.shapes]:
        try:
            row = bench_shape(s, runner, args, timing)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            row = {"shape": s.name, **asdict(s), "checks": {}, "ms": {}, "x_bf16": {},
                   "failures": [f"error: {type(err).__name__}: {str(err)[:400]}"]}
        payload["rows"].append(row)
        failed += [f"{s.name}: {f}" for f in row["failures"]]
        print(f"{s.name}: {time.perf_counter() - start:.0f} s; x bf16 {row['x_bf16']}; checks {row['checks']}; "
              f"route {row.get('route')}; failures {row['failures']}", flush=True)
        save_outputs(args.out, table(payload), payload)
        torch.cuda.empty_cache()
    payload["failures"] = failed
    payload["seconds"] = round(time.perf_counter() - start, 1)
    save_outputs(args.out, table(payload), payload)
    print(table(payload))
    print("FAILED:\n  " + "\n  ".join(failed) if failed else "all checks passed")
    runner.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
