"""Writing events inside the caller's transaction: the Outbox, its three ways in.

1. ``with outbox.transaction() as tx:`` opens a Session, commits on a clean exit and rolls
   back on an exception (which propagates). ``tx.session`` is the domain's Session and
   ``tx.emit`` writes in the same transaction.

   ``tx.emit`` validates at once but writes when the transaction commits, all the
   transaction's events in one statement just before the COMMIT, so an emit costs the
   domain transaction what a hand-written INSERT of the row costs. The ORM's pending
   changes are flushed first, and a ``tx.session.commit()`` made by hand writes the buffered events
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

from sqlalchemy import MetaData, Table, event, insert
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from outbox.db import make_engine
from outbox.dialect import is_mysql
from outbox.errors import ConfigError, InvalidEvent
from outbox.event import DEFAULT_MAX_PAYLOAD_BYTES, NewEvent, key_hash, make_event
from outbox.schema import DEFAULT_TABLE, OutboxSchema, build_schema, create_schema
from outbox.validate import check_number

P = ParamSpec("P")
R = TypeVar("R")

EventSpec = Mapping[str, Any] | NewEvent
"""What ``emit_many`` takes: a NewEvent, or a mapping of ``emit``'s arguments
(``topic``, ``key``, ``payload``, and optionally ``tenant``, ``identity``, ``headers``,
``event_id``)."""

_EMIT_ARGS = frozenset({"topic", "key", "payload", "tenant", "identity", "headers", "event_id"})
PENDING_EVENTS_KEY = "outbox.pending_events"  # Session.info key of a transaction's buffered events
INSERT_COLUMNS = (
    "event_id",
    "topic",
    "key",
    "key_hash",
    "tenant",
    "identity",
    "payload",
    "headers",
)
_PG_ROW = "(%s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)"
_MYSQL_ROW = "(%s, %s, %s, %s, %s, %s, %s, %s)"


_UNNEST = (
    " SELECT e, t, k, h, te, i, p::jsonb, hd::jsonb FROM unnest(%b::text[], %b::text[],"
    " %b::text[], %b::int8[], %b::text[], %b::text[], %b::text[], %b::text[])"
    " WITH ORDINALITY AS u(e, t, k, h, te, i, p, hd, n) ORDER BY n"
)
# Rows per statement of the array form (bounded only to keep one message reasonable).
_MAX_ARRAY_ROWS = 50_000


def _column_arrays(events: list[NewEvent]) -> tuple[list[Any], ...]:
    """The eight column arrays of ``_UNNEST``, in ``INSERT_COLUMNS`` order."""
    return (
        [item.event_id for item in events],
        [item.topic for item in events],
        [item.key for item in events],
        [key_hash(item.key) for item in events],
        [item.tenant for item in events],
        [item.identity for item in events],
        [item.payload_json for item in events],
        [json.dumps(item.headers) if item.headers else None for item in events],
    )


def row_params(events: list[NewEvent]) -> list[Any]:
    """The flat parameter list of ``_PG_ROW`` x len(events), in ``INSERT_COLUMNS`` order."""
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
                item.payload_json,
                json.dumps(item.headers) if item.headers else None,
            )
        )
    return params


def check_specs(specs: Iterable[EventSpec], max_payload_bytes: int) -> list[NewEvent]:
    """Validate what ``emit_many`` takes (NewEvents, or mappings of ``emit``'s arguments)."""
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
                max_payload_bytes=max_payload_bytes,
            )
        )
    return events


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
        check_number("max_payload_bytes", max_payload_bytes, ConfigError, integer=True)
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
        self._insert_head = self._build_fast_insert_head()
        head = self._insert_head or ""  # unused without psycopg (SQLite: SQLAlchemy's insert)
        self._mysql = is_mysql(self.engine.dialect.name)
        self._insert_one = f"{head} VALUES {_MYSQL_ROW if self._mysql else _PG_ROW}"
        self._unnest_sql = f"{head}{_UNNEST}"
        # The sync psycopg and PyMySQL drivers (the async ones are reached through
        # SQLAlchemy's adaptation).
        self._raw_driver = self.engine.dialect.driver in ("psycopg", "pymysql")
        dbapi = getattr(self.engine.dialect, "loaded_dbapi", None)
        self._dbapi_error: type[Exception] = getattr(dbapi, "Error", Exception)

    # -- schema ---------------------------------------------------------------------------

    @property
    def metadata(self) -> MetaData:
        """The SQLAlchemy MetaData holding the outbox table (for Alembic autogenerate)."""
        return self.schema.metadata

    @property
    def table(self) -> Table:
        return self.schema.table

    def create_schema(
        self, *, notify: bool | None = None, partitioned: str | int | None = None
    ) -> None:
        """Create the outbox table and its indexes if they do not exist (idempotent).

        ``notify`` (PostgreSQL): True adds the NOTIFY trigger that wakes relays at once (at
        the price of a global lock at every writer's commit), False drops it; None, the
        default, creates a new table without it (relays poll, quickly while busy) and leaves
        an existing table as it is. See ``outbox.schema``.

        ``partitioned`` (PostgreSQL): ``"hourly"``, ``"daily"`` or seconds per partition (a
        whole number, e.g. 120) creates the table partitioned on ``created_at``; retention
        then drops whole partitions (``outbox.partitions``). ConfigError on SQLite or when
        the table already exists unpartitioned.
        """
        create_schema(self.engine, self.schema, notify=notify, partitioned=partitioned)

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

    def checked_events(self, specs: Iterable[EventSpec]) -> list[NewEvent]:
        """Validate what ``emit_many`` takes (:func:`check_specs`, with this payload limit)."""
        return check_specs(specs, self.max_payload_bytes)

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
        checked = self.checked_events(events)
        self.write(session_or_connection, checked)
        return [event.event_id for event in checked]

    def write(self, session_or_connection: Session | Connection, events: list[NewEvent]) -> None:
        """Insert already-validated events in the caller's transaction (one round trip).

        This is the one writer of outbox rows: the sync ways in call it directly, the async
        ones (:class:`outbox.aio.AsyncOutbox`) through ``run_sync`` on the same Session or
        Connection, so both write the same statement.
        """
        if not events:
            return
        if isinstance(session_or_connection, Session):
            if session_or_connection.autoflush:
                # As Session.execute would: the ORM's pending state change (an UPDATE that
                # locks the aggregate) goes first, so that for one key the row's seq is
                # taken after that lock, and seq order stays commit order.
                session_or_connection.flush()
            connection = self._connection_of(session_or_connection)
        elif isinstance(session_or_connection, Connection):
            connection = session_or_connection
        else:
            raise TypeError(
                "emit needs a SQLAlchemy Session or Connection, got "
                f"{type(session_or_connection).__name__}"
            )
        self._insert(connection, events)

    def _connection_of(self, session: Session) -> Connection:
        # A Session with several binds picks the one for the outbox table.
        return session.connection(bind_arguments={"clause": self.schema.table})

    def _insert(self, connection: Connection, events: list[NewEvent]) -> None:
        if self._insert_head is None:
            statement = insert(self.schema.table)
            if len(events) == 1:
                connection.execute(statement, events[0].row())
            else:
                # executemany: SQLite runs it in-process; one statement.
                connection.execute(statement, [event.row() for event in events])
            return
        if self._mysql:
            # MySQL: the same hand-written INSERT, the payload text from validation as it is
            # (a JSON column parses it); several rows go as one executemany, which PyMySQL
            # and aiomysql send as one multi-row INSERT.
            params = row_params(events)
            if len(events) == 1:  # straight to PyMySQL's cursor (see _driver_execute)
                self._driver_execute(connection, self._insert_one, tuple(params))
                return
            width = len(INSERT_COLUMNS)
            rows = [tuple(params[i : i + width]) for i in range(0, len(params), width)]
            connection.exec_driver_sql(self._insert_one, rows)
            return
        # psycopg: a hand-written INSERT sent straight to the driver. Through insert(table)
        # a Connection transaction spent more client CPU on the INSERT than a hand-written
        # text() INSERT did (per transaction: bare 441 us, + text() INSERT 732, +
        # insert(table) 1075, this 691; issue 10): SQLAlchemy's bind processing re-encodes
        # the payload we already encoded while validating, and builds the parameters column
        # by column. Here the payload text from validation is cast to jsonb by the server,
        # and psycopg prepares the statement after a few executions like any other.
        if len(events) == 1:
            self._driver_execute(connection, self._insert_one, tuple(row_params(events)))
            return
        # Several rows: one array per column. A multi-row VALUES has 8 parameters a row, and
        # psycopg parses a query with more than 50 parameters again on every execution (its
        # cache stops there): emit_many of 10 spent more client CPU than a hand-written
        # executemany of the same rows. This statement is the same text for any number of
        # rows, so psycopg caches and prepares it once; WITH ORDINALITY ... ORDER BY keeps the
        # rows in the order given (seq order within the transaction).
        for start in range(0, len(events), _MAX_ARRAY_ROWS):
            chunk = events[start : start + _MAX_ARRAY_ROWS]
            self._driver_execute(connection, self._unnest_sql, _column_arrays(chunk))

    def _driver_execute(self, connection: Connection, sql: str, params: Any) -> None:
        """Run our INSERT on the psycopg connection itself when nothing could tell the
        difference: the caller's transaction is open, no event listener and no echo (what
        SQLAlchemy would add). Else, and on any other driver, through ``exec_driver_sql``.

        SQLAlchemy's execution context costs the writer about 10 us of client CPU per
        transaction (109 against 98 us for a whole one-event transaction on one thread,
        issue 25): part of its gap to a minimal hand-written outbox. A driver error is
        raised as SQLAlchemy would raise it (``DBAPIError.instance``: an ``IntegrityError``
        for a duplicate event id), and a lost connection is invalidated, as it would be.
        """
        if not (self._raw_driver and _nobody_listens(connection)):
            connection.exec_driver_sql(sql, params)
            return
        dbapi_connection: Any = connection.connection.dbapi_connection
        try:
            with dbapi_connection.cursor() as cursor:
                cursor.execute(sql, params)
        except self._dbapi_error as exc:
            dialect = connection.dialect
            lost = dialect.is_disconnect(exc, dbapi_connection, None)  # type: ignore[arg-type]
            if lost:
                connection.invalidate(exc)
            raise DBAPIError.instance(
                sql, params, exc, self._dbapi_error, connection_invalidated=lost, dialect=dialect
            ) from exc
        except BaseException as exc:
            # Ctrl-C or a cancelled greenlet mid-statement: the connection's state is unknown,
            # so it is not given back to the pool as it is (SQLAlchemy does the same).
            if not isinstance(exc, Exception):
                connection.invalidate(exc)
            raise

    # -- transactions we own --------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Open a Session and transaction; commit on success, roll back on any exception."""
        with self._sessions() as session, session.begin():
            tx = Transaction(self, session)
            session.info[PENDING_EVENTS_KEY] = tx.pending
            yield tx
            self.write_with_commit(session, tx.pending)

    def _before_commit(self, session: Session) -> None:
        """A commit we did not make ourselves (``tx.session.commit()``): write buffered events
        first, in the transaction being committed."""
        pending: list[NewEvent] | None = session.info.get(PENDING_EVENTS_KEY)
        if pending:
            session.flush()  # the state change first (see write), whatever autoflush says
            events = list(pending)
            pending.clear()
            self.write(session, events)

    def write_with_commit(self, session: Session, pending: list[NewEvent]) -> None:
        """Write the buffered events just before the COMMIT of a transaction we own.

        The ORM flush comes first, so the state change precedes the events. The events go
        in with the same prepared INSERT as ``emit`` (one statement for all of them), then
        the Session commits: a domain transaction with ``tx.emit`` costs what the same
        transaction with a hand-written INSERT costs.

        Measured and dropped (issue 10): sending ``INSERT ...; COMMIT`` as one simple query
        with client-side binding saves a round trip, but the server then parses and plans
        the INSERT every time (a simple query cannot use a prepared statement). Alternating
        rounds of one writer (UPDATE + INSERT + COMMIT, psycopg, loopback): 830/837/510/453
        us per transaction for the one-message form against 784/761/433/355 for INSERT then
        COMMIT; pipeline mode (prepared INSERT and COMMIT in one flush) 803/941/417/431, no
        better and psycopg-specific. The async path (``outbox.aio``) runs this same method
        through ``AsyncSession.run_sync``.
        """
        if not pending:
            return
        session.flush()
        events = list(pending)
        pending.clear()
        self._insert(self._connection_of(session), events)  # flushed just above

    def _build_fast_insert_head(self) -> str | None:
        dialect = self.engine.dialect
        fast_pg = dialect.name == "postgresql" and dialect.driver in ("psycopg", "psycopg_async")
        # MySQL drivers (PyMySQL, aiomysql, mysqlclient) all take %s placeholders.
        fast_mysql = is_mysql(dialect.name) and dialect.paramstyle in ("format", "pyformat")
        if not (fast_pg or fast_mysql):
            return None
        preparer = dialect.identifier_preparer
        columns = ", ".join(preparer.quote(name) for name in INSERT_COLUMNS)
        table = preparer.format_table(self.schema.table)
        return f"INSERT INTO {table} ({columns})"

    def create_schema_on(
        self,
        connection: Connection,
        *,
        notify: bool | None = None,
        partitioned: str | int | None = None,
    ) -> None:
        """``create_schema`` on a Connection the caller holds (the async path runs it)."""
        create_schema(connection, self.schema, notify=notify, partitioned=partitioned)

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


