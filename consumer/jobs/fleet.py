"""The fleet-wide side of the provider limits: :class:`FleetTable`.

What every worker on one database shares about a provider, in its row of
``outbox_provider_limits``: its pause and its rate reservations, every time from the
database clock so that every worker agrees (the statements: ``consumer.jobs.driver_fleet``).
This process remembers a pause it has seen until it ends, and reads no more meanwhile.
``consumer.jobs.limits.FleetLimits`` adds this process's gates, one per provider; its module
docstring has the whole design.
"""

from __future__ import annotations

import threading
import time

from consumer.jobs.store import Store

__all__ = ["FleetTable"]


class FleetTable:
    """The fleet-wide side (``outbox_provider_limits``): pauses and rate reservations, every
    time from the database clock so that every worker agrees."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._paused: dict[str, tuple[float, float]] = {}  # provider -> (until, local deadline)
        self._lock = threading.Lock()
        self._known: set[str] = set()

    def _ensure(self, provider: str) -> None:
        # The provider's row, committed before any statement that needs it: known to this
        # process only once it is visible to every other transaction (a thread that read
        # it as known while another's insert was not yet committed found no row).
        if provider in self._known:
            return
        with self.store.driver.begin() as conn:
            self.store.driver.provider_insert(conn, provider)
        self._known.add(provider)

    def _remember_pause(self, provider: str, until: float, clock: float) -> None:
        with self._lock:
            self._paused[provider] = (until, time.monotonic() + (until - clock))

    def paused_locally(self, provider: str) -> float | None:
        """``paused_until`` as this process learnt it, while it lasts (no round trip)."""
        clock = self.store.driver.clock
        with self._lock:
            known = self._paused.get(provider)
            if known is None:
                return None
            if (clock() >= known[0]) if clock is not None else time.monotonic() >= known[1]:
                del self._paused[provider]
                return None
            return known[0]

    def paused_until(self, provider: str) -> float | None:
        """The end of the provider's pause if it is paused now (database clock), else None."""
        local = self.paused_locally(provider)
        if local is not None:
            return local
        found = self.store.driver.provider_pause(provider)  # read before every call
        if found is None or found[0] <= found[1]:
            return None
        self._remember_pause(provider, *found)
        return found[0]

    def pause(self, provider: str, seconds: float) -> float:
        """Pause the provider for every worker for ``seconds`` from now (a pause already
        reaching further stays); returns its end (database clock)."""
        self._ensure(provider)
        # One statement, its commit not waiting for a WAL flush (a crash loses a pause, no
        # more): every call whose intent statement starts after this commit is refused, so
        # the time from the statement to its commit is the time calls may still slip past.
        with self.store.driver.begin() as conn:
            until, clock = self.store.driver.provider_pause_extend(conn, provider, seconds)
        self._remember_pause(provider, until, clock)
        return until

    def unpause(self, provider: str) -> None:
        """Lift a provider's pause now (an operator who knows better than its Retry-After).
        Processes that have seen the pause keep to it until its end (they do not read it
        again meanwhile); this one forgets it at once."""
        with self.store.driver.begin() as conn:
            self.store.driver.provider_pause_lift(conn, provider)
        with self._lock:
            self._paused.pop(provider, None)

    def reserve(self, provider: str, spacing: float, max_wait: float) -> tuple[float, float | None]:
        """Reserve the provider's next call start: ``(seconds to wait, None)``, or ``(seconds
        until then, until)`` when the provider is paused or its reservations reach past
        ``max_wait`` (nothing reserved; try again at ``until``, database clock). One UPDATE
        when it succeeds."""
        self._ensure(provider)
        driver = self.store.driver
        with driver.begin() as conn:
            row = driver.provider_start_reserve(conn, provider, spacing, max_wait)
            if row is not None:
                start = row[0] - spacing
                return max(0.0, start - row[1]), None
            paused, booked, clock = driver.provider_limits_get(conn, provider)
        if paused > clock:
            self._remember_pause(provider, paused, clock)
        until = max(paused, booked - max_wait, clock + spacing)
        return until - clock, until

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every provider's row: ``{"paused_for": seconds, "booked_ahead": seconds, "pauses"}``."""
        with self.store.driver.connect() as conn:
            rows = self.store.driver.provider_limits_list(conn)
        return {
            str(r[0]): {
                "paused_for": max(0.0, float(r[1]) - float(r[4])),
                "booked_ahead": max(0.0, float(r[2]) - float(r[4])),
                "pauses": float(r[3]),
            }
            for r in rows
        }
