"""The relay's storage seam: every SQL statement the relay runs, PostgreSQL and SQLite.

Why the statements look as they do (partitions owned through advisory locks, the claim in
``seq`` order that also writes the intent, the ``blocked`` index that holds back a failing
key only, the claim floor that never skips a late commit, the receipt as a compare-and-set,
the single relay on SQLite) is explained once, in docs/explanation/claims-and-order.md and
docs/explanation/reconciliation.md; each statement below carries its own reason beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from psycopg import sql as psycopg_sql
from sqlalchemy import DateTime, Integer, String, column, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.sql.selectable import TextualSelect

from outbox.dialect import NOW_SQL, POSTGRESQL, SQLITE, is_postgresql, quoted_table
from outbox.errors import ConfigError
from outbox.logs import fields
from outbox.maintenance import vacuum_unless_autovacuum
from outbox.schema import PENDING, QUARANTINED, OutboxSchema, table_schema_of
from relay.config import RelayConfig
from relay.records import Orphan, Record, RequeueResult, TopicStatus, entry_id_key

log = logging.getLogger("outbox.relay")


class Store(Protocol):
    """What the relay loop needs from storage (see the module doc)."""

    payload_is_json: bool
    supports_notify: bool
    partitions: int

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def rebalance_due(self) -> bool: ...
    def rebalance(self) -> bool: ...
    @property
    def owned(self) -> frozenset[int]: ...
    def claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]: ...
    def mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int: ...
    def mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None: ...
    def quarantine(self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]) -> None: ...
    def release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None: ...
    def retry_now(self, seqs: Sequence[int]) -> int:
        """Make these pending, unclaimed rows available at once (their backoff is over: what
        refused them, a whole-Redis condition, has cleared); returns how many."""
        ...

    def orphans(self, limit: int) -> list[Orphan]: ...
    def retry_ready(self) -> bool: ...
    def resolve_orphans(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None: ...
    def wait_for_notify(self, timeout: float) -> int: ...
    def delete_published(self, older_than_seconds: float, limit: int) -> int: ...
    def backlog(self) -> tuple[int, float | None]: ...
    def receipt_store(self) -> Store | None:
        """A second store on its own connection that writes receipts while this one claims
        (the pipelined ``run``), or None when the database gains nothing from it."""
        ...

    def vacuum_if_no_autovacuum(self) -> float | None: ...
    def status(self) -> dict[str, TopicStatus]:
        """Pending, quarantined, oldest pending age and max attempts, per topic."""
        ...

    def requeue(self, event_ids: Sequence[str] | None, all_quarantined: bool) -> RequeueResult:
        """Quarantined events back to pending (see :func:`relay.admin.requeue`)."""
        ...

    def published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        """Published (retained) rows with ``seq > after_seq`` (and ``created_at >= since``,
        of ``topic``), in ``seq`` order, each with the stream its receipt names: what
        ``republish`` sends again. A range scan of the primary key."""
        ...

    def latest_receipts(self) -> list[tuple[str, str]]:
        """``(stream, entry id)``: the highest entry id of each stream among the latest
        receipts (the last 1,000 published rows by ``seq``), whichever relay wrote them:
        what Redis must still hold (the data-loss check, and on a cluster each slot's
        expected marker)."""
        ...

    def oldest_published_since(self, published_after: float | None) -> datetime | None:
        """The oldest ``created_at`` among published rows whose receipt was written at or
        after ``published_after`` (unix seconds; None: every retained row). Where a
        ``republish --since`` must start to cover entries a Redis lost. Scans the retained
        published rows: run once per data loss, not per batch."""
        ...


def open_store(engine: Engine, schema: OutboxSchema, config: RelayConfig | None = None) -> Store:
    """The store for ``engine``'s database: the one place that asks which database it is."""
    config = config or RelayConfig()
    if is_postgresql(engine.dialect.name):
        return PostgresStore(
            engine,
            schema,
            partitions=config.partitions,
            reconcile_after=config.reconcile_after,
            listen=config.listen,
            rebalance_interval=config.rebalance_interval,
            sweep_interval=config.sweep_interval,
        )
    if engine.dialect.name == SQLITE:
        return SqliteStore(engine, schema, reconcile_after=config.reconcile_after)
    raise ConfigError("database_url", f"unsupported database {engine.dialect.name}")


def _quoted(schema: OutboxSchema) -> str:
    return quoted_table(schema.table_name, schema.schema)


# -- the backlog, on both databases ------------------------------------------------------------
# The relay's status and progress and the metrics collector read the backlog with these
# statements (one place for the backlog SQL). Each is bounded by a partial index whatever the
# size of the table: the outbox keeps published rows until retention, so a query that touched
# them would grow with history instead of with the backlog. The states are literals, not
# bound parameters, so PostgreSQL's planner matches the partial indexes' predicates
# (``WHERE state = 'pending'``) in every plan mode; ``table`` is a quoted reference built from
# checked identifiers.


def backlog_by_topic(table: str) -> TextualSelect:
    """Backlog and oldest pending row per topic.

    Served by the partial index ``ix_<table>_pending_topic (topic, created_at) WHERE state =
    'pending'``: PostgreSQL reads it alone (index-only scan, no heap) and its size follows the
    backlog, not the published history.
    """
    return text(
        f"SELECT topic, count(*) AS backlog, min(created_at) AS oldest "
        f"FROM {table} WHERE state = '{PENDING}' GROUP BY topic"
    ).columns(
        column("topic", String),
        column("backlog", Integer),
        column("oldest", DateTime(timezone=True)),
    )


def quarantined_count(table: str) -> TextualSelect:
    """Quarantined rows: few by nature, counted through the partial index
    ``ix_<table>_quarantined`` (index-only on PostgreSQL)."""
    return text(f"SELECT count(*) AS n FROM {table} WHERE state = '{QUARANTINED}'").columns(
        column("n", Integer)
    )


def pending_attempts(table: str) -> TextualSelect:
    """How many pending rows have each attempts value (the histogram and the maximum).

    Walks the pending rows through the partial index ``ix_<table>_pending`` (heap fetches for
    ``attempts``): proportional to the backlog. One row per distinct attempts value, so the
    result is tiny.
    """
    return text(
        f"SELECT attempts, count(*) AS n FROM {table} WHERE state = '{PENDING}' GROUP BY attempts"
    ).columns(column("attempts", Integer), column("n", Integer))


