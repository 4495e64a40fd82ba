"""Creating the job tables (:func:`create_schema`, :func:`create_tables`) and adding what
they gained since their first release to a table made before (:func:`upgrade_schema`;
``consumer.jobs.migrations`` lists each step). The tables themselves are declared in
``consumer.jobs.schema``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, inspect, text
from sqlalchemy.engine import Connection, Engine

from consumer.jobs.order_ddl import pg_concurrency_release_sql, pg_order_release_sql
from consumer.jobs.schema import (
    CANCEL_REQUESTED_INDEX,
    CONCURRENCY_HELD_INDEX,
    DEFAULT_QUEUE,
    DELIVERIES_KEY,
    DELIVERIES_OPERATION_INDEX,
    DUE_SCHEDULES_INDEX,
    JOBS_TABLE,
    LEASED_TENANT_INDEX,
    OPEN_RECEIPTS_INDEX,
    ORDER_HELD_INDEX,
    PG_TENANT_ROOM_SQL,
    READY_INDEX,
    UNAPPLIED_DELIVERIES_INDEX,
    WAITING_PARENTS_INDEX,
    concurrency_keys,
    deliveries,
    early_replies,
    job_steps,
    jobs,
    metadata,
    operations,
    order_keys,
    paused_queues,
    replies,
    schedules,
    set_autovacuum,
)
from outbox.dialect import is_postgresql

__all__ = [
    "ADDED_JOB_COLUMNS",
    "ADDED_OPERATION_COLUMNS",
    "COUNTED_JOB_COLUMNS",
    "create_schema",
    "create_tables",
    "upgrade_schema",
]


ADDED_OPERATION_COLUMNS = (
    *("call_deadline", "settled_by", "settled_reason", "settled_at"),
    *("delivery_status", "delivery_at"),
)
"""Nullable columns ``outbox_operations`` gained after its first release (issue 11; the
delivery outcome, issue 38)."""
ADDED_JOB_COLUMNS = (
    *("trace_context", "cancel_requested_at", "cancel_reason"),
    *("result", "on_parent_failure"),
    *("order_key", "order_hold", "concurrency_key", "concurrency_limit"),
)
"""Nullable columns ``outbox_jobs`` gained after its first release: the trace context (issue
23), the cancel request (issue 38). The queue (issue 27) and the reply counters (issue 38)
are NOT NULL with a default: added on their own below."""
COUNTED_JOB_COLUMNS = ("replies_received", "replies_consumed", "parents_pending", "children")
"""``outbox_jobs``'s NOT NULL integer columns with default 0 added after its first release."""


# complexity: one step per schema version, in order
def upgrade_schema(conn: Connection) -> None:
    """Add what the job tables gained since they were created (module docstring), in
    ``conn``'s transaction. The tables themselves must exist (``metadata.create_all``)."""
    inspector = inspect(conn)
    prep = conn.dialect.identifier_preparer
    if inspector.has_table(operations.name):
        present = {c["name"] for c in inspector.get_columns(operations.name)}
        _add_columns(conn, operations, [n for n in ADDED_OPERATION_COLUMNS if n not in present])
        OPEN_RECEIPTS_INDEX.create(conn, checkfirst=True)

    job_columns = {c["name"] for c in inspector.get_columns(jobs.name)}
    _add_columns(conn, jobs, [n for n in ADDED_JOB_COLUMNS if n not in job_columns])
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
    for name in COUNTED_JOB_COLUMNS:
        if name not in job_columns:
            conn.execute(
                text(
                    f"ALTER TABLE {prep.format_table(jobs)} ADD COLUMN "
                    f"{prep.quote(name)} INTEGER NOT NULL DEFAULT 0"
                )
            )
    LEASED_TENANT_INDEX.create(conn, checkfirst=True)
    CANCEL_REQUESTED_INDEX.create(conn, checkfirst=True)
    paused_queues.create(conn, checkfirst=True)
    replies.create(conn, checkfirst=True)
    if inspector.has_table(deliveries.name):
        _deliveries_per_operation(conn, inspector)
    early_replies.create(conn, checkfirst=True)
    deliveries.create(conn, checkfirst=True)
    schedules.create(conn, checkfirst=True)
    DUE_SCHEDULES_INDEX.create(conn, checkfirst=True)
    job_steps.create(conn, checkfirst=True)  # steps (issue 57), with its indexes
    WAITING_PARENTS_INDEX.create(conn, checkfirst=True)  # counted by the metrics (issue 57)
    for extra in (ORDER_HELD_INDEX, CONCURRENCY_HELD_INDEX, order_keys, concurrency_keys):
        extra.create(conn, checkfirst=True)  # order and concurrency keys (issue 56)
    if is_postgresql(conn.dialect.name):
        conn.exec_driver_sql(PG_TENANT_ROOM_SQL)
        conn.exec_driver_sql(pg_order_release_sql(JOBS_TABLE))
        conn.exec_driver_sql(pg_concurrency_release_sql(JOBS_TABLE))


