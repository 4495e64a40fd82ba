"""Guarantee 1 (atomic write) and the write path's validation: ONE contract suite for every
way in, sync and async, on PostgreSQL, SQLite and MariaDB.

The ``writer`` fixture is parametrised twice: ``outbox_db_url`` (PostgreSQL / SQLite /
MariaDB) and the API (``sync``: :class:`outbox.Outbox`; ``async``: :class:`outbox.AsyncOutbox`
on psycopg's async mode, aiosqlite or aiomysql). A test talks to a small facade with a sync
surface; the async facade runs each call on one event loop (``asyncio.Runner``), and inside a
decorated ``async def`` it awaits through SQLAlchemy's greenlet bridge, so the same test body
checks both paths. Reads for the assertions go through a separate sync engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.util import await_only, greenlet_spawn

from outbox import AsyncOutbox, ConfigError, InvalidEvent, Outbox
from outbox.schema import PENDING

Run = Callable[[Coroutine[Any, Any, Any]], Any]


class Tx:
    """``tx`` of a transaction we own, sync surface over either path."""

    def __init__(self, tx: Any, run: Run | None) -> None:
        self.tx = tx
        self.run = run  # None: the sync path

    def _do(self, value: Any) -> Any:
        return value if self.run is None else self.run(value)

    def execute(self, statement: Any, params: Any = None) -> Any:
        return self._do(self.tx.session.execute(statement, params))

    def emit(self, topic: Any, **kwargs: Any) -> str:
        return str(self.tx.emit(topic, **kwargs))  # a plain call on both paths

    def emit_many(self, events: Any) -> list[str]:
        return list(self.tx.emit_many(events))

    def flush(self) -> None:
        self._do(self.tx.flush())

    def add(self, obj: Any) -> None:
        self.tx.session.add(obj)

    def commit_by_hand(self) -> None:
        self._do(self.tx.session.commit())


class Caller:
    """A Session or Connection the caller owns (sync surface)."""

    def __init__(self, target: Any, run: Run | None) -> None:
        self.target = target
        self.run = run

    def _do(self, value: Any) -> Any:
        return value if self.run is None else self.run(value)

    def execute(self, statement: Any) -> Any:
        return self._do(self.target.execute(statement))

    def commit(self) -> None:
        self._do(self.target.commit())

    def rollback(self) -> None:
        self._do(self.target.rollback())

    def in_transaction(self) -> bool:
        return bool(self.target.in_transaction())


class Writer:
    """The outbox under test, sync or async, behind one sync surface."""

    kind = "sync"

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.box = Outbox(url, **kwargs)
        self.engine: sa.Engine = self.box.engine  # for reads and listeners

    @property
    def table(self) -> sa.Table:
        return self.box.table

    @property
    def metadata(self) -> sa.MetaData:
        return self.table.metadata

    @property
    def write_engine(self) -> sa.Engine:
        """The (sync facade of the) engine the events are written through, for listeners."""
        return self.box.engine

    def create_schema(self) -> None:
        self.box.create_schema()

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self.box.transaction() as tx:
            yield Tx(tx, None)

    def transactional(self, fn: Any = None, *, parentheses: bool = False) -> Any:
        def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
            def domain(tx: Any, *args: Any, **kwargs: Any) -> Any:
                return body(Tx(tx, None), *args, **kwargs)

            domain.__name__ = body.__name__
            return (
                self.box.transactional()(domain) if parentheses else self.box.transactional(domain)
            )

        return wrap if fn is None else wrap(fn)

    @contextmanager
    def session(self) -> Iterator[Caller]:
        with Session(self.engine) as session:
            yield Caller(session, None)

    @contextmanager
    def begin(self) -> Iterator[Caller]:
        with self.engine.begin() as conn:
            yield Caller(conn, None)

    @contextmanager
    def connect(self) -> Iterator[Caller]:
        with self.engine.connect() as conn:
            yield Caller(conn, None)

    def begin_on(self, caller: Caller) -> Any:
        return caller.target.begin()

    def emit(self, caller: Any, topic: Any, **kwargs: Any) -> str:
        target = caller.target if isinstance(caller, Caller) else caller
        return self.box.emit(target, topic, **kwargs)

    def emit_many(self, caller: Caller, events: Any) -> list[str]:
        return self.box.emit_many(caller.target, events)

    def close(self) -> None:
        self.box.engine.dispose()


class AsyncWriter(Writer):
    kind = "async"

    def __init__(self, url: str, **kwargs: Any) -> None:
        self.runner = asyncio.Runner()
        self.abox = AsyncOutbox(url, **kwargs)
        self.box = Outbox(url, **kwargs)  # reads only; never writes events here
        self.engine = self.box.engine

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.runner.run(coro)

    @property
    def table(self) -> sa.Table:
        return self.abox.table

    @property
    def write_engine(self) -> sa.Engine:
        return self.abox.engine.sync_engine

    def create_schema(self) -> None:
        self.run(self.abox.create_schema())

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        manager = self.abox.transaction()
        tx = self.run(manager.__aenter__())
        try:
            yield Tx(tx, self.run)
        except BaseException as exc:
            if not self.run(manager.__aexit__(type(exc), exc, exc.__traceback__)):
                raise
        else:
            self.run(manager.__aexit__(None, None, None))

    def transactional(self, fn: Any = None, *, parentheses: bool = False) -> Any:
        def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
            # The body is sync test code: inside the decorated coroutine it runs in a
            # greenlet, where each session call is awaited by await_only.
            async def domain(tx: Any, *args: Any, **kwargs: Any) -> Any:
                return await greenlet_spawn(body, Tx(tx, await_only), *args, **kwargs)

            domain.__name__ = body.__name__
            decorated = (
                self.abox.transactional()(domain)
                if parentheses
                else self.abox.transactional(domain)
            )

            def call(*args: Any, **kwargs: Any) -> Any:
                return self.run(decorated(*args, **kwargs))

            call.__name__ = decorated.__name__
            return call

        return wrap if fn is None else wrap(fn)

    @contextmanager
    def session(self) -> Iterator[Caller]:
        session = AsyncSession(self.abox.engine)
        try:
            yield Caller(session, self.run)
        finally:
            self.run(session.close())

    @contextmanager
    def begin(self) -> Iterator[Caller]:
        manager = self.abox.engine.begin()
        conn = self.run(manager.__aenter__())
        try:
            yield Caller(conn, self.run)
        except BaseException as exc:
            self.run(manager.__aexit__(type(exc), exc, exc.__traceback__))
            raise
        else:
            self.run(manager.__aexit__(None, None, None))

    @contextmanager
    def connect(self) -> Iterator[Caller]:
        conn: AsyncConnection = self.run(self.abox.engine.connect().start())
        try:
            yield Caller(conn, self.run)
        finally:
            self.run(conn.close())

    def begin_on(self, caller: Caller) -> Any:
        trans = self.run(caller.target.begin().start())

        class Trans:
            is_active = property(lambda _self: trans.is_active)

            def rollback(_self) -> None:
                self.run(trans.rollback())

        return Trans()

    def emit(self, caller: Any, topic: Any, **kwargs: Any) -> str:
        target = caller.target if isinstance(caller, Caller) else caller
        return str(self.run(self.abox.emit(target, topic, **kwargs)))

    def emit_many(self, caller: Caller, events: Any) -> list[str]:
        return list(self.run(self.abox.emit_many(caller.target, events)))

    def close(self) -> None:
        self.run(self.abox.dispose())
        self.runner.close()
        self.box.engine.dispose()


WRITERS: dict[str, type[Writer]] = {"sync": Writer, "async": AsyncWriter}


@pytest.fixture(params=["sync", "async"])
def api(request: pytest.FixtureRequest) -> type[Writer]:
    return WRITERS[request.param]


@pytest.fixture
def outbox(outbox_db_url: str, api: type[Writer]) -> Iterator[Writer]:
    writer = api(outbox_db_url)
    writer.create_schema()
    with writer.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE quotes (id INTEGER PRIMARY KEY, state VARCHAR(20))"))
        conn.execute(sa.text("INSERT INTO quotes (id, state) VALUES (17, 'draft')"))
    yield writer
    writer.close()


def events(box: Writer) -> list[sa.Row[Any]]:
    table = box.table
    with box.engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.seq)).all())


def quote_state(box: Writer) -> str:
    with box.engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT state FROM quotes WHERE id = 17")).scalar_one())


APPROVE = sa.text("UPDATE quotes SET state = 'approved' WHERE id = 17")


class Boom(Exception):
    pass


class Base(DeclarativeBase):
    pass


class Note(Base):
    __tablename__ = "notes"
    id: Mapped[int] = mapped_column(primary_key=True)
    text: Mapped[str] = mapped_column(sa.String(200))


# -- atomic write ------------------------------------------------------------------------------


def test_commit_makes_event_visible_with_state_change(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        tx.execute(APPROVE)
        event_id = tx.emit(
            "quote.approved",
            key="quote-017",
            payload={"total": 120},
            tenant="studio",
            identity="studio:send-quote-017",
            headers={"traceparent": "00-abc-def-01"},
        )
        # Not visible outside the transaction before commit.
        assert events(outbox) == []
    assert quote_state(outbox) == "approved"
    [row] = events(outbox)
    assert row.event_id == event_id
    assert (row.topic, row.key, row.tenant, row.identity) == (
        "quote.approved",
        "quote-017",
        "studio",
        "studio:send-quote-017",
    )
    assert row.payload == {"total": 120}
    assert row.headers == {"traceparent": "00-abc-def-01"}
    assert row.state == PENDING
    assert row.attempts == 0
    assert row.stream_id is None


def test_identity_defaults_to_event_id(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        event_id = tx.emit("quote.approved", key="quote-017", payload={})
    [row] = events(outbox)
    assert row.identity == event_id
    assert row.tenant is None


def test_exception_in_with_block_rolls_back_both(outbox: Writer) -> None:
    with pytest.raises(Boom), outbox.transaction() as tx:
        tx.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"total": 120})
        raise Boom
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


def test_explicit_rollback_leaves_neither(outbox: Writer) -> None:
    with outbox.session() as session:
        session.execute(APPROVE)
        outbox.emit(session, "quote.approved", key="quote-017", payload={"total": 120})
        session.rollback()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


def test_transactional_decorator_commits_and_passes_arguments(outbox: Writer) -> None:
    @outbox.transactional
    def approve(tx: Any, quote_id: int, *, total: int) -> str:
        tx.execute(sa.text("UPDATE quotes SET state = 'approved' WHERE id = :id"), {"id": quote_id})
        return str(tx.emit("quote.approved", key=f"quote-{quote_id}", payload={"total": total}))

    event_id = approve(17, total=5)
    assert approve.__name__ == "approve"
    assert quote_state(outbox) == "approved"
    assert [row.event_id for row in events(outbox)] == [event_id]


def test_transactional_decorator_with_parentheses(outbox: Writer) -> None:
    @outbox.transactional(parentheses=True)
    def approve(tx: Any) -> None:
        tx.emit("quote.approved", key="quote-017", payload=1)

    approve()
    assert len(events(outbox)) == 1


def test_exception_in_decorated_function_rolls_back_and_propagates(outbox: Writer) -> None:
    @outbox.transactional
    def approve(tx: Any) -> None:
        tx.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"total": 120})
        raise Boom("domain said no")

    with pytest.raises(Boom, match="domain said no"):
        approve()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


# -- joining the caller's transaction ---------------------------------------------------------


def test_emit_joins_callers_session_and_never_commits(outbox: Writer) -> None:
    with outbox.session() as session:
        session.execute(APPROVE)
        outbox.emit(session, "quote.approved", key="quote-017", payload={"n": 1})
        assert session.in_transaction()
        assert events(outbox) == []  # nothing committed behind the caller's back
        session.commit()
    assert quote_state(outbox) == "approved"
    assert len(events(outbox)) == 1


def test_emit_on_callers_connection_joins_and_rollback_removes(outbox: Writer) -> None:
    with outbox.connect() as conn:
        trans = outbox.begin_on(conn)
        conn.execute(APPROVE)
        outbox.emit(conn, "quote.approved", key="quote-017", payload={"n": 1})
        assert trans.is_active
        trans.rollback()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []
    with outbox.begin() as conn:
        conn.execute(APPROVE)
        outbox.emit(conn, "quote.approved", key="quote-017", payload={"n": 2})
    assert quote_state(outbox) == "approved"
    assert [row.payload for row in events(outbox)] == [{"n": 2}]


def test_emit_many_writes_a_list_in_one_statement(outbox: Writer) -> None:
    calls: list[bool] = []

    def count(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if "INSERT" in statement.upper():
            calls.append(many)

    sa.event.listen(outbox.write_engine, "before_cursor_execute", count)
    try:
        with outbox.begin() as conn:
            ids = outbox.emit_many(
                conn,
                [
                    {"topic": "line.added", "key": "quote-017", "payload": {"line": i}}
                    for i in range(250)
                ],
            )
    finally:
        sa.event.remove(outbox.write_engine, "before_cursor_execute", count)
    assert len(calls) == 1, "a list of events must be written with one statement"
    rows = events(outbox)
    assert [row.event_id for row in rows] == ids
    assert [row.payload["line"] for row in rows] == list(range(250))


def test_emit_many_in_our_transaction_writes_all_in_order(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        tx.execute(APPROVE)
        ids = tx.emit_many(
            [{"topic": "line.added", "key": "q", "payload": {"line": i}} for i in range(300)]
        )
    rows = events(outbox)
    assert [row.event_id for row in rows] == ids
    assert [row.payload["line"] for row in rows] == list(range(300))
    assert quote_state(outbox) == "approved"


def test_manual_commit_inside_transaction_keeps_events_with_state_change(outbox: Writer) -> None:
    with pytest.raises(sa.exc.InvalidRequestError), outbox.transaction() as tx:
        tx.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"n": 1})
        tx.commit_by_hand()  # by hand: the buffered event must go with this commit
        assert quote_state(outbox) == "approved"
        assert [row.payload for row in events(outbox)] == [{"n": 1}]
        # SQLAlchemy refuses further work in a begin() block after a manual commit.
        tx.execute(APPROVE)
    assert [row.payload for row in events(outbox)] == [{"n": 1}]


def test_flush_writes_buffered_events_inside_the_transaction(outbox: Writer) -> None:
    with pytest.raises(Boom), outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1)
        tx.flush()
        count = tx.execute(sa.text("SELECT count(*) FROM outbox_events")).scalar()
        assert count == 1
        assert events(outbox) == []  # written, not committed
        raise Boom
    assert events(outbox) == []


def test_orm_changes_commit_with_the_events(outbox: Writer) -> None:
    Base.metadata.create_all(outbox.engine)
    with outbox.transaction() as tx:
        tx.add(Note(id=1, text="approved"))
        tx.emit("note.added", key="note-1", payload={"id": 1})
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM notes")).scalar() == "approved"
    assert len(events(outbox)) == 1
    with pytest.raises(sa.exc.IntegrityError), outbox.transaction() as tx:
        tx.emit("note.added", key="note-1", payload={"id": 1})
        tx.add(Note(id=1, text="duplicate key"))  # flush fails at commit
    assert len(events(outbox)) == 1


def test_duplicate_event_id_fails_the_commit_and_rolls_back(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1, event_id="fixed-id")
    with pytest.raises(Exception, match=r"fixed-id|UNIQUE|unique"), outbox.transaction() as tx:
        tx.execute(APPROVE)
        tx.emit("t", key="k", payload=2, event_id="fixed-id")
    assert quote_state(outbox) == "draft"
    assert [row.payload for row in events(outbox)] == [1]


def test_emit_many_validates_every_event_before_writing(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        with pytest.raises(InvalidEvent) as info:
            tx.emit_many(
                [
                    {"topic": "ok", "key": "k", "payload": 1},
                    {"topic": "ok", "key": "k", "payload": {1, 2}},
                ]
            )
        assert info.value.field == "payload"
        with pytest.raises(InvalidEvent) as info:
            tx.emit_many([{"topic": "ok", "payload": 1}])
        assert info.value.field == "key"
        with pytest.raises(InvalidEvent):
            tx.emit_many([{"topic": "ok", "key": "k", "payload": 1, "colour": "red"}])
        with pytest.raises(InvalidEvent):
            tx.emit_many({"topic": "ok", "key": "k", "payload": 1})  # type: ignore[arg-type]
    assert events(outbox) == []


# -- validation ---------------------------------------------------------------------------------


class Opaque:
    pass


BAD_EVENTS: list[tuple[str, dict[str, Any]]] = [
    ("topic", {"topic": ""}),
    ("topic", {"topic": "   "}),
    ("topic", {"topic": "t" * 201}),
    ("topic", {"topic": None}),
    ("topic", {"topic": 7}),
    # A topic names a Redis key: no whitespace nor control characters (issue 26).
    ("topic", {"topic": "quote approved"}),
    ("topic", {"topic": "outbox.a b\n"}),
    ("topic", {"topic": "quote.approved\t"}),
    ("topic", {"topic": "quote\x1b[31m"}),
    ("key", {"key": ""}),
    ("key", {"key": "k" * 201}),
    ("key", {"key": "a\x00b"}),
    ("tenant", {"tenant": ""}),
    ("tenant", {"tenant": "x" * 201}),
    ("identity", {"identity": ""}),
    ("identity", {"identity": "i" * 201}),
    ("payload", {"payload": {1, 2, 3}}),
    ("payload", {"payload": b"bytes"}),
    ("payload", {"payload": {"total": math.nan}}),
    ("payload", {"payload": {"total": math.inf}}),
    ("payload", {"payload": Opaque()}),
    ("payload", {"payload": {"nested": [Opaque()]}}),
    ("payload", {"payload": {"text": "nul \x00 inside"}}),
    ("payload", {"payload": "x" * (1024 * 1024 + 1)}),
    ("headers", {"headers": {"traceparent": 5}}),
    ("headers", {"headers": {"": "empty name"}}),
    ("headers", {"headers": ["not", "a", "mapping"]}),
]


def test_bad_input_raises_invalid_event_naming_the_field(outbox: Writer) -> None:
    """Every bad event of BAD_EVENTS is refused naming its field, before anything is written:
    the transaction is still usable and the caller decides whether to commit. One outbox for
    all of them (a schema per case made this one test an eighth of the fast tier)."""
    for field, override in BAD_EVENTS:
        arguments: dict[str, Any] = {"topic": "quote.approved", "key": "quote-017", "payload": {}}
        arguments.update(override)
        topic = arguments.pop("topic")
        case = f"{field}: {override!r}"[:120]
        with outbox.transaction() as tx:
            tx.execute(APPROVE)
            try:
                tx.emit(topic, **arguments)
            except InvalidEvent as error:
                assert error.field == field, case
                assert field in str(error), case
                assert isinstance(error, ValueError), case
            else:
                pytest.fail(f"accepted: {case}")
            tx.emit("quote.approved", key="quote-017", payload={"after": "error"})
    assert quote_state(outbox) == "approved"
    assert [row.payload for row in events(outbox)] == [{"after": "error"}] * len(BAD_EVENTS)


def test_a_topic_of_exactly_200_characters_is_accepted(outbox: Writer) -> None:
    """The limit the docs state: more than 200 characters are refused, 200 are not."""
    with outbox.transaction() as tx:
        tx.execute(APPROVE)
        tx.emit("t" * 200, key="k" * 200, payload={})
    assert [row.topic for row in events(outbox)] == ["t" * 200]


def test_payload_size_limit_is_configurable(db_url: str, api: type[Writer]) -> None:
    box = api(db_url, max_payload_bytes=64)
    box.create_schema()
    with box.transaction() as tx:
        tx.emit("t", key="k", payload="x" * 50)
        with pytest.raises(InvalidEvent, match="over the limit of 64"):
            tx.emit("t", key="k", payload="x" * 70)
    assert len(events(box)) == 1
    with pytest.raises(ConfigError, match="max_payload_bytes"):
        api(db_url, max_payload_bytes=0)
    box.close()


def test_emit_rejects_something_that_is_not_a_session(outbox: Writer) -> None:
    with pytest.raises(TypeError, match=r"Session or (Async)?Connection"):
        outbox.emit(outbox.engine, "t", key="k", payload=1)  # type: ignore[arg-type]


# -- schema and configuration ------------------------------------------------------------------


def test_create_schema_is_idempotent_and_metadata_is_exposed(outbox: Writer) -> None:
    outbox.create_schema()
    outbox.create_schema()
    assert "outbox_events" in outbox.metadata.tables
    inspector = sa.inspect(outbox.engine)
    # Every writer pays for each index (issue 25): the pending rows in order, and two
    # partial ones that hold almost nothing (failing keys, quarantined rows). No more. MySQL
    # has no partial index: two whole ones there, (state, seq) and (key, state, seq).
    plain = {ix["name"] for ix in inspector.get_indexes("outbox_events") if not ix["unique"]}
    assert plain == (
        {"ix_outbox_events_state_seq", "ix_outbox_events_key_state"}
        if outbox.engine.dialect.name in ("mysql", "mariadb")
        else {
            "ix_outbox_events_pending",
            "ix_outbox_events_blocked",
            "ix_outbox_events_quarantined",
        }
    )


@pytest.mark.parametrize(
    "bad", ["events; DROP TABLE quotes", "1abc", "a-b", "", "x" * 64, 'q"uote', "a b"]
)
def test_table_and_schema_names_must_be_identifiers(
    db_url: str, api: type[Writer], bad: str
) -> None:
    with pytest.raises(ConfigError, match="table"):
        api(db_url, table=bad)
    with pytest.raises(ConfigError, match="schema"):
        api(db_url, schema=bad)


def test_custom_table_name(db_url: str, api: type[Writer]) -> None:
    box = api(db_url, table="domain_outbox")
    box.create_schema()
    with box.transaction() as tx:
        tx.emit("t", key="k", payload=[1])
    assert sa.inspect(box.engine).has_table("domain_outbox")
    assert len(events(box)) == 1
    box.close()


def test_custom_postgres_schema(pg_admin_engine: sa.Engine, api: type[Writer]) -> None:
    name = f"s_{uuid.uuid4().hex[:10]}"
    box = api("postgresql+psycopg://postgres@127.0.0.1:5432/test", schema=name)
    try:
        box.create_schema()
        box.create_schema()
        with box.transaction() as tx:
            tx.emit("t", key="k", payload=[1])
        with box.engine.connect() as conn:
            count = conn.execute(sa.text(f"SELECT count(*) FROM {name}.outbox_events")).scalar()
        assert count == 1
    finally:
        box.close()
        with pg_admin_engine.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))


def test_bad_database_url_and_argument(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="database_url"):
        Outbox("not a url")
    with pytest.raises(ConfigError, match="unsupported backend"):
        Outbox("oracle://localhost/app")
    with pytest.raises(ConfigError, match="url_or_engine"):
        Outbox(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="database_url"):
        AsyncOutbox("not a url")
    with pytest.raises(ConfigError, match="unsupported backend"):
        AsyncOutbox("oracle://localhost/app")
    with pytest.raises(ConfigError, match="url_or_async_engine"):
        AsyncOutbox(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="url_or_async_engine"):
        AsyncOutbox(sa.create_engine("sqlite://"))  # type: ignore[arg-type]


def test_async_transactional_refuses_a_plain_function(sqlite_url: str) -> None:
    box = AsyncOutbox(sqlite_url)
    with pytest.raises(TypeError, match="async def"):

        @box.transactional
        def approve(tx: Any) -> None:  # not async
            pass


def test_event_ids_are_time_ordered_uuid7(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key="k", payload=i) for i in range(50)]
    assert ids == sorted(ids)
    assert all(uuid.UUID(i).version == 7 for i in ids)
    assert len(set(ids)) == 50


def test_event_ids_of_a_forked_child_share_no_random_bits_with_the_parent() -> None:
    """The random bits are drawn in chunks: a child forked with part of a chunk unused must
    draw its own, or it would make the parent's next ids' random parts."""
    import os

    from outbox.ids import new_event_id

    new_event_id()  # the parent holds a chunk, almost all of it unused
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then exit without running pytest's teardown
        os.close(read)
        os.write(write, ",".join(new_event_id() for _ in range(100)).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    child = b"".join(chunks).decode().split(",")
    parent = [new_event_id() for _ in range(100)]
    assert len(child) == 100
    assert not {i[19:] for i in child} & {i[19:] for i in parent}  # the 62 random bits
    assert all(uuid.UUID(i).version == 7 for i in child + parent)


def test_created_at_comes_from_the_database_clock(outbox: Writer) -> None:
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1)
    with outbox.engine.connect() as conn:
        if outbox.engine.dialect.name == "postgresql":
            age = conn.execute(
                sa.text("SELECT extract(epoch FROM now() - created_at) FROM outbox_events")
            ).scalar_one()
        elif outbox.engine.dialect.name in ("mysql", "mariadb"):
            age = conn.execute(
                sa.text(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) / 1e6 "
                    "FROM outbox_events"
                )
            ).scalar_one()
        else:
            age = conn.execute(
                sa.text(
                    "SELECT (julianday('now') - julianday(created_at)) * 86400 FROM outbox_events"
                )
            ).scalar_one()
    assert -1 < float(age) < 60


# -- concurrency (PostgreSQL) --------------------------------------------------------------------


@pytest.mark.slow  # eight writer threads (~15 s under load)
def test_eight_threads_every_committed_event_present_exactly_once(pg_url: str) -> None:
    box = Outbox(pg_url)
    box.create_schema()
    with box.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE aggregates (id INTEGER PRIMARY KEY, version INTEGER)"))
        conn.execute(sa.text("INSERT INTO aggregates SELECT g, 0 FROM generate_series(0, 7) g"))
    committed: list[list[str]] = [[] for _ in range(8)]
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(500):
                try:
                    with box.transaction() as tx:
                        tx.session.execute(
                            sa.text("UPDATE aggregates SET version = version + 1 WHERE id = :id"),
                            {"id": n},
                        )
                        event_id = tx.emit("load", key=f"agg-{n}", payload={"i": i})
                        if i % 10 == 9:
                            raise Boom  # every tenth transaction rolls back
                    committed[n].append(event_id)
                except Boom:
                    pass
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    expected = [event_id for ids in committed for event_id in ids]
    assert len(expected) == 8 * 450
    with box.engine.connect() as conn:
        stored = [r[0] for r in conn.execute(sa.text("SELECT event_id FROM outbox_events"))]
        versions = dict(conn.execute(sa.text("SELECT id, version FROM aggregates")).all())
    assert sorted(stored) == sorted(expected)  # each committed event exactly once, no others
    assert versions == dict.fromkeys(range(8), 450)
    box.engine.dispose()


@pytest.mark.slow
def test_fifty_async_tasks_every_committed_event_present_exactly_once(outbox_db_url: str) -> None:
    """50 concurrent tasks on one event loop x 200 transactions, one in ten rolled back."""
    tasks, per_task = 50, 200

    async def scenario() -> tuple[list[str], list[str], dict[int, int]]:
        box = AsyncOutbox(outbox_db_url)
        await box.create_schema()
        async with box.engine.begin() as conn:
            await conn.execute(
                sa.text("CREATE TABLE aggregates (id INTEGER PRIMARY KEY, version INTEGER)")
            )
            for n in range(tasks):
                await conn.execute(sa.text("INSERT INTO aggregates VALUES (:n, 0)"), {"n": n})
        committed: list[str] = []

        async def writer(n: int) -> None:
            for i in range(per_task):
                try:
                    async with box.transaction() as tx:
                        await tx.session.execute(
                            sa.text("UPDATE aggregates SET version = version + 1 WHERE id = :id"),
                            {"id": n},
                        )
                        event_id = tx.emit("load", key=f"agg-{n}", payload={"i": i})
                        if i % 10 == 9:
                            raise Boom  # every tenth transaction rolls back
                    committed.append(event_id)
                except Boom:
                    pass

        await asyncio.gather(*(writer(n) for n in range(tasks)))
        async with box.engine.connect() as conn:
            stored = [
                r[0] for r in await conn.execute(sa.text("SELECT event_id FROM outbox_events"))
            ]
            versions = dict(
                (await conn.execute(sa.text("SELECT id, version FROM aggregates"))).all()
            )
        await box.dispose()
        return committed, stored, versions

    committed, stored, versions = asyncio.run(scenario())
    assert len(committed) == tasks * per_task * 9 // 10
    assert sorted(stored) == sorted(committed)  # each committed event exactly once, no others
    assert versions == dict.fromkeys(range(tasks), per_task * 9 // 10)


# -- NOTIFY is a choice (PostgreSQL) -------------------------------------------------------------


def test_notify_trigger_is_a_choice_kept_by_later_default_calls(pg_url: str) -> None:
    from outbox.schema import has_notify_trigger

    box = Outbox(pg_url)

    def trigger() -> bool:
        with box.engine.connect() as conn:
            return has_notify_trigger(conn, box.schema)

    box.create_schema(notify=False)  # a new table without the trigger
    assert not trigger()
    box.create_schema()  # default (a relay starting): leaves an existing table as it is
    assert not trigger()
    box.create_schema(notify=True)
    assert trigger()
    box.create_schema()
    assert trigger()
    box.create_schema(notify=False)  # dropped again
    assert not trigger()
    with box.transaction() as tx:  # writes work without it
        tx.emit("t", key="k", payload=1)
    assert len(events_of(box)) == 1
    box.engine.dispose()


def test_new_table_has_no_trigger_by_default_and_async_create_schema_chooses(
    pg_url: str,
) -> None:
    from outbox.schema import has_notify_trigger

    async def scenario() -> tuple[bool, bool]:
        box = AsyncOutbox(pg_url)
        await box.create_schema()  # issue 25: no NOTIFY lock at writers' commits by default
        async with box.engine.connect() as conn:
            first = await conn.run_sync(has_notify_trigger, box.schema)
        await box.create_schema(notify=True)
        async with box.engine.connect() as conn:
            second = await conn.run_sync(has_notify_trigger, box.schema)
        await box.create_schema()  # the default keeps an existing table's choice
        async with box.engine.connect() as conn:
            third = await conn.run_sync(has_notify_trigger, box.schema)
        await box.dispose()
        return first, second, third

    assert asyncio.run(scenario()) == (False, True, True)


def test_init_db_no_notify(pg_url: str) -> None:
    from outbox.schema import has_notify_trigger
    from relay.cli import main

    assert main(["init-db", "--database-url", pg_url, "--no-notify"]) == 0
    box = Outbox(pg_url)
    with box.engine.connect() as conn:
        assert not has_notify_trigger(conn, box.schema)
    assert main(["init-db", "--database-url", pg_url, "--notify"]) == 0  # opting back in
    with box.engine.connect() as conn:
        assert has_notify_trigger(conn, box.schema)
    assert main(["init-db", "--database-url", pg_url]) == 0  # the default keeps the choice
    with box.engine.connect() as conn:
        assert has_notify_trigger(conn, box.schema)
    assert main(["init-db", "--database-url", pg_url, "--no-notify"]) == 0
    with box.engine.connect() as conn:
        assert not has_notify_trigger(conn, box.schema)
    box.engine.dispose()


def events_of(box: Outbox) -> list[sa.Row[Any]]:
    with box.engine.connect() as conn:
        return list(conn.execute(sa.select(box.table)).all())


def test_async_sqlite_engine_has_the_sync_engines_settings(tmp_path: Any) -> None:
    """sqlite:/// maps to aiosqlite, with WAL and the busy timeout of make_engine."""

    async def pragmas() -> tuple[str, str, int]:
        box = AsyncOutbox(f"sqlite:///{tmp_path}/a.db")
        async with box.engine.connect() as conn:
            mode = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one()
            timeout = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar_one()
        await box.dispose()
        return box.engine.url.drivername, str(mode), int(timeout)

    assert asyncio.run(pragmas()) == ("sqlite+aiosqlite", "wal", 30000)


