"""GPTQ: round a weight column by column on its format's fixed grid, feeding each column's rounding
error forward into the columns not yet rounded, weighted by the layer's input Hessian H = E[x^T x]
(Frantar et al. 2022, "GPTQ", Algorithm 1 with lazy batch updates and the Cholesky form of H^-1).

The grid is the round-to-nearest result's: its scales (per row, per block, global) stay as they are
and only the stored codes change, so the layer's tensors, record and layout are those of plain RTN
and every loader that reads RTN files reads these. Rotated formats are handled in the basis the
weight is stored in: the rotated weight W H_rot^T against the Hessian of the rotated input.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from lowbit_pipe.formats import FormatSpec, QuantizedWeight, get_format
from lowbit_pipe.kernels import rotation


@dataclass(frozen=True)
class GPTQSettings:
    block_size: int = 128  # columns per lazy batch update
    damp: float = 0.1  # added to H's diagonal, as a fraction of its mean
    act_order: bool = True  # round columns in order of decreasing H diagonal (largest input energy first)
    cuda_graph: bool = True  # on a GPU, replay each block's column loop as one captured CUDA graph (_GraphedBlock)
    # On the CPU: torch's threads for the Cholesky and the block updates (None: gptq_threads(), the cores not busy);
    # the column loop, tiny ops, always runs on one (see gptq_threads).
    threads: int | None = None
    # Layers up to this many inputs get their Hessian's eigenvalues (numerical rank, share below the damping; an
    # O(K^3) eigvalsh); wider ones the Cholesky pivots' estimate of that share, which costs nothing more.
    spectrum_max_width: int = 4096


@dataclass(frozen=True)
class GPTQResult:
    qweight: QuantizedWeight  # the layer's tensors: RTN's scales, GPTQ's codes
    rtn_loss: float  # tr((W - Q) H (W - Q)^T) / tr(W H W^T) of round-to-nearest on the grid: relative output MSE
    gptq_loss: float  # the same for GPTQ's codes (<= rtn_loss up to the damping)
    damp: float  # the damping that made H positive definite (raised from the setting when it was not)
    threads: int | None = None  # torch threads the Cholesky and block updates ran on (None: on a GPU)
    # How well the calibration determined the Hessian: its numerical rank (eigenvalues above K * eps * the largest;
    # None when not computed) and the share of directions where the damping outweighs the data (eigenvalues below
    # damp * mean diagonal; wider layers: Cholesky pivots of H + damp whose data part is below the damping).
    rank: int | None = None
    damp_share: float = 0.0
    damp_measure: str = "eigenvalues"  # or "cholesky pivots"


class HessianAccumulator:
    """Running H = mean over rows of x^T x of one layer's (rotated) input, fp32, [K, K]: bounded memory
    whatever the number of calibration tokens."""

    def __init__(self, features: int, kind: str, group: int | None, device: torch.device | str):
        self.kind, self.group = kind, group
        self.hessian = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.hessian.device)
        # Uncentred: hadanorm adds the mean's term back from the same dequantized weight, so the output error
        # is that of the whole input.
        x, _ = rotation.rotate_activation(x, self.kind, self.group, centre=False)
        n = x.shape[0]
        self.hessian.mul_(self.rows / (self.rows + n))
        self.hessian.addmm_(x.t(), x, alpha=1.0 / (self.rows + n))
        self.rows += n


def gptq_threads(setting: int | None = None) -> int:
    """Torch threads for GPTQ's CPU matrix work: `setting` when given, else torch's own count capped by the cores
    this process may run on less those other processes keep busy (the 1-minute load average beyond this process's
    own thread). Oversubscribed, each of the thousands of small parallel regions waits for a descheduled thread:
    on a 2-core machine beside one busy process, 2 threads ran GPTQ 3-8x slower than 1
    (bench/results/gptq_threads.md)."""
    if setting is not None:
        return setting
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        busy = max(0.0, os.getloadavg()[0] - 1.0)
    except OSError:  # no load average on this platform
        busy = 0.0
    return max(1, min(torch.get_num_threads(), int(cpus - busy + 0.5)))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside the `with` (None: unchanged), restored after: nothing
    outlives the call, so the ledger has nothing to record."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _energy(w: torch.Tensor, h: torch.Tensor) -> float:
    """tr(W H W^T) in float64: the output energy of W x over the inputs H describes."""
    return float(torch.einsum("nk,kj,nj->", w.double(), h.double(), w.double()))


def _inverse_cholesky(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float, float]:
    """Upper Cholesky factor of (H + damp * mean(diag) * I)^-1, the damping that made it, and the share of the
    columns whose Cholesky pivot (of H + damp, given the columns before) owes more to the damping than to H. The
    damping is raised tenfold until H is positive definite (a calibration set with fewer tokens than features
    leaves H singular)."""
    mean_diag = float(torch.diag(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h + damp * mean_diag * eye)
        if int(info) == 0:
            pivots_damped = float((torch.diag(chol) ** 2 < 2 * damp * mean_diag).float().mean())
            hinv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return upper, damp, pivots_damped
        damp *= 10.0
    raise ValueError(f"the input Hessian is not positive definite even with damping {damp / 10:g} "
                     "(calibration inputs all zero?)")


def _round_block(block: torch.Tensor, hb: torch.Tensor, cols: torch.Tensor, q: torch.Tensor, errs: torch.Tensor,
                 round_columns) -> None:
    """GPTQ's inner loop over one block of columns, in place: column i of `block` rounded on the grid into q, its
    error (scaled by Hinv's diagonal) into errs and spread over the block's later columns by `hb` (Hinv's tile)."""
    for i in range(block.shape[1]):
        col = block[:, i:i + 1]
        rounded = round_columns(col, cols[i:i + 1])
        q[:, i:i + 1] = rounded
        err = (col - rounded) / hb[i, i]
        block[:, i:] -= err @ hb[i:i + 1, i:]
        errs[:, i:i + 1] = err


class _GraphedBlock:
    """`_round_block` over full-width blocks as one CUDA graph per layer, captured on the first block and replayed
    for every later one. Eagerly the loop is some 10-25 tiny launches per column (the format's rounding and the
    error update), whose host cost dwarfs their device time: nvfp4's full-size Krea 2 pass ran ~3 s a layer. The
    block, its Hinv tile and its column indices go in by copy into static buffers; the rounded values and the
    errors come out of them (valid until the next call). Replay runs the captured kernels: the same results."""

    def __init__(self, n: int, width: int, like: torch.Tensor, round_columns) -> None:
        self.block = torch.empty(n, width, dtype=like.dtype, device=like.device)
        self.hb = torch.empty(width, width, dtype=like.dtype, device=like.device)
        self.cols = torch.empty(width, dtype=torch.long, device=like.device)
        self.q, self.errs = torch.empty_like(self.block), torch.empty_like(self.block)
        self.round_columns = round_columns
        self.graph: torch.cuda.CUDAGraph | None = None

    def _run(self) -> None:
        _round_block(self.block, self.hb, self.cols, self.q, self.errs, self.round_columns)

    def __call__(self, block: torch.Tensor, hb: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graph is None:
            # a warm-up run on a side stream first (cuBLAS and allocator set-up may not happen during a capture)
            side = torch.cuda.Stream(device=self.block.device)
            side.wait_stream(torch.cuda.current_stream(self.block.device))
            with torch.cuda.stream(side):
                self.block.copy_(block)
                self.hb.copy_(hb)
                self.cols.copy_(cols)
                self._run()
            torch.cuda.current_stream(self.block.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()
        self.block.copy_(block)
        self.hb.copy_(hb)
        self.cols.copy_(cols)
        self.graph.replay()
        return self.q, self.errs


def gptq_quantize(weight: torch.Tensor, spec: FormatSpec, hessian: torch.Tensor,
                  settings: GPTQSettings = GPTQSettings(), where: str = "") -> GPTQResult:
    """Quantize `weight` [N, K] to `spec` with GPTQ against `hessian` [K, K] (of the layer's input after
    the format's rotation, as HessianAccumulator builds it). Raises NotImplementedError for a format
    without fixed-grid rounding. On the CPU the matrix work runs on `settings.threads` (None: gptq_threads()) and
    the column loop on one thread; torch's count is restored after."""
    fmt = get_format(spec.format)
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"{where or spec.format}: Hessian is {tuple(hessian.shape)}, the weight has {k} inputs")
    device = hessian.device
    q0 = fmt.calibrated_grid(weight.to(device), spec, hessian)
    q0 = QuantizedWeight(q0.format, q0.shape, {s: t.to(device) for s, t in q0.tensors.items()}, q0.record)
    values, h_target = fmt.grid_target(q0, weight.to(device).float(), spec, hessian.float())
    cols = torch.arange(k, device=device)
    round_columns = fmt.grid_rounder(q0)
    rtn = round_columns(values, cols)

    # The grid above (SVD, clipping search) ran on torch's own threads, so its scales are those RTN gets here.
    threads = gptq_threads(settings.threads) if not hessian.is_cuda else None
    with torch_threads(threads):
        q, damp, damp_share, rank, measure = _feedback(values, h_target, cols, round_columns, settings, threads)
    # Relative to the whole layer's output energy, in the basis the Hessian was measured in.
    kind, group = fmt.input_rotation(spec, k)
    energy = _energy(rotation.rotate_weight(weight.to(device).float(), kind, group or None), hessian.float())
    out = fmt.encode_on_grid(q0, q)
    return GPTQResult(out, _energy(values - rtn, h_target) / energy if energy > 0 else 0.0,
                      _energy(values - q, h_target) / energy if energy > 0 else 0.0, damp, threads, rank, damp_share,
                      measure)


def _feedback(values: torch.Tensor, h_target: torch.Tensor, cols: torch.Tensor, round_columns,
              settings: GPTQSettings, threads: int | None) -> tuple[torch.Tensor, float, float, int | None, str]:
    """GPTQ's codes (as grid values) of `values` against `h_target`: (q, damping used, damping share, rank, the
    share's measure). `threads`: on the CPU, the column loop runs on one thread (None: leave torch's count)."""
    n, k = values.shape
    h = h_target.float().clone()
    # A column whose input is always zero: rounded to nearest, its error (which nothing multiplies) not spread.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w = values
    if settings.act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h, cols = w[:, perm], h[perm][:, perm], cols[perm]
    hinv, damp, damp_share = _inverse_cholesky(h, settings.damp)
    rank, measure = None, "cholesky pivots"
    if k <= settings.spectrum_max_width:
        eig = torch.linalg.eigvalsh(h_target.float())
        rank = int((eig > k * torch.finfo(torch.float32).eps * eig.max().clamp_min(0)).sum())
        damp_share, measure = float((eig < damp * float(torch.diag(h).mean())).float().mean()), "eigenvalues"

    w = w.clone()
    q = torch.empty_like(w)
    width = settings.block_size
    graphed = _GraphedBlock(n, width, w, round_columns) if settings.cuda_graph and w.is_cuda and k >= width else None
    for start in range(0, k, width):
        stop = min(start + width, k)
        hb = hinv[start:stop, start:stop]
        if graphed is not None and stop - start == width:
            q[:, start:stop], errs = graphed(w[:, start:stop], hb, cols[start:stop])
        else:
            block, errs = w[:, start:stop].clone(), torch.empty(n, stop - start, dtype=w.dtype, device=w.device)
            # Some 10-25 ops on one column each: too small to gain from threads, and slowed many-fold by them
            # whenever another process holds a core.
            with torch_threads(1 if threads is not None else None):
                _round_block(block, hb, cols[start:stop], q[:, start:stop], errs, round_columns)
        w[:, stop:] -= errs @ hinv[start:stop, stop:]
    if settings.act_order:
        q = q[:, torch.argsort(perm)]
    return q, damp, damp_share, rank, measure
