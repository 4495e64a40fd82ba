"""How long-running parts start and stop: a stop flag set by SIGTERM/SIGINT or ``stop()``,
and the fresh name each process incarnation takes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import uuid
from types import FrameType

log = logging.getLogger("outbox")

_interrupted = threading.Event()
"""Set when a SIGINT (Ctrl-C) asked a loop to stop: the command still drains, then exits
130 like any program interrupted by Ctrl-C (``outbox.cli.run_main``); SIGTERM exits 0."""


def interrupted() -> bool:
    """True once a Ctrl-C asked this process's loop to stop (since the last ``reset``)."""
    return _interrupted.is_set()


def reset_interrupted() -> None:
    """Forget an earlier Ctrl-C (a command run again in the same process: the tests)."""
    _interrupted.clear()


def incarnation_name(prefix: str) -> str:
    """A fresh name for this process: host, pid and random, never reused by a restart."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GracefulStop:
    """A stop flag set by SIGTERM/SIGINT (or ``stop()``), for loops that drain then exit.

    The first signal asks the loop to finish the batch in hand; a second SIGINT raises
    KeyboardInterrupt for a user who really wants out. A SIGINT is remembered
    (:func:`interrupted`), so a command stopped by Ctrl-C exits 130 once it has drained.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._signals = 0

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if signum == signal.SIGINT:
            _interrupted.set()
            if self._signals > 1:
                raise KeyboardInterrupt
        log.info("stop requested", extra={"fields": {"signal": signal.Signals(signum).name}})
        self.event.set()

    def stop(self) -> None:
        self.event.set()

    @property
    def stopped(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if stop was requested meanwhile."""
        return self.event.wait(max(0.0, seconds))
