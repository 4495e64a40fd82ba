"""What differs between PostgreSQL, SQLite and MySQL/MariaDB, shared by every part's storage
seam.

The relay's store, the job store's driver and the inbox each own their SQL; the few
differences they all meet live here, once: the database clock, "insert or ignore" and quoted
table names. Nothing outside the storage seams asks which database it runs on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Double, Table, delete, select
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import SchemaItem
from sqlalchemy.sql.compiler import DDLCompiler
from sqlalchemy.sql.ddl import BaseDDLElement
from sqlalchemy.sql.functions import FunctionElement

POSTGRESQL = "postgresql"
SQLITE = "sqlite"
MYSQL = "mysql"
MARIADB = "mariadb"
MYSQL_DIALECTS = (MYSQL, MARIADB)
"""SQLAlchemy names the dialect ``mariadb`` for a ``mariadb+...://`` URL and ``mysql`` for a
``mysql+...://`` one (also on a MariaDB server); both run the same SQL here."""

NOW_SQL = {
    POSTGRESQL: "now()",
    SQLITE: "strftime('%Y-%m-%d %H:%M:%f', 'now')",
    # UTC whatever the session's time_zone (a user's own engine may set another): DATETIME
    # columns hold no offset, so every writer and reader must agree on UTC.
    MYSQL: "UTC_TIMESTAMP(6)",
    MARIADB: "UTC_TIMESTAMP(6)",
}
"""The database clock as a timestamp, in raw SQL. PostgreSQL: the transaction's start (the
same for every row it writes). SQLite's CURRENT_TIMESTAMP has one-second resolution while ages
and latencies want milliseconds, so there it is UTC text with milliseconds. MySQL: UTC with
microseconds, at the statement (MySQL has no transaction-start clock)."""

MYSQL_EPOCH_OF = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', {}) / 1e6)"
"""A UTC DATETIME as unix seconds on MySQL, in raw SQL (``{}``: the expression). Not
UNIX_TIMESTAMP(), which reads its argument in the session's time_zone."""

EPOCH_SQL = {
    POSTGRESQL: "CAST(extract(epoch from now()) AS double precision)",
    # julianday('now') has millisecond resolution; 2440587.5 is the julian day of 1970-01-01.
    SQLITE: "((julianday('now') - 2440587.5) * 86400.0)",
    MYSQL: MYSQL_EPOCH_OF.format(NOW_SQL[MYSQL]),
    MARIADB: MYSQL_EPOCH_OF.format(NOW_SQL[MYSQL]),
}
"""The database clock in unix seconds, in raw SQL (leases and timers compare these)."""


def is_postgresql(dialect_name: str) -> bool:
    """For storage seams choosing their implementation: PostgreSQL, or else SQLite (or
    MySQL, for the seams that have it: :func:`is_mysql`)."""
    return dialect_name == POSTGRESQL


def is_mysql(dialect_name: str) -> bool:
    """MySQL 8 or MariaDB 10.6+ (either SQLAlchemy dialect name)."""
    return dialect_name in MYSQL_DIALECTS


MYSQL_TABLE: dict[str, Any] = {
    "mysql_engine": "InnoDB",
    "mysql_charset": "utf8mb4",
    "mysql_collate": "utf8mb4_bin",
}
"""MySQL table options (ignored elsewhere): InnoDB (transactions), and a binary collation,
so keys and identities that differ only in case or accents are different, as on PostgreSQL
and SQLite (the server's default collation compares them equal)."""


def timestamp_type() -> DateTime:
    """A timestamp column's type: ``timestamptz`` on PostgreSQL, UTC text on SQLite, and
    ``DATETIME(6)`` on MySQL (a plain DATETIME there keeps whole seconds: ages, backoffs and
    leases want microseconds)."""
    return DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), *MYSQL_DIALECTS)


