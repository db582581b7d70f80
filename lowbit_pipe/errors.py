"""Error types. Every message names the file, key, layer or recipe path at fault."""

from __future__ import annotations


class LowbitError(Exception):
    """Base of every error lowbit_pipe raises on purpose."""


class RecipeError(LowbitError):
    """A recipe is invalid: unknown key, wrong type, unknown format or stage name."""

    def __init__(self, path: str, problem: str):
        self.path = path
        self.problem = problem
        super().__init__(f"recipe error at '{path}': {problem}")


class FormatError(LowbitError):
    """A tensor or record does not fit its format (shape, dtype, JSON, values)."""


class CheckpointError(LowbitError):
    """A weights file is unreadable or inconsistent; names the file and the key."""

    def __init__(self, file: str, problem: str, key: str | None = None):
        self.file = file
        self.key = key
        where = f"{file}" + (f" [{key}]" if key else "")
        super().__init__(f"{where}: {problem}")


class StageError(LowbitError):
    """A stage failed; wraps the cause and names the stage."""

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        self.cause = cause
        super().__init__(f"stage '{stage}' failed: {type(cause).__name__}: {cause}")


class LoraError(LowbitError):
    """A LoRA file does not fit the model, or its adapter config cannot be read or applied: names the file, the
    key or config field, and the layer."""


class WriteError(LowbitError):
    """An output could not be written (disk full, no permission); names the path. The target is untouched and the
    temporary file removed."""

    def __init__(self, path: str, problem: str):
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class MalformedKeysError(LowbitError, ValueError):
    """A state dict's key names cannot be a model's: a block index no model reaches (a billion layers), names
    the key."""

    def __init__(self, key: str, problem: str):
        self.key = key
        super().__init__(f"[{key}]: {problem}")
