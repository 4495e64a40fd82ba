"""How big each table is, and whether its retention keeps up (issue 25: "see the size").

For every table of the toolkit that exists in a database: rows, dead rows, table and index
bytes, and the age of its oldest row **as its retention measures it** (so that the age of a
table whose retention keeps up stays near its window, and one that only grows ages at one
second per second):

| table | oldest row's age from | retention window (default) |
|---|---|---|
| ``outbox_events`` | ``published_at`` of the first published row | outbox retention (1 day) |
| ``consumer_inbox`` | ``processed_at`` (the oldest over every group) | inbox window (7 days) |
| ``consumer_dead_letters`` | ``replayed_at`` of the oldest replayed record | 30 days |
| ``outbox_jobs`` | the last change of the oldest DONE/CANCELLED job | job retention (7 days) |
| ``outbox_job_attempts`` | ``at`` of the first attempt row | goes with its job |
| ``outbox_operations`` | ``created_at`` of the oldest job's first intent | goes with its job |
| ``outbox_workers`` | ``alive_until`` of the longest expired liveness row | 1 hour |
| ``outbox_audit`` | ``at`` of the oldest operator action | 90 days |

Every age is one indexed probe (``ORDER BY ... LIMIT 1`` on the index its retention walks;
the inbox's a loose scan over its groups), never a scan of the table. On PostgreSQL the
counts and sizes come from the statistics views (``n_live_tup``, ``n_dead_tup``,
``pg_table_size``, ``pg_indexes_size``): estimates, free to read at any size. On SQLite the
rows are counted (an embedded database is small) and the sizes come from ``dbstat`` when the
library has it (None otherwise). On MySQL they are information_schema's estimates. Used by
``outbox-relay status`` and the metrics collector.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from outbox.dialect import (
    EPOCH_SQL,
    MYSQL,
    POSTGRESQL,
    SQLITE,
    is_mysql,
    is_postgresql,
    quoted_table,
)
from outbox.retention import (
    DEFAULT_AUDIT_RETENTION,
    DEFAULT_DEAD_LETTER_RETENTION,
    DEFAULT_INBOX_WINDOW,
    DEFAULT_JOB_RETENTION,
    DEFAULT_OUTBOX_RETENTION,
    DEFAULT_WORKER_GRACE,
)
from outbox.schema import DEFAULT_TABLE

OUTBOX = "outbox"
"""Stands for the outbox table's (configurable) name in :data:`OLDEST` and windows."""

# The oldest row's time, per table, as its retention measures it: (SQL, kind) where kind is
# "ts" (a timestamp column) or "epoch" (unix seconds). {t} is the quoted table.
OLDEST: Mapping[str, tuple[str, str]] = {
    OUTBOX: (
        "SELECT published_at FROM {t} WHERE state = 'published' ORDER BY seq LIMIT 1",
        "ts",
    ),
    "consumer_inbox": (
        # A loose index scan of ix_consumer_inbox_processed (group_name, processed_at): the
        # next group name by one probe each, the oldest row of each group by another.
        """WITH RECURSIVE g(name) AS (
            SELECT (SELECT group_name FROM {t} ORDER BY group_name LIMIT 1)
            UNION ALL
            SELECT (SELECT i.group_name FROM {t} i WHERE i.group_name > g.name
                    ORDER BY i.group_name LIMIT 1) FROM g WHERE g.name IS NOT NULL)
        SELECT min((SELECT i.processed_at FROM {t} i WHERE i.group_name = g.name
                    ORDER BY i.processed_at LIMIT 1)) FROM g WHERE g.name IS NOT NULL""",
        "ts",
    ),
    "consumer_dead_letters": (
        "SELECT replayed_at FROM {t} WHERE state = 'replayed' ORDER BY replayed_at LIMIT 1",
        "ts",
    ),
    "outbox_jobs": (
        "SELECT updated_at FROM {t} WHERE state IN ('DONE', 'CANCELLED') "
        "ORDER BY updated_at, id LIMIT 1",
        "epoch",
    ),
    "outbox_job_attempts": ("SELECT at FROM {t} ORDER BY id LIMIT 1", "epoch"),
    "outbox_operations": ("SELECT created_at FROM {t} ORDER BY job_id LIMIT 1", "epoch"),
    "outbox_workers": ("SELECT min(alive_until) FROM {t}", "epoch"),
    "outbox_audit": ("SELECT at FROM {t} ORDER BY at LIMIT 1", "epoch"),
}

