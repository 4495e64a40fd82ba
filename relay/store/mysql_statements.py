"""The relay's SQL statements on MySQL 8 and MariaDB 10.6+, as text with ``{t}`` for the
table: what :class:`relay.store.mysql.MysqlStore` runs, each with the reason for its shape.

The connections run with ``ANSI_QUOTES`` (``outbox.db.make_engine``), so identifiers are
double-quoted as on the other databases; ``key`` is a reserved word in MySQL and always
quoted. Batches travel as one JSON document unpacked by ``JSON_TABLE`` (MySQL 8.0.4+,
MariaDB 10.6+): one statement per batch, where PyMySQL's ``executemany`` of an UPDATE is
one round trip per row.
"""

from __future__ import annotations

from outbox.dialect import MYSQL, MYSQL_EPOCH_OF, NOW_SQL

NOW = NOW_SQL[MYSQL]

RECORD_COLUMNS = (
    """o.seq, o.event_id, o.topic, o."key", o.key_hash, o.tenant, o.identity,
    o.payload, o.headers,
    DATE_FORMAT(o.created_at, '%Y-%m-%dT%H:%i:%s.%fZ'), """
    + MYSQL_EPOCH_OF.format("o.created_at")
    + """, o.attempts"""
)

# The blocked-key probe: an earlier row of the same key that is quarantined, or pending and
# already tried (in backoff, or an intent awaiting reconciliation). MySQL has no partial
# index: ix_<table>_key_state (key, state, seq) answers it with two short ranges, never
# reading the key's published rows.
BLOCKED = """NOT EXISTS (
        SELECT 1 FROM {t} b
        WHERE b."key" = o."key" AND b.state IN ('quarantined', 'pending') AND b.seq < o.seq
          AND (b.state = 'quarantined' OR b.attempts > 0))"""

# The claim, step 1: the candidates, a plain (consistent, non-locking) read in seq order.
#
# No claim floor, and why none is needed on MySQL. On PostgreSQL the claim starts above the
# rows earlier claims examined, and a snapshot-xmin floor proves that no transaction still
# running can commit a row below that start. MySQL exposes no such horizon for AUTO_INCREMENT
# values: a transaction takes its seq at INSERT and may commit seconds later, after rows with
# higher seqs were claimed and published. So every claim starts at the FIRST pending row of
# ix_<table>_state_seq (state, seq). A row that commits late is pending, with a seq below the
# rows already taken, and the next claim reads it first: it can be published late, never
# skipped. Until it commits it is invisible to this read (READ COMMITTED: each statement
# reads the committed rows as of its start), and the per-key rule keeps order: a domain that
# locks its aggregate row inserts a key's second event only after the first committed, so
# for one key seq order is commit order. The price is that each claim walks the pending rows
# it cannot take (claimed and in flight, held behind a failing key, in backoff): a handful
# normally, the held rows of a quarantined key until it is requeued (docs/how-to/mysql.md).
CLAIM_CANDIDATES = (
    """
SELECT o.seq FROM {t} o
WHERE o.state = 'pending' AND o.claimed_by IS NULL AND o.available_at <= """
    + NOW
    + """
  AND MOD(o.key_hash, :nparts) IN :parts AND """
    + BLOCKED
    + """
ORDER BY o.seq
LIMIT :limit"""
)

# Step 2, in one transaction with step 3: lock the candidates by primary key, re-checking
# what step 1 read. SKIP LOCKED: a row another session holds (a writer's uncommitted
# requeue, say) is left for a later claim rather than waited on. READ COMMITTED takes no gap
# locks, so writers inserting new rows never wait for a claim.
CLAIM_LOCK = (
    "SELECT "
    + RECORD_COLUMNS
    + """ FROM {t} o
WHERE o.seq IN :seqs AND o.state = 'pending' AND o.claimed_by IS NULL
ORDER BY o.seq
FOR UPDATE SKIP LOCKED"""
)

# Step 3: the intent. Committed (innodb_flush_log_at_trx_commit = 1, the default) before any
# XADD of these rows.
CLAIM_INTENT = (
    "UPDATE {t} SET claimed_by = :owner, claim_epoch = :epoch, claimed_at = "
    + NOW
    + " WHERE seq IN :seqs"
)

