"""hydra/launcher=ray (hydra_plugins/lowbit_ray_launcher): the preset composes and is typed, each job asks
Ray for a GPU only when its recipe wants CUDA and the cluster has GPUs, and a sweep on a local Ray
instance gives the same run dirs, figures and export bytes as the basic launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli
from omegaconf import OmegaConf
from test_repro import differing, figures

from lowbit_pipe import report

pytest.importorskip("ray", reason="hydra/launcher=ray needs `pip install '.[ray]'`")

# A local Ray instance kept small, so CI stays fast (Ray's object store minimum is 75 MiB).
RAY_LOCAL = ["hydra/launcher=ray", "hydra.launcher.num_cpus=2", "hydra.launcher.object_store_memory=100000000"]
QUICK = ["evaluate.samples=1", "evaluate.trajectory_seeds=0"]


@pytest.fixture
def quiet_ray(monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no usage-stats prompt or upload


def _sweep_dir(root: Path) -> Path:
    (sweep,) = [p for p in (root / "runs" / "multirun").glob("*/*") if p.is_dir()]
    return sweep


def test_preset_composes_and_refuses_a_misspelt_key(tmp_path):
    proc = cli(["hydra/launcher=ray", "--cfg", "hydra", "--package", "hydra.launcher"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    launcher = OmegaConf.create(proc.stdout)  # the "# @package hydra.launcher" line is a YAML comment
    assert launcher["_target_"] == "hydra_plugins.lowbit_ray_launcher.ray_launcher.RayLauncher"
    assert launcher["address"] is None and launcher["cpus_per_job"] == 1 and launcher["gpus_per_job"] == 1

    proc = cli(["hydra/launcher=ray", "hydra.launcher.adress=auto", "--cfg", "hydra"], tmp_path)
    assert proc.returncode != 0 and "Key 'adress' not in 'RayLauncherConf'" in proc.stderr


def test_a_job_asks_for_a_gpu_only_when_its_recipe_wants_cuda_and_the_cluster_has_gpus():
    from hydra_plugins.lowbit_ray_launcher._core import job_resources
    from hydra_plugins.lowbit_ray_launcher.config import RayLauncherConf

    settings = RayLauncherConf()

    def asks(device, cluster_gpus):
        return job_resources(OmegaConf.create({"model": {"device": device}}), settings, cluster_gpus)

    assert asks("cuda", 8) == {"num_cpus": 1, "num_gpus": 1}
    assert asks("auto", 8) == {"num_cpus": 1, "num_gpus": 1}
    assert asks("cuda:0", 8) == {"num_cpus": 1, "num_gpus": 1}
    assert asks(None, 8) == asks("cpu", 8) == asks("cuda", 0) == asks("auto", 0) == {"num_cpus": 1, "num_gpus": 0}
    with pytest.raises(ValueError, match=r"model\.device=cuda:3.*hydra\.launcher\.gpus_per_job"):
        asks("cuda:3", 8)  # each job sees only its own GPU(s)


def test_joining_a_cluster_refuses_local_instance_settings():
    from hydra_plugins.lowbit_ray_launcher._core import init_ray
    from hydra_plugins.lowbit_ray_launcher.config import RayLauncherConf

    with pytest.raises(ValueError, match=r"hydra\.launcher\.num_cpus=2 .*hydra\.launcher\.address=auto"):
        init_ray(RayLauncherConf(address="auto", num_cpus=2))


@pytest.mark.slow
def test_ray_sweep_matches_the_basic_launcher(tmp_path, quiet_ray):
    sweep = ["-m", "quantize.default.format=int8,fp8", *QUICK]
    (tmp_path / "basic").mkdir()
    (tmp_path / "ray").mkdir()
    basic = cli(sweep, tmp_path / "basic")
    assert basic.returncode == 0, basic.stderr[-3000:]
    ray = cli(sweep + RAY_LOCAL, tmp_path / "ray")
    assert ray.returncode == 0, ray.stderr[-3000:]
    assert "Ray launcher: 2 jobs" in ray.stderr + ray.stdout

    basic_dir, ray_dir = _sweep_dir(tmp_path / "basic"), _sweep_dir(tmp_path / "ray")
    assert (ray_dir / "multirun.yaml").is_file()
    for job in ("0", "1"):
        # Same layout of each run dir, same overrides, same figures and byte-identical exports.
        assert sorted(p.name for p in (ray_dir / job).iterdir()) == sorted(p.name for p in (basic_dir / job).iterdir())
        assert OmegaConf.load(ray_dir / job / ".hydra" / "overrides.yaml") == \
            OmegaConf.load(basic_dir / job / ".hydra" / "overrides.yaml")
        assert json.loads((ray_dir / job / "report.json").read_text())["status"] == "ok"
        assert differing(figures(ray_dir / job), figures(basic_dir / job)) == []

    assert report.main([str(ray_dir)]) == 0
    rows = (ray_dir / "report.md").read_text().splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["quantize.default.format=int8", "quantize.default.format=fp8"]