def most_attempted(table: str, limit: int) -> TextualSelect:
    """The top-N pending rows by attempts (rows never tried, attempts 0, are not stuck).

    Same pending partial index as :func:`pending_attempts` plus a bounded top-N sort
    (``LIMIT``), so a caller labelling by event id never exceeds ``limit`` series.
    """
    return text(
        f"SELECT event_id, topic, attempts FROM {table} "
        f"WHERE state = '{PENDING}' AND attempts > 0 "
        f"ORDER BY attempts DESC, seq LIMIT {int(limit)}"
    ).columns(column("event_id", String), column("topic", String), column("attempts", Integer))


def quarantined_by_topic(table: str) -> TextualSelect:
    """Quarantined rows and their highest attempts, per topic (``ix_<table>_quarantined``)."""
    return text(
        f"SELECT topic, count(*) AS n, max(attempts) AS attempts FROM {table} "
        f"WHERE state = '{QUARANTINED}' GROUP BY topic"
    ).columns(column("topic", String), column("n", Integer), column("attempts", Integer))


def pending_max_attempts_by_topic(table: str) -> TextualSelect:
    """The highest attempts of pending rows per topic, among rows tried at least once: the
    small ``ix_<table>_blocked`` index holds exactly those."""
    return text(
        f"SELECT topic, max(attempts) AS attempts FROM {table} "
        f"WHERE state = '{PENDING}' AND attempts > 0 GROUP BY topic"
    ).columns(column("topic", String), column("attempts", Integer))


def _status(conn: Connection, table: str, now_sql: str) -> dict[str, TopicStatus]:
    """Per-topic status from the backlog statements above; ages on the database clock
    (``now_sql``), the clock that wrote ``created_at``."""
    now = conn.execute(
        text(f"SELECT {now_sql} AS now").columns(column("now", DateTime(timezone=True)))
    ).scalar_one()
    out: dict[str, TopicStatus] = {}
    for topic, count, oldest in conn.execute(backlog_by_topic(table)):
        out[topic] = TopicStatus(int(count), 0, age_seconds(now, oldest) or 0.0, 0)
    for topic, attempts in conn.execute(pending_max_attempts_by_topic(table)):
        out[topic].max_attempts = int(attempts or 0)
    for topic, count, attempts in conn.execute(quarantined_by_topic(table)):
        status = out.setdefault(topic, TopicStatus(0, 0, 0.0, 0))
        status.quarantined = int(count)
        status.max_attempts = max(status.max_attempts, int(attempts or 0))
    return dict(sorted(out.items()))


def age_seconds(now: datetime, then: datetime | None) -> float | None:
    """Seconds from ``then`` to ``now``, both read from the database (naive means UTC), at
    least 0; None when ``then`` is None."""
    if then is None:
        return None
    if now.tzinfo is None:
        now = now.replace(tzinfo=UTC)
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())


def _highest_receipts(rows: Sequence[Any]) -> list[tuple[str, str]]:
    best: dict[str, str] = {}
    for stream, entry_id in rows:
        if not stream or not entry_id:
            continue
        held = best.get(str(stream))
        if held is None or entry_id_key(str(entry_id)) > entry_id_key(held):
            best[str(stream)] = str(entry_id)
    return list(best.items())


def _requeue(
    engine: Engine,
    t: str,
    now_sql: str,
    event_ids: Sequence[str] | None,
    all_quarantined: bool,
    after: Callable[[Connection], None] | None = None,
) -> RequeueResult:
    """Both databases' requeue; ``after``: one more statement in the same transaction when
    anything was requeued (PostgreSQL asks the relays for a sweep)."""
    result = RequeueResult()
    with engine.begin() as conn:
        if all_quarantined:
            ids = [
                r[0]
                for r in conn.execute(
                    text(f"SELECT event_id FROM {t} WHERE state = 'quarantined' ORDER BY seq")
                )
            ]
        else:
            wanted = list(dict.fromkeys(event_ids or []))
            states: dict[str, str] = {}
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                params = {f"i{n}": v for n, v in enumerate(chunk)}
                marks = ", ".join(f":i{n}" for n in range(len(chunk)))
                for event_id, state in conn.execute(
                    text(f"SELECT event_id, state FROM {t} WHERE event_id IN ({marks})"), params
                ):
                    states[event_id] = state
            ids = []
            for event_id in wanted:
                state = states.get(event_id)
                if state is None:
                    result.unknown.append(event_id)
                elif state != "quarantined":
                    result.not_quarantined[event_id] = state
                else:
                    ids.append(event_id)
        if ids:
            conn.execute(
                text(
                    f"UPDATE {t} SET state = 'pending', available_at = {now_sql}, "
                    "claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
                    "WHERE event_id = :id AND state = 'quarantined'"
                ),
                [{"id": i} for i in ids],
            )
            if after is not None:
                after(conn)
        result.requeued = ids
    return result


# -- PostgreSQL --------------------------------------------------------------------------------

_PG_RECORD_COLUMNS = """t.seq, t.event_id, t.topic, t.key, t.key_hash, t.tenant, t.identity,
    t.payload::text, t.headers::text,
    to_char(t.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    extract(epoch FROM t.created_at)::float8, t.attempts"""

# The blocked-key probe. Its predicate is the predicate of ix_<table>_blocked, so the probe
# reads that small index only.
_BLOCKED = """NOT EXISTS (
        SELECT 1 FROM {t} b
        WHERE b.key = o.key AND b.seq < o.seq
          AND (b.state = 'quarantined' OR (b.state = 'pending' AND b.attempts > 0)))"""

# The claim, shaped so that no plan the planner may pick reads more than the rows it
# examines (issue 10). A single ``ORDER BY seq LIMIT n`` query is cheap only while the
# planner believes many rows match; on a never-analyzed table (or one analyzed while empty)
# it estimates a handful and picks a bitmap scan of the whole backlog, the blocked-key probe
# for every row and a sort, per batch (measured: 100,000 pending rows, 155-193 ms per batch
# of 500: 5,000-6,000 events/s draining). So the claim bounds its scans by index conditions
# on ``seq``, not by LIMIT: it takes the backlog in chunks, each the pending rows of a seq
# range [lo, lo + span) that starts at the first pending row at or after the previous chunk
# (an ``ORDER BY seq LIMIT 1`` probe: always the index), and collects the candidates of each
# chunk (not claimed, available, in an owned partition, key not blocked) until it has
# ``limit`` of them. Whatever plan a chunk gets (index scan, or bitmap scan and sort), it
# reads the rows of its range and no others. ``span`` is 1.25 ``limit`` divided by the share
# of partitions this relay owns, so that a dense backlog fills a batch in one chunk.
# Measured (SQL alone, claim and mark 500 rows per batch, 100,000 pending): the same rate
# with no statistics, stale ones or fresh ones.
#
# The rows are locked after the collection, one primary-key probe each (a LATERAL, so a
# nested loop: a join let stale statistics pick a hash join over every pending row), FOR
# UPDATE SKIP LOCKED with the state re-checked. Nothing but this relay locks pending rows of
# its partitions, so this skips nothing in practice; a row skipped anyway is left to the next
# sweep, as before.
_CHUNK = (
    """SELECT coalesce(array_agg(o.seq ORDER BY o.seq), '{}'::bigint[]) AS seqs
        FROM {t} o
        WHERE o.state = 'pending' AND o.seq >= f.lo AND o.seq < f.lo + s.span
          AND o.claimed_by IS NULL AND o.available_at <= now()
          AND (o.key_hash %% %(nparts)s) = ANY(%(parts)s) AND """
    + _BLOCKED
)

