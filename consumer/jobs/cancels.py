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
  makes the job CANCELLED instead (``LeaseMoves._move``; a batch finish through
  :func:`end_requested`), its history saying how the run ended.

An intent written before the request keeps its receipt, whatever it becomes: a cancel cannot
recall an email. The trace says so when a CANCELLED job holds an ACCEPTED receipt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, select, tuple_, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import attempts, jobs
from consumer.jobs.states import CANCELLED, LEASED

__all__ = ["end_requested", "is_requested", "requested_list"]


def end_requested(
    conn: Connection, worker: str, leases: Sequence[tuple[int, int]], clock: Any
) -> list[int]:
    """Of ``(job_id, epoch)`` leases of ``worker`` whose run ended well, move those with a
    cancel request to CANCELLED (fenced, each on its own epoch), with their history rows;
    returns their ids. One statement when none has a request (the usual case). ``clock``:
    unix seconds, or the database clock as an expression."""
    if not leases:
        return []
    wanted = tuple_(jobs.c.id, jobs.c.lease_epoch).in_([tuple(pair) for pair in leases])
    rows = conn.execute(
        update(jobs)
        .where(
            jobs.c.id.in_(sorted(job_id for job_id, _ in leases)),
            wanted,
            jobs.c.lease_owner == worker,
            jobs.c.state == LEASED,
            jobs.c.cancel_requested_at.is_not(None),
        )
        .values(
            state=CANCELLED,
            lease_owner=None,
            lease_expires_at=None,
            wait_reason=jobs.c.cancel_reason,
            timer_scheduled_for=None,
            timer_reason=None,
            timer_subject_version=None,
            timer_cancellation_condition=None,
            updated_at=clock,
        )
        .returning(jobs.c.id, jobs.c.lease_epoch, jobs.c.updated_at)
    ).all()
    if not rows:
        return []
    conn.execute(
        insert(attempts),
        [
            {
                "job_id": int(job_id),
                "epoch": int(epoch),
                "worker": worker,
                "outcome": "cancelled",
                "error": "cancel requested; the run ended done",
                "at": float(at),
            }
            for job_id, epoch, at in rows
        ],
    )
    return [int(row[0]) for row in rows]


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
