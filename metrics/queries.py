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

from sqlalchemy import DateTime, Integer, String, column, text
from sqlalchemy.sql.elements import TextClause
from sqlalchemy.sql.selectable import TextualSelect

from outbox.schema import PENDING, QUARANTINED


def qualified(table: str, schema: str | None) -> str:
    """A quoted table reference from names already checked as plain identifiers."""
    return f'"{schema}"."{table}"' if schema else f'"{table}"'


def now_sql(dialect: str) -> TextualSelect:
    """The database clock. SQLite: UTC text with milliseconds (what ``db_now`` writes)."""
    if dialect == "sqlite":
        sql = "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now') AS now"
    else:
        sql = "SELECT now() AS now"
    return text(sql).columns(column("now", DateTime(timezone=True)))


# -- outbox ----------------------------------------------------------------------------------


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
    result is tiny; the buckets are summed in Python.
    """
    return text(
        f"SELECT attempts, count(*) AS n FROM {table} WHERE state = '{PENDING}' GROUP BY attempts"
    ).columns(column("attempts", Integer), column("n", Integer))


def most_attempted(table: str, limit: int) -> TextualSelect:
    """The top-N pending rows by attempts, for the labelled stuck-record gauge.

    Same pending partial index as :func:`pending_attempts` plus a bounded top-N sort
    (``LIMIT``), so the label set never exceeds ``limit`` series. Rows never tried
    (attempts 0) are not stuck and are left out.
    """
    return text(
        f"SELECT event_id, topic, attempts FROM {table} "
        f"WHERE state = '{PENDING}' AND attempts > 0 "
        f"ORDER BY attempts DESC, seq LIMIT {int(limit)}"
    ).columns(column("event_id", String), column("topic", String), column("attempts", Integer))


# -- naive baselines (bench/scrape.py compares against these; never used by the collector) ----


def naive_state_counts(table: str) -> TextClause:
    """What a dashboard query often looks like: a full scan of the table, published included."""
    return text(
        f"SELECT topic, state, count(*), min(created_at), max(attempts) "
        f"FROM {table} GROUP BY topic, state"
    )
