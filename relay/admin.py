"""Operator commands as functions: ``status`` (backlog, oldest age, quarantined, attempts per
topic) and ``requeue`` (put quarantined events back after a fix). The CLI prints them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Engine

from outbox.schema import OutboxSchema


def _quoted(schema: OutboxSchema) -> str:
    if schema.schema:
        return f'"{schema.schema}"."{schema.table_name}"'
    return f'"{schema.table_name}"'


_PG_STATUS = """
SELECT topic,
    count(*) FILTER (WHERE state = 'pending'),
    count(*) FILTER (WHERE state = 'quarantined'),
    extract(epoch FROM now() - min(created_at) FILTER (WHERE state = 'pending'))::float8,
    max(attempts)
FROM {t} WHERE state IN ('pending', 'quarantined') GROUP BY topic ORDER BY topic"""

_SQLITE_STATUS = """
SELECT topic,
    sum(CASE WHEN state = 'pending' THEN 1 ELSE 0 END),
    sum(CASE WHEN state = 'quarantined' THEN 1 ELSE 0 END),
    (julianday('now') - julianday(min(CASE WHEN state = 'pending' THEN created_at END)))
        * 86400.0,
    max(attempts)
FROM {t} WHERE state IN ('pending', 'quarantined') GROUP BY topic ORDER BY topic"""


def status(engine: Engine, schema: OutboxSchema) -> dict[str, Any]:
    """``{"pending", "quarantined", "oldest_unpublished_age_seconds", "max_attempts",
    "topics": {topic: {the same four keys}}}``; ages from the database clock, 0 when
    nothing is pending."""
    sql = _PG_STATUS if engine.dialect.name == "postgresql" else _SQLITE_STATUS
    with engine.connect() as conn:
        rows = conn.execute(text(sql.replace("{t}", _quoted(schema)))).fetchall()
    topics: dict[str, dict[str, Any]] = {}
    for topic, pending, quarantined, age, attempts in rows:
        topics[topic] = {
            "pending": int(pending or 0),
            "quarantined": int(quarantined or 0),
            "oldest_unpublished_age_seconds": round(max(float(age), 0.0), 3)
            if age is not None
            else 0.0,
            "max_attempts": int(attempts or 0),
        }
    return {
        "pending": sum(t["pending"] for t in topics.values()),
        "quarantined": sum(t["quarantined"] for t in topics.values()),
        "oldest_unpublished_age_seconds": max(
            (t["oldest_unpublished_age_seconds"] for t in topics.values()), default=0.0
        ),
        "max_attempts": max((t["max_attempts"] for t in topics.values()), default=0),
        "topics": topics,
    }


@dataclass
class RequeueResult:
    """What ``requeue`` did: ids put back, ids not found, ids found in another state."""

    requeued: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    not_quarantined: dict[str, str] = field(default_factory=dict)


def requeue(
    engine: Engine,
    schema: OutboxSchema,
    event_ids: Iterable[str] | None = None,
    *,
    all_quarantined: bool = False,
) -> RequeueResult:
    """Put quarantined events back to pending, available now, intent cleared. ``attempts``
    and ``last_error`` are kept as history (a requeued row keeps holding back the later
    events of its key until it is published). By id, or every quarantined one."""
    t = _quoted(schema)
    now = (
        "now()" if engine.dialect.name == "postgresql" else ("strftime('%Y-%m-%d %H:%M:%f', 'now')")
    )
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
                    f"UPDATE {t} SET state = 'pending', available_at = {now}, "
                    "claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
                    "WHERE event_id = :id AND state = 'quarantined'"
                ),
                [{"id": i} for i in ids],
            )
            if engine.dialect.name == "postgresql":
                # Relays claim from a floor above old rows; ask them for a full sweep.
                conn.execute(text("SELECT pg_notify(:c, 'sweep')"), {"c": schema.notify_channel})
        result.requeued = ids
    return result
