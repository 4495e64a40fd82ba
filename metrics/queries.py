"""Every SQL statement the metrics run, with the reason it stays cheap beside it.

The collector runs these at scrape time (behind a cache), so each one must be bounded by an
index whatever the size of the table: the outbox keeps published rows until retention, so a
query that touched them would grow with history instead of with the backlog. The states are
written into the SQL as literals, not bound parameters, so PostgreSQL's planner can match
the partial indexes' predicates (``WHERE state = 'pending'``) whatever plan mode a driver
uses; table names come from validated identifiers (``outbox.schema.check_identifier``).

Ages are computed against the database clock (:func:`now_sql`), the clock that wrote
``created_at``, so a skewed exporter host cannot report a wrong age.
"""

from __future__ import annotations

from sqlalchemy import DateTime, Double, Integer, String, column, text
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect

from outbox.dialect import EPOCH_SQL, NOW_SQL, quoted_table
from outbox.status import backlog_by_topic as backlog_by_topic
from outbox.status import most_attempted as most_attempted
from outbox.status import pending_attempts as pending_attempts
from outbox.status import quarantined_count as quarantined_count


def qualified(table: str, schema: str | None) -> str:
    """A quoted table reference from names already checked as plain identifiers."""
    return quoted_table(table, schema)


def now_sql(dialect: str) -> TextualSelect:
    """The database clock. SQLite: UTC text with milliseconds (what ``db_now`` writes)."""
    return text(f"SELECT {NOW_SQL[dialect]} AS now").columns(column("now", DateTime(timezone=True)))


# -- outbox ----------------------------------------------------------------------------------
# The backlog statements are outbox.status.py's (also relay.store's), one place for the backlog
# SQL: backlog_by_topic, quarantined_count, pending_attempts and most_attempted, each with
# the index that bounds it.


# -- naive baselines (bench/scrape.py compares against these; never used by the collector) ----


def naive_state_counts(table: str) -> TextClause:
    """What a dashboard query often looks like: a full scan of the table, published included."""
    return text(
        f"SELECT topic, state, count(*), min(created_at), max(attempts) "
        f"FROM {table} GROUP BY topic, state"
    )


# -- consumer (tables of consumer/inbox.py) ------------------------------------------------------

DEAD_LETTER_TABLE = "consumer_dead_letters"
NEEDS_ATTENTION_LETTER = "needs_attention"


def dead_letters(table: str) -> TextualSelect:
    """NEEDS_ATTENTION dead letters per group and reason, with the oldest one's time.

    Served by ``ix_consumer_dead_letters_state (state, group_name)``: replayed letters are
    skipped by the index, so the cost follows what still needs attention. The consumer's
    inbox itself is not counted: its size is the deduplication window (days of history), and
    counting it would be a scan that grows with traffic.
    """
    return text(
        f"SELECT group_name, reason, count(*) AS n, min(created_at) AS oldest FROM {table} "
        f"WHERE state = '{NEEDS_ATTENTION_LETTER}' GROUP BY group_name, reason"
    ).columns(
        column("group_name", String),
        column("reason", String),
        column("n", Integer),
        column("oldest", DateTime(timezone=True)),
    )


# -- jobs (tables of consumer/jobs/schema.py; times there are unix seconds) ----------------------

OPERATIONS_TABLE = "outbox_operations"
JOBS_TABLE = "outbox_jobs"
# Open (non-terminal) states. DONE and CANCELLED are history: counting them would scan every
# job ever run, so they are not exported (the workers' outcome counters show throughput).
# HELD: jobs of an order key behind an earlier one (``ix_outbox_jobs_order_held``).
# WAITING_PARENTS: steps whose parents are not all DONE (``ix_outbox_jobs_waiting_parents``).
OPEN_JOB_STATES = (
    *("READY", "LEASED", "WAITING_EXTERNAL", "WAITING_REVIEW", "NEEDS_ATTENTION"),
    *("HELD", "WAITING_PARENTS"),
)
STEPS_TABLE = "outbox_job_steps"


def epoch_sql(dialect: str) -> str:
    """The database clock in unix seconds, as the job store writes its times."""
    return EPOCH_SQL[dialect]


