"""What every child process of the ComfyUI tests does around its own checks: read the job JSON, import diffusers'
classes before ComfyUI's CPU set-up stubs torchvision (diffusers reads torchvision's version on import), set
ComfyUI up from the job's folder (its base directory, where it writes input/ and output/, in the child's own
folder), and write everything, an error and its traceback included, to the result JSON:
the parent asserts on that file."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any, Callable


def run_child(argv: list[str], body: Callable[[dict[str, Any], dict[str, Any]], None],
              archs: tuple[str, ...] = ("krea2",), result: dict[str, Any] | None = None) -> int:
    """`python child.py job.json result.json`: body(job, result) fills `result`."""
    job = json.loads(Path(argv[0]).read_text())
    result = {} if result is None else result
    try:
        from comfy_check import _comfy_cpu_setup

        from lowbit_pipe.arch import get_arch

        for arch_id in archs:
            get_arch(arch_id).linear_names_set  # noqa: B018 - imports the arch's diffusers classes
        # ComfyUI's base directory in this child's own folder (its cwd): the shared ComfyUI tree stays read-only
        _comfy_cpu_setup(Path(job["comfyui"]), Path.cwd() / "comfy_base")
        body(job, result)
    except BaseException as err:  # noqa: BLE001 - everything goes to the JSON, the parent asserts on it
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()[-8000:]
    Path(argv[1]).write_text(json.dumps(result, indent=1, default=str))
    return 0


def lora_name(path: str) -> str:
    """ComfyUI's name for the LoRA file at `path` (the LoRA node reads only names of ComfyUI's "loras" list): a copy
    under a name unique to that path, in a folder that joins the list, as a user's models/loras would be."""
    import hashlib
    import shutil

    import folder_paths

    folder = Path(path).resolve().parent / "_comfy_loras"
    folder.mkdir(exist_ok=True)
    folder_paths.add_model_folder_path("loras", str(folder))
    name = f"{hashlib.sha1(str(Path(path).resolve()).encode()).hexdigest()[:10]}_{Path(path).name}"
    shutil.copyfile(path, folder / name)
    folder_paths.filename_list_cache.pop("loras", None)  # ComfyUI caches the list; the file is new
    return name


def example_sampler(model: Any) -> Callable[[Any], Any]:
    """`sample(m)`: what ComfyUI's KSampler node runs (nodes.common_ksampler, less its previews) on `m`, 2 Euler steps,
    cfg 1, seed 1, on the pack's example inputs for `model` (64 x 64, 8 text tokens)."""
    import comfy.sample

    from lowbit_pipe.comfy.nodes import LowbitExampleInputs

    cond, latent = LowbitExampleInputs().make(model, 64, 64, 8, 1, 0)

    def sample(m: Any) -> Any:
        image = comfy.sample.fix_empty_latent_channels(m, latent["samples"])
        noise = comfy.sample.prepare_noise(image, 1)
        return comfy.sample.sample(m, noise, 2, 1.0, "euler", "simple", cond, cond, image, disable_pbar=True,
                                   seed=1).float()

    return sample
