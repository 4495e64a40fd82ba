"""The job driver's statements on the fleet's provider limits (``outbox_provider_limits``):
the provider's row, its pause and its rate reservations, every time from the database clock
so that every worker agrees. ``consumer.jobs.limits`` decides (when to pause, what a
reservation means); these run its statements. A mixin of
:class:`consumer.jobs.driver.JobDriver`; the pause read on every dispatch
(``provider_pause``, on a connection of its own) stays in ``driver_base``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Double, literal, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.sql import ColumnElement

from consumer.jobs.schema import provider_limits
from outbox.dialect import db_epoch, insert_or_ignore


class FleetStatements(ABC):
    """Provider limits: the row, the pause, the rate reservations, the snapshot."""

    clock: Callable[[], float] | None

    # -- where the databases differ ---------------------------------------------------------

    @abstractmethod
    def _statement_clock(self) -> ColumnElement[float]:
        """The database clock at the time the row is updated, not at the transaction's
        start: a reservation that waited on the row's lock behind another worker's must not
        start its call from a clock read before that wait (it would be late, then clump with
        the next)."""

    @abstractmethod
    def _greatest(self, a: Any, b: Any) -> ColumnElement[float]:
        """The greater of two values, as one scalar function."""

    @abstractmethod
    def _commit_unflushed(self, conn: Connection) -> None:
        """Let ``conn``'s transaction commit without waiting for its WAL flush: a pause or a
        reservation is not worth one (a crash loses a pause or a slot, no more)."""

    def _fleet_now(self) -> Any:
        """The database clock as SQL; a number when the store has a clock of its own
        (``Store(clock=...)``: a test's time, which pauses must follow too)."""
        clock = self.clock
        return db_epoch() if clock is None else literal(clock(), Double)

    def _update_now(self) -> Any:
        # A store's own clock (tests) wins over the statement's.
        return self._fleet_now() if self.clock is not None else self._statement_clock()

    # -- statements -------------------------------------------------------------------------

    def provider_insert(self, conn: Connection, provider: str) -> None:
        """The provider's row, unless it exists."""
        conn.execute(
            insert_or_ignore(provider_limits, ("provider",), conn.dialect.name).values(
                provider=provider
            )
        )

    def provider_pause_extend(
        self, conn: Connection, provider: str, seconds: float
    ) -> tuple[float, float]:
        """Pause the provider until ``seconds`` from now (a pause already reaching further
        stays) and count the pause: ``(paused_until, clock)``. Its commit does not wait for
        a WAL flush (:meth:`_commit_unflushed`)."""
        now = self._update_now()
        self._commit_unflushed(conn)
        row = conn.execute(
            update(provider_limits)
            .where(provider_limits.c.provider == provider)
            .values(
                paused_until=self._greatest(
                    provider_limits.c.paused_until, now + max(0.0, seconds)
                ),
                pauses=provider_limits.c.pauses + 1,
            )
            .returning(provider_limits.c.paused_until, now)
        ).one()
        return float(row[0]), float(row[1])

    def provider_pause_lift(self, conn: Connection, provider: str) -> None:
        """End the provider's pause now."""
        conn.execute(
            update(provider_limits)
            .where(provider_limits.c.provider == provider)
            .values(paused_until=0.0)
        )

    def provider_start_reserve(
        self, conn: Connection, provider: str, spacing: float, max_wait: float
    ) -> tuple[float, float] | None:
        """Book the provider's next call start, ``next_call_at = max(next_call_at, now) +
        spacing``, unless it is paused or its bookings reach past ``max_wait``: ``(the new
        next_call_at, clock)``, or None (nothing booked). Its commit does not wait for a WAL
        flush: a commit that waits on a busy disk would start the call late, out of step."""
        now = self._update_now()
        self._commit_unflushed(conn)
        row = conn.execute(
            update(provider_limits)
            .where(
                provider_limits.c.provider == provider,
                provider_limits.c.paused_until <= now,
                provider_limits.c.next_call_at <= now + max_wait,
            )
            .values(next_call_at=self._greatest(provider_limits.c.next_call_at, now) + spacing)
            .returning(provider_limits.c.next_call_at, now)
        ).first()
        return None if row is None else (float(row[0]), float(row[1]))

    def provider_limits_get(self, conn: Connection, provider: str) -> tuple[float, float, float]:
        """The provider's ``paused_until``, ``next_call_at`` and the clock."""
        held = conn.execute(
            select(
                provider_limits.c.paused_until, provider_limits.c.next_call_at, self._fleet_now()
            ).where(provider_limits.c.provider == provider)
        ).one()
        return float(held[0]), float(held[1]), float(held[2])

    def provider_limits_list(self, conn: Connection) -> Sequence[Any]:
        """Every provider's row: ``(provider, paused_until, next_call_at, pauses, clock)``
        (the database clock)."""
        return conn.execute(
            select(
                provider_limits.c.provider,
                provider_limits.c.paused_until,
                provider_limits.c.next_call_at,
                provider_limits.c.pauses,
                db_epoch(),
            )
        ).all()
