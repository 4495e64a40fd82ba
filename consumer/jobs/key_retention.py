"""Retention of the per-key rows (issue 56): ``outbox_order_keys`` and
``outbox_concurrency_keys`` keep one row per key ever used, so they grow with the keys, not
with the work in flight. :class:`IdleKeys` deletes the rows of idle keys, as one more target
of the job store's retention (``consumer.jobs.retention.JobRetention.targets``: the worker's
duty and ``outbox-worker purge``).

**What goes.** An order key's row with no head (``head_id`` NULL: its last job finished and
none waits), or a concurrency key's row with no place taken (``active`` 0), whose last change
is older than ``job_retention_seconds`` (the finished jobs' own window: 0 keeps them forever),
and with no HELD job of the key.

**Why it is safe.** A row holds nothing an idle key needs: every change of a key's line
locks its row first and makes it when it is missing (``consumer.jobs.order_ddl``: an
upsert; SQLite: the same under the write lock), and a fresh row reads as the idle one did
(no head; no place taken). On PostgreSQL the purge locks the rows it deletes (``FOR UPDATE
SKIP LOCKED``: a key whose line is changing now is skipped) and the DELETE checks the row's
latest version again, so a key that got a head or a place meanwhile keeps its row; a line
change that waited for the purge's lock finds no row and makes it anew.

**Cost.** The rows are read with a scan of the key table that stops after ``limit`` idle rows
(the key tables are one row per key, far smaller than the jobs; no index is kept for this, so
the keyed jobs' own writes pay nothing), and each candidate's HELD jobs are probed through
``ix_outbox_jobs_order_held`` / ``ix_outbox_jobs_concurrency_held``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, and_, delete, exists, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.elements import ColumnElement

from consumer.jobs.schema import ORDER_KEYS_TABLE, concurrency_keys, jobs, order_keys
from consumer.jobs.states import HELD
from outbox.dialect import is_postgresql

__all__ = ["IdleKeys", "idle_key_targets"]


class IdleKeys:
    """One key table's retention target: ``due()`` and ``purge(limit)`` of its idle rows."""

    def __init__(self, owner: Any, table: Table) -> None:
        """``owner``: the ``JobRetention`` (its store, config and database clock)."""
        self.owner = owner
        self.keys = table
        self.table = str(table.name)
        self.deleted = 0
        """Rows this target deleted so far."""

    def _idle(self, cutoff: float) -> ColumnElement[bool]:
        quiet: ColumnElement[bool]
        if self.table == ORDER_KEYS_TABLE:
            key, job_key, idle = order_keys.c.order_key, jobs.c.order_key, order_keys.c.head_id
            quiet = idle.is_(None)
        else:
            key, job_key = concurrency_keys.c.concurrency_key, jobs.c.concurrency_key
            quiet = concurrency_keys.c.active <= 0
        held = exists().where(job_key == key, jobs.c.state == HELD)
        return and_(quiet, self.keys.c.updated_at < cutoff, ~held)

    def _cutoff(self, conn: Connection, now: float | None) -> float:
        age = float(self.owner.config.job_retention_seconds)
        clock = float(now) if now is not None else self.owner.store.driver.clock_epoch(conn)
        return clock - age

    def due(self, *, now: float | None = None) -> int:
        """Idle rows a purge would delete now."""
        with self.owner.store.driver.connect() as conn:
            where = self._idle(self._cutoff(conn, now))
            count = select(func.count()).select_from(self.keys).where(where)
            return int(conn.execute(count).scalar_one())

    def purge(self, limit: int, *, now: float | None = None) -> int:
        """Delete at most ``limit`` idle rows in one transaction; how many went."""
        key = self.keys.c[self.keys.primary_key.columns.keys()[0]]
        with self.owner.store.driver.begin() as conn:
            where = self._idle(self._cutoff(conn, now))
            chosen = select(key).where(where).limit(limit)
            if is_postgresql(conn.dialect.name):
                chosen = chosen.with_for_update(skip_locked=True)
            gone = conn.execute(delete(self.keys).where(key.in_(chosen), where)).rowcount
        self.deleted += max(0, int(gone or 0))
        return max(0, int(gone or 0))


def idle_key_targets(owner: Any) -> list[IdleKeys]:
    """The key tables' targets of a ``JobRetention`` (none when jobs are kept forever)."""
    if owner.config.job_retention_seconds <= 0:
        return []
    return [IdleKeys(owner, order_keys), IdleKeys(owner, concurrency_keys)]
