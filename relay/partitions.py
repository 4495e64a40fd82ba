"""Partition upkeep of a partitioned outbox table, as a relay duty (``outbox.partitions``).

The relay owning key partition 0 runs it (as it runs retention and vacuum), every quarter of
a partition's length (at most every minute, at least every half second):

1. create the partitions of the current period and the next ``AHEAD`` ones that are missing
   (the DEFAULT partition takes any row that still finds none, so no insert ever fails);
2. drop each partition whose upper bound is older than ``RelayConfig.retention_seconds``
   and that holds no pending and no quarantined row: DETACH, then DROP, in one short
   transaction under an ACCESS EXCLUSIVE lock that waits at most
   ``outbox.partitions.LOCK_TIMEOUT_MS`` (a round that cannot have it leaves the partition to
   the next). A partition with a quarantined row stays until an operator requeues (and the
   relay publishes) it; the DEFAULT partition is never dropped.

No row is ever deleted from a partitioned table. On a plain table this duty does nothing
(and the relay's DELETE-based retention runs instead).

:class:`PartitionRetention` is the same for ``outbox-relay purge``: ``--dry-run`` lists the
partitions that would go, with their row estimates.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from outbox import partitions
from outbox.dialect import is_postgresql, quoted_table
from outbox.logs import fields
from outbox.outage import report_failure
from outbox.partitions import Partition
from outbox.schema import PG_STORAGE_PARAMETERS, OutboxSchema, table_schema_of

log = logging.getLogger("outbox.relay")

PLAIN = 0  # the table is not partitioned (or not on PostgreSQL)


@dataclass
class UpkeepRound:
    """What one round did: partitions created, dropped, and kept past the retention because
    a row in them is pending or quarantined."""

    created: list[str] = field(default_factory=list)
    dropped: list[Partition] = field(default_factory=list)
    kept: list[Partition] = field(default_factory=list)

    @property
    def rows_dropped(self) -> int:
        return sum(p.rows for p in self.dropped)


class PartitionUpkeep:
    """The upkeep of one outbox table (see the module docstring). ``now`` (unix seconds) may
    be given to every round; the database clock otherwise."""

    def __init__(
        self,
        engine: Engine,
        schema: OutboxSchema,
        retention_seconds: float,
        *,
        ahead: int = partitions.AHEAD,
    ) -> None:
        self.engine = engine
        self.schema = schema
        self.retention_seconds = retention_seconds
        self.ahead = ahead
        self._length: int | None = None  # None: not looked up yet; PLAIN: not partitioned

    def length(self) -> int:
        """Seconds per partition, or ``PLAIN`` (0); looked up once."""
        if self._length is None:
            if not is_postgresql(self.engine.dialect.name):
                self._length = PLAIN
            else:
                with self.engine.connect() as conn:
                    quoted = quoted_table(self.schema.table_name, self.schema.schema)
                    self._length = partitions.table_length(conn, quoted) or PLAIN
        return self._length

    @property
    def partitioned(self) -> bool:
        return self.length() != PLAIN

    def interval(self) -> float:
        """Seconds between rounds: a quarter of a partition, from 0.5 s to 60 s; never on a
        plain table; every 5 s until the table could be looked up."""
        if self._length is None:
            return 5.0
        if self._length == PLAIN:
            return math.inf
        return min(60.0, max(0.5, self._length / 4))

    def run_once(self, now: float | None = None, *, count: bool = False) -> UpkeepRound:
        """One round now (on a plain table: nothing). ``count``: the dropped partitions'
        rows are counted (a scan each; the relay's rounds report the statistics' estimate)."""
        done = UpkeepRound()
        if not self.partitioned:
            return done
        length = self.length()
        name = self.schema.table_name
        with self.engine.begin() as conn:
            schema_name = table_schema_of(conn, self.schema)
            done.created = partitions.ensure_partitions(
                conn, schema_name, name, length, PG_STORAGE_PARAMETERS, now=now, ahead=self.ahead
            )
            droppable, done.kept = partitions.expired_partitions(
                conn, schema_name, name, length, self.retention_seconds, now=now
            )
        for part in droppable:
            if count:
                part = self._counted(part, schema_name)
            try:
                with self.engine.begin() as conn:
                    went = partitions.drop_partition(conn, schema_name, name, part)
            except Exception as exc:
                report_failure(
                    log, "outbox partition not dropped this round", exc, partition=part.name
                )
                continue
            (done.dropped if went else done.kept).append(part)
        if done.created or done.dropped:
            log.info(
                "outbox partitions",
                extra=fields(
                    created=done.created,
                    dropped=[p.name for p in done.dropped],
                    kept=[p.name for p in done.kept],
                ),
            )
        return done

    def _counted(self, part: Partition, schema_name: str) -> Partition:
        with self.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"SELECT count(*) FROM {partitions.qualified(schema_name, part.name)}"
            ).scalar_one()
        return Partition(part.name, part.lower, part.upper, int(rows))

    def due(self, now: float | None = None, *, count: bool = False) -> list[Partition]:
        """The partitions a round would drop now (``purge --dry-run``)."""
        if not self.partitioned:
            return []
        with self.engine.connect() as conn:
            schema_name = table_schema_of(conn, self.schema)
            droppable, _kept = partitions.expired_partitions(
                conn,
                schema_name,
                self.schema.table_name,
                self.length(),
                self.retention_seconds,
                now=now,
            )
        return [self._counted(p, schema_name) for p in droppable] if count else droppable

    def partitions(self) -> list[Partition]:
        """The toolkit's partitions of the table, oldest first (empty on a plain table)."""
        if not self.partitioned:
            return []
        with self.engine.connect() as conn:
            schema_name = table_schema_of(conn, self.schema)
            return partitions.list_partitions(
                conn, schema_name, self.schema.table_name, self.length()
            )


class PartitionRetention:
    """A purge target (``outbox.retention.PurgeTarget``) over whole partitions: ``due()``
    counts the rows of the partitions that would go, ``purge()`` drops them all (one short
    transaction each) and returns their rows; ``by_partition()`` is what ``--dry-run``
    shows."""

    def __init__(self, upkeep: PartitionUpkeep) -> None:
        self.upkeep = upkeep

    @property
    def table(self) -> str:
        return self.upkeep.schema.qualified_name

    def by_partition(self) -> dict[str, int]:
        prefix = f"{self.upkeep.schema.schema}." if self.upkeep.schema.schema else ""
        return {f"{prefix}{p.name}": p.rows for p in self.upkeep.due(count=True)}

    def due(self) -> int:
        return sum(p.rows for p in self.upkeep.due(count=True))

    def purge(self, limit: int) -> int:
        del limit  # a partition goes whole
        return self.upkeep.run_once(count=True).rows_dropped


__all__ = ["PLAIN", "PartitionRetention", "PartitionUpkeep", "UpkeepRound"]
