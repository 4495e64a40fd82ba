"""The consumer's storage seam: its tables and every query on them (the inbox and the dead
letters), PostgreSQL and SQLite side by side.

In the spirit of ``relay/store/`` and ``consumer/jobs/driver.py``: :class:`Inbox` holds the
SQL both databases share, one method per operation named noun first (``inbox_insert``,
``dead_letter_insert``); :class:`PostgresInbox` and :class:`SqliteInbox` hold what differs
(DDL serialised by an advisory lock and ``FOR UPDATE`` on PostgreSQL; ``BEGIN IMMEDIATE``
and naive UTC clocks on SQLite). :func:`inbox_for` is the one place that asks which database
an engine talks to: the consumer, its admin actions and its CLI never do.

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
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
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
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from consumer.bulk import bulk_insert
from outbox.db import write_locked
from outbox.dialect import (
    MYSQL_TABLE,
    db_now,
    insert_or_ignore,
    is_mysql,
    is_postgresql,
    quoted_table,
    timestamp_type,
)
from outbox.maintenance import HOT_TABLE_AUTOVACUUM, set_storage_parameters
from outbox.schema import check_identifier
from outbox.validate import MAX_EVENT_ID_LENGTH, MAX_NAME_LENGTH

INBOX_TABLE = "consumer_inbox"
DEAD_LETTER_TABLE = "consumer_dead_letters"

NEEDS_ATTENTION = "needs_attention"
REPLAYED = "replayed"

POISON = "poison"
UNDECODABLE = "undecodable"
UNKNOWN_TYPE = "unknown_type"
TOO_LARGE = "too_large"
REASONS = (POISON, UNDECODABLE, UNKNOWN_TYPE, TOO_LARGE)

NAME_WIDTH = MAX_NAME_LENGTH
STREAM_WIDTH = 512
ID_WIDTH = MAX_EVENT_ID_LENGTH
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
        Column("processed_at", timestamp_type(), nullable=False, server_default=db_now()),
        schema=schema_name,
        **MYSQL_TABLE,
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
        # ASCII on MySQL (entry ids are digits and a dash): the unique key below must fit
        # InnoDB's 3,072 bytes, at 4 bytes a character for utf8mb4 columns.
        Column(
            "entry_id",
            String(ID_WIDTH).with_variant(
                mysql.VARCHAR(ID_WIDTH, charset="ascii", collation="ascii_bin"), "mysql", "mariadb"
            ),
            nullable=False,
        ),
        Column("event_id", String(ID_WIDTH), nullable=True),
        Column("topic", String(NAME_WIDTH), nullable=True),
        Column("identity", String(NAME_WIDTH), nullable=True),
        Column("reason", String(32), nullable=False),
        Column("error", Text, nullable=False),
        Column("deliveries", Integer, nullable=False),
        Column("payload", Text, nullable=False),
        Column("state", String(16), nullable=False, server_default=text(f"'{NEEDS_ATTENTION}'")),
        Column("dead_letter_stream", String(STREAM_WIDTH), nullable=False),
        Column("created_at", timestamp_type(), nullable=False, server_default=db_now()),
        Column("replayed_at", timestamp_type(), nullable=True),
        Column("replayed_entry_id", String(ID_WIDTH), nullable=True),
        UniqueConstraint("group_name", "stream", "entry_id", name="uq_consumer_dead_letters_entry"),
        schema=schema_name,
        **MYSQL_TABLE,
    )
    Index(f"ix_{DEAD_LETTER_TABLE}_state", dead.c.state, dead.c.group_name)
    # Retention (consumer.retention) deletes replayed records oldest first: a range of this.
    Index(
        f"ix_{DEAD_LETTER_TABLE}_replayed",
        dead.c.replayed_at,
        postgresql_where=dead.c.state == REPLAYED,
        sqlite_where=dead.c.state == REPLAYED,
    )
    return InboxSchema(metadata=md, inbox=inbox, dead_letters=dead)


def clip(value: str | None, width: int) -> str | None:
    """Fit a value into its column: PostgreSQL refuses NUL and over-long varchars."""
    if value is None:
        return None
    return value.replace("\x00", "\ufffd")[:width]


def encode_fields(fields: dict[str, str]) -> str:
    """An entry's fields as the JSON text of a dead letter's ``payload``."""
    return json.dumps(fields, ensure_ascii=False, sort_keys=True).replace("\\u0000", "\\ufffd")


class Inbox:
    """The consumer's SQL both databases share; subclasses override what differs.

    Methods that belong to a caller's transaction take its open ``Connection``; the others
    (schema, purge, operator reads) open their own from :attr:`engine`.
    """

    def __init__(self, engine: Engine, tables: InboxSchema) -> None:
        self.engine = engine
        self.tables = tables

    # -- transactions and schema ------------------------------------------------------------

    def session(self) -> Session:
        """A Session for one batch's read-write transaction (the caller begins it)."""
        return Session(self.engine)

    def schema_create(self) -> None:
        """Create the tables if missing (idempotent, safe from several processes at once)."""
        with write_locked(self.engine).begin() as conn:  # several processes may at once
            self._before_ddl(conn)
            self.tables.metadata.create_all(conn, checkfirst=True)
            self._after_ddl(conn)

    def _before_ddl(self, conn: Connection) -> None:
        """Per-dialect preparation of the DDL transaction."""

    def _after_ddl(self, conn: Connection) -> None:
        """Per-dialect additions once the tables exist."""

    @property
    def inbox_table_quoted(self) -> str:
        """The inbox table, quoted: written by every batch and purged by retention, so it
        gets the hot-table autovacuum settings and a vacuum by the consumer when the server
        runs without autovacuum (``outbox.maintenance``)."""
        return quoted_table(self.tables.inbox.name, self.tables.inbox.schema)

    def clock_read(self, conn: Connection) -> datetime:
        """The database clock, comparable with the tables' timestamps."""
        value = conn.execute(select(db_now())).scalar_one()
        assert isinstance(value, datetime)
        return value

    def clock_at(self, conn: Connection, now: datetime | None = None) -> datetime:
        """``now`` (default: the database clock) as the tables store timestamps."""
        return self._comparable(now if now is not None else self.clock_read(conn))

    def _comparable(self, moment: datetime) -> datetime:
        """``moment`` as the tables store timestamps."""
        return moment

    # -- inbox ------------------------------------------------------------------------------

    def inbox_insert(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> set[str]:
        """Insert-or-skip the inbox rows of a batch; return the identities that were NEW.

        One statement for the whole batch, ``ON CONFLICT DO NOTHING RETURNING identity``:
        RETURNING, not rowcount, tells which rows went in (SQLAlchemy 2.1 reports rowcount -1
        for such inserts). The caller passes distinct identities sorted, so two consumers
        inserting overlapping batches take the unique-index locks in the same order and
        cannot deadlock on them. A row another transaction inserted but has not committed
        makes this statement wait for it: a commit turns ours into a duplicate, a rollback
        lets ours in, so the same identity is never handled twice concurrently.
        """
        table = self.tables.inbox
        returned = bulk_insert(
            conn,
            table,
            rows,
            conflict=(table.c.group_name.name, table.c.identity.name),
            returning=table.c.identity.name,
        )
        return set(returned)

    def inbox_delete(self, conn: Connection, group: str, identities: Sequence[str]) -> None:
        """Undo the insert of identities whose handler failed (same, uncommitted transaction)."""
        if not identities:
            return
        table = self.tables.inbox
        conn.execute(
            delete(table).where(table.c.group_name == group, table.c.identity.in_(identities))
        )

    def inbox_seen(self, conn: Connection, group: str, identities: Sequence[str]) -> set[str]:
        """Which of ``identities`` this group has handled already."""
        if not identities:
            return set()
        table = self.tables.inbox
        result = conn.execute(
            select(table.c.identity).where(
                table.c.group_name == group, table.c.identity.in_(list(identities))
            )
        )
        return {row[0] for row in result}

    def inbox_purge(
        self,
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
        table = self.tables.inbox
        total = 0
        for _ in range(max_batches):
            with self.engine.begin() as conn:
                clock = self.clock_at(conn, now)
                cutoff = clock - timedelta(seconds=retention_seconds)
                oldest = (
                    select(table.c.group_name, table.c.identity)
                    .where(table.c.group_name == group, table.c.processed_at < cutoff)
                    .order_by(table.c.processed_at)
                    .limit(batch)
                )
                result = conn.execute(
                    delete(table)
                    .where(
                        tuple_(table.c.group_name, table.c.identity).in_(oldest.scalar_subquery())
                    )
                    .returning(table.c.identity)
                )
                removed = len(result.fetchall())
            total += removed
            if removed < batch:
                break
        return total

    # -- dead letters -----------------------------------------------------------------------

    def dead_letter_insert(
        self, conn: Connection, rows: Sequence[dict[str, Any]]
    ) -> dict[tuple[str, str], int]:
        """Record NEEDS_ATTENTION rows (skip entries already recorded); return (stream,
        entry_id) -> id for every row of ``rows`` (new, or recorded before by a consumer
        that died before XACK)."""
        if not rows:
            return {}
        table = self.tables.dead_letters
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
        conn.execute(
            insert_or_ignore(
                table,
                [table.c.group_name, table.c.stream, table.c.entry_id],
                conn.dialect.name,
            ),
            clean,
        )
        keys = [(row["stream"], row["entry_id"]) for row in clean]
        return self.dead_letter_ids(conn, clean[0]["group_name"], keys)

    def dead_letter_ids(
        self, conn: Connection, group: str, keys: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], int]:
        """(stream, entry_id) -> record id of the entries of ``keys`` this group has
        dead-lettered already."""
        if not keys:
            return {}
        table = self.tables.dead_letters
        result = conn.execute(
            select(table.c.stream, table.c.entry_id, table.c.id).where(
                table.c.group_name == clip(group, NAME_WIDTH),
                tuple_(table.c.stream, table.c.entry_id).in_(list(keys)),
            )
        )
        return {(stream, entry_id): ident for stream, entry_id, ident in result}

    def dead_letter_list(
        self,
        *,
        group: str | None = None,
        include_replayed: bool = False,
        limit: int = 100,
    ) -> list[dict[str, Any]]:
        """NEEDS_ATTENTION records (with ``include_replayed``, all), oldest first."""
        table = self.tables.dead_letters
        query = select(table).order_by(table.c.id).limit(limit)
        conditions = []
        if group is not None:
            conditions.append(table.c.group_name == group)
        if not include_replayed:
            conditions.append(table.c.state == NEEDS_ATTENTION)
        if conditions:
            query = query.where(and_(*conditions))
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def dead_letter_get_for_update(self, conn: Connection, record_id: int) -> dict[str, Any] | None:
        """One record, locked against a concurrent replay until ``conn``'s transaction ends."""
        table = self.tables.dead_letters
        row = conn.execute(self._lock_rows(select(table).where(table.c.id == record_id))).first()
        return dict(row._mapping) if row is not None else None

    def _lock_rows(self, query: Any) -> Any:
        """``query`` taking row locks where the database has them."""
        return query

    def dead_letter_mark_replayed(
        self, conn: Connection, record_id: int, new_entry_id: str
    ) -> None:
        table = self.tables.dead_letters
        conn.execute(
            update(table)
            .where(table.c.id == record_id)
            .values(state=REPLAYED, replayed_at=db_now(), replayed_entry_id=new_entry_id)
        )

    def dead_letter_count(self, group: str | None = None) -> int:
        """How many records need attention (this group's, or all)."""
        table = self.tables.dead_letters
        query = select(func.count()).select_from(table).where(table.c.state == NEEDS_ATTENTION)
        if group is not None:
            query = query.where(table.c.group_name == group)
        with self.engine.connect() as conn:
            return int(conn.execute(query).scalar_one())


class PostgresInbox(Inbox):
    """PostgreSQL: DDL serialised by an advisory lock, replay locks its record."""

    def _before_ddl(self, conn: Connection) -> None:
        # CREATE TABLE IF NOT EXISTS races in PostgreSQL: serialise on a lock.
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:n))"), {"n": "consumer-ddl"})
        schema = self.tables.inbox.schema
        if schema:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))

    def _after_ddl(self, conn: Connection) -> None:
        # Every handled entry inserts a row and retention deletes it: dead tuples all day.
        set_storage_parameters(conn, self.inbox_table_quoted, HOT_TABLE_AUTOVACUUM)

    def _lock_rows(self, query: Any) -> Any:
        return query.with_for_update()


