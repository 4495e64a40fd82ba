"""Writing events inside the caller's transaction: the Outbox, its three ways in.

1. ``with outbox.transaction() as tx:`` opens a Session, commits on a clean exit and rolls
   back on an exception (which propagates). ``tx.session`` is the domain's Session and
   ``tx.emit`` writes in the same transaction.
2. ``@outbox.transactional`` wraps a domain function in (1) and passes it ``tx`` first.
3. ``outbox.emit(session_or_connection, ...)`` joins a transaction the caller owns. The
   outbox never commits or rolls back a transaction it did not open.

Every event is validated before anything is written (``InvalidEvent`` names the field), so
a bad event leaves the caller's transaction exactly as usable as it was. ``emit_many``
writes a list in one statement: one round trip, however many events.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

from sqlalchemy import MetaData, Table, insert
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import make_engine
from outbox.errors import ConfigError, InvalidEvent
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES, NewEvent, make_event
from outbox.schema import DEFAULT_TABLE, OutboxSchema, build_schema, create_schema

P = ParamSpec("P")
R = TypeVar("R")

EventSpec = Mapping[str, Any] | NewEvent
"""What ``emit_many`` takes: a NewEvent, or a mapping of ``emit``'s arguments
(``topic``, ``key``, ``payload``, and optionally ``tenant``, ``identity``, ``headers``,
``event_id``)."""

_EMIT_ARGS = frozenset({"topic", "key", "payload", "tenant", "identity", "headers", "event_id"})


class Outbox:
    """A transactional outbox on one database.

    ``Outbox(url_or_engine)`` takes a SQLAlchemy URL (``postgresql+psycopg://...``,
    ``sqlite:///file.db``) or an Engine; with neither, a SQLite file in the working directory.
    ``table`` and ``schema`` name where the events live (validated as plain identifiers);
    ``max_payload_bytes`` caps an encoded payload (default 1 MiB).
    """

    def __init__(
        self,
        url_or_engine: str | URL | Engine | None = None,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        metadata: MetaData | None = None,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    ) -> None:
        if isinstance(max_payload_bytes, bool) or not isinstance(max_payload_bytes, int):
            raise ConfigError("max_payload_bytes", "must be an integer")
        if max_payload_bytes <= 0:
            raise ConfigError("max_payload_bytes", f"must be positive, got {max_payload_bytes}")
        if isinstance(url_or_engine, Engine):
            self.engine = url_or_engine
        elif url_or_engine is None or isinstance(url_or_engine, (str, URL)):
            self.engine = make_engine(url_or_engine)
        else:
            raise ConfigError(
                "url_or_engine",
                f"expected a URL string or an Engine, got {type(url_or_engine).__name__}",
            )
        self.schema: OutboxSchema = build_schema(table, schema, metadata)
        self.max_payload_bytes = max_payload_bytes
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    # -- schema ---------------------------------------------------------------------------

    @property
    def metadata(self) -> MetaData:
        """The SQLAlchemy MetaData holding the outbox table (for Alembic autogenerate)."""
        return self.schema.metadata

    @property
    def table(self) -> Table:
        return self.schema.table

    def create_schema(self) -> None:
        """Create the outbox table and its indexes if they do not exist (idempotent)."""
        create_schema(self.engine, self.schema)

    # -- validation -----------------------------------------------------------------------

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
        return make_event(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
            max_payload_bytes=self.max_payload_bytes,
        )

    def _events(self, specs: Iterable[EventSpec]) -> list[NewEvent]:
        if isinstance(specs, (str, bytes, Mapping)):
            raise InvalidEvent("events", "emit_many takes a list of events, not a single one")
        events: list[NewEvent] = []
        for index, spec in enumerate(specs):
            if isinstance(spec, NewEvent):
                events.append(spec)
                continue
            if not isinstance(spec, Mapping):
                kind = type(spec).__name__
                raise InvalidEvent("events", f"item {index} is {kind}, not a mapping")
            unknown = set(spec) - _EMIT_ARGS
            if unknown:
                raise InvalidEvent("events", f"item {index} has unknown fields {sorted(unknown)}")
            if "topic" not in spec:
                raise InvalidEvent("topic", f"is required (item {index})")
            if "key" not in spec:
                raise InvalidEvent("key", f"is required (item {index})")
            if "payload" not in spec:
                raise InvalidEvent("payload", f"is required (item {index})")
            events.append(
                make_event(
                    spec["topic"],
                    key=spec["key"],
                    payload=spec["payload"],
                    tenant=spec.get("tenant"),
                    identity=spec.get("identity"),
                    headers=spec.get("headers"),
                    event_id=spec.get("event_id"),
                    max_payload_bytes=self.max_payload_bytes,
                )
            )
        return events

    # -- writing --------------------------------------------------------------------------

    def emit(
        self,
        session_or_connection: Session | Connection,
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
        event = self.event(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
        )
        self.write(session_or_connection, [event])
        return event.event_id

    def emit_many(
        self, session_or_connection: Session | Connection, events: Iterable[EventSpec]
    ) -> list[str]:
        """Validate every event, then write them all in one statement; return their ids."""
        checked = self._events(events)
        self.write(session_or_connection, checked)
        return [event.event_id for event in checked]

    def write(self, session_or_connection: Session | Connection, events: list[NewEvent]) -> None:
        """Insert already-validated events in the caller's transaction (one round trip)."""
        if not events:
            return
        if not isinstance(session_or_connection, (Session, Connection)):
            raise TypeError(
                "emit needs a SQLAlchemy Session or Connection, got "
                f"{type(session_or_connection).__name__}"
            )
        statement = insert(self.schema.table)
        if len(events) == 1:
            session_or_connection.execute(statement, events[0].row())
        else:
            # executemany: psycopg 3 pipelines it, SQLite runs it in-process; one round trip.
            session_or_connection.execute(statement, [event.row() for event in events])

    # -- transactions we own --------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Open a Session and transaction; commit on success, roll back on any exception."""
        with self._sessions() as session, session.begin():
            yield Transaction(self, session)

    @overload
    def transactional(self, fn: Callable[Concatenate[Transaction, P], R]) -> Callable[P, R]: ...

    @overload
    def transactional(
        self, fn: None = None
    ) -> Callable[[Callable[Concatenate[Transaction, P], R]], Callable[P, R]]: ...

    def transactional(self, fn: Any = None) -> Any:
        """Decorate a domain function ``f(tx, ...)``: it runs inside ``transaction()``.

        The decorated function is called without ``tx``; an exception it raises rolls back
        the state change and the events together and propagates. ``@outbox.transactional``
        and ``@outbox.transactional()`` both work.
        """

        def decorate(func: Callable[Concatenate[Transaction, P], R]) -> Callable[P, R]:
            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                with self.transaction() as tx:
                    return func(tx, *args, **kwargs)

            return wrapper

        if fn is None:
            return decorate
        if not callable(fn):
            raise TypeError("transactional decorates a function")
        return decorate(fn)


@dataclass(frozen=True)
class Transaction:
    """One open domain transaction: ``session`` for the state change, ``emit`` for events."""

    outbox: Outbox
    session: Session

    @property
    def connection(self) -> Connection:
        """The Connection the session's transaction runs on."""
        return self.session.connection()

    def emit(
        self,
        topic: str,
        *,
        key: str,
        payload: Any,
        tenant: str | None = None,
        identity: str | None = None,
        headers: Mapping[str, str] | None = None,
        event_id: str | None = None,
    ) -> str:
        """Write one event in this transaction; return its event id."""
        return self.outbox.emit(
            self.session,
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
        )

    def emit_many(self, events: Iterable[EventSpec]) -> list[str]:
        """Write a list of events in this transaction in one round trip."""
        return self.outbox.emit_many(self.session, events)
