"""The ``schedules`` source of the metrics collector (issue 39): what the schedules fired and
missed, fleet-wide, read from ``outbox_schedules`` (``consumer.jobs.schedules``) at scrape.

- ``outbox_schedule_slots_fired_total{schedule}``: slots that enqueued their job (a counter:
  the table counts them, whichever worker fired them, across restarts).
- ``outbox_schedule_slots_missed_total{schedule}``: slots given up, because no worker fired
  them within their grace (``missed="skip"``, or beyond ``catch_up_limit``).
- ``outbox_schedule_overdue_seconds{schedule}``: for a running schedule, how far past its
  grace its earliest unfired slot is (0 while on time; paused schedules: 0).
- ``outbox_workers_alive``: workers whose liveness row is fresh (``outbox_workers``).

``OutboxScheduleSlotOverdue`` (metrics/alerts.yml) fires when a slot stays unfired beyond its
grace while workers are alive: they are all too busy, none runs the firing duty, or the
schedule's rows are locked. The label set is bounded: at most :data:`MAX_SCHEDULES` series
(the most overdue first, then by name); schedules are defined by operators, not per event.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import text

from metrics.tables import Source
from outbox.dialect import EPOCH_SQL, quoted_table

__all__ = ["MAX_SCHEDULES", "schedules_source"]

SCHEDULES_TABLE = "outbox_schedules"
WORKERS_TABLE = "outbox_workers"
MAX_SCHEDULES = 200


def schedules_source(schema: str | None = None) -> Source:
    """The collector's ``schedules`` source over the job store's tables in ``schema``
    (a name already checked as a plain identifier)."""
    table = quoted_table(SCHEDULES_TABLE, schema)
    workers = quoted_table(WORKERS_TABLE, schema)

    def run(ctx: Any) -> list[Metric]:  # a metrics.collector.ScrapeContext
        conn = ctx.conn
        now = EPOCH_SQL[ctx.dialect]
        # One row per schedule, at most MAX_SCHEDULES: the table holds what operators
        # defined (a handful to hundreds), never a row per job.
        rows = conn.execute(
            text(
                f"SELECT name, fired, missed, CASE WHEN paused_at IS NULL "
                f"THEN {now} - next_slot - grace ELSE 0 END AS overdue "
                f"FROM {table} ORDER BY overdue DESC, name LIMIT {MAX_SCHEDULES}"
            )
        ).all()
        alive = conn.execute(
            text(f"SELECT count(*) FROM {workers} WHERE alive_until > {now}")
        ).scalar_one()
        fired = CounterMetricFamily(
            "outbox_schedule_slots_fired",
            "Slots of each schedule that enqueued their job, over the whole fleet.",
            labels=["schedule"],
        )
        missed = CounterMetricFamily(
            "outbox_schedule_slots_missed",
            "Slots of each schedule given up: no worker fired them within their grace "
            "(missed='skip'), or they were beyond catch_up_limit.",
            labels=["schedule"],
        )
        overdue = GaugeMetricFamily(
            "outbox_schedule_overdue_seconds",
            "How far past its grace the earliest unfired slot of each running schedule is "
            "(0 while on time or paused).",
            labels=["schedule"],
        )
        for name, n_fired, n_missed, late in rows:
            fired.add_metric([name], float(n_fired))
            missed.add_metric([name], float(n_missed))
            overdue.add_metric([name], max(0.0, float(late)))
        workers_alive = GaugeMetricFamily(
            "outbox_workers_alive",
            "Workers whose liveness row is fresh (outbox_workers, database clock).",
            value=float(alive),
        )
        return [fired, missed, overdue, workers_alive]

    return Source(
        name="schedules", tables=((SCHEDULES_TABLE, schema), (WORKERS_TABLE, schema)), run=run
    )
