"""One job's process: `python -m hydra_plugins.lowbit_gpu_launcher.worker COMMON JOB RESULT` (started by `_core`,
with CUDA_VISIBLE_DEVICES already set to the job's GPU, so torch sees exactly that device as cuda:0).

It loads Hydra's context, the task function and the ConfigStore state (COMMON) and the job's config (JOB), runs the
job as the Ray launcher's workers do (`execute_job`: Hydra's `run_job`, a failing `sys.exit` recorded as a failed
job), and leaves the JobReturn at RESULT (written to a temporary name, then renamed: the driver never reads half).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def portable(returned: Any, pickle: Any) -> bytes:
    """`returned` pickled; a return value or exception that cannot be pickled is replaced by its text."""
    try:
        return pickle.dumps(returned)
    except Exception as err:  # noqa: BLE001 - any pickling failure: keep the job's status, carry its value as text
        value = getattr(returned, "_return_value", None)
        returned._return_value = RuntimeError(f"{type(value).__name__}: {value} (not picklable: {err})")
        return pickle.dumps(returned)


def main(argv: list[str]) -> int:
    import cloudpickle

    common, job, result = (Path(a) for a in argv)
    hydra_context, task_function, singleton_state = cloudpickle.loads(common.read_bytes())
    sweep_config = cloudpickle.loads(job.read_bytes())
    from hydra_plugins.lowbit_ray_launcher._core import execute_job

    returned = execute_job(sweep_config, hydra_context, task_function, singleton_state)
    tmp = result.with_name(result.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(portable(returned, cloudpickle))
    tmp.replace(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