PG_CLAIM = (
    """
WITH RECURSIVE s AS (
    SELECT greatest(1, %(limit)s::bigint * 5 / 4 * %(nparts)s
                       / greatest(1, cardinality(%(parts)s::int[]))) AS span
),
chunk(hi, n, seqs) AS (
    SELECT f.lo + s.span, cardinality(c.seqs), c.seqs
    FROM s CROSS JOIN LATERAL (
        SELECT o.seq AS lo FROM {t} o WHERE o.state = 'pending' AND o.seq >= %(floor)s
        ORDER BY o.seq LIMIT 1) f
    CROSS JOIN LATERAL ("""
    + _CHUNK
    + """) c
  UNION ALL
    SELECT f.lo + s.span, k.n + cardinality(c.seqs), c.seqs
    FROM chunk k CROSS JOIN s CROSS JOIN LATERAL (
        SELECT o.seq AS lo FROM {t} o WHERE o.state = 'pending' AND o.seq >= k.hi
        ORDER BY o.seq LIMIT 1) f
    CROSS JOIN LATERAL ("""
    + _CHUNK
    + """) c
    WHERE k.n < %(limit)s
),
picked AS (
    SELECT l.seq FROM (
        SELECT u.seq FROM chunk CROSS JOIN LATERAL unnest(chunk.seqs) AS u(seq)
        ORDER BY u.seq LIMIT %(limit)s) w
    CROSS JOIN LATERAL (
        SELECT o.seq FROM {t} o
        WHERE o.seq = w.seq AND o.state = 'pending' AND o.claimed_by IS NULL
        FOR UPDATE OF o SKIP LOCKED) l
)
UPDATE {t} t SET claimed_by = %(owner)s, claim_epoch = %(epoch)s, claimed_at = now()
FROM picked WHERE t.seq = picked.seq
  AND (SELECT set_config('synchronous_commit', 'on', true)) = 'on'
RETURNING """
    + _PG_RECORD_COLUMNS
)

# Receipts: one statement for the whole batch. Adapting Python lists into arrays costs
# psycopg milliseconds of CPU per batch (and a text-mode list tens of milliseconds), so the
# sequence numbers and entry ids travel as one comma-joined string each (neither can hold a
# comma), split by the server; streams, usually one or a few per batch, as a small array
# indexed per row. Compare-and-set on (claimed_by, claim_epoch): a relay whose intent was
# reconciled away records nothing. The state test is written as an expression on purpose:
# as ``t.state = 'pending'`` it lets the planner read the table through the pending partial
# index, and without statistics it believes that index holds a few dozen rows, so it hashed
# every pending row to find the batch's 500 (measured: 100,000 pending, 111 ms per receipt,
# O(backlog) per batch). Now the only paths are the primary key (one probe per receipt) or
# a sequential scan the planner costs at the table's real size.
PG_PUBLISHED = """
UPDATE {t} t SET state = 'published', stream = (%(streams)b::text[])[u.sidx],
    stream_id = u.sid, published_at = now()
FROM unnest(string_to_array(%(seqs)s, ',')::bigint[], string_to_array(%(sids)s, ','),
            string_to_array(%(sidxs)s, ',')::int[]) AS u(seq, sid, sidx)
WHERE t.seq = u.seq AND t.claimed_by = %(owner)s AND t.claim_epoch = %(epoch)s
  AND (t.state || '') = 'pending'"""

# Transient failures: count the attempt, push available_at by the jittered delay, keep the
# intent when the XADD may have happened (it is then reconciled before the next attempt).
PG_FAILED = """
UPDATE {t} t SET attempts = t.attempts + 1,
    available_at = now() + make_interval(secs => u.delay),
    last_error = u.err,
    claimed_by = CASE WHEN u.keep THEN t.claimed_by END,
    claim_epoch = CASE WHEN u.keep THEN t.claim_epoch END,
    claimed_at = CASE WHEN u.keep THEN t.claimed_at END
FROM unnest(%(seqs)b::bigint[], %(delays)b::float8[], %(errs)b::text[], %(keeps)b::bool[])
    AS u(seq, delay, err, keep)
WHERE t.seq = u.seq AND t.claimed_by = %(owner)s AND t.claim_epoch = %(epoch)s
  AND t.state = 'pending'"""

PG_QUARANTINE = """
UPDATE {t} t SET state = 'quarantined', attempts = t.attempts + 1, last_error = u.err,
    claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL
FROM unnest(%(seqs)b::bigint[], %(errs)b::text[]) AS u(seq, err)
WHERE t.seq = u.seq AND t.claimed_by = %(owner)s AND t.claim_epoch = %(epoch)s
  AND t.state = 'pending'"""

PG_RELEASE = """
UPDATE {t} t SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL
WHERE t.seq = ANY(%(seqs)b::bigint[]) AND t.claimed_by = %(owner)s
  AND t.claim_epoch = %(epoch)s AND t.state = 'pending'"""

# After a whole-Redis refusal (OOM, LOADING, ...) has cleared: end those rows' backoff.
PG_RETRY_NOW = """
UPDATE {t} t SET available_at = now()
WHERE t.seq = ANY(%(seqs)b::bigint[]) AND t.claimed_by IS NULL AND t.state = 'pending'
  AND t.available_at > now()"""

# On taking over partitions: the intents found there belong to a relay that lost them.
# Counting them as an attempt puts them in the blocked index (their keys wait), and they
# become reconcilable once no XADD for them can still arrive.
PG_MARK_ORPHANS = """
UPDATE {t} t SET attempts = t.attempts + 1,
    available_at = greatest(t.available_at,
                            t.claimed_at + make_interval(secs => %(after)s)),
    last_error = 'relay ' || t.claimed_by || ' left an intent without a receipt'
WHERE t.state = 'pending' AND t.claimed_by IS NOT NULL
  AND (t.key_hash %% %(nparts)s) = ANY(%(parts)s)"""

