"""The job driver's statements on operation intents and receipts (``consumer.jobs.operations``
and ``consumer.jobs.settlement`` decide): :class:`OperationStatements`, a mixin of
:class:`consumer.jobs.driver_base.JobDriver`.

Every method takes the caller's open ``conn`` first, except the dispatch path's
``operation_intent`` and ``operation_record``: each is one unit of work committed on its own,
as SQL text on the DBAPI connection, and each dialect implements it (``driver_pg``,
``driver_sqlite``; docs/contributing.md, "Storage seams").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from consumer.jobs.receipts import NOT_SENT, PENDING, UNKNOWN
from consumer.jobs.schema import jobs, operations
from outbox.dialect import db_epoch, insert_new

__all__ = ["OperationStatements", "check_operation_columns"]


class OperationStatements(ABC):
    """The statements of ``outbox_operations`` (intents and their receipts)."""

    def operation_insert(self, conn: Connection, values: Mapping[str, Any]) -> float | None:
        """Insert an intent unless its operation id exists: the call deadline it was created
        with, or None when it existed."""
        created = insert_new(
            conn, operations, ("operation_id",), values, operations.c.call_deadline
        )
        return None if created is None else float(created[0])

    @abstractmethod
    def operation_intent(
        self,
        *,
        operation_id: str,
        job_id: int,
        provider: str,
        digest: str,
        timeout: float,
        worker: str,
        epoch: int,
    ) -> str:
        """The fast path of a dispatch, committed on its own: create the intent of a call
        (PENDING, its deadline now + ``timeout``, the call counted) and extend the lease to
        that deadline, both or neither. ``"created"``; ``"exists"`` when the operation has
        an intent already (nothing written; the caller reads it); ``"fenced"`` when the
        lease is not held at ``epoch``; ``"paused"`` when the provider is paused (the
        check before every call, in the same unit of work; nothing written)."""
        # Differs: one autocommit statement on PostgreSQL (its pause, lease and intent as
        # CTEs), BEGIN IMMEDIATE and three statements on SQLite; both on the DBAPI
        # connection, since a SQLAlchemy Connection costs several times the statement here.

    def operation_get(self, conn: Connection, operation_id: str, *, lock: bool = False) -> Any:
        query = select(operations).where(operations.c.operation_id == operation_id)
        if lock:
            query = query.with_for_update()
        return conn.execute(query).first()

    def operation_update(
        self,
        conn: Connection,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
    ) -> bool:
        """Update one receipt; True if it matched. ``unless_states``/``if_states`` filter on
        its state, ``if_attempts`` on its call count (compare-and-set: no new call was made
        since it was read)."""
        stmt = update(operations).where(operations.c.operation_id == operation_id)
        if unless_states:
            stmt = stmt.where(operations.c.state.not_in(list(unless_states)))
        if if_states:
            stmt = stmt.where(operations.c.state.in_(list(if_states)))
        if if_attempts is not None:
            stmt = stmt.where(operations.c.attempts == if_attempts)
        row = conn.execute(stmt.values(**values).returning(operations.c.operation_id)).first()
        return row is not None

    @abstractmethod
    def operation_record(
        self,
        operation_id: str,
        values: Mapping[str, Any],
        *,
        stamp: Sequence[str] = (),
        unless_states: Sequence[str] = (),
        if_states: Sequence[str] = (),
        if_attempts: int | None = None,
        durable: bool = True,
    ) -> bool:
        """Record a call's outcome on its receipt in one statement, committed on its own:
        ``values`` are plain column values, ``stamp`` names the columns set to the database
        clock; the filters are :meth:`operation_update`'s. True if the receipt matched.
        ``durable=False``: no wait for the WAL flush (PostgreSQL;
        ``consumer.jobs.settlement.record_outcome``)."""
        # Differs: prepared SQL text per shape of the update on the DBAPI connection, in
        # autocommit (PostgreSQL, where durable=False turns synchronous_commit off for it)
        # or its own BEGIN IMMEDIATE (SQLite); ``consumer.jobs.record_text`` caches both.

    def operation_list(
        self,
        conn: Connection,
        *,
        states: Sequence[str] | None = None,
        due_before: float | None = None,
        limit: int = 1000,
        skip_locked: bool = False,
    ) -> Sequence[Any]:
        """Receipts, oldest first; ``due_before``: only those whose call deadline passed
        (no deadline counts as passed)."""
        query = select(operations)
        if states:
            query = query.where(operations.c.state.in_(list(states)))
        if due_before is not None:
            query = query.where(
                (operations.c.call_deadline.is_(None)) | (operations.c.call_deadline <= due_before)
            )
        query = query.order_by(operations.c.updated_at, operations.c.operation_id).limit(limit)
        if skip_locked:
            query = query.with_for_update(skip_locked=True)
        return conn.execute(query).all()

    def operation_call_start(
        self, conn: Connection, operation_id: str, deadline: float, if_attempts: int | None
    ) -> bool:
        """Count a new call on the receipt and set its deadline (PENDING again, no error),
        if its state allows a call (PENDING, UNKNOWN, NOT_SENT) and, with ``if_attempts``,
        no call was counted since it was read: True if it matched."""
        return self.operation_update(
            conn,
            operation_id,
            {
                "state": PENDING,
                "attempts": operations.c.attempts + 1,
                "call_deadline": deadline,
                "last_error": None,
                "updated_at": db_epoch(),
            },
            if_states=(PENDING, UNKNOWN, NOT_SENT),
            if_attempts=if_attempts,
        )

    def job_trace_contexts(self, conn: Connection, job_ids: Sequence[int]) -> dict[int, str | None]:
        """The jobs' trace contexts (``outbox.tracing``: the reconciliation sweep's spans)."""
        query = select(jobs.c.id, jobs.c.trace_context).where(jobs.c.id.in_(list(job_ids)))
        return {int(job_id): context for job_id, context in conn.execute(query)}


def check_operation_columns(names: Sequence[str]) -> None:
    for name in names:
        if name not in operations.c:
            raise ValueError(f"{name!r} is not a column of {operations.name}")
