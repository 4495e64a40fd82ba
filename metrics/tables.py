"""The ``tables`` source of the metrics collector: each table's size and whether its
retention keeps up (``outbox.tablestats``; issue 25).

Gauges, one series per table that exists (a bounded label set: the toolkit's tables):

- ``outbox_table_rows{table}``: rows (PostgreSQL: the statistics' estimate).
- ``outbox_table_dead_rows{table}``: dead tuples waiting for vacuum (PostgreSQL only).
- ``outbox_table_bytes{table}`` / ``outbox_table_index_bytes{table}``: heap and index sizes.
- ``outbox_table_oldest_row_age_seconds{table}``: the age of the oldest row as its retention
  measures it (published, processed, replayed, finished...): flat near the window when the
  retention keeps up, rising one second per second when it does not.
- ``outbox_table_retention_seconds{table}``: the table's retention window (the defaults, or
  the ``windows`` given); 0 means the table has none.

``metrics/alerts.yml`` fires ``OutboxTableGrowingWithoutRetention`` and
``OutboxRetentionFallingBehind`` on these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from outbox.tablestats import known_tables, table_stats


@dataclass(frozen=True)
class Source:
    """One group of gauges and the tables (name, schema) it reads (``metrics.collector``)."""

    name: str
    tables: tuple[tuple[str, str | None], ...]
    run: Callable[[Any], list[Metric]]  # takes a metrics.collector.ScrapeContext


def table_sizes_source(
    outbox_table: str,
    outbox_schema: str | None,
    consumer_schema: str | None,
    jobs_schema: str | None,
    windows: Mapping[str, float] | None = None,
) -> Source:
    """The collector's ``tables`` source."""

    tables = known_tables(outbox_table, outbox_schema, consumer_schema, jobs_schema)

    def run(ctx: Any) -> list[Metric]:
        families = {
            "rows": GaugeMetricFamily(
                "outbox_table_rows", "Rows per table (PostgreSQL: estimate).", labels=["table"]
            ),
            "dead_rows": GaugeMetricFamily(
                "outbox_table_dead_rows",
                "Dead tuples per table, waiting for vacuum (PostgreSQL).",
                labels=["table"],
            ),
            "table_bytes": GaugeMetricFamily(
                "outbox_table_bytes", "Heap size of each table, bytes.", labels=["table"]
            ),
            "index_bytes": GaugeMetricFamily(
                "outbox_table_index_bytes", "Index size of each table, bytes.", labels=["table"]
            ),
            "oldest_age_seconds": GaugeMetricFamily(
                "outbox_table_oldest_row_age_seconds",
                "Age of each table's oldest row as its retention measures it (published, "
                "processed, replayed, finished); flat when retention keeps up.",
                labels=["table"],
            ),
            "retention_seconds": GaugeMetricFamily(
                "outbox_table_retention_seconds",
                "Each table's retention window, seconds (0: none).",
                labels=["table"],
            ),
        }
        for stats in table_stats(ctx.conn, tables, windows=windows):
            for key, value in stats.as_dict().items():
                if value is not None:
                    families[key].add_metric([stats.table], float(value))
        return list(families.values())

    return Source(name="tables", tables=(), run=run)