PG_ORPHANS = """
SELECT t.seq, t.event_id, t.topic, t.key, t.key_hash, t.tenant, t.claimed_by, t.claim_epoch,
    extract(epoch FROM t.claimed_at)::float8
FROM {t} t
WHERE t.state = 'pending' AND t.attempts > 0 AND t.claimed_by IS NOT NULL
  AND t.available_at <= now()
  AND t.claimed_at <= now() - make_interval(secs => %(after)s)
  AND (t.key_hash %% %(nparts)s) = ANY(%(parts)s)
ORDER BY t.seq
LIMIT %(limit)s"""

# Rows whose backoff is over (or that were requeued): they may sit below the claim floor,
# so their presence asks for a sweep. Reads the small blocked index only.
PG_RETRY_READY = """
SELECT EXISTS (SELECT 1 FROM {t} t
    WHERE t.state = 'pending' AND t.attempts > 0 AND t.claimed_by IS NULL
      AND t.available_at <= now() AND (t.key_hash %% %(nparts)s) = ANY(%(parts)s))"""

PG_RESOLVE_FOUND = """
UPDATE {t} t SET state = 'published', stream = u.stream, stream_id = u.sid,
    published_at = now()
FROM unnest(%(seqs)b::bigint[], %(streams)b::text[], %(sids)b::text[],
            %(owners)b::text[], %(epochs)b::bigint[]) AS u(seq, stream, sid, owner, epoch)
WHERE t.seq = u.seq AND t.claimed_by = u.owner AND t.claim_epoch = u.epoch
  AND t.state = 'pending'"""

PG_RESOLVE_MISSING = """
UPDATE {t} t SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL
FROM unnest(%(seqs)b::bigint[], %(owners)b::text[], %(epochs)b::bigint[])
    AS u(seq, owner, epoch)
WHERE t.seq = u.seq AND t.claimed_by = u.owner AND t.claim_epoch = u.epoch
  AND t.state = 'pending'"""

# Retention walks the table from its oldest rows and stops at the first row created after
# the cutoff (rows are created in about seq order), so a round costs what it deletes, not a
# scan of the whole table. A row committed late with an old created_at is deleted in a later
# round, once the rows before it are old too.
PG_RETENTION = """
DELETE FROM {t} WHERE seq IN (
    SELECT seq FROM {t}
    WHERE seq < coalesce((SELECT y.seq FROM {t} y
                          WHERE y.created_at >= now() - make_interval(secs => %(age)s)
                          ORDER BY y.seq LIMIT 1), 9223372036854775807)
      AND state = 'published' AND published_at < now() - make_interval(secs => %(age)s)
    ORDER BY seq LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED)"""

PG_BACKLOG = """
SELECT count(*), extract(epoch FROM now() - min(created_at))::float8
FROM {t} WHERE state = 'pending'"""

# The floor sample: the highest sequence value handed out so far, and the snapshot's xmin
# and xmax. Once a later sample's xmin reaches this xmax, every transaction that could hold
# a sequence value up to last_value has finished.
PG_SNAPSHOT = """
SELECT pg_snapshot_xmin(s)::text::bigint, pg_snapshot_xmax(s)::text::bigint,
    coalesce(pg_sequence_last_value(%(seq)s::regclass), 0)
FROM pg_current_snapshot() s"""

PG_LOCKS = """
SELECT l.classid::bigint, l.objid::bigint, l.pid = pg_backend_pid()
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid::bigint IN (%(c)s, %(m)s)"""


SETTLE = 0.25
"""Seconds between reading a sequence value and the snapshot whose xmax covers it."""


