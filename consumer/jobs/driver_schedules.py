"""The job driver's statements on schedules (``outbox_schedules``): defining, reading,
pausing and removing them (``consumer.jobs.schedules``) and the firing duty's round
(``consumer.jobs.firing``: the due rows locked, the rows moved on in one batch). The
domain modules decide (the slots, what fires, what is missed); these run their statements,
the same SQL on both databases (``FOR UPDATE SKIP LOCKED`` is PostgreSQL's; SQLite's write
transaction holds the write lock instead). A mixin of :class:`consumer.jobs.driver.JobDriver`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Integer, bindparam, delete, func, select, update
from sqlalchemy.engine import Connection

from consumer.jobs.schema import jobs, schedules
from outbox.dialect import insert_or_ignore

SCHEDULE_MOVE_KEYS = ("name", "first", "next", "last", "job", "fired", "missed")
"""The keys of each row :meth:`ScheduleStatements.schedule_move_batch` takes."""


class ScheduleStatements:
    """Schedules: insert, lock, update, pause, delete, list; the firing round's statements."""

    def schedule_insert(self, conn: Connection, values: Mapping[str, Any]) -> None:
        """Insert a schedule unless one of its name exists."""
        conn.execute(insert_or_ignore(schedules, ("name",), conn.dialect.name).values(**values))

    def schedule_lock(self, conn: Connection, name: str) -> Any:
        """The schedule ``name``, locked for ``conn``'s transaction, or None."""
        return conn.execute(
            select(schedules).where(schedules.c.name == name).with_for_update()
        ).first()

    def schedule_update(self, conn: Connection, name: str, values: Mapping[str, Any]) -> None:
        conn.execute(update(schedules).where(schedules.c.name == name).values(**values))

    def schedule_pause(self, conn: Connection, name: str, clock: float) -> bool:
        """Pause the schedule at ``clock`` unless it is paused: True if it was running."""
        paused = conn.execute(
            update(schedules)
            .where(schedules.c.name == name, schedules.c.paused_at.is_(None))
            .values(paused_at=clock, updated_at=clock)
            .returning(schedules.c.name)
        ).first()
        return paused is not None

    def schedule_delete(self, conn: Connection, name: str) -> None:
        conn.execute(delete(schedules).where(schedules.c.name == name))

    def schedule_list(self, conn: Connection, name: str | None = None) -> Sequence[Any]:
        """Every schedule (or the one ``name``), by name, with its last job's state
        (``job_state``)."""
        query = (
            select(schedules, jobs.c.state.label("job_state"))
            .select_from(schedules.outerjoin(jobs, jobs.c.id == schedules.c.last_job_id))
            .order_by(schedules.c.name)
        )
        if name is not None:
            query = query.where(schedules.c.name == name)
        return conn.execute(query).all()

    def schedule_due_list(self, conn: Connection, clock: float, limit: int) -> Sequence[Any]:
        """Running schedules whose next slot passed at ``clock``, oldest first, at most
        ``limit``, locked with SKIP LOCKED (PostgreSQL: two workers never wait for each
        other nor decide the same row)."""
        return conn.execute(
            select(schedules)
            .where(schedules.c.paused_at.is_(None), schedules.c.next_slot <= clock)
            .order_by(schedules.c.next_slot)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).all()

    def schedule_move_batch(
        self, conn: Connection, moves: Sequence[Mapping[str, Any]], clock: float
    ) -> None:
        """Move schedules on in one batched statement (executemany), each filtered on the
        ``next_slot`` read (``first``): ``next_slot``, ``last_slot``, ``last_job_id`` set to
        ``next``, ``last``, ``job``, and ``fired``/``missed`` counted up
        (:data:`SCHEDULE_MOVE_KEYS`)."""
        statement = (
            update(schedules)
            .where(
                schedules.c.name == bindparam("b_name"),
                schedules.c.next_slot == bindparam("b_first"),
            )
            .values(
                next_slot=bindparam("b_next"),
                last_slot=bindparam("b_last"),
                last_job_id=bindparam("b_job"),
                fired=schedules.c.fired + bindparam("b_fired", type_=Integer),
                missed=schedules.c.missed + bindparam("b_missed", type_=Integer),
                updated_at=clock,
            )
        )
        conn.execute(statement, [{f"b_{k}": move[k] for k in SCHEDULE_MOVE_KEYS} for move in moves])

    def schedule_next_due(self, conn: Connection) -> float | None:
        """The earliest next slot of a running schedule, or None."""
        next_due = conn.execute(
            select(func.min(schedules.c.next_slot)).where(schedules.c.paused_at.is_(None))
        ).scalar()
        return None if next_due is None else float(next_due)