class SqliteInbox(Inbox):
    """SQLite: a batch takes the write lock up front; timestamps are naive UTC text."""

    def session(self) -> Session:
        # BEGIN IMMEDIATE (outbox.db): the batch reads the inbox before it writes it; taking
        # SQLite's single write lock first avoids a busy upgrade between two consumers.
        return Session(self.engine.execution_options(sqlite_begin="IMMEDIATE"))

    def _comparable(self, moment: datetime) -> datetime:
        # SQLite stores UTC text without an offset: compare like with like.
        if moment.tzinfo is not None:
            return moment.astimezone(UTC).replace(tzinfo=None)
        return moment


class MysqlInbox(Inbox):
    """MySQL/MariaDB: replay locks its record; timestamps are naive UTC DATETIME(6); the
    purge is a single-table DELETE with ORDER BY and LIMIT (MySQL takes no LIMIT in an IN
    subquery)."""

    def _lock_rows(self, query: Any) -> Any:
        return query.with_for_update()

    def _comparable(self, moment: datetime) -> datetime:
        if moment.tzinfo is not None:
            return moment.astimezone(UTC).replace(tzinfo=None)
        return moment

    def inbox_purge(
        self,
        group: str,
        retention_seconds: float,
        *,
        batch: int,
        max_batches: int,
        now: datetime | None = None,
    ) -> int:
        table = self.tables.inbox
        total = 0
        # READ COMMITTED: no gap locks, so consumers inserting meanwhile never wait on it.
        engine = self.engine.execution_options(isolation_level="READ COMMITTED")
        for _ in range(max_batches):
            with engine.begin() as conn:
                cutoff = self.clock_at(conn, now) - timedelta(seconds=retention_seconds)
                removed = int(
                    conn.execute(
                        delete(table)
                        .where(table.c.group_name == group, table.c.processed_at < cutoff)
                        .with_dialect_options(mysql_limit=batch)
                    ).rowcount
                )
            total += removed
            if removed < batch:
                break
        return total


def inbox_for(engine: Engine, tables: InboxSchema | None = None) -> Inbox:
    """The inbox seam for ``engine``'s database: the one dialect check of the consumer."""
    tables = tables if tables is not None else build_inbox_schema()
    if is_postgresql(engine.dialect.name):
        return PostgresInbox(engine, tables)
    if is_mysql(engine.dialect.name):
        return MysqlInbox(engine, tables)
    return SqliteInbox(engine, tables)


def create_inbox_schema(engine: Engine, tables: InboxSchema) -> None:
    """Create the consumer tables in ``engine``'s database if missing (idempotent)."""
    inbox_for(engine, tables).schema_create()
