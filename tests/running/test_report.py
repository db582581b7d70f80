"""Sweep and compare: a 6-job tiny Krea 2 sweep through the local (joblib) launcher preset, then
`python -m lowbit_pipe.report` on its multirun dir: table, CSV, markdown, plot with Pareto fronts."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli, has_module

from lowbit_pipe import report

JOBLIB = has_module("hydra_plugins.hydra_joblib_launcher")


def test_pareto_front():
    # (cost, quality): (3, 5) is beaten by (2, 6); (4, 6) by (2, 6); ties on cost keep the better one.
    points = [(1, 1), (2, 6), (3, 5), (4, 6), (5, 9), (5, 2)]
    assert report.pareto(points) == [0, 1, 4]
    assert report.pareto([(1, 0.5), (2, 0.1), (3, 0.3)], higher_is_better=False) == [0, 1]


@pytest.mark.slow
@pytest.mark.skipif(not JOBLIB, reason="hydra-joblib-launcher not installed (pip install '.[sweep]')")
def test_six_job_local_sweep_and_report(tmp_path):
    proc = cli(["-m", "hydra/launcher=local", "hydra.launcher.n_jobs=2", "evaluate.samples=1", "evaluate.steps=2",
                "evaluate.images=true", "quantize.default.format=int8,fp8,nvfp4", "quantize.arch_keep_float=true,false"],
               tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = [p for p in (tmp_path / "runs" / "multirun").glob("*/*") if p.is_dir()]
    reports = sorted(sweep.glob("*/report.json"))
    assert len(reports) == 6 and all(json.loads(p.read_text())["status"] == "ok" for p in reports)

    # In-process main() for speed; the __main__ guard is exercised by the subprocess below on one run.
    assert report.main([str(sweep)]) == 0
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert len(rows) == 6
    assert {r["overrides"] for r in rows} == {f"quantize.default.format={f} quantize.arch_keep_float={k}"
                                              for f in ("int8", "fp8", "nvfp4") for k in ("True", "False")}
    by = {r["overrides"]: r for r in rows}
    # Quantizing the keep-float layers too saves bytes and costs quality, whatever the format.
    for f in ("int8", "fp8", "nvfp4"):
        keep, drop = by[f"quantize.default.format={f} quantize.arch_keep_float=True"], \
            by[f"quantize.default.format={f} quantize.arch_keep_float=False"]
        assert int(drop["weight_bytes"]) < int(keep["weight_bytes"]) and float(drop["psnr_db"]) < float(keep["psnr_db"])
    md = (sweep / "report.md").read_text()
    assert md.startswith("| overrides |") and md.count("\n") == 8
    png = (sweep / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000

    # Rerun one job from its run dir (here in-process, with this process's thread count; joblib workers
    # ran single-threaded): the very same figures and export bytes. The CLI form is in test_repro.
    from test_repro import differing, figures

    import lowbit_pipe

    job = reports[3].parent
    lowbit_pipe.run(str(job / "recipe.yaml"), run_dir=tmp_path / "rerun")
    assert differing(figures(tmp_path / "rerun"), figures(job)) == []

    proc = subprocess.run([sys.executable, "-m", "lowbit_pipe.report", str(reports[0].parent), "--out", str(tmp_path / "one"),
                           "--metric", "rel_error"], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    assert "rel_error" in proc.stdout.splitlines()[0] and (tmp_path / "one" / "report.png").is_file()


def test_report_without_hydra_dirs_uses_differing_recipe_keys(tmp_path):
    import lowbit_pipe

    for fmt in ("int8", "fp8"):
        lowbit_pipe.run("default", ["pipeline=[load,detect,quantize,evaluate]", f"quantize.default.format={fmt}",
                                    "evaluate.samples=1", "evaluate.trajectory_seeds=0"], run_dir=tmp_path / fmt)
    rows = report.collect([tmp_path])
    assert [r["overrides"] for r in rows] == ["quantize.default.format=fp8", "quantize.default.format=int8"]
    assert report.main([str(tmp_path / "none")]) == 2


def test_report_without_matplotlib_writes_the_table(tmp_path, monkeypatch, capsys):
    """The lean install (no `report` extra): table, CSV and Markdown, and one line saying what the plot needs."""
    import lowbit_pipe

    lowbit_pipe.run("default", ["pipeline=[load,detect,quantize]"], run_dir=tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert report.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "report.csv").is_file() and (tmp_path / "out" / "report.md").is_file()
    assert not (tmp_path / "out" / "report.png").exists()
    assert 'need matplotlib: pip install "lowbit_pipe[report]"' in capsys.readouterr().out


OPTUNA = has_module("hydra_plugins.hydra_optuna_sweeper")


@pytest.mark.skipif(not OPTUNA, reason="hydra-optuna-sweeper not installed (pip install '.[optuna]')")
def test_optuna_budget_example(tmp_path):
    proc = cli(["-m", "recipe=krea2_nvfp4", "hydra/sweeper=optuna_budget", "hydra.sweeper.n_trials=2",
                "evaluate.budget_bytes=3000000", "evaluate.samples=1", "evaluate.trajectory_seeds=0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = (tmp_path / "runs" / "multirun").rglob("optimization_results.yaml")
    assert "best_value" in result.read_text()
