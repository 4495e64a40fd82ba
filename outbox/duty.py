"""Periodic duties as named objects: a name, ``run_once()``, and the interval in one place.

Every long-running loop of the toolkit does more than its main work: the relay reconciles
orphaned intents, checks Redis, deletes published rows and vacuums; a consumer reports its
lag, purges its inbox and keeps its heartbeat; a worker recovers expired leases and
reconciles receipts. Each of those is a :class:`Duty` (or, where the loop decides inline, an
:class:`Interval`), so when it runs is said once, with its name, instead of a ``_last_x``
float and a sentinel (``-1e9``, ``-inf``, ``0``) per loop.

- :class:`Interval`: when something periodic is next due, on a monotonic clock. ``due(now)``,
  ``done(now)`` (the next one ``seconds`` later, or ``again_in``), ``make_due()`` (at once:
  a rebalance asks for a reconciliation, a failed claim for a sweep).
- :class:`Duty`: an :class:`Interval` with the function it runs. ``maybe_run(now)`` runs a
  round when one is due. The round is booked before it runs: a round that raises waits one
  interval, as :class:`outbox.retention.RetentionDuty`'s do (``retry_failed=True``: it is due
  again at once). ``again_in(result)`` may bring the next round forward (0: at once, a full
  batch says there is more to do).

Background duties that must never block their loop have their own classes with the same
face: :class:`outbox.retention.RetentionDuty` and :class:`outbox.maintenance.PeriodicVacuum`.
Their windows and intervals are explained in ``docs/explanation/retention.md``.

``now`` is the caller's monotonic clock where it has one (a loop that measured its cycle's
start books its duties at that instant); without it the duty reads its own ``clock``.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from typing import Generic, Literal, ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")

First = Literal["now", "later"]
"""When the first round is due: at once (``"now"``), or one interval after the duty is made
(``"later"``: a process that starts and stops at once does none)."""


class Interval:
    """When something periodic is next due: ``seconds`` (monotonic) after the last time it
    was :meth:`done`. ``seconds`` may be a function, read at every check (a worker whose
    config is replaced after it was made). ``first``: due at once, or one interval after
    construction."""

    def __init__(
        self,
        seconds: float | Callable[[], float],
        *,
        first: First = "now",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seconds = seconds
        self._clock = clock
        self.last = -math.inf if first == "now" else clock()  # when it last ran
        self._again_at: float | None = None  # done(again_in=) or make_due(): this instead

    @property
    def seconds(self) -> float:
        return float(self._seconds() if callable(self._seconds) else self._seconds)

    @property
    def next_at(self) -> float:
        """When it is next due (monotonic; -inf: at once)."""
        return self._again_at if self._again_at is not None else self.last + self.seconds

    def due(self, now: float | None = None) -> bool:
        """Whether it is due at ``now``."""
        return (self._clock() if now is None else now) >= self.next_at

    def done(self, now: float | None = None, *, again_in: float | None = None) -> None:
        """It ran at ``now``: next due ``seconds`` later (``again_in`` seconds, if given)."""
        self.last = self._clock() if now is None else now
        self._again_at = None if again_in is None else self.last + again_in

    def make_due(self) -> None:
        """Due at once, whatever the interval says."""
        self._again_at = -math.inf

    def remaining(self, now: float | None = None) -> float:
        """Seconds until it is due (0 when it is)."""
        return max(0.0, self.next_at - (self._clock() if now is None else now))

    def __repr__(self) -> str:
        return f"Interval({self.seconds!r}, next_at={self.next_at!r})"


class Duty(Generic[T]):
    """A named periodic duty: ``run`` every ``seconds`` (see the module docstring).

    ``run_once()`` runs a round now, whatever the interval; ``maybe_run(now)`` runs one if
    due and returns whether it did; ``run_now(now)`` books the round and runs it (what
    ``maybe_run`` does when due), returning what the round returned.
    """

    def __init__(
        self,
        name: str,
        seconds: float | Callable[[], float],
        run: Callable[[], T],
        *,
        first: First = "now",
        retry_failed: bool = False,
        again_in: Callable[[T], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.interval = Interval(seconds, first=first, clock=clock)
        self._run = run
        self.retry_failed = retry_failed
        self._again_in = again_in

    def run_once(self) -> T:
        """One round now, in the calling thread."""
        return self._run()

    def due(self, now: float | None = None) -> bool:
        return self.interval.due(now)

    def make_due(self) -> None:
        """The next :meth:`maybe_run` runs a round, whatever the interval says."""
        self.interval.make_due()

    def run_now(self, now: float | None = None) -> T:
        """Book the round at ``now`` and run it. A round that raises waits one interval (or,
        with ``retry_failed``, is due again at once); ``again_in(result)``, when it says a
        number of seconds, brings the next round forward."""
        self.interval.done(now)
        try:
            result = self._run()
        except BaseException:
            if self.retry_failed:
                self.interval.make_due()
            raise
        if self._again_in is not None:
            sooner = self._again_in(result)
            if sooner is not None:
                self.interval.done(now, again_in=sooner)
        return result

    def maybe_run(self, now: float | None = None) -> bool:
        """A round if one is due at ``now``; whether one ran."""
        if not self.interval.due(now):
            return False
        self.run_now(now)
        return True

    def __repr__(self) -> str:
        return f"Duty({self.name!r}, {self.interval!r})"


def weakly(method: Callable[P, T]) -> Callable[P, T]:
    """A bound method that does not keep its object alive. An object whose parts (its duties,
    its helpers) hold its own bound methods is a reference cycle: dropped by its user, it
    lives on until the cyclic garbage collector runs, with whatever it holds (a relay: its
    partition locks, so a new relay in the same process claims nothing until then)."""
    ref = weakref.WeakMethod(method)
    name = method.__qualname__  # not ``method``: the closure would hold it, and its object

    def call(*args: P.args, **kwargs: P.kwargs) -> T:
        bound = ref()
        if bound is None:
            raise ReferenceError(f"{name}: its object is gone")
        return bound(*args, **kwargs)

    return call


__all__ = ["Duty", "First", "Interval", "weakly"]
