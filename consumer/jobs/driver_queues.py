"""The job driver's queue statements: depth, pause and resume, and the counts the tenant
limits read. A mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection

from consumer.jobs import queries as q
from consumer.jobs.schema import jobs, paused_queues
from consumer.jobs.states import LEASED, READY
from outbox.dialect import insert_or_ignore


class QueueStatements:
    """Queues: depth, pause, resume, leased and ready counts."""

    def job_depth(self, conn: Connection, queue: str | None) -> Sequence[Any]:
        """``(queue, ready, age)`` per queue with READY jobs (``queries.depth``: O(ready))."""
        params = {} if queue is None else {"queue": queue}
        return conn.execute(q.depth(conn.dialect.name, queue is not None), params).all()

    def queue_pause(self, conn: Connection, queue: str, clock: float) -> bool:
        """Pause ``queue``: True if it was not paused already."""
        stmt = insert_or_ignore(paused_queues, ("queue",), conn.dialect.name)
        row = conn.execute(
            stmt.values(queue=queue, paused_at=clock).returning(paused_queues.c.queue)
        ).first()
        return row is not None

    def queue_resume(self, conn: Connection, queue: str) -> bool:
        """Resume ``queue``: True if it was paused."""
        row = conn.execute(
            delete(paused_queues)
            .where(paused_queues.c.queue == queue)
            .returning(paused_queues.c.queue)
        ).first()
        return row is not None

    def queue_paused_list(self, conn: Connection) -> dict[str, float]:
        """Paused queues and when they were paused (a handful of rows)."""
        rows = conn.execute(select(paused_queues.c.queue, paused_queues.c.paused_at))
        return {str(name): float(at) for name, at in rows}

    def job_leased_by_tenant(self, conn: Connection) -> Sequence[Any]:
        """``(queue, tenant, leased)`` over LEASED jobs: O(leased), the jobs in flight
        (``ix_outbox_jobs_leased_tenant``), never the history."""
        return conn.execute(
            select(jobs.c.queue, jobs.c.tenant, func.count())
            .where(jobs.c.state == LEASED)
            .group_by(jobs.c.queue, jobs.c.tenant)
        ).all()

    def job_ready_count(self, conn: Connection, queue: str, tenant: str) -> int:
        """READY jobs of one tenant in one queue (a range of ``ix_outbox_jobs_ready``)."""
        return int(
            conn.execute(
                select(func.count()).where(
                    jobs.c.state == READY, jobs.c.queue == queue, jobs.c.tenant == tenant
                )
            ).scalar_one()
        )
