"""Launch-shape sweep for the LoRA-fused kernels at Krea 2 shapes (M=4608, rank 32, bf16): which
quantize-with-down config, and which int8 GEMM tiles with the low-rank epilogue.

    python3 bench/lora_kernel_tune.py --out bench/results/lora_kernel_tune_h200.json      # GPU
    python3 bench/lora_kernel_tune.py --quick                                              # fewer configs

Measured in one run (CUDA-graph medians, triton.testing.do_bench_cudagraph):
- quantize (int8 and fp8 codes), plain: BLOCK_M x BLOCK_K x warps; every config's codes must equal
  the default config's bit for bit (else it is marked wrong and not ranked);
- quantize with the LoRA down projection xa = x @ down^T (the slice kernel reads x once for the row
  amax and xa, then the codes kernel makes one pass): the slice kernel's rows x chunk x slice x
  warps x stages x down layout ([R, K] rows or a transposed [K, R] copy); codes equal the plain
  call's bit for bit, xa within bf16 rounding of cuBLAS's;
- the baselines those replace: cuBLAS x @ down^T, and plain quantize + it;
- GEMMs per (K, N): Triton int8 with and without the epilogue, per tile config, against cuBLAS fp8
  (torch._scaled_mm, row-wise) and cuBLAS fp8 followed by addmm_ (the fp8 LoRA path).
The chosen defaults go into the kernels' launch tables by hand; this file is the evidence.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe.kernels.int8_gemm import int8_gemm
from lowbit_pipe.kernels.quantize_act import quantize_act

M, R = 4608, 32
DEVICE = "cuda"
SHAPES = [(6144, 6144), (6144, 16384), (16384, 6144), (6144, 1536)]
GEMM_TILES = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 256, 128, 8, 4), (256, 128, 128, 8, 4),
              (128, 128, 128, 8, 4), (128, 128, 128, 4, 4), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5),
              (64, 256, 128, 4, 4)]


def timed(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


PLAIN = [{"BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w}
         for bm, bk, w in itertools.product((2, 4), (1024, 2048), (4, 8))]
# the slice kernel (x read once for the row amax and x @ down^T); the codes kernel keeps its default
FUSED = [({"DOWN_BLOCK_M": bm, "DOWN_BLOCK_K": bk, "DOWN_SLICE": sl, "down_warps": w, "down_stages": st}, layout)
         for bm, bk, sl, w, st, layout in itertools.product((32, 64, 128), (64, 128), (512, 1024, 2048), (4, 8), (3,), ("rk",))
         ] + [({"DOWN_BLOCK_M": 64, "DOWN_BLOCK_K": 128, "DOWN_SLICE": 1024, "down_warps": 4, "down_stages": st}, layout)
              for st, layout in itertools.product((2, 4), ("rk", "kr"))]


def sweep_quant(k: int, modes: tuple[str, ...], plain: list, fused: list, deadline: float) -> dict:
    """Every config of `plain` / `fused` for each mode at M x k; rows carry ok (bit-equal codes) and ms."""
    gen = torch.Generator(device=DEVICE).manual_seed(k)
    x = torch.randn(M, k, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    down = (torch.randn(R, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02)
    layouts = {"rk": down, "kr": down.t().contiguous().t()}  # kr: the same matrix stored as [K, R]
    xa_ref = F.linear(x, down)
    out: dict = {"k": k, "plain": [], "fused": [], "baseline": {"xa_cublas_ms": timed(lambda: F.linear(x, down))}}
    for mode in modes:
        q0, s0 = quantize_act(x, mode)
        out["baseline"][f"{mode}_default_ms"] = timed(lambda: quantize_act(x, mode))
        for cfg in plain:
            if time.time() > deadline:
                break
            q, s = quantize_act(x, mode, config=cfg)
            ok = torch.equal(q.view(torch.int8), q0.view(torch.int8)) and torch.equal(s, s0)
            out["plain"].append({"mode": mode, **cfg, "ok": ok, "ms": timed(lambda: quantize_act(x, mode, config=cfg))})
        for cfg, layout in fused:
            if time.time() > deadline:
                break
            d = layouts[layout]
            try:
                q, s, xa = quantize_act(x, mode, down=d, config=cfg)
                ok = torch.equal(q.view(torch.int8), q0.view(torch.int8)) and torch.equal(s, s0) and rel(xa, xa_ref) < 1e-2
                row = {"mode": mode, **cfg, "layout": layout, "ok": ok, "xa_err": rel(xa, xa_ref),
                       "ms": timed(lambda: quantize_act(x, mode, down=d, config=cfg))}
            except Exception as err:  # noqa: BLE001 - a config that does not compile (shared memory): recorded, not ranked
                row = {"mode": mode, **cfg, "layout": layout, "ok": False, "error": repr(err)[:160]}
            out["fused"].append(row)
    return out


def best(rows: list[dict], mode: str, top: int) -> list[dict]:
    return sorted((r for r in rows if r["mode"] == mode and r.get("ok")), key=lambda r: r["ms"])[:top]


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k in ("BLOCK_M", "BLOCK_K", "num_warps") or k.startswith(("DOWN_", "down_"))}


def sweep_gemm(k: int, n: int, quick: bool, deadline: float) -> dict:
    from lowbit_pipe.kernels.quantize_act import quantize_act as qa

    gen = torch.Generator(device=DEVICE).manual_seed(k + n)
    x = torch.randn(M, k, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02
    up_t = (torch.randn(n, R, generator=gen, device=DEVICE, dtype=torch.bfloat16) * 0.02).t()
    xa = torch.randn(M, R, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    out: dict = {"k": k, "n": n, "tiles": []}
    # int8 operands
    qi, si = qa(x, "int8")
    wi_scale = w.abs().amax(1).float() / 127
    wi = torch.round(w.float() / wi_scale[:, None]).clamp(-127, 127).to(torch.int8)
    # fp8 operands
    qf, sf = qa(x, "fp8")
    wf_scale = w.abs().amax(1).float() / 448
    wf = (w.float() / wf_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws_row = wf_scale.reshape(1, n).contiguous()
    out["cublas_fp8_ms"] = timed(lambda: torch._scaled_mm(qf, wf.t(), scale_a=sf, scale_b=ws_row, out_dtype=torch.bfloat16))
    out["cublas_fp8_addmm_ms"] = timed(
        lambda: torch._scaled_mm(qf, wf.t(), scale_a=sf, scale_b=ws_row, out_dtype=torch.bfloat16).addmm_(xa, up_t))
    out["bf16_ms"] = timed(lambda: F.linear(x, w))
    for bm, bn, bk, warps, stages in GEMM_TILES if not quick else GEMM_TILES[:2]:
        if time.time() > deadline:
            break
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        row = {"tile": f"{bm}x{bn}x{bk}_w{warps}_s{stages}"}
        try:
            row["int8_ms"] = timed(lambda: int8_gemm(qi, wi, si, wi_scale, None, torch.bfloat16, 0, cfg))
            row["int8_lora_ms"] = timed(lambda: int8_gemm(qi, wi, si, wi_scale, None, torch.bfloat16, 0, cfg, xa, up_t))
        except Exception as err:  # noqa: BLE001 - out of shared memory etc.: recorded
            row["error"] = repr(err)[:160]
        out["tiles"].append(row)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-gemm", action="store_true", help="quantize sweep only")
    p.add_argument("--budget-s", type=float, default=200, help="quantize sweep budget (GEMM sweep: +150 s)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    deadline = time.time() + args.budget_s
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "m": M, "rank": R,
           "quant": [], "gemm": []}
    # full sweep at K=6144 / int8; the best few re-measured for fp8 and for K=16384
    first = sweep_quant(6144, ("int8",), PLAIN if not args.quick else PLAIN[:4],
                        FUSED if not args.quick else FUSED[:4], deadline)
    top_plain = [strip(r) for r in best(first["plain"], "int8", 5)]
    top_fused = [(strip(r), r["layout"]) for r in best(first["fused"], "int8", 6)]
    res["quant"] = [first,
                    sweep_quant(6144, ("fp8",), top_plain, top_fused, deadline + 60),
                    sweep_quant(16384, ("int8", "fp8"), top_plain, top_fused, deadline + 60)]
    for q in res["quant"]:
        print(f"== quantize K={q['k']}: baseline {q['baseline']}")
        for mode in ("int8", "fp8"):
            for kind in ("plain", "fused"):
                rows = best(q[kind], mode, 4)
                bad = [r for r in q[kind] if r["mode"] == mode and not r.get("ok")]
                if rows or bad:
                    print(f"  {mode} {kind}: {len(bad)} wrong/failed; best:")
                for r in rows:
                    print("   ", {k2: v for k2, v in r.items() if k2 not in ("mode", "ok")})
    for k, n in SHAPES if not args.skip_gemm else []:
        g = sweep_gemm(k, n, args.quick, deadline + 150)
        res["gemm"].append(g)
        print(f"== GEMM K={k} N={n}: cuBLAS fp8 {g['cublas_fp8_ms']:.4f} ms, +addmm_ {g['cublas_fp8_addmm_ms']:.4f}, "
              f"bf16 {g['bf16_ms']:.4f}")
        for r in g["tiles"]:
            print("   ", r)
    res["seconds"] = round(time.time() - deadline + args.budget_s, 1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
