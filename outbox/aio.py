"""The outbox for async domain code: ``AsyncOutbox``, the same three ways in.

1. ``async with aoutbox.transaction() as tx:`` opens an ``AsyncSession`` and a transaction,
   commits on a clean exit and rolls back on an exception. ``tx.emit`` is a plain call (not
   awaited): it validates at once and buffers, and the events are written with the COMMIT,
   in the same single round trip as the sync path.
2. ``@aoutbox.transactional`` on an ``async def f(tx, ...)``.
3. ``await aoutbox.emit(async_session_or_connection, ...)`` joins a transaction the caller
   owns and never commits it.

Nothing here is a second implementation. An ``AsyncSession`` or ``AsyncConnection`` is a
facade over a sync Session or Connection run in a greenlet, so every write goes through
``run_sync`` into the sync :class:`~outbox.core.Outbox`'s own code: the validation, the row
building, the SQL (the psycopg fast path included) and the buffering of a transaction are the
ones in ``outbox.core``. This module only opens sessions and awaits.

Drivers: psycopg 3's async mode for PostgreSQL (``postgresql+psycopg://``, also what plain
``postgresql://`` maps to), aiosqlite for SQLite (``sqlite:///file`` maps to
``sqlite+aiosqlite:///file``), aiomysql for MySQL and MariaDB (``mysql://`` maps to
``mysql+aiomysql://``), with the engine settings of :func:`outbox.db.make_engine`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import MetaData, Table
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from outbox.core import PENDING_EVENTS_KEY, EventBuffer, EventSpec, Outbox
from outbox.db import (
    configure_sqlite,
    default_database_url,
    mysql_connect_args,
    normalise_url,
    write_locked,
)
from outbox.dialect import MYSQL_DIALECTS
from outbox.errors import ConfigError
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES, NewEvent
from outbox.partitions import partition_length
from outbox.schema import DEFAULT_TABLE, OutboxSchema

P = ParamSpec("P")
R = TypeVar("R")


def make_async_engine(url: str | URL | None = None, **kwargs: Any) -> AsyncEngine:
    """An AsyncEngine for ``url`` (default: the SQLite file) with our backend settings.

    ``postgresql://`` runs on psycopg 3 (async mode), ``sqlite://`` on aiosqlite; SQLite gets
    WAL, the busy timeout and SQLAlchemy-emitted BEGIN exactly as the sync engine does.
    """
    parsed = normalise_url(url if url is not None else default_database_url())
    if parsed.get_backend_name() == "sqlite":
        if parsed.drivername in ("sqlite", "sqlite+pysqlite"):
            parsed = parsed.set(drivername="sqlite+aiosqlite")
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("timeout", 30)
        engine = create_async_engine(parsed, connect_args=connect_args, **kwargs)
        configure_sqlite(engine.sync_engine)
        return engine
    backend = parsed.get_backend_name()
    if backend in MYSQL_DIALECTS:
        # aiomysql: PyMySQL's protocol code under asyncio (the sync engine's driver).
        if parsed.drivername == f"{backend}+pymysql":
            parsed = parsed.set(drivername=f"{backend}+aiomysql")
        kwargs["connect_args"] = mysql_connect_args(kwargs.pop("connect_args", {}))
        kwargs.setdefault("pool_recycle", 3600)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_async_engine(parsed, **kwargs)


class AsyncOutbox:
    """A transactional outbox on one database, for async code.

    ``AsyncOutbox(url_or_async_engine)`` takes a SQLAlchemy URL or an ``AsyncEngine``; the
    keyword arguments are the sync ``Outbox``'s (``table``, ``schema``, ``metadata``,
    ``max_payload_bytes``), and so are the table, the validation and the guarantees.
    """

    def __init__(
        self,
        url_or_async_engine: str | URL | AsyncEngine | None = None,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        metadata: MetaData | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if isinstance(url_or_async_engine, AsyncEngine):
            engine = url_or_async_engine
        elif url_or_async_engine is None or isinstance(url_or_async_engine, (str, URL)):
            engine = make_async_engine(url_or_async_engine)
        else:
            kind = type(url_or_async_engine).__name__
            raise ConfigError(
                "url_or_async_engine", f"expected a URL string or an AsyncEngine, got {kind}"
            )
        self.engine = engine
        # The sync outbox on the async engine's sync facade: it is never used to open
        # connections itself, only to validate and to write on the sessions opened here.
        self.core = Outbox(
            engine.sync_engine,
            table=table,
            schema=schema,
            metadata=metadata,
            max_payload_bytes=max_payload_bytes,
        )
        # The sync Session class behind each AsyncSession is the core's, so its
        # before_commit hook (events buffered, then tx.session.commit() by hand) applies.
        self._sessions = async_sessionmaker(
            engine, expire_on_commit=False, sync_session_class=self.core._sessions.class_
        )

    @property
    def schema(self) -> OutboxSchema:
        return self.core.schema

    @property
    def metadata(self) -> MetaData:
        """The SQLAlchemy MetaData holding the outbox table (for Alembic autogenerate)."""
        return self.core.metadata

    @property
    def table(self) -> Table:
        return self.core.table

    @property
    def max_payload_bytes(self) -> int:
        return self.core.max_payload_bytes

    async def create_schema(
        self, *, notify: bool | None = None, partitioned: str | int | None = None
    ) -> None:
        """Create the outbox table and its indexes if missing (see ``Outbox.create_schema``;
        ``partitioned="hourly"|"daily"|seconds`` on PostgreSQL)."""
        if partitioned is not None:
            partition_length(partitioned)  # a bad value fails before any connection
        async with write_locked(self.engine).begin() as conn:
            await conn.run_sync(
                lambda sync: self.core.create_schema_on(
                    sync, notify=notify, partitioned=partitioned
                )
            )

    def event(
        self,
        topic: str,
        *,
        key: str,
        payload: Any,
        tenant: str | None = None,
        identity: str | None = None,
        headers: Mapping[str, str] | None = None,
        event_id: str | None = None,
    ) -> NewEvent:
        """Validate and build an event without writing it (raises InvalidEvent)."""
        return self.core.event(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
        )

    # -- joining the caller's transaction ----------------------------------------------------

    async def emit(
        self,
        session_or_connection: AsyncSession | AsyncConnection,
        topic: str,
        *,
        key: str,
        payload: Any,
        tenant: str | None = None,
        identity: str | None = None,
        headers: Mapping[str, str] | None = None,
        event_id: str | None = None,
    ) -> str:
        """Write one event in the caller's transaction; return its event id. Never commits."""
        new = self.event(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
        )
        await self.write(session_or_connection, [new])
        return new.event_id

    async def emit_many(
        self, session_or_connection: AsyncSession | AsyncConnection, events: Iterable[EventSpec]
    ) -> list[str]:
        """Validate every event, then write them all in one statement; return their ids."""
        checked = self.core.checked_events(events)
        await self.write(session_or_connection, checked)
        return [new.event_id for new in checked]

    async def write(
        self, session_or_connection: AsyncSession | AsyncConnection, events: list[NewEvent]
    ) -> None:
        """Insert already-validated events in the caller's transaction (``Outbox.write``)."""
        if not events:
            return
        if not isinstance(session_or_connection, (AsyncSession, AsyncConnection)):
            raise TypeError(
                "emit needs a SQLAlchemy AsyncSession or AsyncConnection, got "
                f"{type(session_or_connection).__name__}"
            )
        await session_or_connection.run_sync(self.core.write, events)

    # -- transactions we own -----------------------------------------------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncTransaction]:
        """Open an AsyncSession and transaction; commit on success, roll back on exception."""
        async with self._sessions() as session, session.begin():
            tx = AsyncTransaction(self, session)
            session.info[PENDING_EVENTS_KEY] = tx.pending
            yield tx
            if tx.pending:
                await session.run_sync(self.core.write_with_commit, tx.pending)

    @overload
    def transactional(
        self, fn: Callable[Concatenate[AsyncTransaction, P], Awaitable[R]]
    ) -> Callable[P, Awaitable[R]]: ...

    @overload
    def transactional(
        self, fn: None = None
    ) -> Callable[
        [Callable[Concatenate[AsyncTransaction, P], Awaitable[R]]], Callable[P, Awaitable[R]]
    ]: ...

    def transactional(self, fn: Any = None) -> Any:
        """Decorate ``async def f(tx, ...)``: it runs inside ``transaction()``.

        The decorated coroutine function is called without ``tx``; an exception it raises
        rolls back the state change and the events together and propagates.
        ``@aoutbox.transactional`` and ``@aoutbox.transactional()`` both work.
        """

        def decorate(
            func: Callable[Concatenate[AsyncTransaction, P], Awaitable[R]],
        ) -> Callable[P, Awaitable[R]]:
            if not inspect.iscoroutinefunction(func):
                raise TypeError("AsyncOutbox.transactional decorates an async def")

            @functools.wraps(func)
            async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                async with self.transaction() as tx:
                    return await func(tx, *args, **kwargs)

            return wrapper

        if fn is None:
            return decorate
        if not callable(fn):
            raise TypeError("transactional decorates a function")
        return decorate(fn)

    async def dispose(self) -> None:
        """Close the engine's pooled connections."""
        await self.engine.dispose()


@dataclass(frozen=True)
class AsyncTransaction(EventBuffer):
    """One open async domain transaction: ``session`` (an AsyncSession) for the state change,
    ``emit`` (a plain call, validated at once) for events written at commit."""

    outbox: AsyncOutbox
    session: AsyncSession
    pending: list[NewEvent] = field(default_factory=list, repr=False)

    @property
    def _validator(self) -> Outbox:
        return self.outbox.core

    async def flush(self) -> None:
        """Write the events emitted so far now, still inside this transaction."""
        if self.pending:
            await self.session.run_sync(self.outbox.core.write, self._take_pending())