class PostgresStore:
    """The relay's statements on PostgreSQL (psycopg 3, autocommit: each statement is one
    short transaction). See the module doc for the design."""

    payload_is_json = True
    supports_notify = True

    def __init__(
        self,
        engine: Engine,
        schema: OutboxSchema,
        *,
        partitions: int,
        reconcile_after: float,
        listen: bool,
        rebalance_interval: float,
        sweep_interval: float,
        member: bool = True,
    ) -> None:
        self.member = member  # False: a helper connection (receipts), not a replica
        self.engine = engine
        self.schema = schema
        self.partitions = partitions
        self.reconcile_after = reconcile_after
        self.listen = listen
        self.rebalance_interval = rebalance_interval
        self.sweep_interval = sweep_interval
        self._conn: Any = None
        self._listen_conn: Any = None
        self._owned: frozenset[int] = frozenset()
        self._sql: dict[str, str] = {}
        self._lock_class = 0
        self._member_class = 0
        self._member_id = random.randrange(1, 2**31 - 1)
        self._sequence = ""
        self._samples: list[tuple[float, int, int]] = []  # (monotonic, xmax, last_value)
        self._floor = 0  # highest sequence value that can no longer appear
        self._low = 0  # where ordinary claims start (see claim)
        self._sweep_pos: int | None = None  # where the sweep in progress goes on
        self._last_rebalance = -math.inf
        self._last_sample = -math.inf

    # -- connections ------------------------------------------------------------------------

    def _connect_args(self) -> tuple[list[Any], dict[str, Any]]:
        cargs, cparams = self.engine.dialect.create_connect_args(self.engine.url)
        return list(cargs), dict(cparams)

    def _new_connection(self) -> Any:
        import psycopg

        cargs, cparams = self._connect_args()
        cparams.setdefault("connect_timeout", 5)
        conn = psycopg.connect(*cargs, autocommit=True, **cparams)
        # Receipts, backoffs and releases may be lost in a database crash without harm:
        # the intent stays and is reconciled against the stream. The claim (the intent
        # itself) must be durable before any XADD, so the claim statement switches
        # synchronous_commit back on for its own transaction (see PG_CLAIM). This saves a
        # WAL flush per batch.
        conn.execute("SET synchronous_commit = off")
        return conn

    def connect(self) -> None:
        if self._conn is not None and not self._conn.closed:
            return
        conn = self._new_connection()
        try:
            row = conn.execute("SELECT current_schema()").fetchone()
            schema_name = self.schema.schema or (row[0] if row else "public")
            qualified = f"{schema_name}.{self.schema.table_name}"
            t = f'"{schema_name}"."{self.schema.table_name}"'
            self._sql = {
                name: sql.replace("{t}", t)
                for name, sql in {
                    "claim": PG_CLAIM,
                    "published": PG_PUBLISHED,
                    "failed": PG_FAILED,
                    "quarantine": PG_QUARANTINE,
                    "release": PG_RELEASE,
                    "retry_now": PG_RETRY_NOW,
                    "mark_orphans": PG_MARK_ORPHANS,
                    "orphans": PG_ORPHANS,
                    "retry_ready": PG_RETRY_READY,
                    "resolve_found": PG_RESOLVE_FOUND,
                    "resolve_missing": PG_RESOLVE_MISSING,
                    "retention": PG_RETENTION,
                    "backlog": PG_BACKLOG,
                }.items()
            }
            self._sql["table"] = t
            seq_row = conn.execute(
                "SELECT pg_get_serial_sequence(%s, 'seq')",
                (f'"{schema_name}"."{self.schema.table_name}"',),
            ).fetchone()
            self._sequence = seq_row[0] if seq_row and seq_row[0] else ""
            self._lock_class = zlib.crc32(f"outbox-relay:{qualified}".encode()) & 0x7FFFFFFF
            self._member_class = (self._lock_class ^ 0x2B5A5A5A) & 0x7FFFFFFF
            if self.member:
                conn.execute(
                    "SELECT pg_advisory_lock(%s, %s)", (self._member_class, self._member_id)
                )
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._owned = frozenset()
        self._samples.clear()
        self._floor = 0
        self._low = 0
        self._sweep_pos = None
        self._last_rebalance = -math.inf

    def close(self) -> None:
        for conn in (self._conn, self._listen_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        self._conn = None
        self._listen_conn = None
        self._owned = frozenset()

    def _lost(self) -> None:
        """Forget a connection that failed: its session (and so its locks) is gone or going."""
        self.close()

    def _execute(self, name: str, params: dict[str, Any]) -> Any:
        if self._conn is None or self._conn.closed:
            raise ConnectionResetError("the relay's database connection is closed")
        try:
            return self._conn.execute(self._sql[name], params)
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
            raise

    # -- partitions -------------------------------------------------------------------------

    @property
    def owned(self) -> frozenset[int]:
        return self._owned

    def rebalance_due(self) -> bool:
        return time.monotonic() - self._last_rebalance >= self.rebalance_interval or not self._owned

    def rebalance(self) -> bool:
        """Take or give back partitions toward a fair share; True if any were taken (their
        orphaned intents were marked, and the caller should sweep)."""
        if not self.rebalance_due():
            return False
        now = time.monotonic()
        self._last_rebalance = now
        self.connect()
        assert self._conn is not None
        try:
            rows = self._conn.execute(
                PG_LOCKS, {"c": self._lock_class, "m": self._member_class}
            ).fetchall()
            members = max(1, len({(c, o) for c, o, _mine in rows if c == self._member_class}))
            mine = {o for c, o, m in rows if c == self._lock_class and m}
            others = {o for c, o, m in rows if c == self._lock_class and not m}
            target = math.ceil(self.partitions / members)
            taken: set[int] = set()
            if len(mine) > target:
                extra = sorted(mine)[target:]
                self._conn.execute(
                    "SELECT pg_advisory_unlock(%s, p) FROM unnest(%s::int[]) p",
                    (self._lock_class, extra),
                )
                mine -= set(extra)
            elif len(mine) < target:
                free = [p for p in range(self.partitions) if p not in mine and p not in others]
                random.shuffle(free)
                if free:
                    got = self._conn.execute(
                        "SELECT p FROM unnest(%s::int[]) p "
                        "WHERE pg_try_advisory_lock(%s, p) LIMIT %s",
                        (free, self._lock_class, target - len(mine)),
                    ).fetchall()
                    taken = {int(r[0]) for r in got}
                    mine |= taken
            if taken:
                self._conn.execute(
                    self._sql["mark_orphans"],
                    {
                        "after": self.reconcile_after,
                        "nparts": self.partitions,
                        "parts": sorted(taken),
                    },
                )
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
            raise
        changed = frozenset(mine) != self._owned
        self._owned = frozenset(mine)
        if changed:
            log.info(
                "partitions",
                extra=fields(owned=sorted(self._owned), replicas=members, target=target),
            )
        return bool(taken)

    # -- floor ------------------------------------------------------------------------------

    def _advance_floor(self) -> None:
        """Sample the snapshot (at most every 100 ms) and raise the floor past sequence
        values whose transactions have all finished (see the module doc)."""
        now = time.monotonic()
        if now - self._last_sample < 0.05 or not self._sequence:
            return
        self._last_sample = now
        assert self._conn is not None
        try:
            row = self._conn.execute(PG_SNAPSHOT, {"seq": self._sequence}).fetchone()
        except Exception as exc:
            if _is_connection_error(exc):
                self._lost()
                raise
            # Most likely no privilege to read the sequence: claims then start from the
            # first pending row (correct, slower while dead index entries pile up).
            log.warning(
                "cannot read the sequence for the claim floor; claiming from the first row",
                extra=fields(error=f"{type(exc).__name__}: {exc}"[:300]),
            )
            self._sequence = ""
            return
        xmin, xmax, last_value = int(row[0]), int(row[1]), int(row[2])
        self._samples.append((now, xmax, last_value))
        # The sequence value of sample i is safe once every transaction that could hold a
        # value up to it has ended. An INSERT allocates its value a moment before its
        # transaction id, so the xmax that covers sample i is the one of a sample taken
        # SETTLE seconds later; once the current xmin has passed that xmax, no transaction
        # holding a value up to sample i's last_value is still running.
        best = -1
        for i, (t_i, _x, _lv) in enumerate(self._samples):
            later = next((s for s in self._samples[i + 1 :] if s[0] - t_i >= SETTLE), None)
            if later is None or later[1] > xmin:
                break
            best = i
        if best >= 0:
            self._floor = max(self._floor, self._samples[best][2])
            del self._samples[: best + 1]
        if len(self._samples) > 2000:
            del self._samples[: len(self._samples) - 2000]

    # -- claim and outcomes -----------------------------------------------------------------

    def claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]:
        if not self._owned:
            return []
        self._advance_floor()
        # Where an ordinary claim starts (``_low``): every row below it has been examined by
        # an earlier claim (claimed, or left behind a blocked key: a sweep takes those) and
        # no new row can appear below it. After a claim that examined [start, end], the
        # rows up to min(end, safe floor) were all visible and examined, so _low moves there.
        # A sweep walks from the first pending row up to _low, one batch per claim.
        if sweep:
            self._sweep_pos = 0
        start = self._low if self._sweep_pos is None else self._sweep_pos
        cur = self._execute(
            "claim",
            {
                "floor": start,
                "nparts": self.partitions,
                "parts": sorted(self._owned),
                "limit": limit,
                "owner": owner,
                "epoch": epoch,
            },
        )
        records = [Record(*row) for row in cur.fetchall()]
        records.sort(key=lambda r: r.seq)
        examined_to = records[-1].seq if len(records) >= limit else math.inf
        if self._sweep_pos is not None:
            self._sweep_pos = None if examined_to + 1 >= self._low else int(examined_to + 1)
        if start <= self._low:
            self._low = int(max(self._low, min(examined_to, self._floor) + 1))
        return records

    @property
    def sweeping(self) -> bool:
        return self._sweep_pos is not None

    def mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int:
        if not receipts:
            return 0
        streams: dict[str, int] = {}
        indexes = [streams.setdefault(r[1], len(streams) + 1) for r in receipts]
        cur = self._execute(
            "published",
            {
                "seqs": ",".join([str(r[0]) for r in receipts]),
                "sids": ",".join([r[2] for r in receipts]),
                "sidxs": ",".join(map(str, indexes)),
                "streams": list(streams),
                "owner": owner,
                "epoch": epoch,
            },
        )
        return int(cur.rowcount)

    def mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None:
        if not failures:
            return
        self._execute(
            "failed",
            {
                "seqs": [f[0] for f in failures],
                "delays": [float(f[1]) for f in failures],
                "errs": [f[2][:2000] for f in failures],
                "keeps": [bool(f[3]) for f in failures],
                "owner": owner,
                "epoch": epoch,
            },
        )

    def quarantine(self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]) -> None:
        if not failures:
            return
        self._execute(
            "quarantine",
            {
                "seqs": [f[0] for f in failures],
                "errs": [f[1][:2000] for f in failures],
                "owner": owner,
                "epoch": epoch,
            },
        )

    def release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None:
        if seqs:
            self._execute("release", {"seqs": list(seqs), "owner": owner, "epoch": epoch})

    def retry_now(self, seqs: Sequence[int]) -> int:
        if not seqs:
            return 0
        return int(self._execute("retry_now", {"seqs": list(seqs)}).rowcount)

    def orphans(self, limit: int) -> list[Orphan]:
        if not self._owned:
            return []
        cur = self._execute(
            "orphans",
            {
                "after": self.reconcile_after,
                "nparts": self.partitions,
                "parts": sorted(self._owned),
                "limit": limit,
            },
        )
        return [Orphan(*row) for row in cur.fetchall()]

    def retry_ready(self) -> bool:
        if not self._owned:
            return False
        cur = self._execute(
            "retry_ready", {"nparts": self.partitions, "parts": sorted(self._owned)}
        )
        row = cur.fetchone()
        return bool(row and row[0])

    def resolve_orphans(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None:
        if found:
            self._execute(
                "resolve_found",
                {
                    "seqs": [o.seq for o, _s, _i in found],
                    "streams": [s for _o, s, _i in found],
                    "sids": [i for _o, _s, i in found],
                    "owners": [o.claimed_by for o, _s, _i in found],
                    "epochs": [o.claim_epoch for o, _s, _i in found],
                },
            )
        if missing:
            self._execute(
                "resolve_missing",
                {
                    "seqs": [o.seq for o in missing],
                    "owners": [o.claimed_by for o in missing],
                    "epochs": [o.claim_epoch for o in missing],
                },
            )

    # -- wake-up ----------------------------------------------------------------------------

    def wait_for_notify(self, timeout: float) -> int:
        """Wait up to ``timeout`` for a NOTIFY: 0 if none came, 1 for new rows, 2 when a
        ``requeue`` asked for a sweep. Without LISTEN (or if the listening connection
        fails) this is a plain sleep."""
        if not self.listen:
            time.sleep(timeout)
            return 0
        try:
            if self._listen_conn is None or self._listen_conn.closed:
                conn = self._new_connection()
                # The channel names the schema the table lives in (the trigger uses
                # TG_TABLE_SCHEMA): other schemas' outboxes do not wake this relay.
                row = conn.execute(_TABLE_SCHEMA_SQL, {"q": _quoted(self.schema)}).fetchone()
                table_schema = row[0] if row and row[0] else (self.schema.schema or "public")
                channel = self.schema.notify_channel(table_schema)
                conn.execute(psycopg_sql.SQL("LISTEN {}").format(psycopg_sql.Identifier(channel)))
                self._listen_conn = conn
            got = 0
            for n in self._listen_conn.notifies(timeout=timeout, stop_after=1):
                got = max(got, 2 if n.payload == "sweep" else 1)
            if got:  # drain what else is queued: one wake-up is enough
                for n in self._listen_conn.notifies(timeout=0.0001):
                    got = max(got, 2 if n.payload == "sweep" else 1)
            return got
        except Exception as exc:
            log.warning(
                "LISTEN connection failed; polling",
                extra=fields(error=f"{type(exc).__name__}: {exc}"),
            )
            if self._listen_conn is not None:
                with contextlib.suppress(Exception):
                    self._listen_conn.close()
            self._listen_conn = None
            time.sleep(timeout)
            return 0

    # -- maintenance ------------------------------------------------------------------------

    def vacuum_if_no_autovacuum(self) -> float | None:
        """VACUUM the table when the server runs without autovacuum; seconds it took, or
        None when autovacuum is on (nothing done). Runs on a connection of its own."""
        # The decision and the VACUUM are outbox.maintenance's, shared with the job worker
        # and the consumer (also: a table with autovacuum_enabled = false is vacuumed).
        done = vacuum_unless_autovacuum(self._new_connection, [self._sql["table"]])
        return sum(done.values()) if done else None

    # -- retention and progress -------------------------------------------------------------

    def delete_published(self, older_than_seconds: float, limit: int) -> int:
        cur = self._execute("retention", {"age": float(older_than_seconds), "limit": limit})
        return int(cur.rowcount)

    def backlog(self) -> tuple[int, float | None]:
        row = self._execute("backlog", {}).fetchone()
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    # -- the pipeline and the operator's commands -------------------------------------------

    def receipt_store(self) -> PostgresStore:
        return PostgresStore(
            self.engine,
            self.schema,
            partitions=self.partitions,
            reconcile_after=self.reconcile_after,
            listen=False,
            rebalance_interval=self.rebalance_interval,
            sweep_interval=self.sweep_interval,
            member=False,
        )

    def status(self) -> dict[str, TopicStatus]:
        with self.engine.connect() as conn:
            return _status(conn, _quoted(self.schema), NOW_SQL[POSTGRESQL])

    def published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        sql = (
            f"SELECT {_PG_RECORD_COLUMNS}, t.stream FROM {_quoted(self.schema)} t "
            "WHERE t.seq > %(after)s AND t.state = 'published'"
            + ("" if since is None else " AND t.created_at >= %(since)s")
            + ("" if topic is None else " AND t.topic = %(topic)s")
            + " ORDER BY t.seq LIMIT %(limit)s"
        )
        params = {"after": after_seq, "since": since, "topic": topic, "limit": limit}
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(sql, params).fetchall()
        return [(Record(*row[:12]), row[12]) for row in rows]

    def latest_receipts(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"SELECT stream, stream_id FROM {_quoted(self.schema)} "
                "WHERE state = 'published' AND stream_id IS NOT NULL ORDER BY seq DESC LIMIT 1000"
            ).fetchall()
        return _highest_receipts(rows)

    def oldest_published_since(self, published_after: float | None) -> datetime | None:
        with self.engine.connect() as conn:
            return cast(
                "datetime | None",
                conn.exec_driver_sql(
                    f"SELECT min(created_at) FROM {_quoted(self.schema)} "
                    "WHERE state = 'published' AND published_at >= to_timestamp(%(after)s)",
                    {"after": published_after or 0.0},
                ).scalar(),
            )

    def requeue(self, event_ids: Sequence[str] | None, all_quarantined: bool) -> RequeueResult:
        outbox_schema = self.schema

        def ask_for_a_sweep(conn: Connection) -> None:
            # Relays claim from a floor above old rows; a requeued row needs a full sweep.
            channel = outbox_schema.notify_channel(table_schema_of(conn, outbox_schema))
            conn.execute(text("SELECT pg_notify(:c, 'sweep')"), {"c": channel})

        return _requeue(
            self.engine,
            _quoted(self.schema),
            NOW_SQL[POSTGRESQL],
            event_ids,
            all_quarantined,
            ask_for_a_sweep,
        )


_TABLE_SCHEMA_SQL = (
    "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass(%(q)s)"
)
"""The schema the outbox table resolves to on a connection (what its NOTIFY channel names)."""


def _is_connection_error(exc: BaseException) -> bool:
    import psycopg

    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError, OSError))


