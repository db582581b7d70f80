"""`python -m lowbit_pipe --help`: what the tool does, example commands, and what a recipe can name
(recipes and models from the config groups; formats, rotations and architectures from the registries).

Served as Hydra's help template (the `hydra/help` group option `lowbit`, selected in conf/config.yaml).
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

EXAMPLES = """\
  python -m lowbit_pipe                                  # embedded tiny Krea 2, INT8 W8A8, CPU, seconds
  python -m lowbit_pipe recipe=krea2_nvfp4               # tiny Krea 2, NVFP4 + ConvRot, sensitive layers INT8
  python -m lowbit_pipe recipe=flux1_fp8                 # tiny FLUX.1, FP8
  python -m lowbit_pipe recipe=krea2_nvfp4 model.path=/models/krea2.safetensors model.dtype=bfloat16 model.device=cuda
  python -m lowbit_pipe recipe=krea2_auto_speed_tiny quantize.target.ratio=0.5   # formats chosen per layer for a target
                                                         # (target.speedup / bytes / ratio / error; docs/recipes.md)
  python -m lowbit_pipe -m quantize.default.format=int8,fp8,nvfp4   # a sweep: one run dir per job
  python -m lowbit_pipe attention.format=int8            # 8-bit attention (int8 Q·Kᵀ, fp8 P·V) on top
  python -m lowbit_pipe recipe=runs/<date>/<time>/recipe.yaml       # rerun a run from its run dir
  python -m lowbit_pipe --cfg job                        # print the composed recipe, run nothing"""


def help_template() -> str:
    from lowbit_pipe.arch import ARCHS
    from lowbit_pipe.attention.route import ATTENTION_FORMATS
    from lowbit_pipe.formats import FORMATS
    from lowbit_pipe.formats.base import ACT_GRANULARITIES, ACTIVATION_MODES, ROTATIONS

    formats = ", ".join(f"{n} ({f.comfy_name})" for n, f in sorted(FORMATS.items()))
    return f"""\
lowbit_pipe: quantize a diffusion transformer (Krea 2, FLUX, Qwen-Image, ...) to low-bit formats from one
YAML recipe, measure it against the float model, export a .safetensors file ComfyUI loads, tear it all down.

== Examples ==
{EXAMPLES}

== What a recipe can name ==
  formats:        {formats}
  rotations:      {", ".join(ROTATIONS)}
  activations:    {", ".join(ACTIVATION_MODES)}
  act_granularity: {", ".join(ACT_GRANULARITIES)} (dynamic activation scales per token, the default; per call:
                  nvfp4 only, stock ComfyUI's global scale, which ties a sample to its batch-mates)
  architectures:  {", ".join(sorted(ARCHS))}, generic
  attention:      {", ".join(ATTENTION_FORMATS)} (attention.format: bf16 keeps the model's own attention; int8 / fp8
                  are the Q·Kᵀ format of 8-bit attention, P·V in fp8; run time only)

== Recipes and models (group=option) ==
$APP_CONFIG_GROUPS
A recipe is also a YAML file: recipe=path/to/mine.yaml. A team's recipe folder joins with
hydra.searchpath=[file:///path/to/conf] (its recipe/*.yaml become recipe= options). Recipe files are data:
no _target_, no Hydra callbacks or logging, no YAML anchors, at most 64 KiB (docs/recipes.md, "Recipe files").

== Flags ==
$FLAGS_HELP
--version prints lowbit_pipe's version (with Hydra's and torch's).
--refresh times the speed table of a quantize.target run again (= quantize.speed_refresh=true).
--allow-resolvers lets recipe files you trust call OmegaConf resolvers (oc.env, oc.decode, ...).
Override any key of the recipe (quantize.default.format=fp8); the schema and every key are in
lowbit_pipe/recipe.py and docs/recipes.md. Exit codes: 0 done, 1 a stage failed, 2 refused before any work.
"""


def register_help() -> None:
    """Store the help template as the `hydra/help` option `lowbit` (idempotent)."""
    ConfigStore.instance().store(group="hydra/help", name="lowbit",
                                 node={"app_name": "lowbit_pipe", "header": "", "footer": "",
                                       "template": help_template()})
