"""Progress display for long stages (rich), off when not on a terminal."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], label: str, *, enabled: bool = True) -> Iterator[T]:
    items = list(items)
    if not enabled or not sys.stderr.isatty() or len(items) < 8:
        yield from items
        return
    from rich.progress import track

    yield from track(items, description=label, transient=True, console=None)