# Receipts: compare-and-set on (claimed_by, claim_epoch), as on every database. The affected
# count is rows matched (SQLAlchemy's MySQL dialect asks for CLIENT_FOUND_ROWS). Every batch
# UPDATE also names its rows in ``t.seq IN :seqs``: without it the optimizer may scan the
# table for the join and wait on rows a writer has inserted and not yet committed (measured:
# a receipt stuck behind an open domain transaction until innodb_lock_wait_timeout).
PUBLISHED = (
    """
UPDATE {t} t JOIN JSON_TABLE(:doc, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]', stream VARCHAR(512) PATH '$[1]', sid VARCHAR(64) PATH '$[2]'
    )) u ON t.seq = u.seq
SET t.state = 'published', t.stream = u.stream, t.stream_id = u.sid, t.published_at = """
    + NOW
    + """
WHERE t.seq IN :seqs AND t.claimed_by = :owner AND t.claim_epoch = :epoch
  AND t.state = 'pending'"""
)

# Transient failures: count the attempt, push available_at by the jittered delay (in
# microseconds: INTERVAL takes no fraction of a second portably), keep the intent when the
# XADD may have happened. MySQL evaluates SET left to right with the new values, so the
# intent columns are cleared last, each testing ``keep`` alone.
FAILED = (
    """
UPDATE {t} t JOIN JSON_TABLE(:doc, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]', delay_us BIGINT PATH '$[1]', err TEXT PATH '$[2]',
        keep INT PATH '$[3]'
    )) u ON t.seq = u.seq
SET t.attempts = t.attempts + 1,
    t.available_at = """
    + NOW
    + """ + INTERVAL u.delay_us MICROSECOND,
    t.last_error = u.err,
    t.claimed_at = CASE WHEN u.keep = 1 THEN t.claimed_at END,
    t.claim_epoch = CASE WHEN u.keep = 1 THEN t.claim_epoch END,
    t.claimed_by = CASE WHEN u.keep = 1 THEN t.claimed_by END
WHERE t.seq IN :seqs AND t.claimed_by = :owner AND t.claim_epoch = :epoch
  AND t.state = 'pending'"""
)

QUARANTINE = """
UPDATE {t} t JOIN JSON_TABLE(:doc, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]', err TEXT PATH '$[1]'
    )) u ON t.seq = u.seq
SET t.state = 'quarantined', t.attempts = t.attempts + 1, t.last_error = u.err,
    t.claimed_at = NULL, t.claim_epoch = NULL, t.claimed_by = NULL
WHERE t.seq IN :seqs AND t.claimed_by = :owner AND t.claim_epoch = :epoch
  AND t.state = 'pending'"""

RELEASE = """
UPDATE {t} SET claimed_at = NULL, claim_epoch = NULL, claimed_by = NULL
WHERE seq IN :seqs AND claimed_by = :owner AND claim_epoch = :epoch AND state = 'pending'"""

RETRY_NOW = (
    "UPDATE {t} SET available_at = "
    + NOW
    + " WHERE seq IN :seqs AND claimed_by IS NULL AND state = 'pending' AND available_at > "
    + NOW
)

# On taking over partitions: the intents found there belong to a relay that lost them (as on
# PostgreSQL: counted as an attempt, so their keys wait, reconcilable once no XADD for them
# can still arrive). Found by a plain read first, then updated by primary key: an UPDATE
# that scanned the pending rows itself would wait on every row a writer has inserted and
# not yet committed (InnoDB locks what a locking scan meets), holding the relay as long as
# the slowest domain transaction.
ORPHAN_INTENTS = """
SELECT seq FROM {t}
WHERE state = 'pending' AND claimed_by IS NOT NULL AND MOD(key_hash, :nparts) IN :parts"""

MARK_ORPHANS = """
UPDATE {t} SET attempts = attempts + 1,
    available_at = GREATEST(available_at, claimed_at + INTERVAL :after_us MICROSECOND),
    last_error = CONCAT('relay ', claimed_by, ' left an intent without a receipt')
WHERE seq IN :seqs AND state = 'pending' AND claimed_by IS NOT NULL"""

