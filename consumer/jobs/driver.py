"""The job store's storage seam: one driver per database, one method per operation.

In the spirit of River's ``riverdriver``: :class:`consumer.jobs.store.Store` validates, decides
and keeps the contract; a :class:`JobDriver` runs the SQL. Methods are named noun first
(``job_claim_batch``, ``job_update_fenced``, ``operation_insert``) and take an open
:class:`~sqlalchemy.engine.Connection` so that several of them make one transaction
(:meth:`JobDriver.begin`). The exceptions are the dispatch path's ``operation_intent`` and
``operation_record`` (and the read ``provider_pause``): each is one unit of work committed on
its own, on the DBAPI connection (docs/contributing.md, "Storage seams").

Most statements are SQLAlchemy Core that compiles the same on both databases; they live in
:class:`JobDriver` (``consumer.jobs.driver_base``) and the area mixins it inherits, one
module ``consumer.jobs.driver_<area>`` per area (``driver_base``'s docstring lists them). What
differs lives in its two subclasses, each in a module of its own (``driver_pg``,
``driver_sqlite``):

- :class:`PostgresJobDriver`: the fair batch claim and the batch finish as one statement each
  (``consumer.jobs.queries``), ``FOR UPDATE SKIP LOCKED``, DDL serialised by an advisory lock.
- :class:`SqliteJobDriver`: transactions take the write lock up front (``BEGIN IMMEDIATE``),
  so the claim picks its rows in a few statements without row locks, and the batch finish is
  a loop of fenced updates in that one transaction.

:func:`driver_for` is the one place that asks which database an engine talks to. The other
modules of ``consumer.jobs`` reach the database only through ``Store.driver``.
"""

from __future__ import annotations

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import StaticPool

from consumer.jobs.driver_base import INSERT_CHUNK, READY_CHANNEL_SQL, JobDriver, ReadyListener
from consumer.jobs.driver_pg import PostgresJobDriver, no_jit
from consumer.jobs.driver_sqlite import SqliteJobDriver
from outbox.db import configure_sqlite, describe_url, make_engine, normalise_url
from outbox.dialect import SQLITE, is_postgresql
from outbox.errors import ConfigError

__all__ = [
    "INSERT_CHUNK",
    "READY_CHANNEL_SQL",
    "JobDriver",
    "PostgresJobDriver",
    "ReadyListener",
    "SqliteJobDriver",
    "driver_for",
    "engine_for",
    "jobs_supported",
]


def jobs_supported(engine: Engine) -> bool:
    """Whether the job store runs on ``engine``'s database (PostgreSQL or SQLite): a reader
    of several parts (the console) shows the jobs only where they can be."""
    return is_postgresql(engine.dialect.name) or engine.dialect.name == SQLITE


def driver_for(engine: Engine, *, notify: bool = True) -> JobDriver:
    """The driver for ``engine``'s database: the one dialect check of the job store.

    ConfigError for any database but PostgreSQL and SQLite: the job store's fenced leases,
    claims and timers are built on their SQL. (MySQL and MariaDB carry the outbox, the relay
    and the consumer's inbox; the jobs of a MySQL service live in PostgreSQL or SQLite.)"""
    if is_postgresql(engine.dialect.name):
        return PostgresJobDriver(engine, notify=notify)
    if engine.dialect.name == SQLITE:
        return SqliteJobDriver(engine, notify=notify)
    raise ConfigError(
        "database_url",
        f"the job store runs on PostgreSQL or SQLite, not {engine.dialect.name} "
        f"({describe_url(engine.url)}); give it a postgresql:// or sqlite:// URL "
        "(the outbox, the relay and the inbox do run on MySQL/MariaDB)",
    )


STORE_POOL = 30
"""Connections the store's own engine keeps, at most (make_engine's 10 + 20 overflow)."""


def engine_for(url: str | URL | None) -> Engine:
    """An engine for a URL; ``None`` or ``sqlite://`` is an in-memory database."""
    if url is None:
        return _memory_engine()
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:"):
        return _memory_engine()
    # The worker's threads take connections in bursts (def handlers' intents and receipts,
    # the statements' executor): the same ceiling as make_engine's (10 + 20 overflow), but
    # every connection opened is kept. An overflow connection is closed when it is returned:
    # at a steady 100 jobs/s that was ~3 new sessions a second per worker, each a fork and
    # cold catalog caches on the server (issue 54: ~2.5 ms of PostgreSQL CPU per effect).
    # LIFO: the connections used most stay warm; the rest sit idle.
    engine = make_engine(parsed, pool_size=STORE_POOL, max_overflow=0, pool_use_lifo=True)
    if is_postgresql(engine.dialect.name):
        # The store's own engine (the user's engine is left alone): no JIT on its sessions,
        # so a claim needs no SET LOCAL of its own (``PostgresJobDriver.job_claim_batch``).
        event.listen(engine, "connect", no_jit)
    return engine


def _memory_engine() -> Engine:
    # One connection for the Store's life (StaticPool): an in-memory database exists only
    # inside its connection, so a pool of several would give each its own empty database.
    engine = create_engine(
        make_url("sqlite://"),
        poolclass=StaticPool,
        connect_args={"check_same_thread": False},
    )
    configure_sqlite(engine)
    return engine
