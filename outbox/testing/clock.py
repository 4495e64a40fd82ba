"""The pipeline's clock: real time plus what the test advanced."""

from __future__ import annotations

import math
import time

from outbox.errors import ConfigError


class Clock:
    """Unix seconds a test moves: ``clock()`` is the real time plus everything the test
    advanced. It only moves forward and never runs behind the database's clock (rows the
    database stamps itself, such as an event's ``created_at``, are never in its future), and
    code that reads ``time.time()`` itself (a handler planning a timer "three days from now")
    agrees with it before the test advances it.

    The pipeline hands it to the job store (``Store(clock=...)``: leases, backoffs, timers,
    operation intents' deadlines), to the relay (``run_once(now=...)``: its cycle's
    intervals; each cycle also moves the database-stamped backoffs and intent ages of
    pending outbox rows back by the advance),
    to consumers (``run_once(now=...)``: entries idle by this clock are claimed back), to
    workers (``run_once(now=...)``) and to the fake providers (a slow or late answer takes
    test time, not real time).
    """

    def __init__(self) -> None:
        self._offset = 0.0

    def __call__(self) -> float:
        return time.time() + self._offset

    def now(self) -> float:
        """The current time of the test, in unix seconds."""
        return self()

    @property
    def offset(self) -> float:
        """Seconds the test has advanced in all."""
        return self._offset

    def advance(
        self, seconds: float = 0.0, *, minutes: float = 0.0, hours: float = 0.0, days: float = 0.0
    ) -> float:
        """Move the clock forward (``clock.advance(days=3)``); returns the new time. Nothing
        waits: the next ``drain()`` sees the timers, leases, backoffs and deadlines that came
        due."""
        total = seconds + 60 * minutes + 3600 * hours + 86400 * days
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total < 0:
            raise ConfigError("seconds", f"the clock moves forward only, got {total!r}")
        self._offset += float(total)
        return self()

    def __repr__(self) -> str:
        return f"Clock(advanced={self._offset:g}s)"
