"""The job driver's statements for replies to jobs (``consumer.jobs.replies`` decides):
:class:`ReplyStatements`, a mixin of :class:`consumer.jobs.driver_base.JobDriver`, SQLAlchemy
Core in the caller's transaction (its open ``conn`` first) on both databases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, select, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs, replies
from outbox.dialect import insert_new

__all__ = ["ReplyStatements"]


class ReplyStatements:
    """The statements of ``outbox_job_replies`` and the job's reply counters."""

    def reply_job_lock(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """Lock the job a reply is for: its ``id``, ``state`` and ``replies_received``, or
        None when there is no such job."""
        return conn.execute(
            select(jobs.c.id, jobs.c.state, jobs.c.replies_received).where(where).with_for_update()
        ).first()

    def reply_insert(
        self,
        conn: Connection,
        *,
        job_id: int,
        seq: int,
        reply_id: str,
        payload: Any,
        source: str | None,
        received_at: float,
    ) -> bool:
        """Insert a reply unless the job has one with that ``reply_id``: True if inserted."""
        values = {
            "job_id": job_id,
            "seq": seq,
            "reply_id": reply_id,
            "payload": payload,
            "source": source,
            "received_at": received_at,
        }
        return insert_new(conn, replies, ("job_id", "reply_id"), values, replies.c.id) is not None

    def reply_job_count(
        self, conn: Connection, job_id: int, state: str, values: Mapping[str, Any]
    ) -> None:
        """Count a reply on its job (``values``: ``replies_received`` and, for a job made
        READY by it, the move's columns), filtered on the state read under the row lock."""
        stmt = update(jobs).where(jobs.c.id == job_id, jobs.c.state == state)
        conn.execute(stmt.values(**values))

    def reply_unconsumed(
        self, conn: Connection, job_id: int, after: int, upto: int
    ) -> Sequence[Any]:
        """The job's replies with ``after < seq <= upto``, oldest first."""
        return conn.execute(
            select(replies)
            .where(replies.c.job_id == job_id, replies.c.seq > after, replies.c.seq <= upto)
            .order_by(replies.c.seq)
        ).all()

    def reply_list(self, conn: Connection, job_ids: Sequence[int], limit: int) -> Sequence[Any]:
        """The replies of some jobs, by job and then oldest first."""
        return conn.execute(
            select(replies)
            .where(replies.c.job_id.in_(list(job_ids)))
            .order_by(replies.c.job_id, replies.c.seq)
            .limit(limit)
        ).all()

    def reply_consume(self, conn: Connection, job_id: int, upto: int, clock: Any) -> None:
        """Mark the job's replies up to ``seq`` ``upto`` consumed at ``clock``."""
        conn.execute(
            update(jobs)
            .where(jobs.c.id == job_id, jobs.c.replies_consumed < upto)
            .values(replies_consumed=upto)
        )
        conn.execute(
            update(replies)
            .where(
                replies.c.job_id == job_id, replies.c.seq <= upto, replies.c.consumed_at.is_(None)
            )
            .values(consumed_at=clock)
        )
