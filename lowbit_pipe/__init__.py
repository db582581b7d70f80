"""lowbit_pipe: quantize diffusion transformers to low-bit formats from one recipe.

Public API (the CLI is a thin layer over it):

    result = lowbit_pipe.run("krea2_nvfp4", overrides=["model.path=/w/krea2.safetensors"])
    result = lowbit_pipe.run("default", model=my_diffusers_transformer, run_dir="runs/x")
    stats  = lowbit_pipe.quantize(module, {"default": {"format": "int8"}})
"""

from __future__ import annotations

from lowbit_pipe.api import export, quantize, run, teardown
from lowbit_pipe.version import __version__

__all__ = ["__version__", "export", "quantize", "run", "teardown"]