def jobs_per_open_state(table: str) -> TextualSelect:
    """Open jobs per state, one UNION ALL branch per state so each can use its partial index.

    READY: ``ix_outbox_jobs_ready`` and LEASED: ``ix_outbox_jobs_leased`` (index-only on
    PostgreSQL); the WAITING states: ``ix_outbox_jobs_waiting``. NEEDS_ATTENTION has no
    index of its own in the job store yet, so that branch scans the table; it runs under the
    statement timeout like every other (a partial index on it would make it free).
    """
    branches = " UNION ALL ".join(
        f"SELECT '{state}' AS state, count(*) AS n FROM {table} WHERE state = '{state}'"
        for state in OPEN_JOB_STATES
    )
    return text(branches).columns(column("state", String), column("n", Integer))


def oldest_ready_job(table: str, dialect: str) -> TextualSelect:
    """Age of the oldest READY job that is eligible now (``run_after`` passed or NULL).

    Walks READY rows through ``ix_outbox_jobs_ready``: proportional to the runnable queue.
    Jobs scheduled for later are not late, so they are left out.
    """
    now = epoch_sql(dialect)
    return text(
        f"SELECT {now} - min(coalesce(run_after, created_at)) AS age FROM {table} "
        f"WHERE state = 'READY' AND coalesce(run_after, created_at) <= {now}"
    ).columns(column("age", Double))


def ready_jobs_per_queue(table: str, dialect: str) -> TextualSelect:
    """READY jobs per queue and the age of each queue's oldest eligible one.

    Reads ``ix_outbox_jobs_ready`` (it leads with the queue; partial on READY): O(ready),
    never the DONE history (the same statement as ``Store.depth``; tests/test_query_plans.py
    checks its plan on 1,000,000 DONE rows). Queues are few; the collector caps the labels.
    """
    now = epoch_sql(dialect)
    eligible = "coalesce(run_after, created_at)"
    return text(
        f"SELECT queue, count(*) AS n, "
        f"{now} - min(CASE WHEN {eligible} <= {now} THEN {eligible} END) AS age "
        f"FROM {table} WHERE state = 'READY' GROUP BY queue"
    ).columns(column("queue", String), column("n", Integer), column("age", Double))


def unreleased_steps(jobs_table: str, steps_table: str, dialect: str) -> TextualSelect:
    """Steps still WAITING_PARENTS although a parent of theirs ended (DONE, CANCELLED) and
    its edge was not released: how many, and how long ago the earliest such parent ended.

    A finish releases its children in its own transaction, so this is 0 but for a moment;
    the exception is a parent finished on the plain path (its lease was claimed before the
    step was enqueued after it), which ``Store.recover`` applies within a recovery round.
    A step counted here for minutes means no worker runs its recovery. Bounded by the open
    graph: a walk of ``ix_outbox_job_steps_unreleased`` (released edges never enter it),
    each parent and child read by primary key.
    """
    return text(
        f"SELECT count(DISTINCT s.child_id) AS n, {epoch_sql(dialect)} - min(p.updated_at) AS age "
        f"FROM {steps_table} s JOIN {jobs_table} p ON p.id = s.parent_id "
        f"JOIN {jobs_table} c ON c.id = s.child_id "
        f"WHERE s.released = 0 AND p.state IN ('DONE', 'CANCELLED') "
        f"AND c.state = 'WAITING_PARENTS'"
    ).columns(column("n", Integer), column("age", Double))


def expired_leases(table: str, dialect: str) -> TextualSelect:
    """LEASED jobs whose lease expired (their worker died and nobody recovered them yet).

    A range on ``ix_outbox_jobs_leased (lease_expires_at) WHERE state = 'LEASED'``.
    """
    return text(
        f"SELECT count(*) AS n FROM {table} "
        f"WHERE state = 'LEASED' AND lease_expires_at <= {epoch_sql(dialect)}"
    ).columns(column("n", Integer))


# -- operation receipts (external effects whose outcome is UNKNOWN) ---------------------------


def unknown_receipts(
    table: str, state_column: str, unknown_value: str, since_column: str, dialect: str
) -> TextualSelect:
    """UNKNOWN receipts: how many, and the age of the oldest (its ``since_column`` holds unix
    seconds, as the job store writes times). Few rows by nature (a timeout leaves one until
    reconciliation settles it); an index on ``state_column`` keeps it bounded.
    """
    return text(
        f"SELECT count(*) AS n, {epoch_sql(dialect)} - min({since_column}) AS age "
        f"FROM {table} WHERE {state_column} = '{unknown_value}'"
    ).columns(column("n", Integer), column("age", Double))
