"""Operator commands as functions: ``status`` (backlog, oldest age, quarantined, attempts per
topic) and ``requeue`` (put quarantined events back after a fix). The CLI prints them; the
SQL is the relay store's (:mod:`relay.store`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from sqlalchemy.engine import Connection, Engine

from outbox.schema import OutboxSchema
from outbox.tablestats import known_tables, table_stats
from relay.records import RequeueResult
from relay.store import store_for

__all__ = ["RequeueResult", "requeue", "status"]


def status(engine: Engine, schema: OutboxSchema) -> dict[str, Any]:
    """``{"pending", "quarantined", "oldest_unpublished_age_seconds", "max_attempts",
    "topics": {topic: {the same four keys}}, "tables": {table: {"rows", "dead_rows",
    "table_bytes", "index_bytes", "oldest_age_seconds", "retention_seconds"}}}``; ages from
    the database clock, 0 when nothing is pending. ``tables``: every table of the toolkit in
    this database (``outbox.tablestats``: sizes, and whether its retention keeps up)."""
    topics: dict[str, dict[str, Any]] = {}
    for topic, line in store_for(engine, schema).outbox_status().items():
        row = asdict(line)
        row["oldest_unpublished_age_seconds"] = round(row["oldest_unpublished_age_seconds"], 3)
        topics[topic] = row
    return {
        "pending": sum(t["pending"] for t in topics.values()),
        "quarantined": sum(t["quarantined"] for t in topics.values()),
        "oldest_unpublished_age_seconds": max(
            (t["oldest_unpublished_age_seconds"] for t in topics.values()), default=0.0
        ),
        "max_attempts": max((t["max_attempts"] for t in topics.values()), default=0),
        "topics": topics,
        "tables": _tables(engine, schema),
    }


def _tables(engine: Engine, schema: OutboxSchema) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        stats = table_stats(conn, known_tables(schema.table_name, schema.schema))
    return {s.table: s.as_dict() for s in stats}


def requeue(
    engine: Engine,
    schema: OutboxSchema,
    event_ids: Iterable[str] | None = None,
    *,
    all_quarantined: bool = False,
    joined: Connection | None = None,
) -> RequeueResult:
    """Put quarantined events back to pending, available now, intent cleared. ``attempts``
    and ``last_error`` are kept as history (a requeued row keeps holding back the later
    events of its key until it is published). By id, or every quarantined one. ``joined``:
    the caller's transaction to run in (the console's action and its audit row)."""
    ids = None if event_ids is None else list(event_ids)
    return store_for(engine, schema).outbox_requeue(ids, all_quarantined, joined)