DEFAULT_WINDOWS: Mapping[str, float] = {
    OUTBOX: DEFAULT_OUTBOX_RETENTION,
    "consumer_inbox": DEFAULT_INBOX_WINDOW,
    "consumer_dead_letters": DEFAULT_DEAD_LETTER_RETENTION,
    "outbox_jobs": DEFAULT_JOB_RETENTION,
    "outbox_job_attempts": DEFAULT_JOB_RETENTION,
    "outbox_operations": DEFAULT_JOB_RETENTION,
    "outbox_workers": DEFAULT_WORKER_GRACE,
    "outbox_audit": DEFAULT_AUDIT_RETENTION,
}
"""Each table's retention window with the project's defaults (0 would mean: none)."""


@dataclass(frozen=True)
class TableStats:
    """One table's size and the age of its oldest row (see the module docstring)."""

    table: str
    rows: int
    dead_rows: int | None
    table_bytes: int | None
    index_bytes: int | None
    oldest_age_seconds: float | None
    retention_seconds: float

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["table"]
        if out["oldest_age_seconds"] is not None:
            out["oldest_age_seconds"] = round(out["oldest_age_seconds"], 3)
        return out


def known_tables(
    outbox_table: str = DEFAULT_TABLE,
    outbox_schema: str | None = None,
    consumer_schema: str | None = None,
    jobs_schema: str | None = None,
) -> list[tuple[str, str | None, str]]:
    """``(table, schema, kind)`` of every table the toolkit writes; ``kind`` is the key of
    :data:`OLDEST` (``outbox`` for the outbox table, whatever its name)."""
    return [
        (outbox_table, outbox_schema, OUTBOX),
        ("consumer_inbox", consumer_schema, "consumer_inbox"),
        ("consumer_dead_letters", consumer_schema, "consumer_dead_letters"),
        ("outbox_jobs", jobs_schema, "outbox_jobs"),
        ("outbox_job_attempts", jobs_schema, "outbox_job_attempts"),
        ("outbox_operations", jobs_schema, "outbox_operations"),
        ("outbox_workers", jobs_schema, "outbox_workers"),
        ("outbox_audit", None, "outbox_audit"),
    ]


def table_stats(
    conn: Connection,
    tables: Sequence[tuple[str, str | None, str]] | None = None,
    *,
    windows: Mapping[str, float] | None = None,
) -> list[TableStats]:
    """Stats of those of ``tables`` (default :func:`known_tables`) that exist, in order.
    ``windows`` (by kind) overrides :data:`DEFAULT_WINDOWS`."""
    wanted = list(tables) if tables is not None else known_tables()
    window = {**DEFAULT_WINDOWS, **(windows or {})}
    dialect = POSTGRESQL if is_postgresql(conn.dialect.name) else SQLITE
    if is_mysql(conn.dialect.name):
        dialect = MYSQL
    sizes = {POSTGRESQL: _pg_sizes, SQLITE: _sqlite_sizes, MYSQL: _mysql_sizes}[dialect](
        conn, wanted
    )
    if not sizes:
        return []
    clock = float(conn.execute(text(f"SELECT {EPOCH_SQL[dialect]}")).scalar_one())
    out: list[TableStats] = []
    for name, schema, kind in wanted:
        found = sizes.get((name, schema))
        if found is None:
            continue
        rows, dead, table_bytes, index_bytes = found
        sql, unit = OLDEST[kind]
        value = conn.execute(text(sql.replace("{t}", quoted_table(name, schema)))).scalar()
        age = None if value is None else max(0.0, clock - _epoch(value, unit))
        out.append(
            TableStats(name, rows, dead, table_bytes, index_bytes, age, window.get(kind, 0.0))
        )
    return out