ORPHANS = (
    """
SELECT o.seq, o.event_id, o.topic, o."key", o.key_hash, o.tenant, o.claimed_by, o.claim_epoch,
    """
    + MYSQL_EPOCH_OF.format("o.claimed_at")
    + """
FROM {t} o
WHERE o.state = 'pending' AND o.attempts > 0 AND o.claimed_by IS NOT NULL
  AND o.available_at <= """
    + NOW
    + """
  AND o.claimed_at <= """
    + NOW
    + """ - INTERVAL :after_us MICROSECOND
  AND MOD(o.key_hash, :nparts) IN :parts
ORDER BY o.seq
LIMIT :limit"""
)

RESOLVE_FOUND = (
    """
UPDATE {t} t JOIN JSON_TABLE(:doc, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]', stream VARCHAR(512) PATH '$[1]', sid VARCHAR(64) PATH '$[2]',
        owner VARCHAR(128) PATH '$[3]', epoch BIGINT PATH '$[4]'
    )) u ON t.seq = u.seq
SET t.state = 'published', t.stream = u.stream, t.stream_id = u.sid, t.published_at = """
    + NOW
    + """
WHERE t.seq IN :seqs AND t.claimed_by = u.owner AND t.claim_epoch = u.epoch
  AND t.state = 'pending'"""
)

RESOLVE_MISSING = """
UPDATE {t} t JOIN JSON_TABLE(:doc, '$[*]' COLUMNS (
        seq BIGINT PATH '$[0]', owner VARCHAR(128) PATH '$[1]', epoch BIGINT PATH '$[2]'
    )) u ON t.seq = u.seq
SET t.claimed_at = NULL, t.claim_epoch = NULL, t.claimed_by = NULL
WHERE t.seq IN :seqs AND t.claimed_by = u.owner AND t.claim_epoch = u.epoch
  AND t.state = 'pending'"""

# Retention: a single-table DELETE may take ORDER BY and LIMIT on MySQL, so a round walks the
# primary key from the oldest row and deletes at most ``limit`` rows (short locks, bounded
# undo). It stops at the first row created after the cutoff, as on PostgreSQL, so a round
# costs what it deletes.
RETENTION = (
    """
DELETE FROM {t}
WHERE seq < :stop AND state = 'published'
  AND published_at < """
    + NOW
    + """ - INTERVAL :age_us MICROSECOND
ORDER BY seq
LIMIT :limit"""
)

RETENTION_STOP = (
    "SELECT seq FROM {t} WHERE created_at >= "
    + NOW
    + " - INTERVAL :age_us MICROSECOND ORDER BY seq LIMIT 1"
)

RETENTION_DUE = (
    "SELECT count(*) FROM {t} WHERE state = 'published' AND published_at < "
    + NOW
    + " - INTERVAL :age_us MICROSECOND"
)

BACKLOG = (
    "SELECT count(*), "
    + MYSQL_EPOCH_OF.format(NOW)
    + " - "
    + MYSQL_EPOCH_OF.format("min(created_at)")
    + " FROM {t} WHERE state = 'pending'"
)

PUBLISHED_PAGE = (
    "SELECT " + RECORD_COLUMNS + ", o.stream FROM {t} o WHERE o.seq > :after "
    "AND o.state = 'published'"
)

RECEIPT_LATEST = (
    "SELECT stream, stream_id FROM {t} "
    "WHERE state = 'published' AND stream_id IS NOT NULL ORDER BY seq DESC LIMIT 1000"
)

OLDEST_PUBLISHED_SINCE = (
    "SELECT min(created_at) FROM {t} WHERE state = 'published' "
    "AND published_at >= TIMESTAMPADD(MICROSECOND, :after_us, '1970-01-01 00:00:00')"
)


def micros(seconds: float) -> int:
    """Seconds as whole microseconds, for ``INTERVAL ... MICROSECOND``."""
    return round(float(seconds) * 1_000_000)
