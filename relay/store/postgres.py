"""The relay store on PostgreSQL: partitions owned through advisory locks, the claim that
writes the intent, LISTEN/NOTIFY (see :mod:`relay.store`)."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, cast

from psycopg import sql as psycopg_sql
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import NOW_SQL, POSTGRESQL
from outbox.duty import Interval, weakly
from outbox.logs import fields
from outbox.maintenance import vacuum_unless_autovacuum
from outbox.schema import OutboxSchema, table_schema_of
from relay.records import Orphan, Record, RequeueResult, TopicStatus
from relay.store.base import (
    _highest_receipts,
    _quoted,
    _requeue,
    _status,
)
from relay.store.partitions import statements_for

log = logging.getLogger("outbox.relay")


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
#
# The update takes the locked rows by primary key: a join hashed them against the table.
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
WHERE t.seq = ANY(ARRAY(SELECT seq FROM picked))
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


FLOOR_SAMPLE_INTERVAL = 0.05
"""Seconds between two samples of the snapshot that raise the claim floor."""


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
        # When partitions are next rebalanced (and at once without any), and when the
        # snapshot is next sampled for the floor (outbox.duty).
        # (Read through a weak reference: a lambda on self would make the store a cycle, kept
        # with its partition locks until the cyclic garbage collector ran.)
        self._rebalance = Interval(weakly(self._rebalance_seconds))
        self._floor_sample = Interval(FLOOR_SAMPLE_INTERVAL)

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

    def _rebalance_seconds(self) -> float:
        return self.rebalance_interval

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
            self._sql = statements_for(conn, t, self._sql)  # relay.store.partitions
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
        self._rebalance.make_due()

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
        return self._rebalance.due() or not self._owned

    def rebalance(self, before_release: Callable[[], None] = lambda: None) -> bool:
        """Take or give back partitions toward a fair share (``before_release`` runs first if
        any go back); True if any were taken (orphans marked: the caller should sweep)."""
        if not self.rebalance_due():
            return False
        self._rebalance.done()
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
                before_release()
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
        """Sample the snapshot (at most every ``FLOOR_SAMPLE_INTERVAL``) and raise the floor
        past sequence values whose transactions have all finished (see the module doc)."""
        now = time.monotonic()
        if not self._floor_sample.due(now) or not self._sequence:
            return
        self._floor_sample.done(now)
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
