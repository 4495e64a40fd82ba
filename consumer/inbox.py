"""The consumer's tables and every query on them: the inbox and the dead letters.

Tables (names fixed, in the database's default schema or ``schema=``):

``consumer_inbox`` - one row per (consumer group, business identity) handled. Its primary
key is the deduplication: an entry whose identity already has a row in its group is
acknowledged without calling the handler. The row is written in the same transaction as
the handler's work (the jobs it creates), so both commit or neither does. Rows older than
the retention (``ConsumerConfig.inbox_retention_seconds``, default 7 days) are deleted in
bounded batches: the retention IS the deduplication window.

    group_name    varchar(200)  consumer group                     } primary key
    identity      varchar(200)  the event's business identity      }
    event_id      varchar(64)   the event id that was handled first
    topic         varchar(200)  the event's type
    stream        varchar(512)  stream the entry was read from
    entry_id      varchar(64)   its stream entry id
    processed_at  timestamptz   database clock at insert (index: retention purge)

``consumer_dead_letters`` - the NEEDS_ATTENTION records: entries a consumer gave up on,
each also copied to the dead-letter stream. Unique on (group_name, stream, entry_id), so a
consumer that dies between commit and XACK does not record one entry twice.

    id                    bigint        record id (``outbox-consumer replay ID``)
    group_name            varchar(200)  consumer group
    stream                varchar(512)  stream the entry was read from
    entry_id              varchar(64)   its stream entry id
    event_id              varchar(64)   event id, when the entry had one
    topic                 varchar(200)  event type, when the entry had one
    identity              varchar(200)  business identity, when decodable
    reason                varchar(32)   ``poison`` (handler failed N deliveries),
                                        ``undecodable`` (missing fields, bad JSON),
                                        ``unknown_type`` (no handler for its type)
    error                 text          the last error, ``Class: message``
    deliveries            integer       delivery count when it was given up
    payload               text          the entry's fields as a JSON object (field -> str)
    state                 varchar(16)   ``needs_attention`` or ``replayed``
    dead_letter_stream    varchar(512)  where the copy went
    created_at            timestamptz   database clock
    replayed_at           timestamptz   when ``replay`` re-injected it
    replayed_entry_id     varchar(64)   the new entry id in ``stream``

Metrics read ``count(*) ... WHERE state = 'needs_attention'`` (index
``ix_consumer_dead_letters_state``) grouped by ``group_name``/``reason``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    delete,
    func,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from consumer.bulk import bulk_insert
from outbox.schema import check_identifier, db_now

INBOX_TABLE = "consumer_inbox"
DEAD_LETTER_TABLE = "consumer_dead_letters"

NEEDS_ATTENTION = "needs_attention"
REPLAYED = "replayed"

POISON = "poison"
UNDECODABLE = "undecodable"
UNKNOWN_TYPE = "unknown_type"
REASONS = (POISON, UNDECODABLE, UNKNOWN_TYPE)

NAME_WIDTH = 200
STREAM_WIDTH = 512
ID_WIDTH = 64
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class InboxSchema:
    """The consumer tables on one MetaData."""

    metadata: MetaData
    inbox: Table
    dead_letters: Table


def build_inbox_schema(schema: str | None = None, metadata: MetaData | None = None) -> InboxSchema:
    schema_name = check_identifier("schema", schema, optional=True)
    md = metadata if metadata is not None else MetaData()
    inbox = Table(
        INBOX_TABLE,
        md,
        Column("group_name", String(NAME_WIDTH), primary_key=True),
        Column("identity", String(NAME_WIDTH), primary_key=True),
        Column("event_id", String(ID_WIDTH), nullable=False),
        Column("topic", String(NAME_WIDTH), nullable=False),
        Column("stream", String(STREAM_WIDTH), nullable=False),
        Column("entry_id", String(ID_WIDTH), nullable=False),
        Column("processed_at", DateTime(timezone=True), nullable=False, server_default=db_now()),
        schema=schema_name,
    )
    # The retention purge deletes the oldest rows of one group in bounded batches.
    Index(f"ix_{INBOX_TABLE}_processed", inbox.c.group_name, inbox.c.processed_at)
    dead = Table(
        DEAD_LETTER_TABLE,
        md,
        Column(
            "id",
            BigInteger().with_variant(Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("group_name", String(NAME_WIDTH), nullable=False),
        Column("stream", String(STREAM_WIDTH), nullable=False),
        Column("entry_id", String(ID_WIDTH), nullable=False),
        Column("event_id", String(ID_WIDTH), nullable=True),
        Column("topic", String(NAME_WIDTH), nullable=True),
        Column("identity", String(NAME_WIDTH), nullable=True),
        Column("reason", String(32), nullable=False),
        Column("error", Text, nullable=False),
        Column("deliveries", Integer, nullable=False),
        Column("payload", Text, nullable=False),
        Column("state", String(16), nullable=False, server_default=text(f"'{NEEDS_ATTENTION}'")),
        Column("dead_letter_stream", String(STREAM_WIDTH), nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=db_now()),
        Column("replayed_at", DateTime(timezone=True), nullable=True),
        Column("replayed_entry_id", String(ID_WIDTH), nullable=True),
        UniqueConstraint("group_name", "stream", "entry_id", name="uq_consumer_dead_letters_entry"),
        schema=schema_name,
    )
    Index(f"ix_{DEAD_LETTER_TABLE}_state", dead.c.state, dead.c.group_name)
    return InboxSchema(metadata=md, inbox=inbox, dead_letters=dead)


def create_inbox_schema(engine: Engine, inbox_schema: InboxSchema) -> None:
    """Create the tables if missing; safe from several processes starting at once."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # CREATE TABLE IF NOT EXISTS races in PostgreSQL: serialise on a lock.
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:n))"), {"n": "consumer-ddl"})
            schema = inbox_schema.inbox.schema
            if schema:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        inbox_schema.metadata.create_all(conn, checkfirst=True)


