"""Host cost of one uncompiled quantized linear call: the Python and launch time the CPU spends per call.

GPU (the committed table):  python bench/host_cost.py --out bench/results/host_cost_h200.json
CPU smoke run:               python bench/host_cost.py --device cpu
Before / after, one run:     python bench/host_cost.py --device cpu --calls 20 --repeats 100 --rounds 3 \
                                 --tree before=../old-checkout --tree after=.

Per format (int8, fp8, int8+convrot, nvfp4 weight-only and with fp8 compute) at Krea 2 shapes with few tokens
(where the host, not the GPU, bounds an eager forward): host ms = wall time of `calls` back-to-back calls without
a synchronisation, divided by `calls` (the GPU queue absorbs the kernels meanwhile), the least of `repeats` such
runs (what other processes add is never negative); gpu ms = one call replayed from a CUDA graph; bf16 F.linear in
the same run as the baseline. Then the top functions of a cProfile of the calls, to say where the host time goes.
On the CPU every op runs on the host (one thread), so the layer is tiny there, and the torch reference's ops are
most of its time: a change to the Python around them shows as a small difference, which short runs (few calls,
many repeats) on an idle machine resolve best.

The `layout ...` rows are the same layers as ComfyUI runs a quantized file the node pack loads: a comfy-kitchen
QuantizedTensor of `lowbit_pipe.comfy.layout.LowbitLayout` called by `F.linear` under `torch.inference_mode()`
(ComfyUI's sampling; the mode is entered per call, a few microseconds); the nvfp4 ones with ConvRot, as
`krea2_nvfp4` writes them (`lowbit_nvfp4`). They need comfy-kitchen (none without it); a tree whose layout has no
compute setting gives "-" for the fp8-compute row.

`--tree NAME=PATH` (repeatable) measures each package tree in its own subprocess, PATH first on sys.path and
PYTHONPATH, with this script's code, and tabulates them side by side with the ratio of the last to the first;
`--rounds` alternates the trees that many times and keeps each figure's least.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import hashlib
import io
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from outputs import save_outputs  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One quantized layer to time: FormatSpec arguments (built in the measured tree) and its `compute` setting."""

    label: str
    spec: dict[str, Any]
    compute: str | None = None


CASES = (Case("int8", {"format": "int8"}), Case("fp8", {"format": "fp8"}),
         Case("int8+convrot", {"format": "int8", "rotation": "convrot"}),
         Case("nvfp4 weight-only", {"format": "nvfp4", "activations": "none"}),
         Case("nvfp4 fp8 compute", {"format": "nvfp4"}, compute="fp8"))
# The same kinds as a file the node pack loads runs them in ComfyUI (LowbitLayout, see the module docstring).
LAYOUT_CASES = (Case("layout int8+quarot", {"format": "int8", "rotation": "quarot"}),
                Case("layout nvfp4+convrot", {"format": "nvfp4", "rotation": "convrot"}),
                Case("layout nvfp4+convrot fp8 compute", {"format": "nvfp4", "rotation": "convrot"}, compute="fp8"))
SHAPES = ((256, 6144, 6144), (256, 6144, 1536))
CPU_SHAPES = ((1, 256, 16),)  # the CPU runs the torch references: the smallest layer every case stores


@dataclass(frozen=True)
class Tree:
    """A package tree to measure: a checkout whose `lowbit_pipe` is imported instead of the installed one."""

    name: str
    path: Path
    commit: str = field(default="")
    content: str = field(default="")  # package_digest: names the measured code where a copy's .git is stale


def host_ms(fn: Callable[[], Any], calls: int, repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(5):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        sync()
        best = min(best, elapsed / calls * 1e3)
    return best


def gpu_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=50))


def profile_top(fn: Callable[[], Any], calls: int, top: int = 12) -> list[str]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return [line for line in out.getvalue().splitlines() if line.strip()][-top:]


def layers(device: str, dtype: torch.dtype, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor
           ) -> list[tuple[str, Callable[[], Any]]]:
    """(label, call) per case, the float baseline first: the quantized layers built by the tree imported."""
    from lowbit_pipe.formats import FormatSpec, get_format

    try:
        from lowbit_pipe.quant.nn import QuantLinear
    except ImportError:  # a tree from before the package was laid out in folders (--tree before=...)
        from lowbit_pipe.nn import QuantLinear

    w_lp = w.to(device, dtype)
    cases = [("bf16" if dtype == torch.bfloat16 else "fp32", lambda: F.linear(x, w_lp, b))]
    for case in CASES:
        spec = FormatSpec(**case.spec)
        fmt = get_format(spec.format)
        layer = QuantLinear(fmt.with_activations(fmt.quantize(w, spec), spec.activations), b).to(device)
        if case.compute is not None:
            layer.compute = case.compute
        cases.append((case.label, (lambda layer: lambda: layer(x))(layer)))
    return cases + layout_layers(device, dtype, x, w, b)


