"""bench/host_cost.py: a CPU smoke run in process, and the side-by-side run of two package trees in subprocesses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

FORMATS = ["fp32", "int8", "fp8", "int8+convrot", "nvfp4 weight-only", "nvfp4 fp8 compute", "layout int8+quarot",
           "layout nvfp4+convrot", "layout nvfp4+convrot fp8 compute"]


def test_cpu_smoke_run_times_every_format(tmp_path):
    from host_cost import main

    threads = torch.get_num_threads()
    out = tmp_path / "host_cost.json"
    assert main(["--device", "cpu", "--calls", "2", "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["format"] for r in report["results"]] == FORMATS
    assert all(r["host_ms"] > 0 and r["gpu_ms"] is None for r in report["results"])
    assert Path(report["env"]["lowbit_pipe"]) == ROOT / "lowbit_pipe"
    assert "| 1 | 256 | 16 | nvfp4 fp8 compute |" in out.with_suffix(".md").read_text()
    assert "| 1 | 256 | 16 | layout nvfp4+convrot fp8 compute |" in out.with_suffix(".md").read_text()
    assert torch.get_num_threads() == threads  # the bench's one thread is given back


def test_two_trees_in_one_run_give_a_side_by_side_table(tmp_path):
    from host_cost import main

    out = tmp_path / "trees.json"
    assert main(["--device", "cpu", "--calls", "2", "--repeats", "1", "--tree", f"before={ROOT}", "--tree",
                 f"after={ROOT}", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [t["name"] for t in report["trees"]] == ["before", "after"]
    assert all(t["path"] == str(ROOT) for t in report["trees"])
    assert [r["format"] for r in report["results"]["after"]] == FORMATS
    table = out.with_suffix(".md").read_text()
    assert "| host ms before | host ms after | last / first |" in table
    assert table.count("| 1 | 256 | 16 |") == len(FORMATS)


def test_a_tree_without_the_package_is_refused(tmp_path):
    from host_cost import main

    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--tree", f"empty={tmp_path}"])


def test_a_row_an_older_tree_cannot_measure_shows_a_dash():
    """A tree whose LowbitLayout has no compute setting (before it had one) gives no figure for that row."""
    from host_cost import markdown_trees

    row = {"M": 1, "K": 256, "N": 16, "format": "layout nvfp4+convrot fp8 compute", "gpu_ms": None}
    report = {"command": "c", "env": {"device": "cpu", "device_name": "cpu", "torch": "x"}, "rounds": 1,
              "trees": [{"name": "before", "path": "/a", "commit": ""}, {"name": "after", "path": "/b", "commit": ""}],
              "results": {"before": [{**row, "host_ms": None}], "after": [{**row, "host_ms": 0.5}]}}
    assert "| 1 | 256 | 16 | layout nvfp4+convrot fp8 compute | - | 0.5000 | - |" in markdown_trees(report)
