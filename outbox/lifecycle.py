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


def incarnation_name(prefix: str) -> str:
    """A fresh name for this process: host, pid and random, never reused by a restart."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class GracefulStop:
    """A stop flag set by SIGTERM/SIGINT (or ``stop()``), for loops that drain then exit.

    The first signal asks the loop to finish the batch in hand; a second SIGINT raises
    KeyboardInterrupt for a user who really wants out.
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
        if signum == signal.SIGINT and self._signals > 1:
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
