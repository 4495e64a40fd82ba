"""The job driver's statements for delivery callbacks (``consumer.jobs.deliveries``
decides): :class:`DeliveryStatements`, a mixin of :class:`consumer.jobs.driver_base.JobDriver`,
SQLAlchemy Core in the caller's transaction (its open ``conn`` first) on both databases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import deliveries, operations
from outbox.dialect import insert_new

__all__ = ["DeliveryStatements"]


class DeliveryStatements:
    """The statements of ``outbox_deliveries`` and the receipt's delivery status."""

    def delivery_insert(
        self,
        conn: Connection,
        *,
        event_id: str,
        operation_id: str,
        status: str,
        provider_ref: str | None,
        detail: str | None,
        received_at: Any,
    ) -> bool:
        """Keep a callback unless the operation's ``event_id`` was kept before: True if
        inserted.
        ``received_at`` is a number or the database clock as an expression."""
        values = {
            "event_id": event_id,
            "operation_id": operation_id,
            "status": status,
            "provider_ref": provider_ref,
            "detail": detail,
            "received_at": received_at,
        }
        return (
            insert_new(
                conn, deliveries, ("operation_id", "event_id"), values, deliveries.c.event_id
            )
            is not None
        )

    def delivery_unapplied_due(self, conn: Connection, cutoff: float) -> int:
        """Callbacks still waiting for their receipt, received before ``cutoff``."""
        query = select(func.count()).where(
            deliveries.c.applied_at.is_(None), deliveries.c.received_at < cutoff
        )
        return int(conn.execute(query).scalar_one())

    def delivery_unapplied_purge(self, conn: Connection, cutoff: float, limit: int) -> int:
        """Delete at most ``limit`` callbacks still waiting for their receipt, received
        before ``cutoff`` (their receipt never came); how many."""
        doomed = conn.execute(
            select(deliveries.c.operation_id, deliveries.c.event_id)
            .where(deliveries.c.applied_at.is_(None), deliveries.c.received_at < cutoff)
            .limit(limit)
        ).all()
        for operation_id, event_id in doomed:  # keyed per operation (issue 53)
            conn.execute(
                delete(deliveries).where(
                    deliveries.c.operation_id == operation_id, deliveries.c.event_id == event_id
                )
            )
        return len(doomed)

    def delivery_applied_at(self, conn: Connection, operation_id: str, event_id: str) -> Any:
        """When a kept callback was applied (None: it waits)."""
        return conn.execute(
            select(deliveries.c.applied_at).where(
                deliveries.c.operation_id == operation_id, deliveries.c.event_id == event_id
            )
        ).scalar()

    def delivery_waiting_list(self, conn: Connection, limit: int) -> list[str]:
        """The operation ids of callbacks not applied yet, oldest first (one per callback:
        an operation may come again). Reads ``ix_outbox_deliveries_unapplied``."""
        rows = conn.execute(
            select(deliveries.c.operation_id)
            .where(deliveries.c.applied_at.is_(None))
            .order_by(deliveries.c.received_at)
            .limit(limit)
        ).all()
        return [str(r[0]) for r in rows]

    def delivery_apply(self, conn: Connection, operation_id: str, stamp: Any) -> Sequence[Any]:
        """Mark the operation's waiting callbacks applied at ``stamp``: the callbacks
        (``event_id``, ``status``, ``provider_ref``, ``detail``, ``received_at``)."""
        return conn.execute(
            update(deliveries)
            .where(
                deliveries.c.operation_id == operation_id,
                deliveries.c.applied_at.is_(None),
            )
            .values(applied_at=stamp)
            .returning(
                deliveries.c.event_id,
                deliveries.c.status,
                deliveries.c.provider_ref,
                deliveries.c.detail,
                deliveries.c.received_at,
            )
        ).all()

    def operation_delivery_set(
        self, conn: Connection, operation_id: str, status: str, stamp: Any
    ) -> None:
        """Set the receipt's ``delivery_status`` (the furthest seen) and ``delivery_at``."""
        conn.execute(
            update(operations)
            .where(operations.c.operation_id == operation_id)
            .values(delivery_status=status, delivery_at=stamp)
        )
