"""Batch paths: one-statement bulk inserts (the consumer's inbox and batch handlers, the job
store's ``enqueue_many``), and deferred writes (the consumer's hook that lets a per-event
call such as ``Store.enqueue(..., session=tx.session)`` be written once per batch).

Deferred writes, the contract between a session's owner and a library writing in it:

- The owner of a transaction that promises to flush before it commits (the consumer, for its
  batch Session) marks the Session with :func:`defer_writes`.
- A library called with that Session (``Store.enqueue(..., session=tx.session)``) may, instead
  of a round trip now, buffer its rows in ``deferred_writes(session)[key]`` (``key``: its own
  object, e.g. the Store) as an object with ``flush(conn)``. :func:`deferred_writes` returns
  None for a Session nobody marked: then it writes at once, as before.
- The owner calls :func:`flush_deferred` after the handlers and before it releases the
  savepoint they ran in, so a buffered write commits or rolls back with the handler's other
  work; a flush that raises fails those handlers like an exception of their own.
  :func:`discard_deferred` drops what a rolled-back handler buffered.
- A library whose caller needs an answer before the flush (``EnqueueResult.duplicate``) may
  flush its own buffer early: ``flush`` must leave the buffer empty and be safe to repeat.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

from sqlalchemy import Table
from sqlalchemy.dialects import mysql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ClauseElement

from outbox.dialect import is_mysql, is_postgresql

DEFERRED_WRITES = "outbox.deferred_writes"
"""The ``Session.info`` key of a session's deferred writers."""


class DeferredWriter(Protocol):
    """Rows a library buffered in a marked Session; ``flush`` writes them in ``conn``'s
    transaction (one statement, ideally) and empties the buffer."""

    def flush(self, conn: Connection) -> None: ...


def defer_writes(session: Session) -> None:
    """Mark ``session``: its owner will call :func:`flush_deferred` before every commit."""
    session.info[DEFERRED_WRITES] = {}


def deferred_writes(session: object) -> dict[Hashable, DeferredWriter] | None:
    """Where a library may buffer writes made in ``session`` (a dict keyed by the library's
    own object), or None when the session is not marked (write at once)."""
    if isinstance(session, Session):
        writers: dict[Hashable, DeferredWriter] | None = session.info.get(DEFERRED_WRITES)
        return writers
    return None


def flush_deferred(session: Session) -> None:
    """Write every buffer of ``session`` now, in its transaction (writers may add more while
    flushing: loop until none is left)."""
    writers = deferred_writes(session)
    while writers:
        pending = list(writers.values())
        writers.clear()
        conn = session.connection()
        for writer in pending:
            writer.flush(conn)


def discard_deferred(session: Session) -> None:
    """Drop what was buffered since the last flush (its handler's savepoint rolled back)."""
    writers = deferred_writes(session)
    if writers:
        writers.clear()


def bulk_insert(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    *,
    conflict: Sequence[str] | None = None,
    returning: str | Sequence[str] | None = None,
    notify: str | None = None,
    returning_sql: Sequence[str] = (),
) -> list[Any]:
    """Insert ``rows`` (same keys in each) in ONE statement; with ``conflict``, skip rows
    that collide on those columns; with ``returning``, return that column of the inserted
    rows (a name: a list of values; a sequence of names: a list of tuples). ``notify``
    (PostgreSQL; SQL giving a channel name): NOTIFY it, at commit, when a row was inserted.
    It rides on the statement's RETURNING, evaluated for inserted rows only; the server
    delivers one notification per channel and transaction however many rows there are.
    ``returning_sql`` (PostgreSQL only; with a sequence ``returning``): SQL expressions over
    the inserted row, returned after the named columns of each tuple (a question the caller
    would otherwise ask in a statement of its own).

    PostgreSQL: ``INSERT ... SELECT * FROM unnest(%b::type[], ...)``, one binary array per
    column, on the Connection's own psycopg connection (same transaction). The statement
    text is the same for every batch size, so psycopg prepares it once; a multi-row VALUES
    with thousands of parameters costs more to build and parse than to run, and a list
    bound as ``%s`` goes as a text array (40-50 ms per 500 elements, measured).
    SQLite: SQLAlchemy's insertmanyvalues (multi-row VALUES) with the same semantics.
    MySQL/MariaDB: a multi-row ``INSERT IGNORE`` (see :func:`_insert_mysql`).
    """
    if not rows:
        return []
    if is_postgresql(conn.dialect.name):
        return _insert_unnest(conn, table, rows, conflict, returning, notify, returning_sql)
    if returning_sql:
        raise ValueError("returning_sql is for PostgreSQL only")
    if is_mysql(conn.dialect.name):
        return _insert_mysql(conn, table, rows, conflict, returning)
    return _insert_values(conn, table, rows, conflict, returning)


