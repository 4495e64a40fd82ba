"""Retention of the consumer's dead letters (the inbox has its own: ``inbox_purge``).

A dead letter (``consumer_dead_letters``) is a record a person acts on: it stays while it
needs attention, whatever its age (deleting it would lose a message nobody handled, and the
alert on it keeps firing until someone does). Once replayed, it is history: it goes
``ConsumerConfig.dead_letter_retention_seconds`` after its replay (default 30 days; 0 keeps
it forever), ``purge_batch`` rows per statement, oldest replay first, through the partial
index ``ix_consumer_dead_letters_replayed``. The consumer steps the duty from its
maintenance (:func:`dead_letter_duty`); ``outbox-worker purge`` runs it on demand.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import func, select

from consumer.inbox import REPLAYED, Inbox
from outbox.dialect import delete_due
from outbox.retention import (
    DEFAULT_DEAD_LETTER_RETENTION,
    DEFAULT_PURGE_BATCH,
    DEFAULT_PURGE_INTERVAL,
    RetentionDuty,
    check_batch,
    check_seconds,
)

__all__ = ["DeadLetterRetention", "dead_letter_duty"]


class DeadLetterRetention:
    """Replayed dead letters older than ``retention_seconds`` (a purge target)."""

    def __init__(
        self, inbox: Inbox, retention_seconds: float = DEFAULT_DEAD_LETTER_RETENTION
    ) -> None:
        self.inbox = inbox
        self.retention_seconds = check_seconds("dead_letter_retention_seconds", retention_seconds)
        self._indexed = False

    @property
    def table(self) -> str:
        return str(self.inbox.tables.dead_letters.name)

    def _ensure_index(self) -> None:
        if not self._indexed:  # a table made before the index existed (a small table)
            index = next(
                i
                for i in self.inbox.tables.dead_letters.indexes
                if str(i.name).endswith("_replayed")
            )
            with self.inbox.engine.begin() as conn:
                index.create(conn, checkfirst=True)
            self._indexed = True

    def _where(self, conn: Any, now: Any) -> Any:
        table = self.inbox.tables.dead_letters
        clock = self.inbox.clock_at(conn, now)
        cutoff = clock - timedelta(seconds=self.retention_seconds)
        return (table.c.state == REPLAYED) & (table.c.replayed_at < cutoff)

    def due(self, *, now: Any = None) -> int:
        if self.retention_seconds <= 0:
            return 0
        self._ensure_index()
        table = self.inbox.tables.dead_letters
        with self.inbox.engine.connect() as conn:
            query = select(func.count()).select_from(table).where(self._where(conn, now))
            return int(conn.execute(query).scalar_one())

    def purge(self, limit: int, *, now: Any = None) -> int:
        check_batch("limit", limit)
        if self.retention_seconds <= 0:
            return 0
        self._ensure_index()
        table = self.inbox.tables.dead_letters
        with self.inbox.engine.begin() as conn:
            where = self._where(conn, now)
            return delete_due(conn, table, table.c.id, where, table.c.replayed_at, limit)


def dead_letter_duty(
    inbox: Inbox,
    retention_seconds: float = DEFAULT_DEAD_LETTER_RETENTION,
    *,
    interval: float = DEFAULT_PURGE_INTERVAL,
    batch: int = DEFAULT_PURGE_BATCH,
) -> RetentionDuty:
    """The consumer's named duty for its dead letters (none when kept forever)."""
    target = DeadLetterRetention(inbox, retention_seconds)
    targets = [target] if target.retention_seconds > 0 else []
    return RetentionDuty("dead-letter retention", targets, interval=interval, batch=batch)
