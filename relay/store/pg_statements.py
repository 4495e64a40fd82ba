"""The relay's SQL statements on PostgreSQL, as text with ``{t}`` for the table: what
:class:`relay.store.postgres.PostgresStore` runs (and :mod:`relay.store.partitions` rewrites
for a partitioned table). Kept apart from the store's logic, with the reasons for their
shapes next to them: each one was measured against plans that read more than its rows."""

from __future__ import annotations

PG_RECORD_COLUMNS = """t.seq, t.event_id, t.topic, t.key, t.key_hash, t.tenant, t.identity,
    t.payload::text, t.headers::text,
    to_char(t.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
    extract(epoch FROM t.created_at)::float8, t.attempts"""

# The blocked-key probe. Its predicate is the predicate of ix_<table>_blocked, so the probe
# reads that small index only.
PG_BLOCKED = """NOT EXISTS (
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
    + PG_BLOCKED
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
    + PG_RECORD_COLUMNS
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

# The statements the store runs by name (``PostgresStore._execute``), with ``{t}`` for the
# table; relay.store.partitions rewrites some of them for a partitioned table.
PG_NAMED: dict[str, str] = {
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
}

# Partition ownership: one session-level advisory lock per partition (class: the table's
# lock class), and one per live relay (class: the member class) so each can count the
# replicas. A partition is taken with try-lock (never waits) and given back by unlock.
PG_MEMBER_LOCK = "SELECT pg_advisory_lock(%s, %s)"
PG_UNLOCK_PARTITIONS = "SELECT pg_advisory_unlock(%s, p) FROM unnest(%s::int[]) p"
PG_TRY_LOCK_PARTITIONS = (
    "SELECT p FROM unnest(%s::int[]) p WHERE pg_try_advisory_lock(%s, p) LIMIT %s"
)

# What the claim floor samples (PG_SNAPSHOT): the sequence behind the table's seq column.
PG_SERIAL_SEQUENCE = "SELECT pg_get_serial_sequence(%s, 'seq')"

PG_TABLE_SCHEMA = (
    "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.oid = to_regclass(%(q)s)"
)
"""The schema the outbox table resolves to on a connection (what its NOTIFY channel names)."""

# The operator's reads, on a pooled connection (``{t}``: the table). republish pages through
# the published rows in seq order, optionally from a creation time and for one topic.
PG_PUBLISHED_PAGE = (
    f"SELECT {PG_RECORD_COLUMNS}, t.stream FROM {{t}} t "
    "WHERE t.seq > %(after)s AND t.state = 'published'"
)
PG_PUBLISHED_PAGE_SINCE = " AND t.created_at >= %(since)s"
PG_PUBLISHED_PAGE_TOPIC = " AND t.topic = %(topic)s"
PG_PUBLISHED_PAGE_END = " ORDER BY t.seq LIMIT %(limit)s"

PG_RECEIPT_LATEST = (
    "SELECT stream, stream_id FROM {t} "
    "WHERE state = 'published' AND stream_id IS NOT NULL ORDER BY seq DESC LIMIT 1000"
)

PG_OLDEST_PUBLISHED_SINCE = (
    "SELECT min(created_at) FROM {t} "
    "WHERE state = 'published' AND published_at >= to_timestamp(%(after)s)"
)