def test_emit_on_a_session_with_several_binds_uses_the_outbox_tables_engine(
    sqlite_url: str, tmp_path: Any
) -> None:
    box = Outbox(sqlite_url)
    box.create_schema()
    other = sa.create_engine(f"sqlite:///{tmp_path}/other.db")
    Base.metadata.create_all(other)
    with Session(binds={Note: other, box.table: box.engine}) as session:
        session.add(Note(id=1, text="elsewhere"))
        box.emit(session, "t", key="k", payload=1)
        session.commit()
    assert len(events_of(box)) == 1
    other.dispose()
    box.engine.dispose()


@pytest.mark.parametrize("way", ["emit", "manual commit", "transaction"])
def test_pending_orm_changes_are_written_before_the_event(outbox_db_url: str, way: str) -> None:
    """The state change (which locks the aggregate) precedes the outbox INSERT, so for one
    key the event's seq is taken after that lock: seq order stays commit order."""
    box = Outbox(outbox_db_url)
    box.create_schema()
    Base.metadata.create_all(box.engine)
    order: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("INSERT"):
            order.append("notes" if "notes" in statement else "outbox")

    sa.event.listen(box.engine, "before_cursor_execute", record)
    if way == "emit":
        with Session(box.engine) as session:
            session.add(Note(id=1, text="approved"))
            box.emit(session, "note.added", key="note-1", payload={})
            session.commit()
    elif way == "manual commit":
        with pytest.raises(sa.exc.InvalidRequestError), box.transaction() as tx:
            tx.emit("note.added", key="note-1", payload={})
            tx.session.add(Note(id=1, text="approved"))
            tx.session.commit()
            tx.session.execute(sa.text("SELECT 1"))  # refused after a manual commit
    else:
        with box.transaction() as tx:
            tx.emit("note.added", key="note-1", payload={})
            tx.session.add(Note(id=1, text="approved"))
    assert order == ["notes", "outbox"]
    box.engine.dispose()


