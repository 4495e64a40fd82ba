"""Writing events inside the caller's transaction: the Outbox, its three ways in.

1. ``with outbox.transaction() as tx:`` opens a Session, commits on a clean exit and rolls
   back on an exception (which propagates). ``tx.session`` is the domain's Session and
   ``tx.emit`` writes in the same transaction.

   ``tx.emit`` validates at once but writes when the transaction commits: on PostgreSQL
   with psycopg the INSERT and the COMMIT travel in one round trip, so an emit costs the
   domain transaction almost nothing beyond the row itself. The ORM's pending changes are
   flushed first, and a ``tx.session.commit()`` made by hand writes the buffered events
   before that commit (a ``before_commit`` hook), so they are never separated from the
   state change. ``tx.flush()`` writes them immediately, for code that reads them back.
2. ``@outbox.transactional`` wraps a domain function in (1) and passes it ``tx`` first.
3. ``outbox.emit(session_or_connection, ...)`` joins a transaction the caller owns. The
   outbox never commits or rolls back a transaction it did not open.

Every event is validated before anything is written (``InvalidEvent`` names the field), so
a bad event leaves the caller's transaction exactly as usable as it was. ``emit_many``
writes a list in one statement: one round trip, however many events.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, overload

import psycopg
from sqlalchemy import MetaData, Table, event, insert
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import make_engine
from outbox.errors import ConfigError, InvalidEvent
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES, NewEvent, key_hash, make_event
from outbox.schema import DEFAULT_TABLE, OutboxSchema, build_schema, create_schema

P = ParamSpec("P")
R = TypeVar("R")

EventSpec = Mapping[str, Any] | NewEvent
"""What ``emit_many`` takes: a NewEvent, or a mapping of ``emit``'s arguments
(``topic``, ``key``, ``payload``, and optionally ``tenant``, ``identity``, ``headers``,
``event_id``)."""

_EMIT_ARGS = frozenset({"topic", "key", "payload", "tenant", "identity", "headers", "event_id"})
_PENDING = "outbox.pending_events"  # Session.info key of a transaction's buffered events
_FAST_COLUMNS = ("event_id", "topic", "key", "key_hash", "tenant", "identity")


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
        event.listen(self._sessions, "before_commit", self._before_commit)
        self._fast_insert_head = self._build_fast_insert_head()

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
            tx = Transaction(self, session)
            session.info[_PENDING] = tx.pending
            yield tx
            self._write_with_commit(session, tx.pending)

    def _before_commit(self, session: Session) -> None:
        """A commit we did not make ourselves (``tx.session.commit()``): write buffered events
        first, in the transaction being committed."""
        pending: list[NewEvent] | None = session.info.get(_PENDING)
        if pending:
            events = list(pending)
            pending.clear()
            self.write(session, events)

    def _write_with_commit(self, session: Session, pending: list[NewEvent]) -> None:
        """Write the buffered events; on PostgreSQL/psycopg, together with the COMMIT.

        The ORM flush comes first so the state change precedes the COMMIT. The statement
        ``INSERT ...; COMMIT`` is sent as one simple query with client-side binding
        (psycopg's ClientCursor quotes every value; nothing is spliced by hand): one round
        trip where a separate INSERT would take two. If the INSERT fails, PostgreSQL skips
        the COMMIT and the error propagates, and ``session.begin()`` rolls back. Afterwards
        the Session's own commit finds the connection idle, and psycopg's commit is a no-op.
        """
        if not pending:
            return
        events = list(pending)
        pending.clear()
        connection = session.connection()
        driver = connection.connection.driver_connection
        if (
            not isinstance(driver, psycopg.Connection)
            or session.in_nested_transaction()
            or self._fast_insert_head is None
        ):
            self.write(session, events)
            return
        session.flush()
        values = ", ".join(["(%s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)"] * len(events))
        params: list[Any] = []
        for item in events:
            params.extend(
                (
                    item.event_id,
                    item.topic,
                    item.key,
                    key_hash(item.key),
                    item.tenant,
                    item.identity,
                )
            )
            params.append(item.payload_json)
            params.append(json.dumps(item.headers) if item.headers else None)
        with psycopg.ClientCursor(driver) as cursor:
            cursor.execute(f"{self._fast_insert_head} VALUES {values}; COMMIT", params)

    def _build_fast_insert_head(self) -> str | None:
        if self.engine.dialect.name != "postgresql":
            return None
        preparer = self.engine.dialect.identifier_preparer
        columns = ", ".join(preparer.quote(name) for name in (*_FAST_COLUMNS, "payload", "headers"))
        table = preparer.format_table(self.schema.table)
        return f"INSERT INTO {table} ({columns})"

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
    """One open domain transaction: ``session`` for the state change, ``emit`` for events.

    Events emitted here are validated at once and written when the transaction commits (see
    the module documentation); ``flush()`` writes them now.
    """

    outbox: Outbox
    session: Session
    pending: list[NewEvent] = field(default_factory=list, repr=False)

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
        """Validate one event and write it with this transaction; return its event id."""
        new = self.outbox.event(
            topic,
            key=key,
            payload=payload,
            tenant=tenant,
            identity=identity,
            headers=headers,
            event_id=event_id,
        )
        self.pending.append(new)
        return new.event_id

    def emit_many(self, events: Iterable[EventSpec]) -> list[str]:
        """Validate every event, then write them all with this transaction (one statement)."""
        checked = self.outbox._events(events)
        self.pending.extend(checked)
        return [new.event_id for new in checked]

    def flush(self) -> None:
        """Write the events emitted so far now, still inside this transaction."""
        if self.pending:
            events = list(self.pending)
            self.pending.clear()
            self.outbox.write(self.session, events)
