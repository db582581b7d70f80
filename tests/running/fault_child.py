"""A child process for the fault tests: a run of lowbit_pipe stopped at a chosen point.

    python tests/running/fault_child.py kill POINT RUN_DIR OVERRIDE...      SIGKILL itself at POINT of the run's writes
                                                                     (`recipe=NAME` among them: that recipe)
    python tests/running/fault_child.py signal SIG STAGE ARG...              send itself SIG (INT/TERM) as STAGE starts,
                                                                     then run the command line with ARG...
    python tests/running/fault_child.py diskfull TARGET                      write onto a (small, full) filesystem

POINT: `bytes:N` (once the output's writer has written N data bytes), `publish` (the output complete and synced,
just before its rename), `published` (just after the rename: the new file is whole). The hooks wrap the package's
functions in this process only (the test's own instrument; the package has no switch for them).
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _kill_at(point: str) -> None:
    from lowbit_pipe.files import checkpoint

    me = os.getpid()
    if point.startswith("bytes:"):
        limit = int(point.split(":", 1)[1])
        write = checkpoint.StreamingWriter.write

        def counting_write(self, key, tensor):
            write(self, key, tensor)
            if self.offset >= limit:
                self._file.flush()  # the bytes are in the file when the kill lands, as a real crash would leave them
                os.kill(me, signal.SIGKILL)

        checkpoint.StreamingWriter.write = counting_write
        return
    replace = os.replace

    def replacing(src, dst):
        output = ".tmp-" in os.path.basename(str(src)) and str(dst).endswith(".safetensors")  # not the report
        if output and point == "publish":
            os.kill(me, signal.SIGKILL)
        replace(src, dst)
        if output and point == "published":
            os.kill(me, signal.SIGKILL)

    os.replace = replacing


def kill(point: str, run_dir: str, overrides: list[str]) -> None:
    import lowbit_pipe

    _kill_at(point)
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "default")
    lowbit_pipe.run(recipe, [o for o in overrides if not o.startswith("recipe=")], run_dir=run_dir)
    print("not killed", file=sys.stderr)
    sys.exit(3)


def send_signal(sig: str, stage: str, args: list[str]) -> None:
    import lowbit_pipe.__main__ as cli
    from lowbit_pipe.__main__ import main
    from lowbit_pipe.stages import STAGES

    signum = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}[sig]
    sys.argv = ["lowbit_pipe", *args]
    if stage == "startup":  # inside Hydra's task, before any Runner
        to_recipe = cli.to_recipe

        def signalled_to_recipe(cfg):
            os.kill(os.getpid(), signum)
            return to_recipe(cfg)

        cli.to_recipe = signalled_to_recipe
        main()
        return
    cls = STAGES[stage]
    run = cls.run

    def signalled(self, ctx):
        os.kill(os.getpid(), signum)  # Python runs the handler at the next bytecode: the stage is cut at its start
        return run(self, ctx)

    cls.run = signalled
    if stage == "teardown":  # the teardown stage is the runner's own function, not Stage.run
        from lowbit_pipe.running import runner

        teardown = runner.teardown

        def signalled_teardown(ctx):
            os.kill(os.getpid(), signum)
            return teardown(ctx)

        runner.teardown = signalled_teardown
    main()


def diskfull(target: str) -> None:
    """On a filesystem too small for it: the export fails with WriteError, the previous file stays, no temp file.
    Prints what it found as JSON (the filesystem lives only as long as this process's mount namespace)."""
    import torch

    from lowbit_pipe.errors import WriteError
    from lowbit_pipe.files.checkpoint import atomic_save

    previous = {"w": torch.arange(1000, dtype=torch.float32)}
    atomic_save(previous, target)
    before = open(target, "rb").read()  # noqa: SIM115
    big = {"w": torch.zeros(1 << 20, dtype=torch.float32)}  # 4 MiB, on a 2 MiB filesystem
    try:
        atomic_save(big, target)
        error = None
    except WriteError as err:
        error = str(err)
    folder = os.path.dirname(target)
    print(json.dumps({"error": error, "unchanged": open(target, "rb").read() == before,  # noqa: SIM115
                      "files": sorted(os.listdir(folder))}))


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "kill":
        kill(rest[0], rest[1], rest[2:])
    elif mode == "signal":
        send_signal(rest[0], rest[1], rest[2:])
    elif mode == "diskfull":
        diskfull(rest[0])
    else:
        sys.exit(f"unknown mode {mode}")
