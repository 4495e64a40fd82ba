"""Bringing an existing job store's tables up to date, at every start and in Alembic.

``metadata.create_all`` never alters a table that exists, so what the job tables gained after
their first release is added here, each piece only when missing (idempotent):

- ``outbox_operations``: the call deadline and the operator's settlement (issue 11);
- ``outbox_jobs.trace_context`` (issue 23);
- queues (issue 27): ``outbox_jobs.queue`` (NOT NULL, default ``'default'``: every job of
  an older table is in the default queue), the READY claim index re-created to lead with the
  queue, the index the tenant limit counts with, and ``outbox_paused_queues``;
- PostgreSQL: the tenant limit's function (``consumer.jobs.queries.PG_TENANT_ROOM_SQL``),
  which no MetaData holds and Alembic's autogenerate never emits.

``Store(...)``, ``outbox-worker init-db`` and ``consumer.jobs.schema.create_schema`` run
:func:`upgrade_schema`. Alembic users add one line at the end of the migration's
``upgrade()``, after the generated operations (or instead of them, on a database made
before queues)::

    from consumer.jobs.migrations import create_job_extras

    def upgrade() -> None:
        ...                       # the generated operations
        create_job_extras(op)

    def downgrade() -> None:
        drop_job_extras(op)       # before the generated drop_table operations
        ...

On PostgreSQL the column is added without rewriting the table (a constant default), but the
index is built with a plain CREATE INDEX, which blocks writes to the jobs table meanwhile:
on a large table, run the upgrade at a quiet time.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from consumer.jobs.queries import PG_TENANT_ROOM_SQL, TENANT_ROOM_FUNCTION
from consumer.jobs.schema import (
    DEFAULT_QUEUE,
    LEASED_TENANT_INDEX,
    OPEN_RECEIPTS_INDEX,
    READY_INDEX,
    jobs,
    operations,
    paused_queues,
)
from outbox.dialect import is_postgresql

ADDED_OPERATION_COLUMNS = ("call_deadline", "settled_by", "settled_reason", "settled_at")
"""Nullable columns ``outbox_operations`` gained after its first release (issue 11)."""
ADDED_JOB_COLUMNS = ("trace_context",)
"""Nullable columns ``outbox_jobs`` gained after its first release: the trace context (issue
23). The queue (issue 27) is NOT NULL with a default: added on its own below."""


def upgrade_schema(conn: Connection) -> None:
    """Add what the job tables gained since they were created (module docstring), in
    ``conn``'s transaction. The tables themselves must exist (``metadata.create_all``)."""
    inspector = inspect(conn)
    prep = conn.dialect.identifier_preparer
    if inspector.has_table(operations.name):
        present = {c["name"] for c in inspector.get_columns(operations.name)}
        for name in ADDED_OPERATION_COLUMNS:
            if name not in present:
                column = operations.c[name]
                conn.execute(
                    text(
                        f"ALTER TABLE {prep.format_table(operations)} ADD COLUMN "
                        f"{prep.quote(name)} {column.type.compile(dialect=conn.dialect)}"
                    )
                )
        OPEN_RECEIPTS_INDEX.create(conn, checkfirst=True)

    job_columns = {c["name"] for c in inspector.get_columns(jobs.name)}
    for name in ADDED_JOB_COLUMNS:
        if name not in job_columns:
            column = jobs.c[name]
            conn.execute(
                text(
                    f"ALTER TABLE {prep.format_table(jobs)} ADD COLUMN "
                    f"{prep.quote(name)} {column.type.compile(dialect=conn.dialect)}"
                )
            )
    if "queue" not in job_columns:
        queue = jobs.c.queue
        conn.execute(
            text(
                f"ALTER TABLE {prep.format_table(jobs)} ADD COLUMN queue "
                f"{queue.type.compile(dialect=conn.dialect)} NOT NULL DEFAULT '{DEFAULT_QUEUE}'"
            )
        )
    ready = {i["name"]: i for i in inspector.get_indexes(jobs.name)}.get(str(READY_INDEX.name))
    if ready is not None and list(ready["column_names"])[:1] != ["queue"]:
        conn.execute(text(f"DROP INDEX {prep.quote(str(READY_INDEX.name))}"))
        ready = None
    if ready is None:
        READY_INDEX.create(conn)
    LEASED_TENANT_INDEX.create(conn, checkfirst=True)
    paused_queues.create(conn, checkfirst=True)
    if is_postgresql(conn.dialect.name):
        conn.exec_driver_sql(PG_TENANT_ROOM_SQL)


def create_job_extras(op: Any) -> None:
    """In an Alembic migration (``op`` is ``alembic.op``): :func:`upgrade_schema` on the
    migration's connection, after the job tables exist."""
    upgrade_schema(op.get_bind())


def drop_job_extras(op: Any) -> None:
    """In an Alembic downgrade: the tenant limit's function (PostgreSQL), which no MetaData
    holds; the tables and indexes go with the generated operations."""
    bind = op.get_bind()
    if is_postgresql(bind.dialect.name):
        bind.exec_driver_sql(f"DROP FUNCTION IF EXISTS {TENANT_ROOM_FUNCTION}(text, text, integer)")
