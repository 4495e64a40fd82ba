"""A worker with one schedule, for the process tests of schedules (``outbox-worker run
tests.schedule_app:build``), configured from environment variables:

- ``OUTBOX_DATABASE_URL``: the database;
- ``SCHED_BASE`` / ``SCHED_REAL0`` / ``SCHED_SPEED``: the schedules' clock, shared by every
  process of a test: unix seconds ``SCHED_BASE`` at the real instant ``SCHED_REAL0``, running
  ``SCHED_SPEED`` times faster than real time (60: a per-minute slot every real second).
  Only the schedules run on it (``Store.schedule_clock``); leases, liveness and claims keep
  the database clock;
- ``SCHED_MISSED`` / ``SCHED_CATCH_UP_LIMIT`` / ``SCHED_GRACE``: the schedule's policy, limit
  and grace (schedule seconds);
- ``SCHED_CRON``: its cron (default every minute).

The handler of ``tick`` checks that it sees its slot (``ctx.slot``, the action's suffix) and
returns: the job ends DONE.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from consumer import Store, Worker
from consumer.errors import PermanentFailure
from consumer.jobs.config import WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.schedules import Schedule


def schedule_clock(env: Mapping[str, str] = os.environ) -> float:
    """The schedules' clock from ``env`` (this process's environment; a test passes the one
    it gave its workers)."""
    base = float(env["SCHED_BASE"])
    real0 = float(env["SCHED_REAL0"])
    speed = float(env.get("SCHED_SPEED", "60"))
    return base + (time.time() - real0) * speed


def build() -> Worker:
    store = Store(os.environ["OUTBOX_DATABASE_URL"])
    store.schedule_clock = schedule_clock
    tick = Schedule(
        "tick",
        os.environ.get("SCHED_CRON", "* * * * *"),
        "t",
        "tick",
        missed="catch_up" if os.environ.get("SCHED_MISSED") == "catch_up" else "skip",
        catch_up_limit=int(os.environ.get("SCHED_CATCH_UP_LIMIT", "10")),
        grace=float(os.environ.get("SCHED_GRACE", "3600")),
    )
    # The firing duty looks every 50 ms (the schedule's minutes pass in real seconds here).
    worker = Worker(store, schedules=[tick], config=WorkerConfig(schedule_interval=0.05))

    @worker.handler("tick")
    def run_tick(job: JobContext) -> None:
        if job.slot is None or job.action != f"tick@{job.slot}":
            raise PermanentFailure(f"no slot for {job.action}")

    return worker
