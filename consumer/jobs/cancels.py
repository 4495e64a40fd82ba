"""Cancelling a running job: the statements of a cancel request (issue 38).

``Store.cancel`` on a LEASED job records a request on its row (``cancel_requested_at``,
``cancel_reason``) instead of moving it under its holder. From there:

- the holder's worker learns it (:func:`requested_list`, a probe of the tiny partial index
  ``ix_outbox_jobs_cancel_requested`` run with its maintenance) and tells the job's
  :class:`~consumer.jobs.context.JobContext`: ``ctx.cancelled`` is True, an ``async def``
  handler's task is cancelled (at its next ``await``, never inside a provider call: see
  ``JobContext.dispatching``), and ``ctx.dispatch`` raises ``JobCancelled`` before writing a
  new intent (:func:`is_requested`, read at that moment);
- whatever the run's end (a finish, a wait, a failure, a defer), the holder's fenced move
  makes the job CANCELLED instead (``LeaseMoves._move``; a batch finish in its own
  statement, ``consumer.jobs.queries``), its history saying how the run ended.

An intent written before the request keeps its receipt, whatever it becomes: a cancel cannot
recall an email. The trace says so when a CANCELLED job holds an ACCEPTED receipt.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs
from consumer.jobs.states import LEASED

__all__ = ["is_requested", "requested_list"]


def requested_list(conn: Connection, worker: str) -> list[int]:
    """The jobs ``worker`` holds that have a cancel request (the partial index: only LEASED
    rows with a request are in it, a handful at most)."""
    rows = conn.execute(
        select(jobs.c.id).where(
            jobs.c.state == LEASED,
            jobs.c.cancel_requested_at.is_not(None),
            jobs.c.lease_owner == worker,
        )
    )
    return [int(r[0]) for r in rows]


def is_requested(conn: Connection, job_id: int, epoch: int) -> bool:
    """Whether the job, still LEASED at ``epoch``, has a cancel request."""
    row = conn.execute(
        select(jobs.c.cancel_requested_at).where(
            jobs.c.id == job_id, jobs.c.lease_epoch == epoch, jobs.c.state == LEASED
        )
    ).first()
    return row is not None and row[0] is not None
