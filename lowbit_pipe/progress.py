"""What a run tells its user while it works: messages, one-line warnings and progress.

On a terminal, progress is a rich bar that disappears when done; elsewhere (a log file, a sweep
job's output) it is a plain line (`evaluate: 12/40`) every `interval` seconds while a loop runs, and a
last one when it ends, so a loop done in a blink writes nothing. In a sweep every line carries the
job number (`[job 3] `), so interleaved jobs stay readable.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TextIO, TypeVar

T = TypeVar("T")


@dataclass
class Console:
    prefix: str = ""  # "[job 3] " in sweeps
    out: TextIO | None = None  # messages and the summary (None: sys.stdout at call time)
    err: TextIO | None = None  # warnings and progress (None: sys.stderr at call time)
    interval: float = 5.0  # seconds between plain progress lines
    warned: list[str] = field(default_factory=list)

    def say(self, message: str) -> None:
        stream = self.out or sys.stdout
        for line in message.splitlines() or [""]:
            print(f"{self.prefix}{line}", file=stream)
        stream.flush()

    def warn(self, message: str) -> None:
        """One line per warning, without a Python source line; each text once per run."""
        text = " ".join(str(message).split())
        if text in self.warned:
            return
        self.warned.append(text)
        print(f"{self.prefix}warning: {text}", file=self.err or sys.stderr)

    def progress(self, items: Iterable[T], label: str, *, minimum: int = 2) -> Iterator[T]:
        """Iterate `items`, showing progress when there are at least `minimum` of them."""
        items = list(items)
        if len(items) < minimum:
            yield from items
            return
        with self.task(label, len(items)) as task:
            for item in items:
                yield item
                task.advance()

    @contextlib.contextmanager
    def task(self, label: str, total: int) -> Iterator[Task]:
        """Progress of `total` units that the caller advances (`task.advance(n)`) from wherever the work is: a
        model forward inside a sampler, a tensor inside a writer. A bar on a terminal, plain lines in a log."""
        stream = self.err or sys.stderr
        if stream.isatty():
            from rich.console import Console as RichConsole
            from rich.progress import Progress

            with Progress(*Progress.get_default_columns(), transient=True, console=RichConsole(file=stream)) as bar:
                job = bar.add_task(f"{self.prefix}{label}", total=total)
                yield Task(label, total, lambda done: bar.update(job, completed=done))
            return
        task = Task(label, total, None)
        task.show = lambda done: self._line(task, done)
        task._last = time.monotonic()
        yield task
        if task._shown and task.done != task._printed:
            print(f"{self.prefix}{label}: {task.done}/{total}", file=stream, flush=True)

    def _line(self, task: Task, done: int) -> None:
        """A plain progress line every `interval` seconds (none for a task done in a blink)."""
        now = time.monotonic()
        if now - task._last >= self.interval or (task._shown and done == task.total):
            print(f"{self.prefix}{task.label}: {done}/{task.total}", file=self.err or sys.stderr, flush=True)
            task._last, task._shown, task._printed = now, True, done


@dataclass
class Task:
    """A progress counter (Console.task): `advance(n)` after each unit of work."""

    label: str
    total: int
    show: Callable[[int], None] | None
    done: int = 0
    _last: float = 0.0
    _shown: bool = False
    _printed: int = -1

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.show is not None:
            self.show(self.done)


def progress(items: Iterable[T], label: str, *, enabled: bool = True, console: Console | None = None) -> Iterator[T]:
    """`Console.progress` for callers without a run's console (enabled=False: plain iteration)."""
    if not enabled:
        yield from items
        return
    yield from (console or Console()).progress(items, label)
