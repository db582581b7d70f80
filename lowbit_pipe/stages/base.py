"""Stage contract."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from lowbit_pipe.stages.context import Context


class Stage:
    """One step of the pipeline. `run` mutates the Context and returns figures for report.json."""

    name: ClassVar[str]

    def run(self, ctx: Context) -> dict[str, Any]:
        raise NotImplementedError
