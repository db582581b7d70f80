"""A synthetic checkpoint of a real architecture at any size (no real weights are downloadable here):
the diffusers class's own config (its defaults: the released model), seeded weights, written in the
native single-file layout a user downloads (BFL / ComfyUI key names), tensor by tensor, so a 25.6 GB
Krea 2 is written with about one tensor in memory.

    python bench/make_checkpoint.py /data/krea2.safetensors                       # full-size Krea 2, bf16
    python bench/make_checkpoint.py /tmp/k2.safetensors --set num_layers=4        # 4 blocks at full width
    python bench/make_checkpoint.py /tmp/f1.safetensors --arch flux1 --dtype float32 --set num_layers=2

Values: matrices N(0, 1/in_features) (unit-variance outputs), norm gains 1 + N(0, 0.02^2), other vectors
N(0, 0.02^2); every tensor from its own generator seeded by (seed, key), so any size and any subset of
keys is reproducible. Random weights: for speed, memory and regressions, not for image quality.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from lowbit_pipe.arch import get_arch
from lowbit_pipe.files.checkpoint import StreamingWriter
from lowbit_pipe.files.lazy import LazyTensor


def _value(key: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    t = torch.randn(shape, generator=gen)
    if len(shape) >= 2:
        t *= shape[1] ** -0.5
    elif key.endswith(("norm.weight", "norm_q.weight", "norm_k.weight", ".scale")) or "norm" in key:
        t = 1 + 0.02 * t
    else:
        t *= 0.02
    return t.to(dtype)


def _in_order(lazy: dict[str, LazyTensor], workers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors in key order, made by `workers` threads, at most `workers` made ahead of the writer.
    torch's seeded randn runs on one core per call and frees the GIL, so threads scale it; the values
    do not depend on the thread count (one generator per key)."""
    with ThreadPoolExecutor(workers) as pool:
        window: deque[tuple[str, Future]] = deque()
        for key, t in lazy.items():
            window.append((key, pool.submit(t.materialize)))
            if len(window) > workers:
                done_key, future = window.popleft()
                yield done_key, future.result()
        while window:
            done_key, future = window.popleft()
            yield done_key, future.result()


def make_checkpoint(path: str | Path, arch_id: str = "krea2", overrides: dict[str, Any] | None = None,
                    dtype: torch.dtype = torch.bfloat16, seed: int = 0, native: bool = True,
                    workers: int | None = None) -> dict[str, Any]:
    """Write the checkpoint; returns its figures (params, bytes, seconds). `workers` threads make the
    values (default: the cores, at most 16); host memory holds about 2 x workers tensors."""
    workers = workers or min(16, os.cpu_count() or 1)
    arch = get_arch(arch_id)
    kwargs = {**arch.default_kwargs(), **(overrides or {})}
    cls = arch.model_class()  # imported before the meta context (module-level tensors stay real)
    with torch.device("meta"):
        model = cls(**kwargs)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    lazy = {k: LazyTensor(s, dtype, lambda k=k, s=s: _value(k, s, dtype, seed), k) for k, s in shapes.items()}
    if native and arch.keymap is not None:
        lazy = arch.state_dict_to_native(lazy)
    params = sum(t.numel() for t in model.state_dict().values())
    header = 2 * sum(len(k) + 96 for k in lazy) + 4096
    start = time.perf_counter()
    with StreamingWriter(path, header) as writer:
        for key, value in _in_order(lazy, workers):
            writer.write(key, value)
        nbytes = writer.close({"synthetic": json.dumps({"arch": arch_id, "seed": seed, "overrides": overrides or {},
                                                        "dtype": str(dtype)})})
    return {"path": str(path), "arch": arch_id, "params": params, "bytes": nbytes, "tensors": len(lazy),
            "seconds": round(time.perf_counter() - start, 2), "layout": "native" if native else "diffusers",
            "workers": workers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--arch", default="krea2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="threads making values (default: cores, at most 16)")
    p.add_argument("--diffusers-names", action="store_true", help="diffusers key names instead of native ones")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="constructor overrides (JSON values)")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    figures = make_checkpoint(args.path, args.arch, overrides, getattr(torch, args.dtype), args.seed,
                              native=not args.diffusers_names, workers=args.workers)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