def not_on_mysql(
    ddl: BaseDDLElement,
    target: SchemaItem | str,
    bind: Connection | None,
    tables: list[Table] | None = None,
    state: Any | None = None,
    *,
    dialect: Dialect,
    compiler: DDLCompiler | None = None,
    checkfirst: bool = False,
) -> bool:
    """``Index.ddl_if(callable_=...)``: create this (partial) index everywhere but MySQL,
    which has no partial indexes (its own indexes say so beside them)."""
    return not is_mysql(dialect.name)


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


@compiles(db_now, "mysql")
@compiles(db_now, "mariadb")
def _db_now_mysql(element: db_now, compiler: Any, **kw: Any) -> str:
    # In parentheses: an expression default (MySQL 8.0.13+, MariaDB 10.2+).
    return f"({NOW_SQL[MYSQL]})"


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


@compiles(db_epoch, "mysql")
@compiles(db_epoch, "mariadb")
def _db_epoch_mysql(element: db_epoch, compiler: Any, **kw: Any) -> str:
    return EPOCH_SQL[MYSQL]


def insert_or_ignore(table: Table, conflict: Sequence[Any], dialect_name: str) -> Any:
    """``INSERT ... ON CONFLICT (conflict) DO NOTHING`` for the dialect: an expected duplicate
    is a result (no row inserted, learn it with RETURNING), never an exception."""
    if is_mysql(dialect_name):
        # MySQL has no ON CONFLICT: INSERT IGNORE skips a duplicate key (the row counts as
        # not inserted). It also turns other errors into warnings (a too-long value is cut),
        # so callers fit their values to the columns first (consumer.inbox.clip).
        return mysql.insert(table).prefix_with("IGNORE")
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


def delete_due(conn: Connection, table: Table, key: Any, where: Any, order: Any, limit: int) -> int:
    """Delete at most ``limit`` rows of ``table`` that match ``where``, oldest by ``order``
    first; return how many went (a retention round: bounded work, short locks).

    PostgreSQL and SQLite: one DELETE of the ``key`` values a LIMITed subquery selects,
    RETURNING them. MySQL and MariaDB refuse a LIMIT in an IN subquery (error 1235): a
    single-table ``DELETE ... WHERE ... LIMIT`` instead, counted by its affected rows; it
    takes any ``limit`` of the matching rows, every one of them due."""
    if is_mysql(conn.dialect.name):
        statement = delete(table).where(where).with_dialect_options(mysql_limit=limit)
        return int(conn.execute(statement).rowcount)
    oldest = select(key).where(where).order_by(order).limit(limit)
    result = conn.execute(delete(table).where(key.in_(oldest.scalar_subquery())).returning(key))
    return len(result.fetchall())


def quoted_table(table: str, schema: str | None = None) -> str:
    """A quoted table reference, from names already checked as plain identifiers
    (``outbox.schema.check_identifier``). Double quotes on every database: the MySQL
    connections of :func:`outbox.db.make_engine` run with ``ANSI_QUOTES``."""
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
    if is_mysql(conn.dialect.name):
        # A session setting (MySQL has no SET LOCAL), put back by the undo: MariaDB bounds any
        # statement (max_statement_time, seconds), MySQL 8 bounds SELECTs (max_execution_time).
        mariadb = getattr(conn.dialect, "is_mariadb", False)
        name = "max_statement_time" if mariadb else "max_execution_time"
        value = f"{timeout_ms / 1000.0:.3f}" if mariadb else str(int(timeout_ms))
        conn.exec_driver_sql(f"SET SESSION {name} = {value}")

        def restore() -> None:
            conn.exec_driver_sql(f"SET SESSION {name} = DEFAULT")

        return restore
    raw: Any = conn.connection.driver_connection
    deadline = time.monotonic() + timeout_ms / 1000.0

    def interrupt() -> int:
        # A non-zero return aborts the running SQLite statement ("interrupted").
        return 1 if time.monotonic() > deadline else 0

    raw.set_progress_handler(interrupt, 10_000)
    return lambda: raw.set_progress_handler(None, 0)
