"""Django's database connection seen from SQLAlchemy, and ``DATABASES`` as SQLAlchemy URLs.

:func:`engine` is a SQLAlchemy Engine whose connections are Django's connection of the calling
thread (``connections[using]``), and whose every transaction is a Django ``atomic()`` block:
SQLAlchemy's first statement enters ``transaction.atomic(using)``, its COMMIT leaves the block
normally and its ROLLBACK leaves it rolled back. So SQLAlchemy code (a consumer's inbox row and
jobs, ``create_schema`` in a migration) and Django ORM code run in one transaction, and
SQLAlchemy can never commit or roll back more than the block it opened: inside an ``atomic()``
of the caller's, that block is a savepoint.

The DB-API connection handed to SQLAlchemy is a thin stand-in (:class:`_Borrowed`): ``cursor()``
opens the block, ``commit()`` / ``rollback()`` close it, ``close()`` only rolls back a block
still open (the real connection is Django's to close), everything else is the real
connection's. A pool of one stand-in per thread (SingletonThreadPool) keeps SQLAlchemy's
connect-time set-up to once per thread.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections, transaction
from sqlalchemy import create_engine
from sqlalchemy.engine import URL, Engine
from sqlalchemy.pool import SingletonThreadPool

from outbox.errors import ConfigError

# Django's OPTIONS that are Django's own, not connection parameters of the driver.
_DJANGO_OPTIONS = frozenset(
    {
        "isolation_level",
        "server_side_binding",
        "pool",
        "assume_role",
        "init_command",
        "transaction_mode",
        "timeout",
        "check_same_thread",
    }
)


class _Borrowed:
    """Django's DB-API connection of one thread, whose transactions are atomic() blocks."""

    def __init__(self, alias: str) -> None:
        self._alias = alias
        self._wrapper = connections[alias]  # this thread's: Django's connections are per thread
        self._thread = threading.get_ident()
        self._atomic: Any = None

    def _raw(self) -> Any:
        self._wrapper.ensure_connection()
        return self._wrapper.connection

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        if self._atomic is None:
            if not self._wrapper.in_atomic_block:
                # A long-running consumer outlives connections (a database restart): as
                # Django does between requests, a broken one is dropped and opened again.
                self._wrapper.close_if_unusable_or_obsolete()
            atomic = transaction.atomic(using=self._alias)
            atomic.__enter__()
            self._atomic = atomic
        cursor = self._raw().cursor(*args, **kwargs)
        if self._wrapper.vendor == "postgresql":
            # Django's connection leaves json/jsonb as text (its JSONField decodes them);
            # SQLAlchemy's JSON columns expect psycopg to decode them. Per cursor, so Django's
            # own cursors keep their loaders.
            from psycopg.types.json import JsonbLoader, JsonLoader

            cursor.adapters.register_loader("json", JsonLoader)
            cursor.adapters.register_loader("jsonb", JsonbLoader)
        return cursor

    def _owned(self) -> bool:
        # Django's transaction functions act on the calling thread's connection: a block is
        # closed only by its own thread (the pool may close a stand-in from another one).
        return threading.get_ident() == self._thread

    def commit(self) -> None:
        if not self._owned():
            return
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.__exit__(None, None, None)

    def rollback(self) -> None:
        if not self._owned():
            return
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            transaction.set_rollback(True, using=self._alias)
            atomic.__exit__(None, None, None)

    def close(self) -> None:
        self.rollback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw(), name)


def _dialect_url(alias: str) -> str:
    """The engine's URL: the database Django's settings name, when they name one another
    process could open, so ``outbox-consumer run --database-url`` (what ``manage.py
    outbox_consumer`` passes) is seen to name this engine's database; otherwise the dialect
    alone. The connections come from the creator, never from this URL."""
    try:
        return database_url(alias)
    except ConfigError:
        pass
    vendor = connections[alias].vendor
    if vendor == "sqlite":
        return "sqlite://"
    if vendor == "postgresql":
        return "postgresql+psycopg://"
    if vendor == "mysql":
        return f"mysql+{_mysql_driver(alias)}://"
    raise ConfigError(
        "using",
        f"database {alias!r} is {vendor}: the outbox runs on PostgreSQL, MySQL or SQLite",
    )


def _mysql_driver(alias: str) -> str:
    """The SQLAlchemy driver matching Django's MySQL connection: Django imports MySQLdb,
    which is mysqlclient or PyMySQL installed under that name (``pymysql.install_as_MySQLdb``);
    the engine must speak to the connection object it is lent."""
    import importlib

    module = importlib.import_module("MySQLdb")  # what Django's backend imported
    return "pymysql" if module.__name__.startswith("pymysql") else "mysqldb"


def engine(using: str | None = None) -> Engine:
    """A SQLAlchemy Engine on Django's connection ``using`` (default ``"default"``), each of its
    transactions one ``transaction.atomic(using)`` block (module doc). Give it to a
    ``Consumer`` so its handlers' Django ORM writes commit with the inbox row."""
    alias = using or DEFAULT_DB_ALIAS
    options: dict[str, Any] = {}
    if connections[alias].vendor == "postgresql":
        # Its look-up of the hstore type needs psycopg's own Connection object, not a stand-in.
        options["use_native_hstore"] = False
    return create_engine(
        _dialect_url(alias),
        creator=lambda: _Borrowed(alias),
        poolclass=SingletonThreadPool,
        pool_reset_on_return=None,
        **options,
    )


def database_url(using: str | None = None) -> str:
    """``DATABASES[using]`` as a SQLAlchemy URL, for the toolkit's own processes (the relay,
    the worker), which open their own connections. During tests it names the test database
    (Django rewrites the connection's settings)."""
    alias = using or DEFAULT_DB_ALIAS
    if alias not in connections.settings:
        raise ConfigError("using", f"no database {alias!r} in DATABASES")
    conn = connections[alias]
    if conn.vendor == "sqlite":
        return _sqlite_url(alias, str(conn.settings_dict["NAME"]))
    if conn.vendor == "postgresql":
        return _postgresql_url(conn.settings_dict)
    if conn.vendor == "mysql":
        # The toolkit's own processes connect with PyMySQL (the mysql extra), whatever
        # driver Django uses.
        return _server_url("mysql+pymysql", conn.settings_dict, {})
    raise ConfigError("DATABASES", f"{alias!r} is {conn.vendor}: PostgreSQL, MySQL or SQLite")


def _sqlite_url(alias: str, name: str) -> str:
    if name == ":memory:" or "mode=memory" in name:
        raise ConfigError(
            "DATABASES",
            f"{alias!r} is an in-memory SQLite database: other processes cannot open it "
            "(give it a file NAME, or TEST['NAME'] in tests)",
        )
    return f"sqlite:///{name}"


def _postgresql_url(settings: dict[str, Any]) -> str:
    options = settings.get("OPTIONS") or {}
    query = {
        key: str(value)
        for key, value in options.items()
        if key not in _DJANGO_OPTIONS and isinstance(value, (str, int))
    }
    return _server_url("postgresql+psycopg", settings, query)


def _server_url(driver: str, settings: dict[str, Any], query: dict[str, str]) -> str:
    url = URL.create(
        driver,
        username=settings.get("USER") or None,
        password=settings.get("PASSWORD") or None,
        host=settings.get("HOST") or None,
        port=int(settings["PORT"]) if settings.get("PORT") else None,
        database=settings.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)
