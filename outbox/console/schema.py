"""The console's own table (the audit of every operator action) and the lookup indexes its
lists and trace read through.

``outbox_audit`` - one row per action an operator took through the console (also a refused
one: its ``outcome`` says why). Written in its own transaction right after the library
operation returned (or raised); ``before`` and ``after`` are the target's row as the console
read it on each side of the operation, as JSON text.

    id           bigint        audit row id (keyset of the audit page)
    at           double        unix seconds, database clock
    actor        varchar(200)  who: the name the operator gave (``by``), else ``console``
    via          varchar(16)   ``bearer`` (API token) or ``cookie`` (a signed-in browser)
    client       varchar(200)  the client's address as the server saw it
    action       varchar(32)   requeue, replay, resume, cancel, settle, pause
    target_kind  varchar(16)   event, dead_letter, job, receipt, queue (pause and resume)
    target_id    varchar(400)  event id, dead-letter record id, job id, operation id, queue
    reason       text          the reason the operator gave (required)
    outcome      text          ``ok``, or the error that refused it
    before       text          JSON: the target before
    after        text          JSON: the target after
    bulk         varchar(400)  for a bulk action, the list filter it took (JSON), else NULL

The table is small and append-only; :func:`purge_audit` deletes rows older than a retention in
bounded batches (the retention duty wires it in).

**Lookup indexes** (:data:`LOOKUP_INDEXES`). The lists page by keyset (``ORDER BY seq DESC``
or ``id DESC`` with ``WHERE key < :cursor``) and the trace finds rows by identity, key,
subject and job id. Without an index for a filter, PostgreSQL can only walk the primary key
backwards and test every row: quick while matches are dense, a scan of the whole table for a
rare value (a topic with 10 rows among 10 million). The indexes below make every filter an
index range scan in the list's order, so a page costs the same on 10 rows or 10 million.
They are NOT part of the parts' own schemas: each costs every writer an index insert (the
outbox table measured x1.30-1.46 a bare transaction with two indexes, DESIGN), and a
deployment without the console should not pay it. ``outbox-console init-db`` creates them
(``CREATE INDEX CONCURRENTLY`` on PostgreSQL: writers are not blocked); ``serve`` only warns
when they are missing. Without them every page still answers correctly, by scanning.
An Alembic migration calls :func:`create_lookup_indexes` with ``op.get_bind()``
(``concurrently=False`` inside the migration's transaction).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import (
    BigInteger,
    Column,
    Double,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import MYSQL, db_epoch, delete_due, is_postgresql, quoted_table
from outbox.logs import fields
from outbox.schema import DEFAULT_TABLE, check_identifier

log = logging.getLogger("outbox.console")

AUDIT_TABLE = "outbox_audit"

metadata = MetaData()

audit = Table(
    AUDIT_TABLE,
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("at", Double, nullable=False),
    Column("actor", String(200), nullable=False),
    Column("via", String(16), nullable=False),
    Column("client", String(200), nullable=True),
    Column("action", String(32), nullable=False),
    Column("target_kind", String(16), nullable=False),
    Column("target_id", String(400), nullable=False),
    Column("reason", Text, nullable=False),
    Column("outcome", Text, nullable=False),
    Column("before", Text, nullable=True),
    Column("after", Text, nullable=True),
    Column("bulk", String(400), nullable=True),
)
# The trace shows the audit rows of the records it found; retention deletes by age.
Index(f"ix_{AUDIT_TABLE}_target", audit.c.target_kind, audit.c.target_id)
Index(f"ix_{AUDIT_TABLE}_at", audit.c.at)


def create_audit_table(engine: Engine) -> None:
    """Create ``outbox_audit`` and its indexes if missing (idempotent; ``serve`` calls it at
    every start)."""
    with engine.begin() as conn:
        if is_postgresql(conn.dialect.name):
            # CREATE TABLE IF NOT EXISTS races in PostgreSQL: serialise on a lock.
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('outbox-console-ddl'))"))
        metadata.create_all(conn, checkfirst=True)


def purge_audit(engine: Engine, older_than_seconds: float, limit: int) -> int:
    """Delete at most ``limit`` audit rows older than ``older_than_seconds`` (database
    clock), oldest first, in one transaction; return how many went. Call it again while it
    returns ``limit`` (bounded work, short locks)."""
    if older_than_seconds < 0:
        raise ValueError("older_than_seconds must be >= 0")
    if limit < 1:
        raise ValueError("limit must be >= 1")
    with engine.begin() as conn:
        cutoff = float(conn.execute(select(db_epoch())).scalar_one()) - older_than_seconds
        return delete_due(conn, audit, audit.c.id, audit.c.at < cutoff, audit.c.at, limit)


@dataclass(frozen=True)
class LookupIndex:
    """One index the console reads through: on ``table`` (the outbox table's name is
    configurable, ``{outbox}`` stands for it), ``columns`` in order."""

    name: str
    table: str
    columns: tuple[str, ...]
    reason: str


LOOKUP_INDEXES: tuple[LookupIndex, ...] = (
    # Each ends with the key its lookup orders by: under "identity = :q", ORDER BY seq is
    # the index order, so the index is the plan. An index on (identity) alone leaves
    # PostgreSQL (no statistics) walking the primary key in seq order with a filter, hoping
    # to meet a match early: 4.7 s on 1M events for an identity that is not there.
    LookupIndex("ix_{outbox}_identity_seq", "{outbox}", ("identity", "seq"), "trace by identity"),
    LookupIndex("ix_{outbox}_key_seq", "{outbox}", ("key", "seq"), "trace and list by key"),
    LookupIndex("ix_{outbox}_topic_seq", "{outbox}", ("topic", "seq"), "events by topic"),
    LookupIndex(
        "ix_outbox_jobs_subject_id", "outbox_jobs", ("subject", "id"), "trace: an event's jobs"
    ),
    LookupIndex("ix_outbox_jobs_state_id", "outbox_jobs", ("state", "id"), "jobs by state"),
    LookupIndex("ix_outbox_jobs_tenant_id", "outbox_jobs", ("tenant", "id"), "jobs by tenant"),
    LookupIndex("ix_outbox_jobs_action", "outbox_jobs", ("action", "id"), "jobs by action"),
    LookupIndex("ix_outbox_operations_job", "outbox_operations", ("job_id",), "a job's receipts"),
    LookupIndex(
        "ix_outbox_operations_updated",
        "outbox_operations",
        ("updated_at", "operation_id"),
        "receipts, newest change first",
    ),
    LookupIndex(
        "ix_outbox_operations_state_updated",
        "outbox_operations",
        ("state", "updated_at", "operation_id"),
        "receipts by state",
    ),
)


def _resolved(index: LookupIndex, outbox_table: str) -> tuple[str, str]:
    name = index.name.replace("{outbox}", outbox_table)[:63]
    return name, index.table.replace("{outbox}", outbox_table)


def missing_lookup_indexes(engine: Engine, outbox_table: str = DEFAULT_TABLE) -> list[str]:
    """The lookup indexes absent from the tables that exist (names); a table that does not
    exist yet needs none."""
    check_identifier("outbox_table", outbox_table)
    inspector = inspect(engine)
    indexes: dict[str, set[str] | None] = {}  # table -> its index names; None: no table
    missing = []
    for index in LOOKUP_INDEXES:
        name, table = _resolved(index, outbox_table)
        if table not in indexes:
            exists = inspector.has_table(table)
            indexes[table] = (
                {str(i["name"]) for i in inspector.get_indexes(table)} if exists else None
            )
        present = indexes[table]
        if present is not None and name not in present:
            missing.append(name)
    return missing


def create_lookup_indexes(
    bind: Engine | Connection, outbox_table: str = DEFAULT_TABLE, *, concurrently: bool = True
) -> list[str]:
    """Create the lookup indexes that are missing, on the tables that exist; return their
    names. On PostgreSQL with an Engine and ``concurrently`` (the default), each is built
    ``CONCURRENTLY`` in autocommit, so writers keep writing while it builds."""
    check_identifier("outbox_table", outbox_table)
    engine = bind if isinstance(bind, Engine) else bind.engine
    missing = set(missing_lookup_indexes(engine, outbox_table))
    made = []
    for index in LOOKUP_INDEXES:
        name, table = _resolved(index, outbox_table)
        if name not in missing:
            continue
        columns = ", ".join(f'"{c}"' for c in index.columns)
        postgres = is_postgresql(engine.dialect.name)
        how = "CONCURRENTLY " if postgres and concurrently and isinstance(bind, Engine) else ""
        # MySQL 8 has no CREATE INDEX ... IF NOT EXISTS (MariaDB has): the index was missing.
        mysql = engine.dialect.name == MYSQL and not getattr(engine.dialect, "is_mariadb", False)
        exists = "" if mysql else "IF NOT EXISTS "
        ddl = f'CREATE INDEX {how}{exists}"{name}" ON {quoted_table(table)} ({columns})'
        if isinstance(bind, Connection):
            bind.execute(text(ddl))
        elif how:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text(ddl))
        else:
            with engine.begin() as conn:
                conn.execute(text(ddl))
        log.info("lookup index created", extra=fields(index=name, reason=index.reason))
        made.append(name)
    return made
