"""CLI: `python -m lowbit_pipe [recipe=NAME|PATH.yaml] [key=value ...] [-m sweeps]`. A thin layer over the Python API.

`recipe=<run dir>/recipe.yaml` reruns a finished run: same recipe, same seeds, same figures and export bytes.
Exit codes: 0 done; 1 a stage failed (the run dir holds report.json; in a sweep, once every job has run);
2 refused before any work (bad recipe, missing file, no such device: no run dir is created); 130 interrupted
(Ctrl-C, after teardown).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lowbit_pipe.compose import cli_recipes, recipe_file_args, register_schema, split_cli, to_recipe
from lowbit_pipe.errors import LowbitError
from lowbit_pipe.paths import config_dir
from lowbit_pipe.preflight import check_extras, preflight
from lowbit_pipe.progress import Console
from lowbit_pipe.runner import Runner

register_schema()


@hydra.main(version_base=None, config_path=str(config_dir()), config_name="config")
def _main(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    sweep = hydra_cfg.mode == RunMode.MULTIRUN
    console = Console(prefix=f"[job {hydra_cfg.job.num}] " if sweep else "")
    try:
        recipe = to_recipe(cfg)
        result = Runner(recipe, run_dir, console=console, hands_back=False).run()  # nothing is kept: auto streams
    except LowbitError as err:
        print(f"{console.prefix}lowbit_pipe: {err}  (run dir: {run_dir})", file=sys.stderr)
        if sweep:  # the other jobs still run; lowbit_pipe.sweep_outcome exits 1 at the sweep's end
            return float("nan")
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"{console.prefix}lowbit_pipe: interrupted; torn down (run dir: {run_dir})", file=sys.stderr)
        sys.exit(130)
    console.say((result.run_dir / "summary.txt").read_text().rstrip("\n"))
    # The value a sweeper (Optuna) optimises; the basic and joblib launchers ignore it.
    return (result.report.get("evaluate") or {}).get("objective")


REFRESH_OVERRIDE = "quantize.speed_refresh=true"


def version() -> str:
    """`--version`: this package's version, with the versions of what runs it (Hydra's flag, listed by --help,
    shows Hydra's own)."""
    import hydra
    import torch

    from lowbit_pipe.version import __version__

    return f"lowbit_pipe {__version__} (Hydra {hydra.__version__}, torch {torch.__version__})"


def main() -> None:
    if "--version" in sys.argv[1:]:
        print(version())
        sys.exit(0)
    # --refresh: time the speed table of a quantize.target run again (the recipe key, spelled as a flag).
    sys.argv = [REFRESH_OVERRIDE if a == "--refresh" else a for a in sys.argv]
    # Refuse a bad recipe, or inputs that cannot work, in one line before Hydra creates any run dir.
    try:
        flags, overrides = split_cli(sys.argv[1:])
        if not (flags.help or flags.hydra_help or flags.shell_completion):
            check_extras(overrides)
            sys.argv = sys.argv[:1] + recipe_file_args(sys.argv[1:])
            for recipe in cli_recipes(recipe_file_args(overrides)):
                preflight(recipe)
    except LowbitError as err:
        print(f"lowbit_pipe: {err}", file=sys.stderr)
        sys.exit(2)
    _main()


if __name__ == "__main__":
    main()
