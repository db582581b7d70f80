"""CLI: `python -m lowbit_pipe [recipe=NAME|PATH.yaml] [key=value ...] [-m sweeps]`. A thin layer over the Python API.

`recipe=<run dir>/recipe.yaml` reruns a finished run: same recipe, same seeds, same figures and export bytes.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lowbit_pipe.compose import check_cli, recipe_file_args, register_schema, to_recipe
from lowbit_pipe.errors import LowbitError
from lowbit_pipe.runner import Runner

register_schema()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def _main(cfg: DictConfig) -> float | None:
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        recipe = to_recipe(cfg)
        result = Runner(recipe, run_dir).run()
    except LowbitError as err:
        print(f"lowbit_pipe: {err}  (run dir: {run_dir})", file=sys.stderr)
        sys.exit(1)
    print((result.run_dir / "summary.txt").read_text(), end="")
    # The value a sweeper (Optuna) optimises; the basic and joblib launchers ignore it.
    return (result.report.get("evaluate") or {}).get("objective")


def main() -> None:
    # Refuse a bad recipe in one line, before Hydra composes or creates any run dir.
    try:
        sys.argv = sys.argv[:1] + recipe_file_args(sys.argv[1:])
        check_cli(sys.argv[1:])
    except LowbitError as err:
        print(f"lowbit_pipe: {err}", file=sys.stderr)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    main()
