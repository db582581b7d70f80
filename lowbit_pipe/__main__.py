"""CLI: `python -m lowbit_pipe [recipe=NAME|PATH.yaml] [key=value ...] [-m sweeps]`. A thin layer over the Python API.

`recipe=<run dir>/recipe.yaml` reruns a finished run: same recipe, same seeds, same figures and export bytes.
Exit codes: 0 done; 1 a stage failed (the run dir holds report.json; in a sweep, once every job has run);
2 refused before any work (bad recipe, missing file, no such device: no run dir is created); 130 stopped by
SIGINT (Ctrl-C), 143 by SIGTERM (Slurm, `timeout`, `docker stop`): after teardown, with one line on stderr saying
where it stopped (lowbit_pipe.running.interrupts).
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from lowbit_pipe.config.compose import cli_recipes, recipe_file_args, register_schema, split_cli, to_recipe
from lowbit_pipe.config.preflight import check_extras, check_groups, check_run_dir, preflight
from lowbit_pipe.errors import LowbitError
from lowbit_pipe.paths import config_dir
from lowbit_pipe.progress import Console
from lowbit_pipe.running.interrupts import Interrupted, OrderlyStop, as_interrupted
from lowbit_pipe.running.runner import Runner

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
        console.say((result.run_dir / "summary.txt").read_text().rstrip("\n"))
    except LowbitError as err:
        print(f"{console.prefix}lowbit_pipe: {err}  (run dir: {run_dir})", file=sys.stderr)
        if sweep:  # the other jobs still run; lowbit_pipe.running.sweep_outcome exits 1 at the sweep's end
            return float("nan")
        sys.exit(1)
    except KeyboardInterrupt as err:  # SIGINT / SIGTERM: the run is torn down; a stop ends a sweep too
        stopped = as_interrupted(err, None)
        print(f"{console.prefix}lowbit_pipe: {stopped_line(stopped)} (run dir: {run_dir})", file=sys.stderr)
        sys.exit(stopped.exit_code)
    # The value a sweeper (Optuna) optimises; the basic and joblib launchers ignore it.
    return (result.report.get("evaluate") or {}).get("objective")


def stopped_line(stopped: Interrupted, *, sweep: bool = False) -> str:
    """One line: which signal stopped the run, in which stage, whether teardown is proven, what the export is.
    `sweep`: the signal reached the sweep's own process outside any job of it (a launcher that runs jobs in other
    processes, e.g. hydra/launcher=gpus, passes it on to them), so jobs may have run and written."""
    report = getattr(stopped, "run_report", None)
    if report is None and sweep:
        return (f"stopped by {stopped.signal_name} during the sweep; jobs that had started were stopped and torn "
                "down in their own processes (each run dir's report.json says how far it got)")
    if report is None:
        return f"stopped by {stopped.signal_name} before the run started; nothing was written"
    teardown = report["stages"].get("teardown") or {}
    if "error" in teardown:
        torn = "teardown FAILED (see report.json)"
    elif teardown.get("proven") and not teardown.get("unfreed") and not teardown.get("retained_bytes"):
        torn = "torn down (proven)"
    else:
        torn = "torn down, NOT proven clean (see report.json)"
    export = report.get("export") or {}
    written = f"export complete: {export['path']}" if export.get("path") else "no export written"
    return f"stopped by {stopped.signal_name} during stage '{report['interrupted']['stage']}'; {torn}; {written}"


REFRESH_OVERRIDE = "quantize.speed_refresh=true"
# Lets a recipe file call OmegaConf resolvers (${oc.env:...}); recipe text is data otherwise (lowbit_pipe.config.untrusted).
ALLOW_RESOLVERS = "--allow-resolvers"


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
    allow_resolvers = ALLOW_RESOLVERS in sys.argv[1:]
    sys.argv = [a for a in sys.argv if a != ALLOW_RESOLVERS]
    # SIGINT / SIGTERM before a run starts (imports, Hydra's start): the same exit codes and one line. Each run
    # installs its own handlers over these (the stage it is in), and puts these back when it ends.
    stop = OrderlyStop("startup")
    stop.install()
    multirun = False
    try:
        # Refuse a bad recipe, or inputs that cannot work, in one line before Hydra creates any run dir.
        try:
            flags, overrides = split_cli(sys.argv[1:])
            multirun = flags.multirun
            if not (flags.help or flags.hydra_help or flags.shell_completion):
                check_extras(overrides)
                check_groups(overrides)
                sys.argv = sys.argv[:1] + recipe_file_args(sys.argv[1:], allow_resolvers=allow_resolvers)
                overrides = recipe_file_args(overrides, allow_resolvers=allow_resolvers)
                for recipe in cli_recipes(overrides, allow_resolvers=allow_resolvers):
                    preflight(recipe)
                if not (flags.cfg or flags.info):  # those print, and make no run dir
                    check_run_dir(overrides, multirun=flags.multirun)
        except LowbitError as err:
            print(f"lowbit_pipe: {err}", file=sys.stderr)
            sys.exit(2)
        _main()
    except KeyboardInterrupt as err:  # not inside a run (those are answered by _main, with their run dir)
        stopped = as_interrupted(err, None)
        print(f"lowbit_pipe: {stopped_line(stopped, sweep=multirun)}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    finally:
        stop.restore()


if __name__ == "__main__":
    main()
