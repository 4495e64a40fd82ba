"""The outbox table, as SQLAlchemy metadata so Alembic users can include it.

One row per event. The relay moves a row through ``pending`` -> ``published`` (or
``quarantined``); retention deletes published rows later; nothing deletes a quarantined one.

Column notes (the relay and the metrics read these names; do not rename them):

- ``seq``: a database sequence, the order of insertion. When the domain serialises writes to
  an aggregate (it locks the aggregate's row), the second transaction inserts after the first
  committed, so for one key ``seq`` order is commit order: that is what per-key order uses.
- ``event_id``: a UUIDv7 string made by the writer, stable across republishing; it travels in
  the stream entry as ``id`` so a relay can reconcile an unreceipted publish.
- ``key_hash``: CRC-32 of ``key``, so relays can split keys into partitions in SQL.
- ``created_at`` and ``available_at`` come from the database clock; ``available_at`` is when
  the row may next be tried (backoff pushes it forward).
- ``claimed_by`` / ``claim_epoch`` / ``claimed_at``: the relay's persisted intent to publish;
  ``stream`` / ``stream_id`` / ``published_at``: the receipt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    and_,
    or_,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.elements import TextClause

from outbox import partitions
from outbox.db import write_locked
from outbox.dialect import MYSQL_TABLE, is_mysql, not_on_mysql, timestamp_type
from outbox.dialect import (
    db_now as db_now,
)  # re-exported: the column default lives in outbox.dialect
from outbox.errors import ConfigError
from outbox.event import MAX_NAME_LENGTH
from outbox.partitions import partition_length

PENDING = "pending"
PUBLISHED = "published"
QUARANTINED = "quarantined"
STATES = (PENDING, PUBLISHED, QUARANTINED)

DEFAULT_TABLE = "outbox_events"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def check_identifier(setting: str, value: str | None, *, optional: bool = False) -> str | None:
    """Table and schema names come from configuration: accept plain identifiers only.

    Nothing from configuration is ever spliced into SQL unchecked.
    """
    if value is None and optional:
        return None
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise ConfigError(
            setting,
            f"{value!r} is not a plain SQL identifier (letters, digits, underscore; max 63)",
        )
    return value


def json_type() -> JSON:
    """JSONB on PostgreSQL (indexable, compact), JSON text elsewhere."""
    return JSON().with_variant(JSONB(), "postgresql")


@dataclass(frozen=True)
class OutboxSchema:
    """The metadata and table of one outbox, with its validated names."""

    metadata: MetaData
    table: Table
    table_name: str
    schema: str | None
    partitioned: int | None = None
    """Seconds per partition of a table partitioned on ``created_at`` (``outbox.partitions``),
    or None for a plain table."""

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table_name}" if self.schema else self.table_name

    def notify_channel(self, table_schema: str) -> str:
        """LISTEN/NOTIFY channel of this table, given the schema it lives in (PostgreSQL
        only): ``<table>_new.<schema>``. Channels are database-wide, so the schema is part of
        the name: outboxes in other schemas of one database (a ``search_path`` per tenant or
        per test) must not wake each other's relays. The trigger computes the same name from
        ``TG_TABLE_SCHEMA``; a relay learns ``table_schema`` with :func:`table_schema_of`."""
        return f"{self.table_name}_new.{table_schema}"[:63]


def build_schema(
    table_name: str = DEFAULT_TABLE,
    schema: str | None = None,
    metadata: MetaData | None = None,
    *,
    partitioned: str | int | None = None,
) -> OutboxSchema:
    """Define the outbox table (and its indexes) on ``metadata`` (a new one by default).

    ``partitioned`` (PostgreSQL): ``"hourly"``, ``"daily"`` or seconds per partition: the
    table is ``PARTITION BY RANGE (created_at)``, its primary key ``(seq, created_at)`` and
    ``event_id``'s unique index ``(event_id, created_at)`` (a partitioned table's unique
    keys must hold the partition key; see :mod:`outbox.partitions`)."""
    name = check_identifier("table", table_name)
    assert name is not None
    schema_name = check_identifier("schema", schema, optional=True)
    length = partition_length(partitioned)
    md = metadata if metadata is not None else MetaData()
    extra: dict[str, Any] = {}
    if length:
        extra["postgresql_partition_by"] = "RANGE (created_at)"
    table = Table(
        name,
        md,
        Column(
            "seq",
            BigInteger().with_variant(Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        Column("event_id", String(64), nullable=False, unique=not length),
        Column("topic", String(MAX_NAME_LENGTH), nullable=False),
        Column("key", String(MAX_NAME_LENGTH), nullable=False),
        Column("key_hash", BigInteger, nullable=False),
        Column("tenant", String(MAX_NAME_LENGTH), nullable=True),
        Column("identity", String(MAX_NAME_LENGTH), nullable=False),
        Column("payload", json_type(), nullable=False),
        Column("headers", json_type(), nullable=True),
        Column(
            "created_at",
            timestamp_type(),
            nullable=False,
            server_default=db_now(),
            primary_key=bool(length),
        ),
        Column("available_at", timestamp_type(), nullable=False, server_default=db_now()),
        Column("attempts", Integer, nullable=False, server_default=text("0")),
        Column("last_error", Text, nullable=True),
        Column("state", String(16), nullable=False, server_default=text(f"'{PENDING}'")),
        Column("claimed_by", String(128), nullable=True),
        Column("claim_epoch", BigInteger, nullable=True),
        Column("claimed_at", timestamp_type(), nullable=True),
        Column("stream", String(512), nullable=True),
        Column("stream_id", String(64), nullable=True),
        Column("published_at", timestamp_type(), nullable=True),
        schema=schema_name,
        **MYSQL_TABLE,
        **extra,
    )
    if length:
        Index(f"ux_{name}_event_id", table.c.event_id, table.c.created_at, unique=True)
    # The relay's claim reads pending rows in sequence order. A partial index holds only the
    # pending rows, so it stays small however many published rows wait for retention, and
    # the claim never walks past published ones. (Updated-away entries linger in it until
    # vacuum: the relay issue tunes autovacuum for that.)
    Index(
        f"ix_{name}_pending",
        table.c.seq,
        postgresql_where=table.c.state == PENDING,
        sqlite_where=table.c.state == PENDING,
    ).ddl_if(callable_=not_on_mysql)
    # No index on the pending rows' topic: `status` and the metrics group the backlog by
    # topic through the pending index above (heap fetches, proportional to the backlog, as
    # their attempts histogram already was). Every index is paid by every writer: with a
    # (topic, created_at) index the connection path measured x1.11-1.14 of a minimal
    # hand-written outbox at 8 threads, x0.94-1.15 without it (issue 25, docs/benchmarks/relay.md).
    # Tables made before keep theirs (`DROP INDEX CONCURRENTLY ix_<table>_pending_topic`).
    # Quarantined rows are few and must be listed fast, for `status`, `requeue` and alerts.
    Index(
        f"ix_{name}_quarantined",
        table.c.seq,
        postgresql_where=table.c.state == QUARANTINED,
        sqlite_where=table.c.state == QUARANTINED,
    ).ddl_if(callable_=not_on_mysql)
    # The relay's per-key hold: a row that is failing (pending with attempts > 0: in backoff
    # or awaiting reconciliation) or quarantined holds back the later rows of its key. The
    # claim probes this index for an earlier such row of the candidate's key; it holds only
    # failing rows, so it is nearly always empty and the probe nearly free.
    Index(
        f"ix_{name}_blocked",
        table.c.key,
        table.c.seq,
        postgresql_where=_blocked_predicate(table),
        sqlite_where=_blocked_predicate(table),
    ).ddl_if(callable_=not_on_mysql)
    return OutboxSchema(
        metadata=md, table=table, table_name=name, schema=schema_name, partitioned=length
    )


def _blocked_predicate(table: Table) -> Any:
    return or_(
        table.c.state == QUARANTINED,
        and_(table.c.state == PENDING, table.c.attempts > 0),
    )


# Per-table autovacuum for PostgreSQL (set when missing). Every published row leaves a dead
# entry in the pending index and a dead tuple; the relay's claims start past them (see
# relay/store/), and vacuum must keep up so that the index and heap stay small: vacuum
# after a fixed number of dead rows (not a fraction of a table that grows by retention),
# without cost-based sleeping. fillfactor leaves room on each page so that the relay's claim
# UPDATE (intent columns only, none indexed) can be a HOT update.
PG_STORAGE_PARAMETERS = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "20000",
    "autovacuum_vacuum_insert_scale_factor": "0",
    "autovacuum_vacuum_insert_threshold": "50000",
    "autovacuum_analyze_scale_factor": "0.02",
    "autovacuum_vacuum_cost_delay": "0",
    "fillfactor": "50",
}


def create_schema(
    bind: Engine | Connection,
    outbox_schema: OutboxSchema,
    *,
    notify: bool | None = None,
    partitioned: str | int | None = None,
) -> None:
    """Create the table and indexes if missing (idempotent, safe to call at every start).

    ``notify`` chooses the relay's wake-up on PostgreSQL (see :func:`create_extras`): True
    adds the NOTIFY trigger, False drops it, None (the default) leaves an existing table as
    it is and creates a new one WITHOUT the trigger, so a relay starting with the default
    undoes neither ``outbox-relay init-db --notify`` nor ``--no-notify``.

    Why no trigger by default (issue 25): a transaction that sent NOTIFY takes a global lock
    at commit, which serialised 8 concurrent writers to half the rate of a minimal
    hand-written outbox (x2.05-2.15 here, x1.00-1.13 without the trigger); the relay's
    polling after a busy batch (``RelayConfig.poll_interval``, 5 ms) keeps commit -> stream
    latency low without it.

    ``partitioned`` (PostgreSQL only): ``"hourly"``, ``"daily"`` or seconds per partition
    creates the table partitioned on ``created_at`` (:mod:`outbox.partitions`), with its
    DEFAULT partition and the partitions of the next periods. None (the default) takes the
    schema's own choice (``build_schema(partitioned=...)``) and leaves an existing table as
    it is. ConfigError, with nothing changed, on SQLite, on an existing plain table (it is
    never converted) and on a partitioned one of another period length.
    """
    length = partition_length(partitioned) or outbox_schema.partitioned
    if length and bind.dialect.name != "postgresql":
        raise ConfigError(
            "partitioned",
            f"a partitioned outbox needs PostgreSQL; {bind.dialect.name} has no table partitions",
        )
    if isinstance(bind, Engine):
        with write_locked(bind).begin() as conn:  # several processes may create it at once
            _create(conn, outbox_schema, notify, length)
    else:
        _create(bind, outbox_schema, notify, length)


def _create(
    conn: Connection, outbox_schema: OutboxSchema, notify: bool | None, length: int | None
) -> None:
    existed = False
    if conn.dialect.name == "postgresql":
        # Several processes may call create_schema at once (relay replicas starting together);
        # CREATE TABLE IF NOT EXISTS is not race-free in PostgreSQL, so serialise on a lock.
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:n))"), {"n": "outbox-ddl"})
        if outbox_schema.schema:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{outbox_schema.schema}"'))
        kind = partitions.relkind(conn, _qualified(outbox_schema))
        existed = kind is not None
        if kind == "r" and length:
            raise ConfigError(
                "partitioned",
                f"{outbox_schema.qualified_name} already exists and is not partitioned; it is "
                "not converted: create a partitioned table under another name and move to it",
            )
        if kind == "p":
            found = partitions.table_length(conn, _qualified(outbox_schema))
            if length and found != length:
                raise ConfigError(
                    "partitioned",
                    f"{outbox_schema.qualified_name} is partitioned every {found} s, not "
                    f"every {length} s; a partitioned table keeps its period",
                )
            length = found
    if length and outbox_schema.partitioned != length:
        outbox_schema = build_schema(
            outbox_schema.table_name, outbox_schema.schema, partitioned=length
        )
    outbox_schema.metadata.create_all(conn, checkfirst=True)
    # None: a table created just now has no trigger; an existing one keeps its choice.
    create_extras(
        conn,
        outbox_schema,
        notify=False if notify is None and not existed else notify,
        partitioned=length,
    )


def _qualified(outbox_schema: OutboxSchema) -> str:
    name = outbox_schema.table_name
    return f'"{outbox_schema.schema}"."{name}"' if outbox_schema.schema else f'"{name}"'


# complexity: one optional DDL piece per schema option (notify, partitions, indexes)
def create_extras(
    conn: Connection,
    outbox_schema: OutboxSchema,
    *,
    notify: bool | None = True,
    partitioned: str | int | None = None,
) -> None:
    """What the relay needs beyond the table metadata, added when missing (so a table made
    by an earlier version, or by an Alembic migration, gets them too): the blocked-key index,
    and on PostgreSQL the storage parameters and the NOTIFY trigger. Each is checked first,
    so a user who does not own the table can still call this once they are in place.

    ``notify``: True adds the trigger if missing, False drops it if present, None leaves the
    choice as it is (an existing trigger's function is brought up to date either way).
    With the trigger, each inserting statement sends one NOTIFY and a LISTENing relay claims
    at once; but a transaction that has sent NOTIFY takes a global lock at commit, which
    serialises the commits of many concurrent writers. Without it the relay's adaptive
    polling finds new rows.

    ``partitioned`` (a table created ``PARTITION BY RANGE (created_at)``, by
    ``build_schema(partitioned=...)`` or a migration): its period comment, its DEFAULT
    partition and the partitions of the current and next periods, each partition with the
    storage parameters (a partitioned table takes none itself).
    """
    table = outbox_schema.table
    name = outbox_schema.table_name
    qualified = _qualified(outbox_schema)
    if is_mysql(conn.dialect.name):
        _mysql_indexes(conn, outbox_schema)
        return
    blocked = next(i for i in table.indexes if i.name == f"ix_{name}_blocked")
    blocked.create(conn, checkfirst=True)
    if conn.dialect.name != "postgresql":
        return
    oid = conn.execute(text("SELECT to_regclass(:q)::oid"), {"q": qualified}).scalar()
    length = partition_length(partitioned) or outbox_schema.partitioned
    is_partitioned = partitions.relkind(conn, qualified) == "p"
    if is_partitioned:
        _partition_extras(conn, outbox_schema, length)
    elif length:
        raise ConfigError(
            "partitioned", f"{outbox_schema.qualified_name} exists and is not partitioned"
        )
    options = (
        []
        if is_partitioned
        else conn.execute(
            text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = :oid"), {"oid": oid}
        ).scalar()
    )
    present = {str(o).split("=", 1)[0] for o in (options or [])}
    missing = {k: v for k, v in PG_STORAGE_PARAMETERS.items() if k not in present}
    if missing and not is_partitioned:
        settings = ", ".join(f"{k} = {v}" for k, v in missing.items())
        conn.execute(text(f"ALTER TABLE {qualified} SET ({settings})"))
    # LISTEN/NOTIFY wake-up: one notification per inserting statement (not per row), on the
    # channel OutboxSchema.notify_channel(<the table's schema>); a relay LISTENing on it claims
    # at once. The schema comes from TG_TABLE_SCHEMA, so one body serves any schema.
    trigger = notify_trigger_name(outbox_schema)
    function = f'"{outbox_schema.schema}"."{trigger}"' if outbox_schema.schema else f'"{trigger}"'
    prefix = outbox_schema.table_name.replace("'", "''") + "_new."
    channel = f"left('{prefix}' || TG_TABLE_SCHEMA, 63)"
    body = f"BEGIN PERFORM pg_notify({channel}, ''); RETURN NULL; END"
    exists = conn.execute(
        text("SELECT 1 FROM pg_trigger WHERE tgrelid = :oid AND tgname = :n"),
        {"oid": oid, "n": trigger},
    ).scalar()
    if exists and notify is False:
        conn.execute(text(f'DROP TRIGGER "{trigger}" ON {qualified}'))
        return
    if exists:
        # A trigger made by an earlier version notifies a channel no relay listens on any
        # more: its function gets today's body (only when it differs: a user who does not
        # own the function can still start a relay once it is current).
        current = conn.execute(
            text("SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure(:f)"),
            {"f": f"{function}()"},
        ).scalar()
        if current is not None and current.strip() != body:
            conn.execute(_trigger_function(function, body))
    elif notify:
        conn.execute(_trigger_function(function, body))
        conn.execute(
            text(
                f'CREATE TRIGGER "{trigger}" AFTER INSERT ON {qualified} '
                f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
            )
        )


def mysql_index_columns(name: str) -> dict[str, tuple[str, ...]]:
    """The outbox table's indexes on MySQL, which has no partial index: the three partial
    ones of :func:`build_schema` become two whole-table indexes there. The claim, status and
    the metrics walk (state, seq): the pending rows in seq order, the quarantined ones apart.
    The blocked-key probe looks up (key, state, seq): for one key, its quarantined and its
    pending rows below a seq, never the key's published history. Two, not three: each costs
    every writer. They are not in the table's metadata (Alembic's autogenerate would put them
    on PostgreSQL too): :func:`create_extras` adds them on MySQL, as it adds the blocked-key
    index elsewhere."""
    return {
        f"ix_{name}_state_seq": ("state", "seq"),
        f"ix_{name}_key_state": ("key", "state", "seq"),
    }


def _mysql_indexes(conn: Connection, outbox_schema: OutboxSchema) -> None:
    table = outbox_schema.table_name
    present = {
        str(r[0])
        for r in conn.execute(
            text(
                "SELECT DISTINCT index_name FROM information_schema.statistics "
                "WHERE table_schema = coalesce(:s, DATABASE()) AND table_name = :t"
            ),
            {"s": outbox_schema.schema, "t": table},
        )
    }
    # Backticks: the caller's connection (an Alembic migration's) may not run ANSI_QUOTES.
    target = f"`{outbox_schema.schema}`.`{table}`" if outbox_schema.schema else f"`{table}`"
    for index, columns in mysql_index_columns(table).items():
        if index not in present:
            listed = ", ".join(f"`{c}`" for c in columns)
            conn.execute(text(f"CREATE INDEX `{index}` ON {target} ({listed})"))


def _partition_extras(conn: Connection, outbox_schema: OutboxSchema, length: int | None) -> None:
    qualified = _qualified(outbox_schema)
    found = partitions.commented_length(conn, qualified)
    if found is None:
        if not length:
            raise ConfigError(
                "partitioned",
                f"{outbox_schema.qualified_name} is partitioned: give its period "
                "(create_extras(op, partitioned='hourly'|'daily'|seconds))",
            )
        conn.execute(text(f"COMMENT ON TABLE {qualified} IS '{partitions.comment(length)}'"))
        found = length
    elif length and found != length:
        raise ConfigError(
            "partitioned",
            f"{outbox_schema.qualified_name} is partitioned every {found} s, not {length} s",
        )
    schema_name = table_schema_of(conn, outbox_schema)
    partitions.create_default(conn, schema_name, outbox_schema.table_name, PG_STORAGE_PARAMETERS)
    partitions.ensure_partitions(
        conn, schema_name, outbox_schema.table_name, found, PG_STORAGE_PARAMETERS
    )


def _trigger_function(function: str, body: str) -> TextClause:
    return text(
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ {body} $$"
    )


def table_schema_of(conn: Connection, outbox_schema: OutboxSchema) -> str:
    """The schema the outbox table resolves to on this connection (PostgreSQL): explicit, or
    the first schema of the ``search_path`` that holds it."""
    found = conn.execute(
        text(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE c.oid = to_regclass(:q)"
        ),
        {"q": _qualified(outbox_schema)},
    ).scalar()
    if found is not None:
        return str(found)
    return outbox_schema.schema or str(conn.execute(text("SELECT current_schema()")).scalar())


def notify_trigger_name(outbox_schema: OutboxSchema) -> str:
    """The NOTIFY trigger's name (and its function's) on this outbox table."""
    return f"{outbox_schema.table_name}_notify"[:63]


def has_notify_trigger(conn: Connection, outbox_schema: OutboxSchema) -> bool:
    """Whether the table has the NOTIFY trigger (always False off PostgreSQL)."""
    if conn.dialect.name != "postgresql":
        return False
    found = conn.execute(
        text("SELECT 1 FROM pg_trigger WHERE tgrelid = to_regclass(:q) AND tgname = :n"),
        {"q": _qualified(outbox_schema), "n": notify_trigger_name(outbox_schema)},
    ).scalar()
    return bool(found)
