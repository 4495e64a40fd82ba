"""Alembic: what autogenerate cannot see of the outbox table, as operations to call.

Include the tables in your ``env.py`` (``target_metadata`` may be a list)::

    from outbox import build_schema
    from consumer.inbox import build_inbox_schema
    from consumer.jobs.schema import metadata as jobs_metadata

    target_metadata = [
        Base.metadata,                     # your models
        build_schema().metadata,           # outbox_events (table=..., schema=... if you set them)
        build_inbox_schema().metadata,     # the consumers' inbox and dead letters
        jobs_metadata,                     # jobs, attempts, operations
    ]

``alembic revision --autogenerate`` then writes the tables, their columns and every index,
the partial ones included (``postgresql_where``). Three things are not in any MetaData and
autogenerate never emits them: the NOTIFY trigger and its function, and the storage
parameters (per-table autovacuum, fillfactor) of the outbox table and of the other hot tables
(the inbox, the job tables: :data:`HOT_TABLES`). Add one line at the end of the
migration that creates the outbox table::

    from outbox.migrations import create_extras

    def upgrade() -> None:
        ...                                 # the generated create_table / create_index
        create_extras(op)                   # or create_extras(op, notify=True)

``create_extras`` is idempotent (each piece is checked first) and is what
``Outbox.create_schema()`` runs, so a database migrated by Alembic and one made by
``create_schema()`` end up the same (tests/test_alembic.py checks exactly that). A second
autogenerate finds no differences: Alembic compares neither triggers nor storage parameters.

A partitioned outbox (``outbox.partitions``): ``build_schema(partitioned="hourly")`` in
``target_metadata`` makes autogenerate write ``create_table(..., postgresql_partition_by=
'RANGE (created_at)')`` with the ``(seq, created_at)`` primary key, and
``create_extras(op, partitioned="hourly")`` adds the partitions (without any, every insert
fails: a partitioned table keeps rows in its partitions only).

On MySQL/MariaDB, which has no partial index, the outbox table carries two whole-table
indexes instead of the three partial ones (``outbox.schema.mysql_index_columns``), and
``create_extras`` adds them. Give autogenerate :func:`include_object_for` so that it neither
writes the partial indexes there nor proposes to drop the two::

    from outbox import include_object_for

    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=include_object_for(connection),
    )
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from outbox.dialect import is_mysql, quoted_table
from outbox.maintenance import HOT_TABLE_AUTOVACUUM, set_storage_parameters
from outbox.schema import DEFAULT_TABLE, build_schema, mysql_index_columns, notify_trigger_name
from outbox.schema import create_extras as _create_extras

HOT_TABLES = ("consumer_inbox", "outbox_jobs", "outbox_job_attempts", "outbox_operations")
"""The inbox's and the job store's tables written all day, which their ``create_schema`` give
the hot-table autovacuum settings (``outbox.maintenance.HOT_TABLE_AUTOVACUUM``); those that
exist get the same here. tests/test_alembic.py keeps this list and theirs in step."""


def create_extras(
    op: Any,
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    notify: bool | None = None,
    hot_tables: tuple[str, ...] = HOT_TABLES,
    partitioned: str | int | None = None,
) -> None:
    """In a migration: the outbox table's NOTIFY trigger (added with ``notify=True``, dropped
    with False; None, the default, adds none and keeps an existing one: relays poll and
    writers' commits take no NOTIFY lock; ``outbox.schema``), storage
    parameters and blocked-key index, and the storage parameters of the ``hot_tables`` that
    exist, each added only if missing. ``op`` is ``alembic.op``; on SQLite only the index
    applies. ``partitioned`` (``"hourly"``, ``"daily"`` or seconds: the table's metadata came
    from ``build_schema(partitioned=...)``): the period comment, the DEFAULT partition and
    the partitions of the current and next periods (``outbox.partitions``)."""
    bind = op.get_bind()
    _create_extras(
        bind,
        build_schema(table, schema, partitioned=partitioned),
        notify=notify,
        partitioned=partitioned,
    )
    if bind.dialect.name != "postgresql":
        return
    for name in hot_tables:
        exists = bind.execute(
            text("SELECT to_regclass(:q)"), {"q": quoted_table(name, schema)}
        ).scalar()
        if exists is not None:
            set_storage_parameters(bind, quoted_table(name, schema), HOT_TABLE_AUTOVACUUM)


def drop_extras(op: Any, *, table: str = DEFAULT_TABLE, schema: str | None = None) -> None:
    """In a downgrade, before dropping the table: the NOTIFY trigger and its function."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    outbox_schema = build_schema(table, schema)
    trigger = notify_trigger_name(outbox_schema)
    prefix = f'"{outbox_schema.schema}".' if outbox_schema.schema else ""
    bind.execute(
        text(f'DROP TRIGGER IF EXISTS "{trigger}" ON {prefix}"{outbox_schema.table_name}"')
    )
    bind.execute(text(f'DROP FUNCTION IF EXISTS {prefix}"{trigger}"()'))


def include_object_for(
    connection: Any, table: str = DEFAULT_TABLE
) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """Alembic's ``include_object`` for ``connection``'s database: on MySQL/MariaDB it leaves
    out the outbox table's partial indexes (MySQL has none) and the two whole-table indexes
    :func:`create_extras` adds in their place; elsewhere it includes everything."""
    if not is_mysql(connection.dialect.name):
        return lambda obj, name, type_, reflected, compare_to: True
    schema = build_schema(table)
    partial = {
        str(index.name)
        for index in schema.table.indexes
        if index.dialect_options["postgresql"].get("where") is not None
    }
    skipped = partial | set(mysql_index_columns(table))

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, to: Any) -> bool:
        return not (type_ == "index" and name in skipped and obj.table.name == table)

    return include_object
