"""The job driver's statements on jobs as such: the wake-up, the clock, inserts (one and
many, deduplicated on ``(tenant, action)``), reads, moves by anyone (operators, timers) and
the history rows (``outbox_job_attempts``). A mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import ColumnElement, func, insert, select, tuple_, update
from sqlalchemy.engine import Connection

from consumer.bulk import bulk_insert
from consumer.jobs.schema import EARLY_REPLIES_TABLE, JOBS_TABLE, attempts, jobs
from consumer.jobs.states import WAITING
from outbox.dialect import db_epoch, insert_or_ignore

INSERT_CHUNK = 500
"""Rows per statement of ``job_insert_many`` (one binary array per column on PostgreSQL)."""


class ReadyListener(Protocol):
    """A wake-up source for idle workers: ``wait`` returns True when jobs became READY."""

    def wait(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


KEPT_RETURNING = (
    f"EXISTS (SELECT 1 FROM {EARLY_REPLIES_TABLE} k"
    f" WHERE k.tenant = {JOBS_TABLE}.tenant AND k.action = {JOBS_TABLE}.action)"
)
"""Whether an inserted job has replies kept for it (the keep's unique index, an index probe;
the keep is empty in the usual case)."""


class JobStatements(ABC):
    """Jobs: wake-up, clock, insert, read, move by anyone, history rows."""

    clock: Callable[[], float] | None
    reply_kept_returned = False  # job_insert_many: kept replies in the INSERT's RETURNING
    reply_kept_keys: Callable[[Connection, Sequence[str]], set[tuple[str, str]]]

    # -- wake-up --------------------------------------------------------------------------

    @abstractmethod
    def job_ready_notify(self, conn: Connection) -> None:
        """Tell listening workers that jobs became READY (at ``conn``'s commit)."""

    @property
    def job_ready_channel_sql(self) -> str | None:
        """SQL naming the channel an INSERT of READY jobs notifies, or None (no NOTIFY)."""
        return None

    def job_ready_listener(self) -> ReadyListener | None:
        """A listener for :meth:`job_ready_notify` and enqueues, or None (poll only)."""
        return None

    def clock_read(self, conn: Connection, now: float | None) -> float:
        """``now`` if given, else the database clock in unix seconds."""
        if now is not None:
            return now
        if self.clock is not None:
            return self.clock()
        return float(conn.execute(select(db_epoch())).scalar_one())

    # -- jobs: insert ---------------------------------------------------------------------

    def job_insert(self, conn: Connection, values: Mapping[str, Any]) -> tuple[int, bool]:
        """Insert one job or find the existing ``(tenant, action)``: ``(id, created)``."""
        job_id, created, _ = self.job_insert_counted(conn, values)
        return job_id, created

    def job_insert_counted(
        self, conn: Connection, values: Mapping[str, Any]
    ) -> tuple[int, bool, int]:
        """:meth:`job_insert`, and the ``replies_received`` its INSERT wrote (replies kept
        before the job existed, counted by a subquery of ``values``; 0 when not created).

        ON CONFLICT DO NOTHING + RETURNING: SQLAlchemy 2.1 reports rowcount -1 for Core
        inserts, so RETURNING is how we learn whether this call created the row."""
        stmt = (
            insert_or_ignore(jobs, ("tenant", "action"), conn.dialect.name)
            .values(**values)
            .returning(jobs.c.id, jobs.c.replies_received)
        )
        new = conn.execute(stmt).first()
        if new is not None:
            return int(new[0]), True, int(new[1])
        existing = conn.execute(
            select(jobs.c.id).where(
                jobs.c.tenant == values["tenant"], jobs.c.action == values["action"]
            )
        ).scalar()
        if existing is None:  # pragma: no cover - the conflicting row vanished (deleted)
            raise LookupError(f"job {values['tenant']}/{values['action']} was deleted meanwhile")
        return int(existing), False, 0

    def job_insert_many(
        self,
        conn: Connection,
        rows: Sequence[Mapping[str, Any]],
        kept: set[tuple[str, str]] | None = None,
    ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
        """Insert many jobs, one statement per :data:`INSERT_CHUNK`; returns the ids of the
        identities created and of those that existed (``consumer.bulk.bulk_insert``: binary
        ``unnest`` arrays on PostgreSQL, insertmanyvalues on SQLite).

        ``created_at``/``updated_at`` are numbers, or the database clock as an expression
        (the same object in every row): :meth:`job_rows_stamped` makes them what this database
        can bind.

        ``kept``: filled with the created keys that have replies kept for them
        (``outbox_kept_replies``). On PostgreSQL the INSERT's RETURNING answers it (an index
        probe per created row, no statement of its own: a consumer's batch made five
        statements, this was one); elsewhere one read after the insert."""
        rows = self.job_rows_stamped(conn, rows)
        created: dict[tuple[str, str], int] = {}
        asked = kept is not None and self.reply_kept_returned
        found: set[tuple[str, str]] = set()  # asked: the created keys with replies kept
        for start in range(0, len(rows), INSERT_CHUNK):
            returned = bulk_insert(
                conn,
                jobs,
                rows[start : start + INSERT_CHUNK],
                conflict=("tenant", "action"),
                returning=("id", "tenant", "action"),
                notify=self.job_ready_channel_sql,
                returning_sql=(KEPT_RETURNING,) if asked else (),
            )
            for job_id, tenant, action, *has_kept in returned:
                created[(tenant, action)] = int(job_id)
                if any(has_kept):
                    found.add((tenant, action))
        if kept is not None:
            kept.update(found if asked else self._kept_among(conn, created))
        missing = sorted({(r["tenant"], r["action"]) for r in rows} - set(created))
        existing: dict[tuple[str, str], int] = {}
        for start in range(0, len(missing), INSERT_CHUNK):
            existing.update(self.job_ids(conn, missing[start : start + INSERT_CHUNK]))
        return created, existing

    def _kept_among(
        self, conn: Connection, created: Mapping[tuple[str, str], int]
    ) -> set[tuple[str, str]]:
        """The created keys with replies kept for them: one read of the keep."""
        if not created:
            return set()
        tenants = sorted({tenant for tenant, _ in created})
        return {key for key in self.reply_kept_keys(conn, tenants) if key in created}

    def job_rows_stamped(
        self, conn: Connection, rows: Sequence[Mapping[str, Any]]
    ) -> Sequence[Mapping[str, Any]]:
        """Rows whose timestamps are the database clock get the clock read once (one value
        for the whole call, as ``now()`` is on PostgreSQL)."""
        stamp = rows[0]["created_at"]
        if isinstance(stamp, (int, float)):
            return rows
        value = self.clock_read(conn, None)
        return [{**row, "created_at": value, "updated_at": value} for row in rows]

    def job_ids(
        self, conn: Connection, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], int]:
        """The ids of existing jobs among ``(tenant, action)`` keys (SQLite: a row-value IN
        list, which its planner answers from the unique index)."""
        query = select(jobs.c.id, jobs.c.tenant, jobs.c.action).where(
            tuple_(jobs.c.tenant, jobs.c.action).in_(list(keys))
        )
        return {(tenant, action): int(job_id) for job_id, tenant, action in conn.execute(query)}

    # -- jobs: reads ----------------------------------------------------------------------

    def job_get(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        return conn.execute(select(jobs).where(where)).first()

    def job_state(self, conn: Connection, where: ColumnElement[bool]) -> str | None:
        state = conn.execute(select(jobs.c.state).where(where)).scalar()
        return None if state is None else str(state)

    def job_lease_state(self, conn: Connection, where: ColumnElement[bool]) -> Any:
        """State, epoch and owner: what a refused fenced move reports."""
        return conn.execute(
            select(jobs.c.state, jobs.c.lease_epoch, jobs.c.lease_owner).where(where)
        ).first()

    def job_count_by_state(self, conn: Connection) -> dict[str, int]:
        rows = conn.execute(select(jobs.c.state, func.count()).group_by(jobs.c.state)).all()
        return {str(state): int(n) for state, n in rows}

    def job_next_timer(self, conn: Connection) -> float | None:
        """The earliest ``run_after`` of a waiting job (``ix_outbox_jobs_waiting``: one probe)."""
        value = conn.execute(
            select(func.min(jobs.c.run_after)).where(jobs.c.state.in_(WAITING))
        ).scalar()
        return None if value is None else float(value)

    def attempt_list(self, conn: Connection, job_id: int) -> Sequence[Any]:
        return conn.execute(
            select(attempts).where(attempts.c.job_id == job_id).order_by(attempts.c.id)
        ).all()

    # -- jobs: moves by anyone (operators, timers, recovery) ------------------------------

    def job_update_from(
        self,
        conn: Connection,
        where: ColumnElement[bool],
        from_states: Sequence[str],
        values: Mapping[str, Any],
    ) -> int | None:
        """Move the job if it is in one of ``from_states``: its id, or None."""
        row = conn.execute(
            update(jobs)
            .where(where, jobs.c.state.in_(list(from_states)))
            .values(**values)
            .returning(jobs.c.id)
        ).first()
        return None if row is None else int(row[0])

    def attempt_insert(
        self,
        conn: Connection,
        job_id: int,
        epoch: int | None,
        worker: str | None,
        outcome: str,
        error: str | None,
        clock: float,
    ) -> None:
        conn.execute(
            insert(attempts).values(
                job_id=job_id, epoch=epoch, worker=worker, outcome=outcome, error=error, at=clock
            )
        )
