"""The ``steps`` source of the metrics collector (issue 57): steps a finished parent did not
release, read from ``outbox_job_steps`` (``consumer.jobs.steps``) at scrape.

- ``outbox_unreleased_steps``: jobs still WAITING_PARENTS although a parent of theirs ended
  (DONE or CANCELLED) and its edge to them was not released.
- ``outbox_oldest_unreleased_step_age_seconds``: how long ago the earliest such parent ended
  (0 when none).

A finish releases its children in its own transaction, so both stay 0 but for a moment.
The one path that leaves an edge for later is a parent whose lease was claimed before the
step was enqueued after it: ``Store.recover`` (every worker, each ``recover_interval``)
applies it. ``OutboxStepsNotReleased`` (metrics/alerts.yml) fires when one waits for
minutes: no worker runs its recovery, or it fails. How many steps wait is
``outbox_jobs{state="WAITING_PARENTS"}`` (the jobs source); a long wait there alone is no
fault (a parent may wait days for a customer's reply).
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from metrics import queries
from metrics.tables import Source

__all__ = ["steps_source"]


def steps_source(schema: str | None = None) -> Source:
    """The collector's ``steps`` source over the job store's tables in ``schema`` (a name
    already checked as a plain identifier). A job table made before steps (no
    ``outbox_job_steps``) has no series of it."""
    jobs = queries.qualified(queries.JOBS_TABLE, schema)
    steps = queries.qualified(queries.STEPS_TABLE, schema)

    def run(ctx: Any) -> list[Metric]:  # a metrics.collector.ScrapeContext
        count, age = ctx.conn.execute(queries.unreleased_steps(jobs, steps, ctx.dialect)).one()
        return [
            GaugeMetricFamily(
                "outbox_unreleased_steps",
                "Jobs WAITING_PARENTS although a parent ended (DONE or CANCELLED) and did not "
                "release them yet; a worker's recovery applies it.",
                value=float(count or 0),
            ),
            GaugeMetricFamily(
                "outbox_oldest_unreleased_step_age_seconds",
                "How long ago the earliest parent ended whose step is still not released "
                "(0 when none).",
                value=max(0.0, float(age)) if age is not None else 0.0,
            ),
        ]

    return Source(
        name="steps",
        tables=((queries.JOBS_TABLE, schema), (queries.STEPS_TABLE, schema)),
        run=run,
    )