def clip(value: str | None, width: int) -> str | None:
    """Fit a value into its column: PostgreSQL refuses NUL and over-long varchars."""
    if value is None:
        return None
    return value.replace("\x00", "\ufffd")[:width]


# -- inbox -----------------------------------------------------------------------------------


def insert_inbox_rows(conn: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert-or-skip the inbox rows of a batch; return the identities that were NEW.

    One statement for the whole batch, ``ON CONFLICT DO NOTHING RETURNING identity``:
    RETURNING, not rowcount, tells which rows went in (SQLAlchemy 2.1 reports rowcount -1
    for such inserts). The caller passes distinct identities sorted, so two consumers
    inserting overlapping batches take the unique-index locks in the same order and cannot
    deadlock on them. A row another transaction inserted but has not committed makes this
    statement wait for it: a commit turns ours into a duplicate, a rollback lets ours in, so
    the same identity is never handled twice concurrently.
    """
    returned = bulk_insert(
        conn,
        table,
        rows,
        conflict=(table.c.group_name.name, table.c.identity.name),
        returning=table.c.identity.name,
    )
    return set(returned)


def delete_inbox_row(conn: Connection, table: Table, group: str, identity: str) -> None:
    """Undo the insert of one identity whose handler failed (same, uncommitted transaction)."""
    conn.execute(delete(table).where(table.c.group_name == group, table.c.identity == identity))


def seen_identities(
    conn: Connection, table: Table, group: str, identities: Sequence[str]
) -> set[str]:
    if not identities:
        return set()
    result = conn.execute(
        select(table.c.identity).where(
            table.c.group_name == group, table.c.identity.in_(list(identities))
        )
    )
    return {row[0] for row in result}


def database_now(conn: Connection) -> datetime:
    value = conn.execute(select(db_now())).scalar_one()
    if isinstance(value, str):  # pragma: no cover - SQLite type processing returns datetime
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value


def purge_inbox(
    engine: Engine,
    table: Table,
    group: str,
    retention_seconds: float,
    *,
    batch: int,
    max_batches: int,
    now: datetime | None = None,
) -> int:
    """Delete this group's inbox rows older than the retention, ``batch`` rows per
    transaction and at most ``max_batches`` transactions per call (bounded work, short
    locks). ``now`` defaults to the database clock. Returns how many rows went."""
    total = 0
    for _ in range(max_batches):
        with engine.begin() as conn:
            clock = now if now is not None else database_now(conn)
            if conn.dialect.name == "sqlite" and clock.tzinfo is not None:
                # SQLite stores UTC text without an offset: compare like with like.
                clock = clock.astimezone(tz=None).replace(tzinfo=None)
            cutoff = clock - timedelta(seconds=retention_seconds)
            oldest = (
                select(table.c.group_name, table.c.identity)
                .where(table.c.group_name == group, table.c.processed_at < cutoff)
                .order_by(table.c.processed_at)
                .limit(batch)
            )
            result = conn.execute(
                delete(table)
                .where(tuple_(table.c.group_name, table.c.identity).in_(oldest.scalar_subquery()))
                .returning(table.c.identity)
            )
            removed = len(result.fetchall())
        total += removed
        if removed < batch:
            break
    return total


# -- dead letters ----------------------------------------------------------------------------


def encode_fields(fields: dict[str, str]) -> str:
    return json.dumps(fields, ensure_ascii=False, sort_keys=True).replace("\\u0000", "\\ufffd")


def insert_dead_letters(
    conn: Connection, table: Table, rows: Sequence[dict[str, Any]]
) -> dict[tuple[str, str], int]:
    """Record NEEDS_ATTENTION rows (skip entries already recorded); return (stream, entry_id)
    -> id
    for every row of ``rows`` (new or recorded before by a consumer that died before XACK)."""
    if not rows:
        return {}
    clean = [
        {
            **row,
            "group_name": clip(row["group_name"], NAME_WIDTH),
            "stream": clip(row["stream"], STREAM_WIDTH),
            "entry_id": clip(row["entry_id"], ID_WIDTH),
            "event_id": clip(row.get("event_id"), ID_WIDTH),
            "topic": clip(row.get("topic"), NAME_WIDTH),
            "identity": clip(row.get("identity"), NAME_WIDTH),
            "error": clip(row["error"], MAX_ERROR_CHARS),
            "dead_letter_stream": clip(row["dead_letter_stream"], STREAM_WIDTH),
        }
        for row in rows
    ]
    dialect_insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
    conn.execute(
        dialect_insert(table).on_conflict_do_nothing(
            index_elements=[table.c.group_name, table.c.stream, table.c.entry_id]
        ),
        clean,
    )
    keys = [(row["stream"], row["entry_id"]) for row in clean]
    result = conn.execute(
        select(table.c.stream, table.c.entry_id, table.c.id).where(
            table.c.group_name == clean[0]["group_name"],
            tuple_(table.c.stream, table.c.entry_id).in_(keys),
        )
    )
    return {(stream, entry_id): ident for stream, entry_id, ident in result}


def list_dead_letters(
    conn: Connection,
    table: Table,
    *,
    group: str | None = None,
    include_replayed: bool = False,
    limit: int = 100,
) -> list[dict[str, Any]]:
    query = select(table).order_by(table.c.id).limit(limit)
    conditions = []
    if group is not None:
        conditions.append(table.c.group_name == group)
    if not include_replayed:
        conditions.append(table.c.state == NEEDS_ATTENTION)
    if conditions:
        query = query.where(and_(*conditions))
    return [dict(row._mapping) for row in conn.execute(query)]


def get_dead_letter(
    conn: Connection, table: Table, record_id: int, *, lock: bool = False
) -> dict[str, Any] | None:
    query = select(table).where(table.c.id == record_id)
    if lock and conn.dialect.name == "postgresql":
        query = query.with_for_update()
    row = conn.execute(query).first()
    return dict(row._mapping) if row is not None else None


def mark_replayed(conn: Connection, table: Table, record_id: int, new_entry_id: str) -> None:
    conn.execute(
        update(table)
        .where(table.c.id == record_id)
        .values(state=REPLAYED, replayed_at=db_now(), replayed_entry_id=new_entry_id)
    )


def count_needs_attention(conn: Connection, table: Table, group: str | None = None) -> int:
    query = select(func.count()).select_from(table).where(table.c.state == NEEDS_ATTENTION)
    if group is not None:
        query = query.where(table.c.group_name == group)
    return int(conn.execute(query).scalar_one())
