"""The job driver's recovery statements: expired leases taken back, workers' liveness rows
(``outbox_workers``) and the leases of dead workers, due timers. A mixin of
:class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs, workers
from consumer.jobs.states import LEASED, WAITING
from outbox.dialect import is_postgresql


class RecoveryStatements:
    """Recovery: expired leases, worker liveness, dead workers' leases, due timers."""

    def job_expired_list(self, conn: Connection, clock: float, limit: int) -> Sequence[Any]:
        """Expired leases, oldest first, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(
                jobs.c.id,
                jobs.c.lease_epoch,
                jobs.c.lease_owner,
                jobs.c.attempts,
                jobs.c.cancel_requested_at,
            )
            .where(jobs.c.state == LEASED, jobs.c.lease_expires_at <= clock)
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def job_expire(
        self, conn: Connection, job_id: int, epoch: int, clock: float, values: Mapping[str, Any]
    ) -> bool:
        """Take back an expired lease, re-checked against the epoch read: a lease renewed or
        finished meanwhile is left alone."""
        hit = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.lease_epoch == epoch,
                jobs.c.state == LEASED,
                jobs.c.lease_expires_at <= clock,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return hit is not None

    # -- worker liveness (outbox_workers) -------------------------------------------------

    def worker_beat(self, conn: Connection, name: str, clock: float, ttl: float) -> None:
        """Upsert ``name``'s liveness row: alive until ``clock + ttl``."""
        make = postgresql.insert if is_postgresql(conn.dialect.name) else sqlite.insert
        stmt = make(workers).values(name=name, alive_until=clock + ttl)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[workers.c.name],
                set_={"alive_until": stmt.excluded.alive_until},
            )
        )

    def worker_delete(self, conn: Connection, name: str) -> None:
        conn.execute(delete(workers).where(workers.c.name == name))

    def worker_dead_list(self, conn: Connection, clock: float) -> list[str]:
        """Workers whose liveness row expired (a tiny table: one row per running worker)."""
        rows = conn.execute(select(workers.c.name).where(workers.c.alive_until <= clock))
        return [str(r[0]) for r in rows]

    def job_owned_list(self, conn: Connection, owners: Sequence[str], limit: int) -> Sequence[Any]:
        """LEASED jobs held by ``owners``, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(
                jobs.c.id,
                jobs.c.lease_epoch,
                jobs.c.lease_owner,
                jobs.c.attempts,
                jobs.c.cancel_requested_at,
            )
            .where(jobs.c.state == LEASED, jobs.c.lease_owner.in_(list(owners)))
            .order_by(jobs.c.lease_expires_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def job_take_back(
        self,
        conn: Connection,
        job_id: int,
        epoch: int,
        owner: str,
        clock: float,
        values: Mapping[str, Any],
    ) -> bool:
        """Take back a lease whose owner's liveness expired, re-checked against the epoch and
        owner read and the owner's row (a worker that beat again meanwhile keeps it)."""
        dead = (
            select(workers.c.name)
            .where(workers.c.name == owner, workers.c.alive_until <= clock)
            .exists()
        )
        hit = conn.execute(
            update(jobs)
            .where(
                jobs.c.id == job_id,
                jobs.c.lease_epoch == epoch,
                jobs.c.state == LEASED,
                jobs.c.lease_owner == owner,
                dead,
            )
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return hit is not None

    def worker_forget_dead(self, conn: Connection, names: Sequence[str], clock: float) -> None:
        """Delete expired liveness rows that no longer own a lease."""
        owns = (
            select(jobs.c.id)
            .where(jobs.c.state == LEASED, jobs.c.lease_owner == workers.c.name)
            .exists()
        )
        conn.execute(
            delete(workers).where(
                workers.c.name.in_(list(names)), workers.c.alive_until <= clock, ~owns
            )
        )

    def job_due_list(self, conn: Connection, clock: float, limit: int) -> Sequence[Any]:
        """Waiting jobs whose timer is due, locked with SKIP LOCKED (PostgreSQL)."""
        return conn.execute(
            select(jobs.c.id, jobs.c.state)
            .where(jobs.c.state.in_(WAITING), jobs.c.run_after <= clock)
            .order_by(jobs.c.run_after)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()