def _epoch(value: Any, unit: str) -> float:
    if unit == "epoch":
        return float(value)
    if isinstance(value, str):  # SQLite: UTC text
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return float(value.timestamp())
    return time.time()  # pragma: no cover - not a time


Sizes = dict[tuple[str, str | None], tuple[int, int | None, int | None, int | None]]


def _pg_sizes(conn: Connection, wanted: Sequence[tuple[str, str | None, str]]) -> Sizes:
    names = [quoted_table(name, schema) for name, schema, _kind in wanted]
    rows = conn.execute(
        text(
            # A partitioned table (outbox.partitions) counts as one: the sums over its
            # partitions (pg_partition_tree's leaves).
            """SELECT q.n, p.live, p.dead, p.tb, p.ib
            FROM unnest(CAST(:names AS text[])) WITH ORDINALITY AS q(n, i)
            JOIN pg_class c ON c.oid = to_regclass(q.n)
            CROSS JOIN LATERAL (
                SELECT sum(coalesce(s.n_live_tup, greatest(m.reltuples, 0)::bigint))::bigint
                           AS live,
                       CASE WHEN count(s.relid) > 0 THEN sum(s.n_dead_tup)::bigint END AS dead,
                       sum(pg_table_size(t.relid))::bigint AS tb,
                       sum(pg_indexes_size(t.relid))::bigint AS ib
                FROM (SELECT relid FROM pg_partition_tree(c.oid)
                      WHERE isleaf AND c.relkind = 'p'
                      UNION ALL SELECT c.oid WHERE c.relkind <> 'p') t
                JOIN pg_class m ON m.oid = t.relid
                LEFT JOIN pg_stat_user_tables s ON s.relid = t.relid) p"""
        ),
        {"names": names},
    ).all()
    by_quoted = {quoted_table(n, s): (n, s) for n, s, _k in wanted}
    return {
        by_quoted[str(r[0])]: (
            int(r[1]),
            None if r[2] is None else int(r[2]),
            int(r[3]),
            int(r[4]),
        )
        for r in rows
    }


def _mysql_sizes(conn: Connection, wanted: Sequence[tuple[str, str | None, str]]) -> Sizes:
    """MySQL/MariaDB: information_schema's estimates (InnoDB's sampled row count and its
    data and index lengths), free to read at any size; no dead-row count (InnoDB's purge
    is not reported per table)."""
    out: Sizes = {}
    for name, schema, _kind in wanted:
        row = conn.execute(
            text(
                "SELECT table_rows, data_length, index_length FROM information_schema.tables "
                "WHERE table_schema = coalesce(:s, DATABASE()) AND table_name = :n"
            ),
            {"s": schema, "n": name},
        ).first()
        if row is not None:
            out[(name, schema)] = (int(row[0] or 0), None, int(row[1] or 0), int(row[2] or 0))
    return out


def _sqlite_sizes(conn: Connection, wanted: Sequence[tuple[str, str | None, str]]) -> Sizes:
    present = {
        str(r[0]) for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'"))
    }
    out: Sizes = {}
    for name, schema, _kind in wanted:
        if name not in present:
            continue
        count = int(conn.execute(text(f"SELECT count(*) FROM {quoted_table(name)}")).scalar_one())
        table_bytes = index_bytes = None
        try:
            table_bytes = int(
                conn.execute(
                    text("SELECT coalesce(sum(pgsize), 0) FROM dbstat WHERE name = :n"),
                    {"n": name},
                ).scalar_one()
            )
            index_bytes = int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum(d.pgsize), 0) FROM dbstat d JOIN sqlite_master m "
                        "ON m.name = d.name WHERE m.type = 'index' AND m.tbl_name = :n"
                    ),
                    {"n": name},
                ).scalar_one()
            )
        except Exception:  # no dbstat in this SQLite build
            table_bytes = index_bytes = None
        out[(name, schema)] = (count, None, table_bytes, index_bytes)
    return out
