"""The job driver's statements of a lease's holder: the fenced move, the lease extended
and renewed, the held job locked, and the batch finish each dialect writes its own way. A
mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, case, select, tuple_, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs
from consumer.jobs.states import LEASED

LEASED_BY_KEY = jobs.c.state.concat("") == LEASED
"""``state = 'LEASED'`` for a batch of leases found by primary key, written so that no partial
index on LEASED rows matches it: every job passes through LEASED, so between two vacuums
those indexes fill with entries of finished jobs that the statistics do not show, and a
batch fenced on ``state = 'LEASED'`` was planned as a scan of them (issue 44: 1,494 buffers
for a renewal of 15 leases after 20,000 finished jobs, 50 by key;
``queries.pg_finish_batch`` has the same fence in SQL)."""


class LeaseStatements(ABC):
    """The lease holder's moves: fenced update, extend, renew, lock, batch finish."""

    def job_update_fenced(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        worker: str,
        epoch: int,
        values: Mapping[str, Any],
    ) -> int | None:
        """The fence: one UPDATE matching (job, epoch, owner, LEASED). The id, or None when
        no row matched (the caller raises Conflict or JobNotFound)."""
        row = conn.execute(
            update(jobs)
            .where(
                where,
                jobs.c.lease_epoch == epoch,
                jobs.c.lease_owner == worker,
                jobs.c.state == LEASED,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return None if row is None else int(row[0])

    def job_lease_extend(
        self, conn: Connection, job_id: int, worker: str, epoch: int, until: Any
    ) -> bool:
        """Fenced: make the lease last at least until ``until`` (a number or SQL expression),
        never shorter than it is. False when the lease is not held."""
        extended = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
        moved = self.job_update_fenced(
            conn, jobs.c.id == job_id, worker, epoch, {"lease_expires_at": extended}
        )
        return moved is not None

    def job_renew_batch(
        self,
        conn: Connection,
        worker: str,
        leases: Sequence[tuple[int, int]],
        until: float,
        clock: float,
    ) -> tuple[list[int], list[int]]:
        """Fenced: make each ``(job_id, epoch)`` lease of ``worker`` last at least until
        ``until``, never shorter than it is: ``(renewed, skipped)``. A row locked by another
        transaction (its holder finishing or moving it) is skipped, not waited for: the
        renewal never deadlocks with a batch finish (measured: it did, locking in another
        order); the others were lost."""
        wanted = tuple_(jobs.c.id, jobs.c.lease_epoch).in_(list(leases))
        present = {job_id for job_id, _ in leases}
        locking = (
            select(jobs.c.id)
            .where(jobs.c.id.in_(sorted(present)))
            .order_by(jobs.c.id)
            .with_for_update(skip_locked=True)
        )
        locked = {int(r[0]) for r in conn.execute(locking)}
        extended = case((jobs.c.lease_expires_at < until, until), else_=jobs.c.lease_expires_at)
        rows = conn.execute(
            update(jobs)
            .where(
                jobs.c.id.in_(sorted(locked)),
                wanted,
                jobs.c.lease_owner == worker,
                LEASED_BY_KEY,
            )
            .values(lease_expires_at=extended, updated_at=clock)
            .returning(jobs.c.id)
        ).all()
        return [int(r[0]) for r in rows], sorted(present - locked)

    def job_lock_held(
        self, conn: Connection, where: ColumnElement[bool], worker: str, epoch: int
    ) -> Any:
        """Lock the job if ``worker`` holds it at ``epoch``: its failure counters."""
        return conn.execute(
            select(jobs.c.attempts, jobs.c.auth_failures, jobs.c.first_failed_at, jobs.c.provider)
            .where(
                where,
                jobs.c.lease_epoch == epoch,
                jobs.c.lease_owner == worker,
                jobs.c.state == LEASED,
            )
            .with_for_update()
        ).first()

    @abstractmethod
    def job_finish_batch(
        self, conn: Connection, worker: str, leases: Sequence[tuple[int, int]], when: float | None
    ) -> list[int]:
        """Finish ``(job_id, epoch)`` leases of ``worker``, each fenced on its own epoch, with
        their history rows; returns the ids finished (the others lost their lease)."""
