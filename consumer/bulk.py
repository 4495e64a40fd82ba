"""One-statement bulk inserts for batch paths (the consumer's inbox and batch handlers, the
job store's ``enqueue_many``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import Connection

from outbox.dialect import is_postgresql


def bulk_insert(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    *,
    conflict: Sequence[str] | None = None,
    returning: str | Sequence[str] | None = None,
) -> list[Any]:
    """Insert ``rows`` (same keys in each) in ONE statement; with ``conflict``, skip rows
    that collide on those columns; with ``returning``, return that column of the inserted
    rows (a name: a list of values; a sequence of names: a list of tuples).

    PostgreSQL: ``INSERT ... SELECT * FROM unnest(%b::type[], ...)``, one binary array per
    column, on the Connection's own psycopg connection (same transaction). The statement
    text is the same for every batch size, so psycopg prepares it once; a multi-row VALUES
    with thousands of parameters costs more to build and parse than to run, and a list
    bound as ``%s`` goes as a text array (40-50 ms per 500 elements, measured).
    SQLite: SQLAlchemy's insertmanyvalues (multi-row VALUES) with the same semantics.
    """
    if not rows:
        return []
    if is_postgresql(conn.dialect.name):
        return _insert_unnest(conn, table, rows, conflict, returning)
    return _insert_values(conn, table, rows, conflict, returning)


def _insert_values(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    conflict: Sequence[str] | None,
    returning: str | Sequence[str] | None,
) -> list[Any]:
    """SQLite: SQLAlchemy's insertmanyvalues (multi-row VALUES)."""
    names = [returning] if isinstance(returning, str) else list(returning or ())
    stmt: Any = sqlite.insert(table)
    if conflict:
        stmt = stmt.on_conflict_do_nothing(index_elements=list(conflict))
    if not names:
        conn.execute(stmt, [dict(r) for r in rows])
        return []
    stmt = stmt.returning(*(table.c[name] for name in names))
    result = conn.execute(stmt, [dict(r) for r in rows])
    single = isinstance(returning, str)
    return [row[0] if single else tuple(row) for row in result]


def _insert_unnest(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    conflict: Sequence[str] | None,
    returning: str | Sequence[str] | None,
) -> list[Any]:
    """PostgreSQL: ``INSERT ... SELECT * FROM unnest(%b::type[], ...)`` on the Connection's
    own psycopg connection (same transaction)."""
    from psycopg.types.json import Jsonb

    columns = list(rows[0].keys())
    names = [returning] if isinstance(returning, str) else list(returning or ())
    single = isinstance(returning, str)
    prep = conn.dialect.identifier_preparer
    arrays: list[list[Any]] = []
    casts: list[str] = []
    for name in columns:
        column = table.c[name]
        sql_type = column.type.compile(dialect=conn.dialect)
        values = [row[name] for row in rows]
        if "JSON" in sql_type.upper():
            values = [Jsonb(v) if v is not None else None for v in values]
        arrays.append(values)
        casts.append(f"%b::{sql_type}[]")
    sql = (
        f"INSERT INTO {prep.format_table(table)} "
        f"({', '.join(prep.quote(c) for c in columns)}) "
        f"SELECT * FROM unnest({', '.join(casts)})"
    )
    if conflict:
        sql += f" ON CONFLICT ({', '.join(prep.quote(c) for c in conflict)}) DO NOTHING"
    if names:
        sql += f" RETURNING {', '.join(prep.quote(name) for name in names)}"
    raw: Any = conn.connection.dbapi_connection
    with raw.cursor() as cursor:
        cursor.execute(sql, arrays)
        if not names:
            return []
        return [row[0] if single else tuple(row) for row in cursor.fetchall()]
