"""What differs between PostgreSQL and SQLite, shared by every part's storage seam.

The relay's store, the job store's driver and the inbox each own their SQL; the few
differences they all meet live here, once: the database clock, "insert or ignore" and quoted
table names. Nothing outside the storage seams asks which database it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Double, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

POSTGRESQL = "postgresql"
SQLITE = "sqlite"

NOW_SQL = {POSTGRESQL: "now()", SQLITE: "strftime('%Y-%m-%d %H:%M:%f', 'now')"}
"""The database clock as a timestamp, in raw SQL. PostgreSQL: the transaction's start (the
same for every row it writes). SQLite's CURRENT_TIMESTAMP has one-second resolution while ages
and latencies want milliseconds, so there it is UTC text with milliseconds."""

EPOCH_SQL = {
    POSTGRESQL: "CAST(extract(epoch from now()) AS double precision)",
    # julianday('now') has millisecond resolution; 2440587.5 is the julian day of 1970-01-01.
    SQLITE: "((julianday('now') - 2440587.5) * 86400.0)",
}
"""The database clock in unix seconds, in raw SQL (leases and timers compare these)."""


def is_postgresql(dialect_name: str) -> bool:
    """For storage seams choosing their implementation: PostgreSQL, or else SQLite."""
    return dialect_name == POSTGRESQL


class db_now(FunctionElement[datetime]):
    """The database clock as a timestamp, as a column default or in queries (:data:`NOW_SQL`)."""

    type = DateTime(timezone=True)
    inherit_cache = True
    name = "db_now"


@compiles(db_now)
def _db_now_default(element: db_now, compiler: Any, **kw: Any) -> str:
    return NOW_SQL[POSTGRESQL]


@compiles(db_now, "sqlite")
def _db_now_sqlite(element: db_now, compiler: Any, **kw: Any) -> str:
    return f"({NOW_SQL[SQLITE]})"


class db_epoch(FunctionElement[float]):
    """The database clock in unix seconds (:data:`EPOCH_SQL`)."""

    type = Double()
    inherit_cache = True
    name = "db_epoch"


@compiles(db_epoch)
def _db_epoch_default(element: db_epoch, compiler: Any, **kw: Any) -> str:
    return EPOCH_SQL[POSTGRESQL]


@compiles(db_epoch, "sqlite")
def _db_epoch_sqlite(element: db_epoch, compiler: Any, **kw: Any) -> str:
    return EPOCH_SQL[SQLITE]


def insert_or_ignore(table: Table, conflict: Sequence[Any], dialect_name: str) -> Any:
    """``INSERT ... ON CONFLICT (conflict) DO NOTHING`` for the dialect: an expected duplicate
    is a result (no row inserted, learn it with RETURNING), never an exception."""
    insert = postgresql.insert if dialect_name == POSTGRESQL else sqlite.insert
    return insert(table).on_conflict_do_nothing(index_elements=list(conflict))


def insert_new(
    conn: Connection,
    table: Table,
    conflict: Sequence[Any],
    values: Mapping[str, Any],
    returning: Any,
) -> Any:
    """Insert one row unless it conflicts on ``conflict`` (:func:`insert_or_ignore`), in
    ``conn``'s transaction: the new row's ``returning`` column(s), or None when the row
    existed (RETURNING is how a caller learns it: SQLAlchemy 2.1 reports rowcount -1 for
    Core inserts)."""
    stmt = insert_or_ignore(table, conflict, conn.dialect.name).values(**values)
    return conn.execute(stmt.returning(returning)).first()


def quoted_table(table: str, schema: str | None = None) -> str:
    """A quoted table reference, from names already checked as plain identifiers
    (``outbox.schema.check_identifier``)."""
    return f'"{schema}"."{table}"' if schema else f'"{table}"'


def limit_statements(conn: Connection, timeout_ms: int) -> Callable[[], None]:
    """Bound every statement of the transaction ``conn`` is in to ``timeout_ms``; returns how
    to undo it (for readers, like the metrics, that must never hang a scrape on a lock)."""
    if conn.dialect.name == POSTGRESQL:
        # is_local=true: SET LOCAL, gone at the end of the transaction, so a pooled
        # connection handed to another part afterwards keeps its own settings.
        conn.exec_driver_sql(
            "SELECT set_config('statement_timeout', %(ms)s, true)", {"ms": str(timeout_ms)}
        )
        return lambda: None
    raw: Any = conn.connection.driver_connection
    deadline = time.monotonic() + timeout_ms / 1000.0

    def interrupt() -> int:
        # A non-zero return aborts the running SQLite statement ("interrupted").
        return 1 if time.monotonic() > deadline else 0

    raw.set_progress_handler(interrupt, 10_000)
    return lambda: raw.set_progress_handler(None, 0)
