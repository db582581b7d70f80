"""SIGINT (Ctrl-C) and SIGTERM (what Slurm, `timeout`, `docker stop` and systemd send) turned into an orderly stop.

While an `OrderlyStop` is installed, the first of these signals raises `Interrupted` in the main thread, where
Python runs signal handlers: between two bytecodes, never inside a C call (a tensor write, a GEMM), so no file or
tensor is left half-changed by the raise itself. The runner catches it like a failed stage: it tears the run down
(the ledger's undo, proven), records `interrupted: {stage, signal}` in report.json, and every write that was under
way removes its temporary file (lowbit_pipe.files.tempfiles), so no partial export is published. Inside `deferred()`
(the teardown stage, the last report write) a signal waits: it is raised by the next `raise_pending()`. Signals
after the first are recorded and change nothing: the stop already under way finishes its teardown.

The handlers are installed with their undo recorded (the previous handler of each signal), and `restore()` puts
those back and checks that it did (`signal.getsignal(sig) is previous`). Only the main thread can install signal
handlers: elsewhere (a ComfyUI worker thread) `install()` installs nothing and says so. A handler the host program
set itself (not Python's default, not another OrderlyStop) is left in place, and so is an ignored signal (a
background job started by a shell ignores SIGINT).

Exit codes of the command line: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a
process that a signal ended.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM stopped the run (a KeyboardInterrupt, so code that handles Ctrl-C handles this too, and
    `except Exception` does not swallow it)."""

    def __init__(self, signum: int, stage: str | None):
        self.signum = int(signum)
        self.stage = stage
        super().__init__(f"{self.signal_name} during {stage or 'startup'}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def as_interrupted(err: KeyboardInterrupt, stage: str | None) -> Interrupted:
    """`err` as an Interrupted (a plain KeyboardInterrupt, raised by Python's own SIGINT handler: SIGINT)."""
    return err if isinstance(err, Interrupted) else Interrupted(signal.SIGINT, stage)


def _python_default(signum: int, handler: Any) -> bool:
    """True when `handler` is what Python starts with (SIGINT: default_int_handler; others: SIG_DFL)."""
    return handler is (signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


@dataclass
class OrderlyStop:
    stage: str = "startup"  # where the run is: the runner sets it to each stage's name
    received: list[int] = field(default_factory=list)  # every signal that arrived while installed
    _previous: dict[int, Any] = field(default_factory=dict)  # signal -> the handler to restore (the recorded undo)
    _deferring: int = 0
    _raised: bool = False

    @property
    def handled(self) -> list[str]:
        return [signal.Signals(s).name for s in self._previous]

    def install(self) -> list[str]:
        """Install the handlers (main thread only; see the module docstring for what is left alone); returns the
        names of the signals now handled."""
        if threading.current_thread() is not threading.main_thread():
            return []
        for signum in SIGNALS:
            current = signal.getsignal(signum)
            ours = isinstance(getattr(current, "__self__", None), OrderlyStop)
            if signum in self._previous or not (ours or _python_default(signum, current)):
                continue
            signal.signal(signum, self._handle)
            self._previous[signum] = current
        return self.handled

    def restore(self) -> bool:
        """Put the previous handlers back; True when each is verifiably back. Idempotent."""
        ok = True
        for signum, previous in list(self._previous.items()):
            signal.signal(signum, previous)
            ok = ok and signal.getsignal(signum) is previous
            del self._previous[signum]
        return ok

    def __enter__(self) -> OrderlyStop:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self._deferring or self._raised:
            return
        self._raised = True
        raise Interrupted(signum, self.stage)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A section a signal must not cut (teardown, the final report): one arriving here waits for the next
        `raise_pending()`."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1

    @property
    def pending(self) -> Interrupted | None:
        """The stop a signal asked for and that no `Interrupted` has carried out yet."""
        if self._raised or not self.received:
            return None
        return Interrupted(self.received[0], self.stage)

    def raise_pending(self) -> None:
        """A safe point: raise the stop a signal asked for during a deferred section, if any."""
        stop = self.pending
        if stop is not None:
            self._raised = True
            raise stop

    def as_dict(self) -> dict[str, Any]:
        return {"handled": self.handled, "received": [signal.Signals(s).name for s in self.received]}