def layout_layers(device: str, dtype: torch.dtype, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor
                  ) -> list[tuple[str, Callable[[], Any] | None]]:
    """(label, call) per LAYOUT_CASES entry: LowbitLayout QuantizedTensors of the tree imported (call None where
    that tree's layout has no compute setting); none without comfy-kitchen. Needs `registered()` around the calls."""
    try:
        from lowbit_pipe.comfy import layout as lay
    except ImportError:
        return []
    from lowbit_pipe.formats import FormatSpec, get_format

    has_compute = "compute" in {f.name for f in dataclasses.fields(lay.LowbitLayout.Params)}
    cases: list[tuple[str, Callable[[], Any] | None]] = []
    for case in LAYOUT_CASES:
        spec = FormatSpec(**case.spec)
        q = get_format(spec.format).quantize(w, spec)
        if case.compute is not None and not has_compute:
            cases.append((case.label, None))
            continue
        q.compute = case.compute
        qt = lay.to_quantized_tensor(type(q)(q.format, q.shape, {k: t.to(device) for k, t in q.tensors.items()},
                                             q.record, compute=case.compute), dtype)

        def call(qt: Any = qt) -> Any:
            with torch.inference_mode():  # ComfyUI samples in it: aten.linear reaches the layout whole
                return F.linear(x, qt, b)
        cases.append((case.label, call))
    return cases


def registered() -> Any:
    """LowbitLayout registered with comfy-kitchen (the tree imported), or nothing to do without comfy-kitchen."""
    try:
        from lowbit_pipe.comfy import layout as lay
    except ImportError:
        return contextlib.nullcontext()
    return lay.registered()


def measure(device: str, calls: int, repeats: int, profile: bool) -> dict[str, Any]:
    """Every case at every shape on `device`, with the lowbit_pipe found first on sys.path."""
    import lowbit_pipe

    threads = torch.get_num_threads()
    if device == "cpu":  # one thread: the host's own work, not a thread pool's wake-ups on a shared machine
        torch.set_num_threads(1)
    try:
        results = [row for shape in (SHAPES if device == "cuda" else CPU_SHAPES)
                   for row in measure_shape(device, shape, calls, repeats, profile)]
    finally:
        torch.set_num_threads(threads)
    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
           "lowbit_pipe": str(Path(lowbit_pipe.__file__).resolve().parent)}
    return {"env": env, "results": results}


def measure_shape(device: str, shape: tuple[int, int, int], calls: int, repeats: int,
                  profile: bool) -> list[dict[str, Any]]:
    m, k, n = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = torch.randn(n, k, generator=gen) * 0.02
    b = torch.randn(n, generator=gen).to(device, dtype)
    results = []
    with registered():
        cases = layers(device, dtype, x, w, b)
        for label, fn in cases:
            row = {"M": m, "K": k, "N": n, "format": label, "host_ms": None, "gpu_ms": None}
            if fn is not None:
                with torch.no_grad():
                    row.update(host_ms=host_ms(fn, calls, repeats, sync), gpu_ms=gpu_ms(fn) if device == "cuda" else None)
                    if profile and label != cases[0][0]:
                        row["profile"] = profile_top(fn, calls)
            results.append(row)
            print(f"M={m} K={k} N={n} {label:18s} host {row['host_ms']} ms  gpu {row['gpu_ms']}", file=sys.stderr,
                  flush=True)
    return results


