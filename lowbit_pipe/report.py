"""Compare runs: `python -m lowbit_pipe.report <multirun dir or run dirs> [--out DIR] [--metric psnr_db]`.

Finds every report.json below the given dirs, prints a table (the overrides that tell runs apart vs
their figures), writes report.csv and report.md, and plots quality against weight bytes and against
latency (report.png, Pareto front marked). Overrides come from Hydra's .hydra/overrides.yaml when
present, else from the recipe keys whose values differ between runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any

# Figures pulled from each report.json: column -> path of keys.
FIGURES: dict[str, tuple[str, ...]] = {
    "status": ("status",),
    "rel_error": ("evaluate", "rel_error"),
    "cosine": ("evaluate", "cosine"),
    "psnr_db": ("evaluate", "psnr_db"),
    "sqnr_min_db": ("evaluate", "sqnr_min_db"),
    "traj_mean_cos": ("evaluate", "trajectory", "mean_cosine"),
    "traj_min_cos": ("evaluate", "trajectory", "min_cosine"),
    "diverged": ("evaluate", "trajectory", "diverged"),
    "image_psnr_db": ("evaluate", "images", "psnr_db"),
    "ssim": ("evaluate", "images", "ssim"),
    "weight_bytes": ("evaluate", "weight_bytes"),
    "export_bytes": ("export", "bytes"),
    "latency_ms": ("evaluate", "latency_ms", "quantized"),
    "target_ms": ("quantize", "target", "forward_check", "measured_ms"),  # the target's whole-forward check
    "target_off": ("quantize", "target", "forward_check", "off"),
    "attention": ("plan_attention", "format"),  # the Plan's attention format (the recipe's, or the target's choice)
    "seconds": (),  # sum of stage seconds (wall clock of the run)
}
HIGHER_IS_BETTER = {"psnr_db": True, "cosine": True, "sqnr_min_db": True, "traj_min_cos": True, "traj_mean_cos": True,
                    "image_psnr_db": True, "ssim": True, "rel_error": False}


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1, "c": [2]}} -> {"a.b": 1, "a.c": "[2]"}: leaves by their key path, lists as JSON text."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(data) if isinstance(data, list) else data}


def _overrides(run_dir: Path) -> list[str] | None:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path) if not str(o).startswith("hydra")]


def collect(dirs: list[Path]) -> list[dict[str, Any]]:
    """One row per run below `dirs`: run, overrides, figures. Ordered by Hydra job number, then path."""
    paths = sorted({p for d in dirs for p in ([d / "report.json"] if (d / "report.json").is_file() else d.rglob("report.json"))})
    reports = [(p.parent, json.loads(p.read_text())) for p in paths]
    flat = [flatten(r.get("recipe", {})) for _, r in reports]
    varying = sorted(k for k in set().union(*flat) if len({json.dumps(f.get(k)) for f in flat}) > 1) if flat else []
    per_run = [_overrides(d) or [f"{k}={recipe.get(k)}" for k in varying] for (d, _), recipe in zip(reports, flat)]
    common = set.intersection(*map(set, per_run)) if len(per_run) > 1 else set()  # shown once, in the title
    rows = []
    for (run_dir, report), overrides in zip(reports, per_run):
        row: dict[str, Any] = {"run": str(run_dir), "overrides": " ".join(o for o in overrides if o not in common) or "(base)"}
        for col, path in FIGURES.items():
            row[col] = _get(report, path) if path else round(sum(s.get("seconds", 0) for s in report.get("stages", {}).values()), 3)
        row["frontier"] = _get(report, ("quantize", "target", "frontier"))  # not a column: plot_frontier draws it
        rows.append(row)
    return sorted(rows, key=lambda r: (_job_number(r["run"]), r["run"]))


def _job_number(run: str) -> int:
    name = Path(run).name
    return int(name) if name.isdigit() else 10**9


def pareto(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[int]:
    """Indices of the points no other point beats on both cost (x, lower is better) and quality (y)."""
    sign = 1.0 if higher_is_better else -1.0
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -sign * points[i][1]))
    front, best = [], -float("inf")
    for i in order:
        q = sign * points[i][1]
        if q > best:
            front.append(i)
            best = q
    return front


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], columns: list[str], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})


def plot(rows: list[dict[str, Any]], metric: str, path: Path) -> dict[str, list[int]]:
    """Two panels: metric vs weight bytes, metric vs latency (GPU ms; on CPU-only runs the run's wall
    seconds, labelled as such). Pareto fronts drawn and ringed. Returns each panel's front (row indices)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    higher = HIGHER_IS_BETTER.get(metric, True)
    have_latency = any(r.get("latency_ms") is not None for r in rows)
    cost_axes = [("weight_bytes", "weight bytes (MB)", 1 / 2**20),
                 ("latency_ms", "forward latency (ms, GPU)", 1.0) if have_latency else
                 ("seconds", "run wall seconds (CPU: no GPU latency measured)", 1.0)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    fronts: dict[str, list[int]] = {}
    for ax, (key, label, scale) in zip(axes, cost_axes):
        idx = [i for i, r in enumerate(rows) if r.get(key) is not None and r.get(metric) is not None]
        pts = [(rows[i][key] * scale, rows[i][metric]) for i in idx]
        front = [idx[j] for j in pareto(pts, higher)] if pts else []
        fronts[key] = front
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", zorder=2, label="run")
        for i, (x, y) in zip(idx, pts):
            ax.annotate(_short(rows[i]["overrides"]), (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        if front:
            fx = [rows[i][key] * scale for i in front]
            fy = [rows[i][metric] for i in front]
            ax.plot(fx, fy, color="tab:red", linestyle="--", zorder=1, label="Pareto front")
            ax.scatter(fx, fy, s=160, facecolors="none", edgecolors="tab:red", linewidths=1.5, zorder=3)
        ax.margins(x=0.2, y=0.1)  # room for the labels
        ax.set_xlabel(label)
        ax.set_ylabel(metric + ("" if higher else " (lower is better)"))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{metric} vs cost, {len(rows)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fronts


def plot_frontier(rows: list[dict[str, Any]], path: Path) -> int:
    """Error against forward time: each target run's frontier (the solver's predicted plans) as a line, and every
    run's measured point (its target check, else its GPU latency) with its evaluate rel_error, so hand-written
    recipes sit beside the frontier. Returns how many frontiers were drawn (0: no file written)."""
    fronts = [(i, r["frontier"]) for i, r in enumerate(rows) if r.get("frontier")]
    if not fronts:
        return 0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, front in fronts:
        ax.plot([f["time_ms"] for f in front], [f["error"] for f in front], marker=".", linestyle="--",
                label=f"frontier (predicted): {_short(rows[i]['overrides'], 30)}")
    for r in rows:
        x = r.get("target_ms") if r.get("target_ms") is not None else r.get("latency_ms")
        if x is not None and r.get("rel_error") is not None:
            ax.scatter([x], [r["rel_error"]], color="black", zorder=3)
            ax.annotate(_short(r["overrides"]), (x, r["rel_error"]), fontsize=7, xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("forward ms (frontier: predicted; points: measured)")
    ax.set_ylabel("relative output error (frontier: predicted on the example input; points: evaluate rel_error)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(fronts)


def _short(overrides: str, width: int = 40) -> str:
    text = " ".join(o.split(".")[-1] if "=" in o else o for o in overrides.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowbit_pipe.report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="a multirun dir, or run dirs")
    parser.add_argument("--out", type=Path, default=None, help="where report.csv/.md/.png go (default: the first dir)")
    parser.add_argument("--metric", default="psnr_db", choices=sorted(HIGHER_IS_BETTER), help="quality axis")
    args = parser.parse_args(argv)
    rows = collect(args.dirs)
    if not rows:
        print(f"lowbit_pipe.report: no report.json under {', '.join(map(str, args.dirs))}", file=sys.stderr)
        return 2
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    columns = ["overrides"] + [c for c in FIGURES if any(r.get(c) is not None for r in rows)]
    print(table(rows, columns))
    write_csv(rows, ["run"] + columns, out / "report.csv")
    (out / "report.md").write_text(markdown(rows, columns))
    try:
        import matplotlib  # noqa: F401 - the `report` extra; the lean install has the table, CSV and Markdown
    except ImportError:
        print(f"wrote {out / 'report.csv'}, {out / 'report.md'} ({len(rows)} runs); report.png and the Pareto fronts "
              "need matplotlib: pip install \"lowbit_pipe[report]\"")
        return 0
    fronts = plot(rows, args.metric, out / "report.png")
    if plot_frontier(rows, out / "frontier.png"):
        print(f"wrote {out / 'frontier.png'} (the targets' frontiers beside every run's measured point)")
    on_front = sorted({i for f in fronts.values() for i in f})
    print(f"\nPareto ({args.metric} vs bytes): " + ", ".join(rows[i]["overrides"] for i in fronts.get("weight_bytes", [])))
    print(f"wrote {out / 'report.csv'}, {out / 'report.md'}, {out / 'report.png'} ({len(rows)} runs, {len(on_front)} on a front)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