# -- SQLite ------------------------------------------------------------------------------------

_SQLITE_NOW = NOW_SQL[SQLITE]

_SQLITE_RECORD_COLUMNS = """o.seq, o.event_id, o.topic, o.key, o.key_hash, o.tenant, o.identity,
    o.payload, o.headers,
    replace(substr(o.created_at, 1, 23), ' ', 'T') || 'Z',
    (julianday(o.created_at) - 2440587.5) * 86400.0, o.attempts"""

SQLITE_CLAIM = (
    """
SELECT """
    + _SQLITE_RECORD_COLUMNS
    + """
FROM {t} o
WHERE o.state = 'pending' AND o.claimed_by IS NULL AND o.available_at <= """
    + _SQLITE_NOW
    + """
  AND """
    + _BLOCKED.replace("{t}", "{t}")
    + """
ORDER BY o.seq
LIMIT :limit"""
)


class SqliteStore:
    """The relay's statements on SQLite: one relay at a time (a lock file), BEGIN IMMEDIATE,
    polling. Same semantics as :class:`PostgresStore` with a single partition."""

    payload_is_json = False
    supports_notify = False
    partitions = 1

    def __init__(self, engine: Engine, schema: OutboxSchema, *, reconcile_after: float) -> None:
        self.engine = engine
        self.schema = schema
        self.reconcile_after = reconcile_after
        self.t = _quoted(schema)
        self._lock_fd: int | None = None
        self._owned: frozenset[int] = frozenset()
        self._waiting_logged = False

    def _lock_path(self) -> str | None:
        database = self.engine.url.database
        if not database or database == ":memory:":
            return None
        return os.path.abspath(database) + ".relay.lock"

    def connect(self) -> None:
        pass

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
        self._lock_fd = None
        self._owned = frozenset()

    @property
    def owned(self) -> frozenset[int]:
        return self._owned

    def rebalance_due(self) -> bool:
        return not self._owned

    def rebalance(self) -> bool:
        if self._owned:
            return False
        path = self._lock_path()
        if path is not None:
            import fcntl

            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                if not self._waiting_logged:
                    log.warning(
                        "another relay holds this SQLite database; waiting (SQLite runs one "
                        "relay at a time)",
                        extra=fields(lock=path),
                    )
                    self._waiting_logged = True
                return False
            self._lock_fd = fd
        self._owned = frozenset({0})
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    f"UPDATE {self.t} SET attempts = attempts + 1, "
                    "available_at = max(available_at, strftime('%Y-%m-%d %H:%M:%f', claimed_at, "
                    "'+' || :after || ' seconds')), "
                    "last_error = 'relay ' || claimed_by || ' left an intent without a receipt' "
                    "WHERE state = 'pending' AND claimed_by IS NOT NULL"
                ),
                {"after": self.reconcile_after},
            )
        return True

    def claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]:
        if not self._owned:
            return []
        sql = SQLITE_CLAIM.replace("{t}", self.t)
        with (
            self.engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn,
            conn.begin(),
        ):
            rows = conn.execute(text(sql), {"limit": limit}).fetchall()
            if not rows:
                return []
            conn.execute(
                text(
                    f"UPDATE {self.t} SET claimed_by = :owner, claim_epoch = :epoch, "
                    f"claimed_at = {_SQLITE_NOW} WHERE seq = :seq"
                ),
                [{"owner": owner, "epoch": epoch, "seq": r[0]} for r in rows],
            )
        return [_sqlite_record(r) for r in rows]

    def _run_many(self, sql: str, params: list[dict[str, Any]]) -> int:
        if not params:
            return 0
        with self.engine.begin() as conn:
            result = conn.execute(text(sql), params)
            return int(result.rowcount)

    def mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int:
        return self._run_many(
            f"UPDATE {self.t} SET state = 'published', stream = :stream, stream_id = :sid, "
            f"published_at = {_SQLITE_NOW} WHERE seq = :seq AND claimed_by = :owner "
            "AND claim_epoch = :epoch AND state = 'pending'",
            [
                {"seq": s, "stream": st, "sid": sid, "owner": owner, "epoch": epoch}
                for s, st, sid in receipts
            ],
        )

    def mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None:
        self._run_many(
            f"UPDATE {self.t} SET attempts = attempts + 1, "
            "available_at = strftime('%Y-%m-%d %H:%M:%f', 'now', '+' || :delay || ' seconds'), "
            "last_error = :err, "
            "claimed_by = CASE WHEN :keep THEN claimed_by END, "
            "claim_epoch = CASE WHEN :keep THEN claim_epoch END, "
            "claimed_at = CASE WHEN :keep THEN claimed_at END "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [
                {
                    "seq": s,
                    "delay": f"{delay:.6f}",
                    "err": err[:2000],
                    "keep": 1 if keep else 0,
                    "owner": owner,
                    "epoch": epoch,
                }
                for s, delay, err, keep in failures
            ],
        )

    def quarantine(self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]) -> None:
        self._run_many(
            f"UPDATE {self.t} SET state = 'quarantined', attempts = attempts + 1, "
            "last_error = :err, claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": s, "err": err[:2000], "owner": owner, "epoch": epoch} for s, err in failures],
        )

    def release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None:
        self._run_many(
            f"UPDATE {self.t} SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": s, "owner": owner, "epoch": epoch} for s in seqs],
        )

    def retry_now(self, seqs: Sequence[int]) -> int:
        return self._run_many(
            f"UPDATE {self.t} SET available_at = {_SQLITE_NOW} WHERE seq = :seq "
            f"AND claimed_by IS NULL AND state = 'pending' AND available_at > {_SQLITE_NOW}",
            [{"seq": s} for s in seqs],
        )

    def orphans(self, limit: int) -> list[Orphan]:
        if not self._owned:
            return []
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT seq, event_id, topic, key, key_hash, tenant, claimed_by, claim_epoch, "
                    "(julianday(claimed_at) - 2440587.5) * 86400.0 "
                    f"FROM {self.t} WHERE state = 'pending' AND attempts > 0 "
                    f"AND claimed_by IS NOT NULL AND available_at <= {_SQLITE_NOW} "
                    "AND claimed_at <= strftime('%Y-%m-%d %H:%M:%f', 'now', "
                    "'-' || :after || ' seconds') ORDER BY seq LIMIT :limit"
                ),
                {"after": self.reconcile_after, "limit": limit},
            ).fetchall()
        return [
            Orphan(int(r[0]), r[1], r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), float(r[8]))
            for r in rows
        ]

    def resolve_orphans(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None:
        self._run_many(
            f"UPDATE {self.t} SET state = 'published', stream = :stream, stream_id = :sid, "
            f"published_at = {_SQLITE_NOW} WHERE seq = :seq AND claimed_by = :owner "
            "AND claim_epoch = :epoch AND state = 'pending'",
            [
                {
                    "seq": o.seq,
                    "stream": s,
                    "sid": i,
                    "owner": o.claimed_by,
                    "epoch": o.claim_epoch,
                }
                for o, s, i in found
            ],
        )
        self._run_many(
            f"UPDATE {self.t} SET claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
            "WHERE seq = :seq AND claimed_by = :owner AND claim_epoch = :epoch "
            "AND state = 'pending'",
            [{"seq": o.seq, "owner": o.claimed_by, "epoch": o.claim_epoch} for o in missing],
        )

    def retry_ready(self) -> bool:
        return False  # SQLite claims always scan from the first pending row

    def wait_for_notify(self, timeout: float) -> int:
        time.sleep(timeout)
        return 0

    def delete_published(self, older_than_seconds: float, limit: int) -> int:
        with self.engine.begin() as conn:
            result = conn.execute(
                text(
                    f"DELETE FROM {self.t} WHERE seq IN (SELECT seq FROM {self.t} "
                    "WHERE state = 'published' AND published_at < "
                    "strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :age || ' seconds') "
                    "ORDER BY seq LIMIT :limit)"
                ),
                {"age": f"{older_than_seconds:.6f}", "limit": limit},
            )
            return int(result.rowcount)

    def backlog(self) -> tuple[int, float | None]:
        with self.engine.connect() as conn:
            row = conn.execute(
                text(
                    "SELECT count(*), (julianday('now') - julianday(min(created_at))) * 86400.0 "
                    f"FROM {self.t} WHERE state = 'pending'"
                )
            ).fetchone()
        assert row is not None
        return int(row[0]), (float(row[1]) if row[1] is not None else None)

    def receipt_store(self) -> None:
        return None  # one writer at a time: a second connection would only wait for the lock

    def vacuum_if_no_autovacuum(self) -> None:
        return None

    def status(self) -> dict[str, TopicStatus]:
        with self.engine.connect() as conn:
            return _status(conn, self.t, NOW_SQL[SQLITE])

    def requeue(self, event_ids: Sequence[str] | None, all_quarantined: bool) -> RequeueResult:
        return _requeue(self.engine, self.t, NOW_SQL[SQLITE], event_ids, all_quarantined)

    def published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        sql = (
            f"SELECT {_SQLITE_RECORD_COLUMNS}, o.stream FROM {self.t} o "
            "WHERE o.seq > :after AND o.state = 'published'"
            + ("" if since is None else " AND o.created_at >= :since")
            + ("" if topic is None else " AND o.topic = :topic")
            + " ORDER BY o.seq LIMIT :limit"
        )
        params: dict[str, Any] = {"after": after_seq, "topic": topic, "limit": limit}
        if since is not None:
            params["since"] = _sqlite_time(since)
        with self.engine.connect() as conn:
            rows = conn.execute(text(sql), params).fetchall()
        return [(_sqlite_record(row[:12]), row[12]) for row in rows]

    def latest_receipts(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    f"SELECT stream, stream_id FROM {self.t} WHERE state = 'published' "
                    "AND stream_id IS NOT NULL ORDER BY seq DESC LIMIT 1000"
                )
            ).fetchall()
        return _highest_receipts(rows)

    def oldest_published_since(self, published_after: float | None) -> datetime | None:
        with self.engine.connect() as conn:
            value = conn.execute(
                text(
                    f"SELECT min(created_at) FROM {self.t} WHERE state = 'published' "
                    "AND published_at >= strftime('%Y-%m-%d %H:%M:%f', :after, 'unixepoch')"
                ),
                {"after": published_after or 0.0},
            ).scalar()
        if value is None:
            return None
        if isinstance(value, datetime):
            return value if value.tzinfo else value.replace(tzinfo=UTC)
        return datetime.fromisoformat(str(value).replace(" ", "T")).replace(tzinfo=UTC)


def _sqlite_time(value: datetime) -> str:
    """A timestamp as SQLite's columns hold it: UTC text with milliseconds."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:23]


def _sqlite_record(r: Sequence[Any]) -> Record:
    payload = r[7] if isinstance(r[7], str) else json.dumps(r[7])
    headers = r[8] if (r[8] is None or isinstance(r[8], str)) else json.dumps(r[8])
    return Record(
        int(r[0]),
        r[1],
        r[2],
        r[3],
        int(r[4]),
        r[5],
        r[6],
        payload,
        headers,
        str(r[9]),
        float(r[10] or 0.0),
        int(r[11]),
    )
