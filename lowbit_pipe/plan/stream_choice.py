"""model.stream: whether a run streams model.path file to file (lowbit_pipe.files.stream) or loads the model, and why.

`stream_blockers` lists what in a recipe needs the model loaded (validate refuses model.stream=true over any);
`decide_stream` is model.stream=auto's decision, made by the runner before any stage and reported on the plan
line and in report.json `stream`. Plain data: imports no stage (stages.load imports this).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit_pipe.errors import RecipeError
from lowbit_pipe.recipe import Recipe

STREAM_STAGES = ("load", "detect", "quantize", "export", "teardown")
STREAM_MODES = {True: "true", False: "false", None: "auto", "auto": "auto", "true": "true", "false": "false"}
# Why each stage that is not in STREAM_STAGES needs the model loaded.
_LOADED_STAGES = {"evaluate": "runs the float and the quantized model", "lora": "attaches LoRA branches to the "
                  "loaded layers", "compile": "compiles the loaded model"}


def stream_mode(value: object) -> str:
    """model.stream as "auto", "true" or "false" (null is auto)."""
    key = value.lower() if isinstance(value, str) else value
    mode = STREAM_MODES.get(key) if isinstance(value, (bool, str)) or value is None else None
    if mode is None:
        raise RecipeError("model.stream", f"must be true, false or auto, got {value!r}")
    return mode


def stream_blockers(recipe: Recipe) -> list[tuple[str, str]]:
    """(recipe key, why) for each thing in the recipe that needs the model loaded; [] when it can stream.

    Streaming has no model in memory and runs no forward, and writes the very file the loading path writes:
    whatever would make the two differ is here too. Where the model comes from (model.path, a model passed in,
    a quantized file) is decided apart: `Runner` and the load stage."""
    out: list[tuple[str, str]] = []
    for name in recipe.pipeline:
        if name not in STREAM_STAGES:
            out.append(("pipeline", f"stage '{name}' {_LOADED_STAGES.get(name, 'needs the model')}"))
    if "export" not in recipe.pipeline:
        out.append(("pipeline", "there is no 'export' stage (a stream only writes an export)"))
    if "detect" not in recipe.pipeline:  # the loaded model then exports as a plain module, diffusers names
        out.append(("pipeline", "there is no 'detect' stage (without it a loaded model exports a plain module's "
                                "names and plan; a stream writes the file's architecture)"))
    q = recipe.quantize
    if q.budget_bytes is not None or q.budget_ratio is not None:
        key = "quantize.budget_bytes" if q.budget_bytes is not None else "quantize.budget_ratio"
        out.append((key, "a byte budget calibrates on forwards"))
    if any(getattr(q.target, k) is not None for k in ("speedup", "bytes", "ratio", "error")):
        out.append(("quantize.target", "a target calibrates and times forwards of the loaded model"))
    if q.gptq.enabled:
        out.append(("quantize.gptq.enabled", "GPTQ calibrates on forwards of the loaded model"))
    choices = [("quantize.default", q.default), ("quantize.sensitive", q.sensitive), ("quantize.fallback", q.fallback)]
    choices += [(f"quantize.rules[{i}]", r) for i, r in enumerate(q.rules)]
    for path, choice in choices:
        if choice is not None and choice.activations == "static":
            out.append((f"{path}.activations", "static scales are calibrated on forwards"))
    if recipe.export.shard_bytes is not None:
        out.append(("export.shard_bytes", "a stream writes one file, not shards"))
    if recipe.model.arch == "generic":
        out.append(("model.arch", "'generic' exports a plain module's names; a stream writes the file's architecture"))
    return out


@dataclass(frozen=True)
class StreamChoice:
    """Whether a run streams model.path file to file or loads the model, and why (report.json `stream`)."""

    mode: str  # model.stream as given: "auto", "true" or "false"
    stream: bool
    reason: str
    blockers: tuple[tuple[str, str], ...] = ()  # (recipe key, why) of what needs the model loaded

    def as_dict(self) -> dict:
        out = {"mode": self.mode, "streamed": self.stream, "reason": self.reason}
        if self.blockers:
            out["blocked_by"] = [{"key": k, "why": w} for k, w in self.blockers]
        return out

    def line(self) -> str:
        """The plan line's words: `streamed file to file (model.stream=auto: ...)`."""
        return f"{'streamed file to file' if self.stream else 'model loaded whole'} (model.stream={self.mode}: {self.reason})"


def _blocker_text(key: str, why: str) -> str:
    return why if key == "pipeline" else f"{key}: {why}"


def decide_stream(recipe: Recipe, *, model_given: bool = False, hands_back: bool = False) -> StreamChoice:
    """model.stream=auto: stream iff the model comes from model.path, no stage or option needs it loaded, and
    the caller does not get the model back (`hands_back`: lowbit_pipe.run returns result.model unless the
    pipeline ends in teardown; the CLI returns nothing). true / false are the recipe's word (validate refused
    a true that cannot stream). The load stage may still load a file streaming cannot read (quantized layers)."""
    mode = stream_mode(recipe.model.stream)
    if mode != "auto":
        return StreamChoice(mode, mode == "true", "set in the recipe")
    if model_given:
        return StreamChoice(mode, False, "a model object was passed in", (("model", "passed in, loaded already"),))
    if recipe.model.path is None:
        return StreamChoice(mode, False, "no model.path (the embedded tiny model is built in memory)",
                            (("model.path", "not set"),))
    blockers = tuple(stream_blockers(recipe))
    if blockers:
        more = f" (+{len(blockers) - 1} more in report.json)" if len(blockers) > 1 else ""
        return StreamChoice(mode, False, _blocker_text(*blockers[0]) + more, blockers)
    if hands_back and "teardown" not in recipe.pipeline:
        why = ("lowbit_pipe.run hands the quantized model back as result.model (end the pipeline with teardown, "
               "or set model.stream=true, to stream)")
        return StreamChoice(mode, False, why, (("pipeline", why),))
    return StreamChoice(mode, True, "no stage or option needs the model loaded")