class EventBuffer:
    """``emit`` and ``emit_many`` of a transaction we own: validate now, buffer, write at
    commit. Shared by :class:`Transaction` and the async one (``outbox.aio``), which differ
    only in their session."""

    pending: list[NewEvent]

    @property
    def _validator(self) -> Outbox:
        raise NotImplementedError

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
        new = self._validator.event(
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
        checked = self._validator.checked_events(events)
        self.pending.extend(checked)
        return [new.event_id for new in checked]

    def _take_pending(self) -> list[NewEvent]:
        events = list(self.pending)
        self.pending.clear()
        return events


@dataclass(frozen=True)
class Transaction(EventBuffer):
    """One open domain transaction: ``session`` for the state change, ``emit`` for events.

    Events emitted here are validated at once and written when the transaction commits (see
    the module documentation); ``flush()`` writes them now.
    """

    outbox: Outbox
    session: Session
    pending: list[NewEvent] = field(default_factory=list, repr=False)

    @property
    def _validator(self) -> Outbox:
        return self.outbox

    @property
    def connection(self) -> Connection:
        """The Connection the session's transaction runs on."""
        return self.session.connection()

    def flush(self) -> None:
        """Write the events emitted so far now, still inside this transaction."""
        if self.pending:
            self.outbox.write(self.session, self._take_pending())


def _nobody_listens(connection: Connection) -> bool:
    """Whether a statement sent straight to the driver is one SQLAlchemy would have sent
    alike: inside the transaction it began (so its commit covers it), with no event
    listener and no echo to tell (attributes of SQLAlchemy 1.4-2.1; missing, it says no)."""
    return (
        connection.in_transaction()
        and getattr(connection, "_has_events", True) is False
        and getattr(connection.engine, "_has_events", True) is False
        and getattr(connection, "_echo", True) is False
    )
