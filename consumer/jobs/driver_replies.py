"""The job driver's statements for replies to jobs (``consumer.jobs.replies`` decides):
:class:`ReplyStatements`, a mixin of :class:`consumer.jobs.driver_base.JobDriver`, SQLAlchemy
Core in the caller's transaction (its open ``conn`` first) on both databases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, delete, func, select, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import early_replies, jobs, replies
from outbox.dialect import insert_new

__all__ = ["ReplyStatements"]


class ReplyStatements:
    """The statements of ``outbox_job_replies`` and the job's reply counters."""

    def reply_job_lock(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """Lock the job a reply is for: its ``id``, ``state``, ``replies_received``,
        ``tenant`` and ``action``, or None when there is no such job."""
        return conn.execute(
            select(jobs.c.id, jobs.c.state, jobs.c.replies_received, jobs.c.tenant, jobs.c.action)
            .where(where)
            .with_for_update()
        ).first()

    # -- replies to a job not enqueued yet ---------------------------------------------------

    def reply_keep(self, conn: Connection, values: Mapping[str, Any]) -> bool:
        """Keep a reply to a ``(tenant, action)`` with no job, unless one with its
        ``reply_id`` is kept already: True if inserted."""
        key = ("tenant", "action", "reply_id")
        return insert_new(conn, early_replies, key, values, early_replies.c.id) is not None

    def reply_kept_take(self, conn: Connection, tenant: str, action: str) -> Sequence[Any]:
        """The replies kept for ``(tenant, action)``, oldest first, deleted from the keep."""
        key = (early_replies.c.tenant == tenant, early_replies.c.action == action)
        rows = conn.execute(
            select(early_replies).where(*key).order_by(early_replies.c.id).with_for_update()
        ).all()
        if rows:
            conn.execute(delete(early_replies).where(early_replies.c.id.in_([r.id for r in rows])))
        return rows

    def reply_kept_keys(self, conn: Connection, tenants: Sequence[str]) -> set[tuple[str, str]]:
        """The ``(tenant, action)`` keys of these tenants with replies kept for them (an
        enqueue of many reads this once, on the keep's unique index; the keep is empty in
        the usual case)."""
        query = (
            select(early_replies.c.tenant, early_replies.c.action)
            .distinct()
            .where(early_replies.c.tenant.in_(list(tenants)))
        )
        return {(str(t), str(a)) for t, a in conn.execute(query)}

    def reply_kept_orphans(self, conn: Connection, limit: int) -> list[int]:
        """Jobs that exist and still have replies kept for them (a reply that raced its
        job's enqueue): the sweep moves them."""
        query = (
            select(jobs.c.id)
            .distinct()
            .select_from(
                early_replies.join(
                    jobs,
                    (jobs.c.tenant == early_replies.c.tenant)
                    & (jobs.c.action == early_replies.c.action),
                )
            )
            .limit(limit)
        )
        return [int(job_id) for job_id in conn.execute(query).scalars()]

    def reply_kept_due(self, conn: Connection, cutoff: float) -> int:
        """Kept replies received before ``cutoff`` (retention's count)."""
        query = select(func.count()).where(early_replies.c.received_at < cutoff)
        return int(conn.execute(query).scalar_one())

    def reply_kept_purge(self, conn: Connection, cutoff: float, limit: int) -> int:
        """Delete at most ``limit`` kept replies received before ``cutoff``; how many."""
        ids = conn.execute(
            select(early_replies.c.id).where(early_replies.c.received_at < cutoff).limit(limit)
        ).scalars()
        doomed = list(ids)
        if doomed:
            conn.execute(delete(early_replies).where(early_replies.c.id.in_(doomed)))
        return len(doomed)

    def reply_seqs(self, conn: Connection, job_id: int) -> set[int]:
        """The numbers the job's recorded replies carry."""
        query = select(replies.c.seq).where(replies.c.job_id == job_id)
        return {int(seq) for seq in conn.execute(query).scalars()}

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
