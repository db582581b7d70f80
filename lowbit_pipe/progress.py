"""What a run tells its user while it works: messages, one-line warnings and progress.

On a terminal, progress is a rich bar that disappears when done; elsewhere (a log file, a sweep
job's output) it is a plain line (`evaluate: 12/40`) every `interval` seconds while a loop runs, and a
last one when it ends, so a loop done in a blink writes nothing. In a sweep every line carries the
job number (`[job 3] `), so interleaved jobs stay readable.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, TextIO, TypeVar

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
        stream = self.err or sys.stderr
        if len(items) < minimum:
            yield from items
            return
        if stream.isatty():
            from rich.console import Console as RichConsole
            from rich.progress import track

            yield from track(items, description=f"{self.prefix}{label}", transient=True,
                             console=RichConsole(file=stream))
            return
        n, last, shown = len(items), time.monotonic(), False
        for i, item in enumerate(items, 1):
            yield item
            now = time.monotonic()
            if now - last >= self.interval or (shown and i == n):
                print(f"{self.prefix}{label}: {i}/{n}", file=stream, flush=True)
                last, shown = now, True


def progress(items: Iterable[T], label: str, *, enabled: bool = True, console: Console | None = None) -> Iterator[T]:
    """`Console.progress` for callers without a run's console (enabled=False: plain iteration)."""
    if not enabled:
        yield from items
        return
    yield from (console or Console()).progress(items, label)
