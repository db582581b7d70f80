"""fp8 GEMM with a LoRA branch: the Triton TMA GEMM (two accumulation modes, several tiles) against cuBLAS.

    python3 bench/fp8_lora_gemm.py --out $OUT/fp8_lora_gemm_h200.json        # H200, ~3 min

Why the fp8 linear runs `lowbit_pipe.kernels.fp8_gemm` on Hopper. Per Krea 2 shape (M=4608, rank 32,
bf16) in one run:
- cuBLAS `_scaled_mm` (row-wise scales), accurate and fast accumulation, and + `addmm_` (the LoRA
  path without an epilogue hook, still used off Hopper);
- `fp8_gemm` with promote 0 (fast accumulation, the linear's) and 4 (a second accumulator added
  every 4 K tiles), each tile config, without and with the branch (the accumulator's initial
  value; the run that also timed the branch as an epilogue dot is at commit 5716ef3);
- whole linears: quantize (+ down projection) + GEMM (+ branch), so overhead = lora / base - 1
  with both in the same accumulation mode;
- accuracy of every GEMM against a float64 oracle of the same fp8 codes (rel. Frobenius error).
Timer: triton.testing.do_bench_cudagraph, median ms.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowbit_pipe.kernels.fp8_gemm import fp8_gemm, reference_fp8_gemm
from lowbit_pipe.kernels.quantize_act import quantize_act

M, RANK = 4608, 32
SHAPES = [(6144, 6144), (6144, 16384), (16384, 6144), (6144, 1536)]
CONFIGS = {  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
    "128x256x128_w8_s3": (128, 256, 128, 8, 3),
    "256x128x128_w8_s3": (256, 128, 128, 8, 3),
    "128x128x128_w4_s4": (128, 128, 128, 4, 4),
    "128x128x256_w8_s3": (128, 128, 256, 8, 3),
}
PROMOTES = (0, 4)
LORA_MODES = ("", "+lora")


def cfg_dict(c: tuple) -> dict:
    return {"BLOCK_M": c[0], "BLOCK_N": c[1], "BLOCK_K": c[2], "num_warps": c[3], "num_stages": c[4]}


def bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def shape_rows(k: int, n: int, failures: list) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w32 = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    ws = w32.abs().amax(dim=1, keepdim=True) / 448.0
    w = (w32 / ws).to(torch.float8_e4m3fn)
    wrow = ws.reshape(1, n).contiguous()
    down = torch.randn(RANK, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
    up = torch.randn(n, RANK, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.01
    up_t = up.t()
    q, s = quantize_act(x, "fp8")
    _, _, xa = quantize_act(x, "fp8", down=down)
    ref = reference_fp8_gemm(q, w, s, wrow)
    ref_lora = ref + xa.float() @ up_t.float()

    def cublas(qq, ss, fast):
        return torch._scaled_mm(qq, w.t(), scale_a=ss, scale_b=wrow, out_dtype=torch.bfloat16, use_fast_accum=fast)

    row: dict = {"K": k, "N": n, "M": M, "rank": RANK, "gemm_ms": {}, "err": {}, "linear_ms": {}}
    for fast in (False, True):
        name = f"cublas_{'fast' if fast else 'acc'}"
        row["gemm_ms"][name] = bench(lambda: cublas(q, s, fast))
        row["err"][name] = rel(cublas(q, s, fast), ref)
        row["gemm_ms"][name + "+addmm"] = bench(lambda: cublas(q, s, fast).addmm_(xa, up_t))
        row["err"][name + "+addmm"] = rel(cublas(q, s, fast).addmm_(xa, up_t), ref_lora)

    best: dict = {}
    for p in PROMOTES:
        for cname, c in CONFIGS.items():
            for suffix in LORA_MODES:
                lora = suffix == "+lora"
                key = f"triton_p{p}_{cname}{suffix}"
                extra = {"xa": xa, "up_t": up_t} if lora else {}
                try:
                    def fn(extra=extra, c=c, p=p):  # binds the loop's values
                        return fp8_gemm(q, w, s, wrow, None, torch.bfloat16, config=cfg_dict(c), promote=p, **extra)
                    row["err"][key] = rel(fn(), ref_lora if lora else ref)
                    row["gemm_ms"][key] = bench(fn)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result of the sweep
                    failures.append(f"{key} K={k} N={n}: {e!r:.160}")
                    continue
                slot = (p, suffix)
                if slot not in best or row["gemm_ms"][key] < row["gemm_ms"][best[slot]]:
                    best[slot] = key
    row["best"] = {f"p{p}{suffix}": key for (p, suffix), key in best.items()}

    # whole linears (quantize + GEMM [+ branch]), each mode against its own base
    lin = row["linear_ms"]
    for fast in (False, True):
        tag = "fast" if fast else "acc"
        lin[f"cublas_{tag}"] = bench(lambda: cublas(*quantize_act(x, "fp8"), fast))

        def cublas_lora(fast=fast):
            qq, ss, xx = quantize_act(x, "fp8", down=down)
            return cublas(qq, ss, fast).addmm_(xx, up_t)

        lin[f"cublas_{tag}+addmm"] = bench(cublas_lora)
    for p in PROMOTES:
        if (p, "+lora") not in best:
            continue
        c = CONFIGS[best[(p, "+lora")].split("_", 2)[2].removesuffix("+lora")]
        row.setdefault("linear_choice", {})[f"p{p}"] = best[(p, "+lora")]

        def base(c=c, p=p):
            qq, ss = quantize_act(x, "fp8")
            return fp8_gemm(qq, w, ss, wrow, None, torch.bfloat16, config=cfg_dict(c), promote=p)

        def with_lora(c=c, p=p):
            qq, ss, xx = quantize_act(x, "fp8", down=down)
            return fp8_gemm(qq, w, ss, wrow, None, torch.bfloat16, xx, up_t, config=cfg_dict(c), promote=p)

        lin[f"triton_p{p}"] = bench(base)
        lin[f"triton_p{p}+lora"] = bench(with_lora)
        row["err"][f"linear_triton_p{p}_lora_delta"] = rel(with_lora().float() - base().float(), xa.float() @ up_t.float())
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    start = time.time()
    failures: list[str] = []
    rows = []
    for k, n in SHAPES:
        rows.append(shape_rows(k, n, failures))
        r = rows[-1]
        lin = r["linear_ms"]
        print(f"K={k} N={n} gemm: cublas acc {r['gemm_ms']['cublas_acc']:.3f} fast {r['gemm_ms']['cublas_fast']:.3f}; "
              + "; ".join(f"{b} {r['gemm_ms'][key]:.3f}" for b, key in sorted(r["best"].items())), flush=True)
        print("   linear: " + "; ".join(f"{name} {t:.3f}" for name, t in lin.items()), flush=True)
        print("   err: " + "; ".join(f"{name} {e:.2e}" for name, e in r["err"].items()
                                     if "+lora" not in name and (name.startswith("cublas") or name in r["best"].values()
                                                                 or name.startswith("linear"))), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "rows": rows, "failures": failures,
              "seconds": time.time() - start}
    print("\n| K x N | base (cuBLAS acc) | +addmm_ | overhead | base (cuBLAS fast) | +addmm_ | overhead |"
          + "".join(f" base (Triton p{p}) | +lora | overhead vs own base |" for p in PROMOTES))
    print("|---" * (7 + 3 * len(PROMOTES)) + "|")
    for r in rows:
        lin = r["linear_ms"]
        cells = [f"{r['K']} x {r['N']}"]
        for tag in ("acc", "fast"):
            b, lo = lin[f"cublas_{tag}"], lin[f"cublas_{tag}+addmm"]
            cells += [f"{b:.3f}", f"{lo:.3f}", f"{(lo / b - 1) * 100:.1f} %"]
        for pp in PROMOTES:
            if f"triton_p{pp}" in lin:
                b, lo = lin[f"triton_p{pp}"], lin[f"triton_p{pp}+lora"]
                cells += [f"{b:.3f}", f"{lo:.3f}", f"{(lo / b - 1) * 100:.1f} %"]
            else:
                cells += ["-", "-", "-"]
        print("| " + " | ".join(cells) + " |")
    for f in failures:
        print("failed:", f)
    tmp = Path(args.out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
