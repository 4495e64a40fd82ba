"""The outbox's backlog, read the same way by the relay's status, its live view and the
metrics collector: one place for the backlog SQL (moved here from ``relay.store``, which
re-exports it). Every statement is bounded by a partial index whatever the size of the table.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime, Integer, String, column, text
from sqlalchemy.sql.selectable import TextualSelect

from outbox.schema import PENDING, QUARANTINED

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

    Walks the pending rows through the partial index ``ix_<table>_pending`` (heap fetches for
    ``topic`` and ``created_at``): proportional to the backlog, not to the published history.
    (A ``(topic, created_at)`` index would make it index-only, at a price every writer pays:
    see ``outbox.schema``.)
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