def _deliveries_per_operation(conn: Connection, inspector: Any) -> None:
    """``outbox_deliveries`` keyed by ``event_id`` alone (issue 38) becomes keyed by
    ``(operation_id, event_id)`` (issue 53): PostgreSQL swaps the primary key in place;
    SQLite, which cannot alter one, copies the rows into the table made anew."""
    key = inspector.get_pk_constraint(deliveries.name)
    if list(key.get("constrained_columns") or []) != ["event_id"]:
        return
    prep = conn.dialect.identifier_preparer
    table = prep.format_table(deliveries)
    if is_postgresql(conn.dialect.name):
        conn.execute(
            text(
                f"ALTER TABLE {table} DROP CONSTRAINT {prep.quote(key['name'])}, "
                f"ADD CONSTRAINT {prep.quote(DELIVERIES_KEY)} "
                "PRIMARY KEY (operation_id, event_id)"
            )
        )
        return
    old = prep.quote(f"{deliveries.name}_before_53")
    conn.execute(text(f"ALTER TABLE {table} RENAME TO {old}"))
    for index in (DELIVERIES_OPERATION_INDEX, UNAPPLIED_DELIVERIES_INDEX):  # they moved along
        conn.execute(text(f"DROP INDEX IF EXISTS {prep.quote(str(index.name))}"))
    deliveries.create(conn)
    names = ", ".join(prep.quote(c.name) for c in deliveries.columns)
    conn.execute(text(f"INSERT INTO {table} ({names}) SELECT {names} FROM {old}"))
    conn.execute(text(f"DROP TABLE {old}"))


def _add_columns(conn: Connection, table: Table, names: list[str]) -> None:
    """ALTER TABLE ... ADD COLUMN for each of ``names``: nullable columns, their type as the
    table declares it."""
    prep = conn.dialect.identifier_preparer
    for name in names:
        column_type = table.c[name].type.compile(dialect=conn.dialect)
        conn.execute(
            text(
                f"ALTER TABLE {prep.format_table(table)} ADD COLUMN "
                f"{prep.quote(name)} {column_type}"
            )
        )


def create_tables(conn: Connection) -> None:
    """Create the job tables and indexes if missing and bring them up to date
    (:func:`upgrade_schema`), in ``conn``'s transaction; idempotent. PostgreSQL: concurrent
    DDL serialised (CREATE TABLE IF NOT EXISTS races between processes starting together),
    and the hot tables' per-table autovacuum settings (:func:`set_autovacuum`)."""
    postgres = is_postgresql(conn.dialect.name)
    if postgres:
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:n))"), {"n": "outbox-jobs-ddl"})
    metadata.create_all(conn, checkfirst=True)
    upgrade_schema(conn)
    if postgres:
        set_autovacuum(conn)


def create_schema(bind: Engine | Connection) -> None:
    """Create the job tables and indexes if missing (idempotent, safe at every start): in a
    transaction of its own on an Engine, in the caller's on a Connection."""
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            create_tables(conn)
    else:
        create_tables(bind)
