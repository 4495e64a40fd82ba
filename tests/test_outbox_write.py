"""Guarantee 1 (atomic write) and the write path's validation, on PostgreSQL and SQLite.

The same contract suite runs on both backends through the ``db_url`` fixture.
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from outbox import ConfigError, InvalidEvent, Outbox
from outbox.schema import PENDING


@pytest.fixture
def outbox(db_url: str) -> Iterator[Outbox]:
    box = Outbox(db_url)
    box.create_schema()
    with box.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE quotes (id INTEGER PRIMARY KEY, state VARCHAR(20))"))
        conn.execute(sa.text("INSERT INTO quotes (id, state) VALUES (17, 'draft')"))
    yield box
    box.engine.dispose()


def events(box: Outbox) -> list[sa.Row[Any]]:
    table = box.table
    with box.engine.connect() as conn:
        return list(conn.execute(sa.select(table).order_by(table.c.seq)).all())


def quote_state(box: Outbox) -> str:
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
    text: Mapped[str]


# -- atomic write ------------------------------------------------------------------------------


def test_commit_makes_event_visible_with_state_change(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.session.execute(APPROVE)
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


def test_identity_defaults_to_event_id(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        event_id = tx.emit("quote.approved", key="quote-017", payload={})
    [row] = events(outbox)
    assert row.identity == event_id
    assert row.tenant is None


def test_exception_in_with_block_rolls_back_both(outbox: Outbox) -> None:
    with pytest.raises(Boom), outbox.transaction() as tx:
        tx.session.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"total": 120})
        raise Boom
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


def test_explicit_rollback_leaves_neither(outbox: Outbox) -> None:
    with Session(outbox.engine) as session:
        session.execute(APPROVE)
        outbox.emit(session, "quote.approved", key="quote-017", payload={"total": 120})
        session.rollback()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


def test_transactional_decorator_commits_and_passes_arguments(outbox: Outbox) -> None:
    @outbox.transactional
    def approve(tx: Any, quote_id: int, *, total: int) -> str:
        tx.session.execute(
            sa.text("UPDATE quotes SET state = 'approved' WHERE id = :id"), {"id": quote_id}
        )
        return str(tx.emit("quote.approved", key=f"quote-{quote_id}", payload={"total": total}))

    event_id = approve(17, total=5)
    assert approve.__name__ == "approve"
    assert quote_state(outbox) == "approved"
    assert [row.event_id for row in events(outbox)] == [event_id]


def test_transactional_decorator_with_parentheses(outbox: Outbox) -> None:
    @outbox.transactional()
    def approve(tx: Any) -> None:
        tx.emit("quote.approved", key="quote-017", payload=1)

    approve()
    assert len(events(outbox)) == 1


def test_exception_in_decorated_function_rolls_back_and_propagates(outbox: Outbox) -> None:
    @outbox.transactional
    def approve(tx: Any) -> None:
        tx.session.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"total": 120})
        raise Boom("domain said no")

    with pytest.raises(Boom, match="domain said no"):
        approve()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []


# -- joining the caller's transaction ---------------------------------------------------------


def test_emit_joins_callers_session_and_never_commits(outbox: Outbox) -> None:
    with Session(outbox.engine) as session:
        session.execute(APPROVE)
        outbox.emit(session, "quote.approved", key="quote-017", payload={"n": 1})
        assert session.in_transaction()
        assert events(outbox) == []  # nothing committed behind the caller's back
        session.commit()
    assert quote_state(outbox) == "approved"
    assert len(events(outbox)) == 1


def test_emit_on_callers_connection_joins_and_rollback_removes(outbox: Outbox) -> None:
    with outbox.engine.connect() as conn:
        trans = conn.begin()
        conn.execute(APPROVE)
        outbox.emit(conn, "quote.approved", key="quote-017", payload={"n": 1})
        assert trans.is_active
        trans.rollback()
    assert quote_state(outbox) == "draft"
    assert events(outbox) == []
    with outbox.engine.begin() as conn:
        conn.execute(APPROVE)
        outbox.emit(conn, "quote.approved", key="quote-017", payload={"n": 2})
    assert quote_state(outbox) == "approved"
    assert [row.payload for row in events(outbox)] == [{"n": 2}]


def test_emit_many_writes_a_list_in_one_statement(outbox: Outbox) -> None:
    calls: list[bool] = []

    def count(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if "INSERT" in statement.upper():
            calls.append(many)

    sa.event.listen(outbox.engine, "before_cursor_execute", count)
    try:
        with Session(outbox.engine) as session, session.begin():
            ids = outbox.emit_many(
                session,
                [
                    {"topic": "line.added", "key": "quote-017", "payload": {"line": i}}
                    for i in range(250)
                ],
            )
    finally:
        sa.event.remove(outbox.engine, "before_cursor_execute", count)
    assert len(calls) == 1, "a list of events must be written with one statement"
    rows = events(outbox)
    assert [row.event_id for row in rows] == ids
    assert [row.payload["line"] for row in rows] == list(range(250))


def test_emit_many_in_our_transaction_writes_all_in_order(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.session.execute(APPROVE)
        ids = tx.emit_many(
            [{"topic": "line.added", "key": "q", "payload": {"line": i}} for i in range(300)]
        )
    rows = events(outbox)
    assert [row.event_id for row in rows] == ids
    assert [row.payload["line"] for row in rows] == list(range(300))
    assert quote_state(outbox) == "approved"


def test_manual_commit_inside_transaction_keeps_events_with_state_change(outbox: Outbox) -> None:
    with pytest.raises(sa.exc.InvalidRequestError), outbox.transaction() as tx:
        tx.session.execute(APPROVE)
        tx.emit("quote.approved", key="quote-017", payload={"n": 1})
        tx.session.commit()  # by hand: the buffered event must go with this commit
        assert quote_state(outbox) == "approved"
        assert [row.payload for row in events(outbox)] == [{"n": 1}]
        # SQLAlchemy refuses further work in a begin() block after a manual commit.
        tx.session.execute(APPROVE)
    assert [row.payload for row in events(outbox)] == [{"n": 1}]


def test_flush_writes_buffered_events_inside_the_transaction(outbox: Outbox) -> None:
    with pytest.raises(Boom), outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1)
        tx.flush()
        count = tx.session.execute(sa.text("SELECT count(*) FROM outbox_events")).scalar()
        assert count == 1
        assert events(outbox) == []  # written, not committed
        raise Boom
    assert events(outbox) == []


def test_orm_changes_commit_with_the_events(outbox: Outbox) -> None:
    Base.metadata.create_all(outbox.engine)
    with outbox.transaction() as tx:
        tx.session.add(Note(id=1, text="approved"))
        tx.emit("note.added", key="note-1", payload={"id": 1})
    with outbox.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM notes")).scalar() == "approved"
    assert len(events(outbox)) == 1
    with pytest.raises(sa.exc.IntegrityError), outbox.transaction() as tx:
        tx.emit("note.added", key="note-1", payload={"id": 1})
        tx.session.add(Note(id=1, text="duplicate key"))  # flush fails at commit
    assert len(events(outbox)) == 1


def test_duplicate_event_id_fails_the_commit_and_rolls_back(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1, event_id="fixed-id")
    with pytest.raises(Exception, match=r"fixed-id|UNIQUE|unique"), outbox.transaction() as tx:
        tx.session.execute(APPROVE)
        tx.emit("t", key="k", payload=2, event_id="fixed-id")
    assert quote_state(outbox) == "draft"
    assert [row.payload for row in events(outbox)] == [1]


def test_emit_many_validates_every_event_before_writing(outbox: Outbox) -> None:
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


@pytest.mark.parametrize(("field", "override"), BAD_EVENTS)
def test_bad_input_raises_invalid_event_naming_the_field(
    outbox: Outbox, field: str, override: dict[str, Any]
) -> None:
    arguments: dict[str, Any] = {"topic": "quote.approved", "key": "quote-017", "payload": {}}
    arguments.update(override)
    topic = arguments.pop("topic")
    with outbox.transaction() as tx:
        tx.session.execute(APPROVE)
        with pytest.raises(InvalidEvent) as info:
            tx.emit(topic, **arguments)
        assert info.value.field == field
        assert field in str(info.value)
        assert isinstance(info.value, ValueError)
        # Documented: validation happens before anything is written, so the transaction
        # is still usable and the caller decides whether to commit.
        tx.emit("quote.approved", key="quote-017", payload={"after": "error"})
    assert quote_state(outbox) == "approved"
    assert [row.payload for row in events(outbox)] == [{"after": "error"}]


def test_payload_size_limit_is_configurable(db_url: str) -> None:
    box = Outbox(db_url, max_payload_bytes=64)
    box.create_schema()
    with box.transaction() as tx:
        tx.emit("t", key="k", payload="x" * 50)
        with pytest.raises(InvalidEvent, match="over the limit of 64"):
            tx.emit("t", key="k", payload="x" * 70)
    assert len(events(box)) == 1
    with pytest.raises(ConfigError, match="max_payload_bytes"):
        Outbox(db_url, max_payload_bytes=0)


def test_emit_rejects_something_that_is_not_a_session(outbox: Outbox) -> None:
    with pytest.raises(TypeError, match="Session or Connection"):
        outbox.emit(outbox.engine, "t", key="k", payload=1)  # type: ignore[arg-type]


# -- schema and configuration ------------------------------------------------------------------


def test_create_schema_is_idempotent_and_metadata_is_exposed(outbox: Outbox) -> None:
    outbox.create_schema()
    outbox.create_schema()
    assert "outbox_events" in outbox.metadata.tables
    inspector = sa.inspect(outbox.engine)
    names = {ix["name"] for ix in inspector.get_indexes("outbox_events")}
    assert "ix_outbox_events_pending" in names


@pytest.mark.parametrize(
    "bad", ["events; DROP TABLE quotes", "1abc", "a-b", "", "x" * 64, 'q"uote', "a b"]
)
def test_table_and_schema_names_must_be_identifiers(db_url: str, bad: str) -> None:
    with pytest.raises(ConfigError, match="table"):
        Outbox(db_url, table=bad)
    with pytest.raises(ConfigError, match="schema"):
        Outbox(db_url, schema=bad)


def test_custom_table_name(db_url: str) -> None:
    box = Outbox(db_url, table="domain_outbox")
    box.create_schema()
    with box.transaction() as tx:
        tx.emit("t", key="k", payload=[1])
    assert sa.inspect(box.engine).has_table("domain_outbox")
    assert len(events(box)) == 1


def test_custom_postgres_schema(pg_admin_engine: sa.Engine) -> None:
    name = f"s_{uuid.uuid4().hex[:10]}"
    box = Outbox("postgresql+psycopg://postgres@127.0.0.1:5432/test", schema=name)
    try:
        box.create_schema()
        box.create_schema()
        with box.transaction() as tx:
            tx.emit("t", key="k", payload=[1])
        with box.engine.connect() as conn:
            count = conn.execute(sa.text(f"SELECT count(*) FROM {name}.outbox_events")).scalar()
        assert count == 1
    finally:
        box.engine.dispose()
        with pg_admin_engine.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))


def test_bad_database_url_and_argument(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="database_url"):
        Outbox("not a url")
    with pytest.raises(ConfigError, match="unsupported backend"):
        Outbox("mysql://localhost/app")
    with pytest.raises(ConfigError, match="url_or_engine"):
        Outbox(42)  # type: ignore[arg-type]


def test_event_ids_are_time_ordered_uuid7(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        ids = [tx.emit("t", key="k", payload=i) for i in range(50)]
    assert ids == sorted(ids)
    assert all(uuid.UUID(i).version == 7 for i in ids)
    assert len(set(ids)) == 50


def test_created_at_comes_from_the_database_clock(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload=1)
    with outbox.engine.connect() as conn:
        if outbox.engine.dialect.name == "postgresql":
            age = conn.execute(
                sa.text("SELECT extract(epoch FROM now() - created_at) FROM outbox_events")
            ).scalar_one()
        else:
            age = conn.execute(
                sa.text(
                    "SELECT (julianday('now') - julianday(created_at)) * 86400 FROM outbox_events"
                )
            ).scalar_one()
    assert -1 < float(age) < 60


# -- concurrency (PostgreSQL) --------------------------------------------------------------------


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
