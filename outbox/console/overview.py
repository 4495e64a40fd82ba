"""The overview: what is stuck, in one read of each part, each bounded by an index.

- backlog and oldest unpublished age per topic, quarantined per topic (``relay.admin.status``:
  the partial indexes of pending and quarantined rows);
- consumer lag and pending entries per group (Redis ``XINFO GROUPS`` of the streams the
  latest receipts name) and dead letters per group;
- jobs by state and tenant (``queries.job_counts``);
- receipts UNKNOWN or PENDING past their deadline;
- the live workers (``outbox_workers``).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.engine import Engine

from consumer.jobs.schema import jobs, operations, workers
from outbox.codec import text_fields
from outbox.console import queries
from outbox.console.queries import Tables
from outbox.logs import fields
from outbox.schema import OutboxSchema
from relay.admin import status

log = logging.getLogger("outbox.console")


def consumer_groups(redis: Any, streams: list[str]) -> list[dict[str, Any]]:
    """Each group of each stream: its lag (entries not yet delivered to it), pending entries
    (delivered, not acknowledged), consumers and last delivered id."""
    out = []
    for stream in streams[:50]:
        try:
            groups = redis.xinfo_groups(stream)
        except Exception as exc:  # a stream trimmed away, Redis down: show what we can
            failed: dict[str, Any] = {"stream": stream, "group": None}
            failed["error"] = f"{type(exc).__name__}: {exc}"
            out.append(failed)
            continue
        for raw in groups:
            info = text_fields({k: v for k, v in raw.items() if v is not None})
            entry: dict[str, Any] = {
                "stream": stream,
                "group": info.get("name"),
                "consumers": int(info.get("consumers", 0) or 0),
                "pending": int(info.get("pending", 0) or 0),
                "lag": None if info.get("lag") in (None, "") else int(info["lag"]),
                "last_delivered_id": info.get("last-delivered-id"),
            }
            out.append(entry)
    return out


def overview(
    engine: Engine, tables: Tables, schema: OutboxSchema, redis: Any, present: set[str]
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "events": None,
        "quarantined": [],
        "consumer_groups": [],
        "dead_letters": {},
        "jobs": {},
        "receipts": {"unknown": 0, "pending_past_deadline": 0, "oldest": []},
        "workers": [],
        "missing_tables": sorted(
            {
                tables.outbox.name,
                tables.inbox.dead_letters.name,
                jobs.name,
                operations.name,
                workers.name,
            }
            - present
        ),
    }
    streams: list[str] = []
    if tables.outbox.name in present:
        data["events"] = status(engine, schema)
        with engine.connect() as conn:
            data["quarantined"] = queries.quarantined_sample(conn, tables)
            streams = queries.recent_streams(conn, tables)
    with engine.connect() as conn:
        if tables.inbox.dead_letters.name in present:
            data["dead_letters"] = queries.dead_letters_by_group(conn, tables)
        if jobs.name in present:
            data["jobs"] = queries.job_counts(conn)
        if operations.name in present:
            data["receipts"] = queries.open_receipts(conn)
        if workers.name in present:
            data["workers"] = queries.live_workers(conn)
    if redis is not None and streams:
        try:
            data["consumer_groups"] = consumer_groups(redis, streams)
        except Exception as exc:
            log.warning("consumer lag not read", extra=fields(error=repr(exc)))
    return data
