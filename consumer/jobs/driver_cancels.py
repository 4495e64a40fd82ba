"""The job driver's cancel-request statements (``consumer.jobs.cancels`` has the contract):
the jobs a worker holds that have a request, and whether one job still held has one. A
mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs
from consumer.jobs.states import LEASED


class CancelStatements:
    """Cancel requests of running jobs: the worker's probe and one job's read."""

    def job_cancel_requested_list(self, conn: Connection, worker: str) -> list[int]:
        """The jobs ``worker`` holds that have a cancel request (the partial index: only
        LEASED rows with a request are in it, a handful at most)."""
        rows = conn.execute(
            select(jobs.c.id).where(
                jobs.c.state == LEASED,
                jobs.c.cancel_requested_at.is_not(None),
                jobs.c.lease_owner == worker,
            )
        )
        return [int(r[0]) for r in rows]

    def job_cancel_requested(self, conn: Connection, job_id: int, epoch: int) -> bool:
        """Whether the job, still LEASED at ``epoch``, has a cancel request."""
        row = conn.execute(
            select(jobs.c.cancel_requested_at).where(
                jobs.c.id == job_id, jobs.c.lease_epoch == epoch, jobs.c.state == LEASED
            )
        ).first()
        return row is not None and row[0] is not None
