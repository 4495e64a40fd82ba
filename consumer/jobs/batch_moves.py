"""A worker's batched moves: its heartbeat renews every lease in hand in one statement, and
its statement finishes many leases in one transaction, each fenced on its own epoch.

Part of :class:`consumer.jobs.store.Store` (through :class:`consumer.jobs.moves.LeaseMoves`;
see the store's module docstring for the contract).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from consumer.errors import JobError
from consumer.jobs import replies as talk
from consumer.jobs.base import StoreBase
from consumer.jobs.checks import Time, valid_time, valid_ttl
from consumer.jobs.rows import BatchResult, Lease
from consumer.jobs.steps import plain, settle_children, write_results

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection


class BatchMoves(StoreBase):
    """Renew and finish many leases at once."""

    def renew_batch(
        self, leases: Iterable[Lease], *, ttl: float = 30, now: Time | None = None
    ) -> BatchResult:
        """:meth:`renew` many leases in one statement (a worker's heartbeat: one round trip
        per beat, not one per job in hand), each fenced on its own epoch. ``done``: renewed;
        ``conflicts``: leases that were lost (nothing raised); a lease whose row another
        transaction holds locked at that moment (its finish) is in neither: the next beat
        renews it if it is still held."""
        seconds = valid_ttl(ttl)
        items, by_worker = leases_by_worker(leases)
        when = valid_time("now", now)
        if not items:
            return BatchResult()
        renewed: list[int] = []
        skipped: list[int] = []
        with self.driver.begin() as conn:
            clock = self._clock(conn, when)
            for worker, pairs in by_worker.items():
                done, busy = self.driver.job_renew_batch(
                    conn, worker, pairs, clock + seconds, clock
                )
                renewed.extend(done)
                skipped.extend(busy)
        held, busy_now = set(renewed), set(skipped)
        return BatchResult(
            done=sorted(held),
            conflicts=sorted(x.job_id for x in items if x.job_id not in held | busy_now),
        )

    def finish_batch(self, leases: Iterable[Lease], *, now: Time | None = None) -> BatchResult:
        """Finish many leases in one transaction, each fenced on its own epoch. Leases that
        were lost are returned in ``conflicts`` (nothing raised): the caller decides."""
        items, by_worker = leases_by_worker(leases)
        when = valid_time("now", now)
        if not items:
            return BatchResult()
        # One worker's leases with no replies to consume: one statement, which commits on
        # its own (PostgreSQL: no BEGIN and COMMIT round trips).
        # Leases with a result or dependents (consumer.jobs.steps) take the transaction.
        steps = not all(plain(x) for x in items)
        alone = len(by_worker) == 1 and all(talk.watermark(x) is None for x in items)
        with self.driver.autocommit() if alone and not steps else self.driver.begin() as conn:
            ended, woke = self._finish_in(conn, items, by_worker, when)
        return self._finished(items, ended, woke)

    # complexity: the batch finish's per-lease fencing, replies and cancel requests
    def _finish_in(
        self,
        conn: Connection,
        items: list[Lease],
        by_worker: dict[str, list[tuple[int, int]]],
        when: float | None,
    ) -> tuple[set[int], bool]:
        """:meth:`finish_batch`'s writes in ``conn``'s transaction: the jobs ended, and
        whether steps of theirs became READY (the local wakers are told after the commit,
        :meth:`_finished`)."""
        if not all(plain(x) for x in items):
            write_results(self.driver, conn, items)
        done: list[int] = []
        for worker, pairs in by_worker.items():
            # A job with a cancel request ends CANCELLED instead (the same statement).
            done.extend(self.driver.job_finish_batch(conn, worker, pairs, when))
        ended = set(done)
        seen = [(x.job_id, talk.watermark(x)) for x in items if x.job_id in ended]
        if any(upto is not None for _, upto in seen):
            clock = self._clock(conn, when)
            for job_id, upto in seen:
                if upto is not None:
                    talk.consume(self.driver, conn, job_id, upto, clock)
        woke = False
        if ended and any(x.children for x in items):  # results alone: nothing to release
            woke = settle_children(self.driver, conn, ended, self._clock(conn, when))
        return ended, woke

    def _finished(self, items: list[Lease], ended: set[int], woke: bool) -> BatchResult:
        """The result of committed finishes; steps made READY wake this process's slots."""
        if woke:  # committed: this process's idle slots claim the steps now READY
            for wake in tuple(self.local_wakers):
                wake()
        return BatchResult(
            done=sorted(ended),
            conflicts=sorted(x.job_id for x in items if x.job_id not in ended),
        )


def leases_by_worker(
    leases: Iterable[Lease],
) -> tuple[list[Lease], dict[str, list[tuple[int, int]]]]:
    """A batch of leases checked (``JobError`` for anything but a Lease), and its (job id,
    epoch) pairs by the worker holding them: the batch moves fence each on its own epoch."""
    items = list(leases)
    by_worker: dict[str, list[tuple[int, int]]] = {}
    for lease in items:
        if not isinstance(lease, Lease):
            raise JobError("leases", f"expected Lease objects, got {type(lease).__name__}")
        by_worker.setdefault(lease.worker, []).append((lease.job_id, lease.epoch))
    return items, by_worker