def _insert_mysql(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    conflict: Sequence[str] | None,
    returning: str | Sequence[str] | None,
) -> list[Any]:
    """MySQL/MariaDB: one multi-row INSERT, ``IGNORE`` with ``conflict`` (a duplicate key is
    skipped, as ON CONFLICT DO NOTHING; only the unique keys count, so ``conflict`` names the
    table's key). MariaDB 10.5+ returns the inserted rows (``RETURNING``, rows an IGNORE
    skipped left out); MySQL 8 has no RETURNING, so there each row goes alone and its
    affected count tells whether it went in."""
    names = [returning] if isinstance(returning, str) else list(returning or ())
    stmt: Any = mysql.insert(table)
    if conflict:
        stmt = stmt.prefix_with("IGNORE")
    values = [dict(r) for r in rows]
    if not names:
        conn.execute(stmt, values)
        return []
    single = isinstance(returning, str)
    if conn.dialect.insert_returning:
        result = conn.execute(stmt.values(values).returning(*(table.c[n] for n in names)))
        return [row[0] if single else tuple(row) for row in result]
    out: list[Any] = []
    for row in values:
        if conn.execute(stmt.values(**row)).rowcount == 1:
            out.append(row[names[0]] if single else tuple(row[n] for n in names))
    return out


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


@lru_cache(maxsize=512)
def _column_type(table: Table, name: str, dialect: Any) -> tuple[str, bool]:
    """A column's SQL type as PostgreSQL names it, and whether it is JSON: compiled once per
    table and column (18 compilations per job batch: ~3 % of a consumer's batch CPU)."""
    sql_type = table.c[name].type.compile(dialect=dialect)
    return sql_type, "JSON" in sql_type.upper()


# complexity: one branch per column type of the binary UNNEST insert
def _insert_unnest(
    conn: Connection,
    table: Table,
    rows: Sequence[Mapping[str, Any]],
    conflict: Sequence[str] | None,
    returning: str | Sequence[str] | None,
    notify: str | None = None,
    returning_sql: Sequence[str] = (),
) -> list[Any]:
    """PostgreSQL: ``INSERT ... SELECT * FROM unnest(%b::type[], ...)`` on the Connection's
    own psycopg connection (same transaction)."""
    from psycopg.types.json import Jsonb

    columns = list(rows[0].keys())
    names = [returning] if isinstance(returning, str) else list(returning or ())
    single = isinstance(returning, str)
    prep = conn.dialect.identifier_preparer
    # A column whose value is the same in every row (a job's state, priority and timestamps,
    # the inbox's group and stream, the many NULLs) goes as ONE scalar parameter instead of
    # an array of copies: dumping arrays element by element was the largest client cost of
    # a batch, and unnest has fewer arrays to walk. The first column always stays an array,
    # so the statement yields one row per input row. The statement's text depends only on
    # which columns are constant, so psycopg still prepares each shape once.
    arrays: list[Any] = []
    array_casts: list[str] = []
    array_names: list[str] = []
    select: list[str] = []
    scalars: list[Any] = []
    for index, name in enumerate(columns):
        sql_type, is_json = _column_type(table, name, conn.dialect)
        values = [row[name] for row in rows]
        first = values[0]
        # Equal and of one type (1 == 1.0 == True); a JSON value only when it is the same
        # object (None, usually): {"a": 1} == {"a": True} in Python.
        kind = type(first)
        if index > 0 and all(
            v is first or (not is_json and type(v) is kind and v == first) for v in values
        ):
            if isinstance(first, ClauseElement):  # a SQL expression (the database clock)
                select.append(f"CAST({first.compile(dialect=conn.dialect)} AS {sql_type})")
                continue
            scalars.append(Jsonb(first) if is_json and first is not None else first)
            select.append(f"%b::{sql_type}")
            continue
        if is_json:
            values = [Jsonb(v) if v is not None else None for v in values]
        alias = f"c{len(array_names)}"
        arrays.append(values)
        array_casts.append(f"%b::{sql_type}[]")
        array_names.append(alias)
        select.append(f"u.{alias}")
    sql = (
        f"INSERT INTO {prep.format_table(table)} "
        f"({', '.join(prep.quote(c) for c in columns)}) "
        f"SELECT {', '.join(select)} "
        f"FROM unnest({', '.join(array_casts)}) AS u({', '.join(array_names)})"
    )
    params = scalars + arrays  # placeholders in the order they appear: select list first
    if conflict:
        sql += f" ON CONFLICT ({', '.join(prep.quote(c) for c in conflict)}) DO NOTHING"
    returned = [prep.quote(name) for name in names] + list(returning_sql)
    if notify is not None:
        returned.append(f"pg_notify({notify}, '')")  # last: dropped from the rows below
    if returned:
        sql += f" RETURNING {', '.join(returned)}"
    raw: Any = conn.connection.dbapi_connection
    with raw.cursor() as cursor:
        cursor.execute(sql, params)
        if not names:
            return []
        width = len(names) + len(returning_sql)
        return [row[0] if single else tuple(row[:width]) for row in cursor.fetchall()]
