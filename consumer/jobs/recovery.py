"""Recovery: expired leases and the leases of dead workers back to READY, due timers.

Part of :class:`consumer.jobs.store.Store` (see its module docstring for the contract).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from consumer.errors import JobError
from consumer.jobs import cancels
from consumer.jobs.base import StoreBase
from consumer.jobs.checks import Time, valid_name, valid_time, valid_ttl
from consumer.jobs.rows import RecoveryResult
from consumer.jobs.schema import jobs
from consumer.jobs.states import LEASED, NEEDS_ATTENTION, READY, check_transition
from consumer.jobs.steps import settle_children, sweep
from outbox.validate import check_number


class Recovery(StoreBase):
    """Recover expired leases and due timers; worker liveness."""

    # -- recovery ------------------------------------------------------------------------

    def recover(self, *, now: Time | None = None, limit: int | None = None) -> RecoveryResult:
        """Return expired leases to READY (NEEDS_ATTENTION when ``max_attempts`` claims are
        spent) and wake waiting jobs whose timer is due. At most ``limit`` rows of each.

        Rows are locked with SKIP LOCKED (PostgreSQL) and re-checked against the epoch read,
        so a lease renewed or finished meanwhile is left alone: a live lease is never touched.
        """
        bound = self.config.recover_limit if limit is None else limit
        check_number("limit", bound, JobError, integer=True)
        when = valid_time("now", now)
        requeued = attention = woken = 0
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            expired = self.driver.job_expired_list(conn, clock, bound)
            requeued, attention = self._take_back(conn, expired, clock, None)
            dead = self._take_back_dead(conn, clock, bound)
            requeued += dead.requeued
            attention += dead.needs_attention
            due = self.driver.job_due_list(conn, clock, bound)
            for waiting in due:
                check_transition(str(waiting.id), waiting.state, READY)
                hit = self.driver.job_update_from(
                    conn,
                    jobs.c.id == waiting.id,
                    (waiting.state,),
                    {"state": READY, "wait_reason": None, "updated_at": clock},
                )
                if hit is not None:
                    self.driver.attempt_insert(
                        conn, waiting.id, None, None, "timer_fired", None, clock
                    )
                    woken += 1
            if requeued or woken:
                self.driver.job_ready_notify(conn)
            sweep(self.driver, conn, clock, bound)  # parents' ends not applied yet (steps)
        return RecoveryResult(requeued=requeued, needs_attention=attention, woken=woken)

    def recover_dead(self, *, now: Time | None = None, limit: int | None = None) -> RecoveryResult:
        """Return to READY (NEEDS_ATTENTION when ``max_attempts`` claims are spent) the leases
        of workers whose liveness row expired (:meth:`worker_alive`), without waiting for the
        leases' own expiry. A worker without a row is left to its leases' expiry. Fenced like
        :meth:`recover`: the next claim increments the epoch and the dead worker's late moves
        get ``Conflict``. Cheap when nobody died: one read of the small liveness table."""
        bound = self.config.recover_limit if limit is None else limit
        check_number("limit", bound, JobError, integer=True)
        when = valid_time("now", now)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            return self._take_back_dead(conn, clock, bound)

    def _take_back_dead(self, conn: Connection, clock: float, bound: int) -> RecoveryResult:
        names = self.driver.worker_dead_list(conn, clock)
        if not names:
            return RecoveryResult(requeued=0, needs_attention=0, woken=0)
        rows = self.driver.job_owned_list(conn, names, bound)
        requeued, attention = self._take_back(conn, rows, clock, "lease owner stopped (liveness)")
        self.driver.worker_forget_dead(conn, names, clock)
        if requeued:
            self.driver.job_ready_notify(conn)
        return RecoveryResult(requeued=requeued, needs_attention=attention, woken=0)

    def _take_back(
        self, conn: Connection, rows: Sequence[Any], clock: float, dead_reason: str | None
    ) -> tuple[int, int]:
        """Expired leases (``dead_reason`` None) or leases of dead owners back to READY or
        NEEDS_ATTENTION (CANCELLED when a cancel was requested: ``consumer.jobs.cancels``),
        each fenced on the epoch read; returns (requeued, attention)."""
        max_attempts = self.config.retry.max_attempts
        requeued = attention = 0
        reason = dead_reason or "lease expired"
        for row in rows:
            if row.cancel_requested_at is not None:  # cancelled while it ran: never again
                cancels.end_expired(self.driver, conn, row.id, int(row.lease_epoch), clock, reason)
                continue
            target = NEEDS_ATTENTION if row.attempts >= max_attempts else READY
            check_transition(str(row.id), LEASED, target)
            values: dict[str, Any] = {
                "state": target,
                "lease_owner": None,
                "lease_expires_at": None,
                "last_error": reason,
                "updated_at": clock,
            }
            if target == NEEDS_ATTENTION:
                values["wait_reason"] = f"{row.attempts} attempts spent ({reason})"
            epoch = int(row.lease_epoch)
            if dead_reason is None:
                taken = self.driver.job_expire(conn, row.id, epoch, clock, values)
            else:
                taken = self.driver.job_take_back(
                    conn, row.id, epoch, str(row.lease_owner), clock, values
                )
            if not taken:
                continue
            self.driver.attempt_insert(
                conn, row.id, epoch, row.lease_owner, "expired", reason, clock
            )
            if target == READY:
                requeued += 1
            else:
                attention += 1
                settle_children(self.driver, conn, [row.id], clock)  # its dependents
        return requeued, attention

    def worker_alive(self, name: str, ttl: float, *, now: Time | None = None) -> None:
        """Worker liveness: ``name`` (the ``lease_owner`` it claims as) is alive until the
        database clock (or ``now``) + ``ttl`` seconds."""
        valid_name("name", name)
        seconds = valid_ttl(ttl)
        when = valid_time("now", now)
        with self.driver.begin() as conn:
            self.driver.worker_beat(conn, name, self._clock(conn, when), seconds)

    def worker_beat(
        self, name: str, ttl: float, *, now: Time | None = None, limit: int | None = None
    ) -> RecoveryResult:
        """:meth:`worker_alive` and :meth:`recover_dead` in one transaction on one clock: the
        beating worker is alive past that clock, so it never finds itself dead. (As two calls,
        a worker stalled longer than ``ttl`` between them took back its own running jobs.)"""
        valid_name("name", name)
        seconds = valid_ttl(ttl)
        bound = self.config.recover_limit if limit is None else limit
        check_number("limit", bound, JobError, integer=True)
        when = valid_time("now", now)
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            self.driver.worker_beat(conn, name, clock, seconds)
            return self._take_back_dead(conn, clock, bound)

    def worker_gone(self, name: str) -> None:
        """Remove ``name``'s liveness row (a clean stop: its leases were released)."""
        valid_name("name", name)
        with self.driver.begin() as conn:
            self.driver.worker_delete(conn, name)
