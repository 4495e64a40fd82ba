"""The ``horizon`` source of the metrics collector (issue 60): how long the oldest
transaction, snapshot or replication slot has held back vacuum, seen from the job store's
database (``outbox.horizon``).

- ``outbox_jobs_horizon_age_seconds``: the age of the oldest transaction (or prepared
  transaction) whose snapshot keeps VACUUM from removing the job tables' dead rows; 0 when
  none holds one. While it grows, every finished, claimed or deleted job leaves row versions
  no vacuum can remove, and the claims walk their index entries.
- ``outbox_jobs_horizon_xid_age``: the same holder's xmin age in transaction ids; the one
  measure a replication slot has (its age in seconds is unknown).

``OutboxVacuumHorizonHeld`` (metrics/alerts.yml) fires on the first. The worker's vacuum
logs the holder (pid, application name, state, age) when its vacuum cannot remove the dead
rows (``outbox.maintenance``). On SQLite (no vacuum horizon) both are 0.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from metrics.tables import Source
from outbox.horizon import horizon_holder

__all__ = ["horizon_source"]

JOBS_TABLE = "outbox_jobs"


def horizon_source(schema: str | None = None) -> Source:
    """The collector's ``horizon`` source, present where the job table is (``schema``)."""

    def run(ctx: Any) -> list[Metric]:  # a metrics.collector.ScrapeContext
        # SQLite has no vacuum horizon: nothing holds one back (0).
        holder = horizon_holder(ctx.conn) if ctx.dialect == "postgresql" else None
        seconds = holder.age_seconds if holder is not None else None
        return [
            GaugeMetricFamily(
                "outbox_jobs_horizon_age_seconds",
                "Age of the oldest transaction whose snapshot holds back vacuum of the job "
                "tables' dead rows (0: none); a replication slot's counts in "
                "outbox_jobs_horizon_xid_age only.",
                value=float(seconds or 0.0),
            ),
            GaugeMetricFamily(
                "outbox_jobs_horizon_xid_age",
                "Transactions since the xmin of the oldest holder of the vacuum horizon "
                "(backend, prepared transaction or replication slot; 0: none).",
                value=float(holder.xid_age if holder is not None else 0),
            ),
        ]

    return Source(name="horizon", tables=((JOBS_TABLE, schema),), run=run)