# -- the INSERT straight on the driver (issue 25) ---------------------------------------------


@pytest.fixture(params=["pg", "mysql"])
def driver_url(request: pytest.FixtureRequest) -> str:
    """The databases whose sync driver takes the INSERT straight (psycopg, PyMySQL)."""
    return str(request.getfixturevalue(f"{request.param}_url"))


def test_the_driver_path_is_what_sqlalchemy_would_have_sent(driver_url: str) -> None:
    """On psycopg and PyMySQL, a single event's INSERT goes straight to the driver inside the
    caller's transaction when nothing would tell the difference; what it raises, and what a
    listener or a connection with no transaction yet sees, is SQLAlchemy's."""
    outbox = Outbox(driver_url)
    outbox.create_schema()
    with outbox.engine.begin() as conn:  # the fast path: a transaction, nobody listening
        outbox.emit(conn, "t", key="k", payload=1, event_id="fixed-id")
    # A duplicate event id is SQLAlchemy's IntegrityError, whichever path raised it, and the
    # transaction is rolled back.
    with pytest.raises(sa.exc.IntegrityError, match="fixed-id"), outbox.engine.begin() as conn:
        outbox.emit(conn, "t", key="k", payload=2, event_id="fixed-id")
    # The first statement on a fresh Connection: SQLAlchemy begins, and its commit covers it.
    with outbox.engine.connect() as conn:
        outbox.emit(conn, "t", key="k", payload=3)
        conn.commit()
    # A listener sees our INSERT, as it sees every statement.
    seen: list[str] = []

    def listen(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)

    sa.event.listen(outbox.engine, "before_cursor_execute", listen)
    try:
        with outbox.engine.begin() as conn:
            outbox.emit(conn, "t", key="k", payload=4)
    finally:
        sa.event.remove(outbox.engine, "before_cursor_execute", listen)
    assert any("INSERT INTO" in s and "outbox_events" in s for s in seen)
    with outbox.engine.connect() as conn:
        payloads = conn.execute(sa.text("SELECT payload FROM outbox_events ORDER BY seq"))
        # psycopg decodes jsonb; MySQL's JSON comes back as its text through text().
        got = [json.loads(p) if isinstance(p, str) else p for (p,) in payloads]
        assert got == [1, 3, 4]
    outbox.engine.dispose()


def test_a_connection_lost_under_the_driver_path_is_invalidated(driver_url: str) -> None:
    outbox = Outbox(driver_url)
    outbox.create_schema()
    admin = sa.create_engine(driver_url)
    mysql = outbox.engine.dialect.name == "mysql"
    whoami = "SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()"
    try:
        with pytest.raises(sa.exc.DBAPIError) as caught, outbox.engine.begin() as conn:
            pid = int(conn.execute(sa.text(whoami)).scalar_one())
            with admin.begin() as other:
                if mysql:
                    other.execute(sa.text(f"KILL {pid}"))
                else:
                    other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
            outbox.emit(conn, "t", key="k", payload=1)
        assert caught.value.connection_invalidated
        with outbox.engine.begin() as conn:  # the pool hands out a working connection
            outbox.emit(conn, "t", key="k", payload=2)
    finally:
        admin.dispose()
        outbox.engine.dispose()
