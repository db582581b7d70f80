"""The lean install (`pip install .`, no extras; docs/install.md) runs the CLI's default recipe.

The test environment has every extra installed, so the lean one is simulated in a child process: every
top-level module that no distribution of lowbit_pipe's core requirements (followed transitively, extras left
out) provides is hidden (`sys.modules[name] = None`: `import` raises ImportError and `importlib.util.find_spec`
returns None, which is how diffusers and torch probe for optional packages). The default run must succeed
there and import no module that only a distribution outside the core's closure provides. A throwaway venv with
`pip install torch==2.13.0 && pip install .` ran the same command (docs/install.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the extras bring that the issue named (issue 29 item 5): none may be imported by the core.
OPTIONAL = ("ray", "mlflow", "optuna", "matplotlib", "comfy_kitchen", "peft", "transformers")

CHILD = r"""
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

at_start = {m.split(".")[0] for m in sys.modules}
core, todo = set(), ["lowbit_pipe"]
while todo:  # the core requirements' closure, extras left out
    name = canon(todo.pop())
    if name in core:
        continue
    core.add(name)
    for req in md.requires(name) or []:
        r = Requirement(req)
        if r.marker is None or r.marker.evaluate({"extra": ""}):
            todo.append(r.name)
providers = md.packages_distributions()  # top-level module -> distributions
lean = {m for m, dists in providers.items() if any(canon(d) in core for d in dists)}
hidden = sorted(m for m, dists in providers.items() if m not in lean and m not in at_start and m != "hydra_plugins")
for m in hidden:
    sys.modules[m] = None

sys.argv = ["lowbit_pipe", *sys.argv[1:]]
from lowbit_pipe.__main__ import main
try:
    main()
finally:
    loaded = {m.split(".")[0] for m, v in list(sys.modules.items()) if v is not None}
    outside = sorted(m for m in loaded - at_start if m in providers and m not in lean and m != "hydra_plugins")
    print("LEAN", json.dumps({"core": sorted(core), "hidden": hidden, "outside": outside, "loaded": sorted(loaded)}))
"""


def test_the_lean_install_runs_the_default_recipe(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                                    if os.environ.get("PYTHONPATH") else "")}
    proc = subprocess.run([sys.executable, "-c", CHILD, f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "teardown: freed" in proc.stdout and "quality: rel_error" in proc.stdout  # the whole default pipeline ran
    found = json.loads(proc.stdout.split("LEAN ", 1)[1])
    assert {"torch", "diffusers", "hydra-core", "safetensors"} <= set(found["core"])
    assert not {"ray", "mlflow", "optuna", "peft", "transformers"} & set(found["core"])  # extras stayed out
    assert found["outside"] == [], found["outside"]
    assert [m for m in OPTIONAL if m in found["loaded"]] == []
    assert json.loads((tmp_path / "run" / "report.json").read_text())["status"] == "ok"
