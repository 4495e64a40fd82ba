"""Retention of published outbox rows, as a purge target for ``outbox-relay purge``.

The relay's own loop deletes published rows older than ``RelayConfig.retention_seconds``
(default one day) every ``retention_interval`` (the replica owning partition 0); this is the
same deletion, on demand, with a count of what would go (``--dry-run``). The SQL is the
relay store's: ``relay.store.PG_RETENTION`` on PostgreSQL (it walks the table from its
oldest rows and stops at the first row created after the cutoff), the MySQL store's
:func:`relay.store.mysql.delete_published` (the same walk, a DELETE ... ORDER BY seq LIMIT n),
the SQLite store's ``outbox_delete_published`` elsewhere. Pending and quarantined rows are
never deleted.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Engine

from outbox.dialect import is_mysql, is_postgresql, quoted_table
from outbox.purge import run_purge
from outbox.retention import check_batch, check_seconds, purge_all
from outbox.schema import OutboxSchema
from relay.config import RelayConfig
from relay.partitions import PartitionRetention, PartitionUpkeep
from relay.store import PG_RETENTION, SqliteStore
from relay.store.mysql import count_published_due, delete_published

# What PG_RETENTION would delete, counted with the same bounds (a range of the primary key
# up to the first row created after the cutoff).
PG_RETENTION_DUE = """
SELECT count(*) FROM {t}
WHERE seq < coalesce((SELECT y.seq FROM {t} y
                      WHERE y.created_at >= now() - make_interval(secs => %(age)s)
                      ORDER BY y.seq LIMIT 1), 9223372036854775807)
  AND state = 'published' AND published_at < now() - make_interval(secs => %(age)s)"""

SQLITE_RETENTION_DUE = """
SELECT count(*) FROM {t} WHERE state = 'published'
  AND published_at < strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :age || ' seconds')"""


class OutboxRetention:
    """Published rows older than ``retention_seconds`` (a purge target)."""

    def __init__(self, engine: Engine, schema: OutboxSchema, retention_seconds: float) -> None:
        self.engine = engine
        self.schema = schema
        self.retention_seconds = check_seconds("retention_seconds", retention_seconds)
        self.quoted = quoted_table(schema.table_name, schema.schema)

    @property
    def table(self) -> str:
        return self.schema.qualified_name

    def due(self) -> int:
        if self.retention_seconds <= 0:
            return 0
        if is_mysql(self.engine.dialect.name):
            return count_published_due(self.engine, self.quoted, self.retention_seconds)
        with self.engine.connect() as conn:
            if is_postgresql(self.engine.dialect.name):
                sql = PG_RETENTION_DUE.replace("{t}", self.quoted)
                row = conn.exec_driver_sql(sql, {"age": self.retention_seconds}).scalar()
            else:
                sql = SQLITE_RETENTION_DUE.replace("{t}", self.quoted)
                row = conn.execute(text(sql), {"age": f"{self.retention_seconds:.6f}"}).scalar()
        return int(row or 0)

    def purge(self, limit: int) -> int:
        check_batch("limit", limit)
        if self.retention_seconds <= 0:
            return 0
        if is_mysql(self.engine.dialect.name):
            return delete_published(self.engine, self.quoted, self.retention_seconds, limit)
        if not is_postgresql(self.engine.dialect.name):
            store = SqliteStore(
                self.engine, self.schema, reconcile_after=RelayConfig().reconcile_after
            )
            return store.outbox_delete_published(self.retention_seconds, limit)
        sql = PG_RETENTION.replace("{t}", self.quoted)
        with self.engine.begin() as conn:
            result = conn.exec_driver_sql(sql, {"age": self.retention_seconds, "limit": limit})
            return int(result.rowcount)


def purge_command(
    engine: Engine,
    schema: OutboxSchema,
    retention_seconds: float,
    *,
    dry_run: bool,
    as_json: bool,
    batch: int,
) -> int:
    """``outbox-relay purge``: published rows past the retention, per table; on a partitioned
    table (``relay.partitions``), the partitions past it, dropped whole (``--dry-run`` lists
    each with its row estimate)."""
    target = OutboxRetention(engine, schema, retention_seconds)
    check_batch("batch_size", batch)
    upkeep = PartitionUpkeep(engine, schema, target.retention_seconds)
    if upkeep.partitioned:
        whole = PartitionRetention(upkeep)
        return run_purge(
            "outbox-relay",
            dry_run=dry_run,
            as_json=as_json,
            count=whole.by_partition,
            purge=lambda progress: purge_all([whole], batch=batch, progress=progress),
        )
    return run_purge(
        "outbox-relay",
        dry_run=dry_run,
        as_json=as_json,
        count=lambda: {target.table: target.due()},
        purge=lambda progress: purge_all([target], batch=batch, progress=progress),
    )
