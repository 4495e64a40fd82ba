"""Making engines: URL normalisation and the per-backend settings every part relies on.

- ``postgresql://`` and ``postgres://`` URLs are driven by psycopg 3.
- SQLite files run in WAL mode with a busy timeout, so a relay and writers in other
  processes can share one file. pysqlite's own transaction handling is switched off and
  SQLAlchemy emits ``BEGIN`` itself (the recipe in SQLAlchemy's SQLite dialect docs), which
  lets a caller ask for ``BEGIN IMMEDIATE`` with the ``sqlite_begin`` execution option: the
  relay does, to take SQLite's single write lock before it reads what it will update.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError

from outbox.dialect import MYSQL_DIALECTS
from outbox.display import display_url
from outbox.errors import ConfigError

if TYPE_CHECKING:  # the async path loads on first use (outbox/__init__.py)
    from sqlalchemy.ext.asyncio import AsyncEngine

    E = TypeVar("E", Engine, AsyncEngine)

DEFAULT_SQLITE_FILE = "outbox.db"


def default_database_url(directory: str | None = None) -> str:
    """The embedded default: a SQLite file in the working directory."""
    path = os.path.join(directory or os.getcwd(), DEFAULT_SQLITE_FILE)
    return f"sqlite:///{path}"


_given: list[str] = []


@contextlib.contextmanager
def database_given(url: str | None) -> Iterator[None]:
    """While a command loads the user's module: ``make_engine()`` without a URL (a
    ``Consumer()`` built with no database) means the database the command line or
    ``OUTBOX_DATABASE_URL`` gave, not the SQLite file, so an engine the module takes from it
    (``Store(consumer.engine)``) is on the same database as the command."""
    if url is None:
        yield
        return
    _given.append(url)
    try:
        yield
    finally:
        _given.pop()


def normalise_url(url: str | URL) -> URL:
    """Parse a database URL and pick our drivers; raise ConfigError naming the problem."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ConfigError(
            "database_url", f"{display_url(url)!r} is not a database URL ({exc})"
        ) from None
    backend = parsed.get_backend_name()
    if backend in ("postgresql", "postgres"):
        if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
            parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend in MYSQL_DIALECTS:
        # PyMySQL: pure Python (no libmysqlclient to build), maintained, and aiomysql (the
        # async way in) runs on it; mysqlclient needs C headers to install.
        if parsed.drivername in MYSQL_DIALECTS:
            parsed = parsed.set(drivername=f"{backend}+pymysql")
    elif backend != "sqlite":
        raise ConfigError(
            "database_url",
            f"unsupported backend {backend!r}: use postgresql://, mysql:// or sqlite://",
        )
    return parsed


MYSQL_INIT_COMMAND = "SET SESSION sql_mode = CONCAT(@@sql_mode, ',ANSI_QUOTES')"
"""Run by every MySQL connection of :func:`make_engine` as it opens: the toolkit's raw SQL
quotes identifiers with double quotes, as PostgreSQL and SQLite do (SQLAlchemy notices the
mode and quotes the same way). String literals in it are single-quoted, so nothing else
changes meaning."""


def mysql_connect_args(connect_args: dict[str, Any]) -> dict[str, Any]:
    """``connect_args`` for a PyMySQL/aiomysql connection: ANSI quotes, UTF-8 (4 bytes)."""
    out = dict(connect_args)
    out.setdefault("init_command", MYSQL_INIT_COMMAND)
    out.setdefault("charset", "utf8mb4")
    return out


def make_engine(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """Create an engine for ``url`` (default: the SQLite file) with our backend settings."""
    if url is None:
        url = _given[-1] if _given else default_database_url()
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite":
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("timeout", 30)
        connect_args.setdefault("check_same_thread", False)
        engine = create_engine(parsed, connect_args=connect_args, **kwargs)
        configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() in MYSQL_DIALECTS:
        kwargs["connect_args"] = mysql_connect_args(kwargs.pop("connect_args", {}))
        # The server closes connections idle past wait_timeout (8 h by default): recycle first.
        kwargs.setdefault("pool_recycle", 3600)
    # No pool_pre_ping: it costs a round trip on every checkout (~15 % of a small domain
    # transaction). After a server restart SQLAlchemy recognises the disconnect error,
    # invalidates the pool, and the relay, consumers and workers retry; a domain transaction
    # that meets a dead connection fails once, as it would on any other connection error.
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_engine(parsed, **kwargs)


def _use_wal(cursor: Any) -> None:
    """Switch a file to WAL. The switch needs the file to itself and SQLite does not wait
    for that (no busy handler): processes opening a fresh file at the same moment got
    "database is locked" at connect. The switch is tried again until the busy timeout's
    30 s are up; once another process has switched the file, it succeeds at once."""
    deadline = time.monotonic() + 30.0
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as exc:  # sqlite3's, or the aiosqlite adapter's of the same name
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)  # a file already in WAL takes the pragma without the lock
            delay = min(delay * 2, 0.2)


def configure_sqlite(engine: Engine) -> None:
    """WAL, a busy timeout, foreign keys, and BEGIN emitted by SQLAlchemy (see module doc)."""
    memory = engine.url.database in (None, "", ":memory:")

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=30000")
        if not memory:
            _use_wal(cursor)
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin")
        conn.exec_driver_sql(f"BEGIN {mode}" if mode in ("IMMEDIATE", "EXCLUSIVE") else "BEGIN")


def write_locked(engine: E) -> E:
    """``engine`` (sync or async) whose transactions take SQLite's write lock at BEGIN
    (``BEGIN IMMEDIATE``; any other database: ``engine`` itself). For work that reads and then
    writes, such as creating tables: in a plain BEGIN, two processes doing it at the same
    moment make the second one's upgrade fail at once with "database is locked" (SQLite runs
    no busy handler for it), where BEGIN IMMEDIATE waits for the lock."""
    if engine.dialect.name != "sqlite":
        return engine
    return engine.execution_options(sqlite_begin="IMMEDIATE")


def missing_sqlite_file(url: str | URL) -> str | None:
    """The path of a SQLite file ``url`` names that does not exist (connecting would create
    it empty), or None (it exists, it is in memory, or the URL is not SQLite)."""
    parsed = normalise_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:"):
        return None
    return None if os.path.exists(parsed.database) else parsed.database


def same_database(a: str | URL, b: str | URL) -> bool:
    """Whether two database URLs name the same database (after our driver choice)."""
    try:
        first, second = normalise_url(a), normalise_url(b)
    except ConfigError:
        return False
    return first.render_as_string(hide_password=False) == second.render_as_string(
        hide_password=False
    )


def describe_url(url: str | URL) -> str:
    """The URL with any password hidden (also one in its query string), for logs, pages and
    error messages: :func:`outbox.display.display_url`, the one rule for that."""
    return display_url(url)