def package_digest(root: Path) -> str:
    """sha256 (12 hex digits) of lowbit_pipe/**/*.py under `root`, paths and contents: the same code gives the same
    digest in any copy (the GPU machine's copy of a checkout keeps an older .git: its commit label can be stale)."""
    digest = hashlib.sha256()
    for path in sorted((root / "lowbit_pipe").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def git_commit(path: Path) -> str:
    proc = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("+dirty" if dirty else "") if proc.returncode == 0 else ""


def parse_tree(text: str) -> Tree:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--tree takes NAME=PATH, got '{text}'")
    root = Path(path).expanduser().resolve()
    if not (root / "lowbit_pipe" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"--tree {name}: no lowbit_pipe package under {root}")
    return Tree(name, root, git_commit(root), package_digest(root))


def measure_tree(tree: Tree, args: argparse.Namespace) -> dict[str, Any]:
    """One subprocess: this script with `tree` first on sys.path (and PYTHONPATH, for what it starts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-tree", str(tree.path), "--child-out", str(out),
               "--device", args.device, "--calls", str(args.calls), "--repeats", str(args.repeats)]
        path = os.pathsep.join(filter(None, (str(tree.path), os.environ.get("PYTHONPATH"))))
        env = {**os.environ, "PYTHONPATH": path}
        subprocess.run(cmd + (["--profile"] if args.profile else []), env=env, check=True)
        report = json.loads(out.read_text())
    if Path(report["env"]["lowbit_pipe"]) != tree.path / "lowbit_pipe":
        raise RuntimeError(f"tree {tree.name}: measured {report['env']['lowbit_pipe']}, not {tree.path}")
    return report


def compare(trees: list[Tree], args: argparse.Namespace) -> dict[str, Any]:
    """Each tree measured `rounds` times, alternately; each figure the least of its rounds."""
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for tree in trees:
            print(f"tree {tree.name}: {tree.path} ({tree.commit or 'not a git checkout'})", file=sys.stderr, flush=True)
            report = measure_tree(tree, args)
            kept = best.setdefault(tree.name, report)
            for old, new in zip(kept["results"], report["results"]):
                for key in ("host_ms", "gpu_ms"):
                    if new[key] is not None and (old[key] is None or new[key] < old[key]):
                        old[key] = new[key]
    first = best[trees[0].name]
    return {"command": args.command, "env": {k: v for k, v in first["env"].items() if k != "lowbit_pipe"},
            "trees": [{"name": t.name, "path": str(t.path), "commit": t.commit, "content": t.content} for t in trees],
            "rounds": args.rounds, "results": {t.name: best[t.name]["results"] for t in trees}}


def _ms(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "-"


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [f"`{report['command']}`", "", f"device: {env['device_name']} | torch {env['torch']}", "",
             "host ms: CPU time per uncompiled call (calls back to back, no sync); gpu ms: the call replayed from a "
             "CUDA graph. An eager forward costs about max(host, gpu) per layer.", "",
             "| M | K | N | format | host ms | gpu ms |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['M']} | {r['K']} | {r['N']} | {r['format']} | {_ms(r['host_ms'])} | {_ms(r['gpu_ms'])} |")
    for r in report["results"]:
        if "profile" in r:
            lines += ["", f"cProfile, {r['format']} at M={r['M']} K={r['K']} N={r['N']} (top by own time):", "```",
                      *r["profile"], "```"]
            break
    return "\n".join(lines) + "\n"


def markdown_trees(report: dict[str, Any]) -> str:
    env, trees = report["env"], report["trees"]
    names = [t["name"] for t in trees]
    gpu = env["device"] == "cuda"
    lines = [f"`{report['command']}`", "", f"device: {env['device_name']} | torch {env['torch']} | "
             f"least of {report['rounds']} round(s) per tree", "",
             *[f"- {t['name']}: `{t['path']}` {t['commit']} (package digest {t.get('content') or '-'})" for t in trees], "",
             f"host ms per uncompiled call (calls back to back, no sync); last / first: {names[-1]} / {names[0]}.", ""]
    head = ["M", "K", "N", "format", *[f"host ms {n}" for n in names], "last / first"]
    head += [f"gpu ms {n}" for n in names] if gpu else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    columns = [report["results"][n] for n in names]
    for rows in zip(*columns):
        r = rows[0]
        first, last = rows[0]["host_ms"], rows[-1]["host_ms"]
        cells = [str(r["M"]), str(r["K"]), str(r["N"]), r["format"], *[_ms(x["host_ms"]) for x in rows],
                 f"{last / first:.2f}" if first and last else "-"]
        cells += [_ms(x["gpu_ms"]) for x in rows] if gpu else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5, help="runs of `calls` calls per figure; the least is kept")
    parser.add_argument("--profile", action="store_true", help="cProfile each format's calls")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here (and .md beside it)")
    parser.add_argument("--tree", type=parse_tree, action="append", default=[], metavar="NAME=PATH",
                        help="a package tree to measure in its own subprocess (repeat for a side-by-side table)")
    parser.add_argument("--rounds", type=int, default=1, help="with --tree: measure the trees alternately this often")
    parser.add_argument("--child-tree", type=Path, help=argparse.SUPPRESS)  # set by measure_tree
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if len({t.name for t in args.tree}) != len(args.tree):
        parser.error("--tree names must differ")
    args.command = "python bench/host_cost.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.child_tree is not None:  # one tree's figures for the parent: nothing printed to stdout, nothing saved
        sys.path.insert(0, str(args.child_tree.resolve()))
        args.child_out.write_text(json.dumps(measure(args.device, args.calls, args.repeats, args.profile)))
        return 0
    if args.tree:
        report = compare(args.tree, args)
        table = markdown_trees(report)
    else:
        sys.path.insert(0, str(ROOT))
        report = {"command": args.command, **measure(args.device, args.calls, args.repeats, args.profile)}
        table = markdown(report)
    print(table)
    if args.out:
        save_outputs(args.out, table, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
