"""``python -m bench schedules``: what schedules cost an idle fleet, and how late their jobs
start, with the defaults, on PostgreSQL (issue 39).

Two fleets run side by side for ``--minutes``, each in a fresh schema, each ``--workers``
:class:`consumer.Worker` objects running ``run()`` in threads of this process with the
default settings (each with its own Store, so its own connection pool, as a process would):

- ``base``: no schedule, no job: the idle fleet's own statements (claim polls, liveness,
  recovery);
- ``sched``: ``--schedules`` per-minute schedules (``* * * * *``, one tenant each, so each
  slot of each is a job of its own; defined by the first worker's ``schedules=``), their
  handler recording ``time.time() - ctx.slot``.

Every statement each fleet's engines execute is counted (a SQLAlchemy ``before_cursor_execute``
listener), and those naming ``outbox_schedules`` apart. Printed: statements per minute per
fleet, the difference (what the schedules cost), the firing duty's own statements per
minute, and the delay from slot to job start (p50, p99, max) over every slot of every
schedule. The first minute is left out of both (start-up: schema creation, first claims).

Options: ``--database-url``, ``--minutes`` (default 3), ``--workers`` (2), ``--schedules``
(100), ``--cron`` (``* * * * *``; ``"0 0 1 1 *"`` measures schedules that never fall due
meanwhile: the duty's own cost on an idle fleet).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


class Counter:
    """Statements executed on some engines, after ``start`` only."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counting = False
        self.total = 0
        self.schedules = 0

    def watch(self, engine: sa.Engine) -> None:
        @event.listens_for(engine, "before_cursor_execute")
        def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if not self.counting:
                return
            with self.lock:
                self.total += 1
                if "outbox_schedules" in statement:
                    self.schedules += 1


def fleet(
    url: str,
    workers: int,
    schedules: int,
    counter: Counter,
    delays: list[float],
    cron: str = "* * * * *",
) -> tuple[list[Any], list[threading.Thread]]:
    from consumer import Store, Worker
    from consumer.jobs.schedules import Schedule

    made, threads = [], []
    definitions = [Schedule(f"s{n:03d}", cron, f"tenant-{n}", "tick") for n in range(schedules)]
    for index in range(workers):
        store = Store(url)
        counter.watch(store.engine)
        worker = Worker(store, schedules=definitions if index == 0 and definitions else None)

        def tick(job: Any) -> None:
            delays.append(time.time() - job.slot.timestamp())

        worker.register("tick", tick)
        thread = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        made.append(worker)
        threads.append(thread)
    return made, threads


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench schedules", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--schedules", type=int, default=100)
    parser.add_argument("--cron", default="* * * * *", help="the schedules' cron")
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url)
    schemas = {name: f"bench_sched_{name}_{uuid.uuid4().hex[:8]}" for name in ("base", "sched")}
    with admin.begin() as conn:
        for schema in schemas.values():
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    counters = {name: Counter() for name in schemas}
    delays: list[float] = []
    ignored: list[float] = []
    running: list[tuple[Any, threading.Thread]] = []
    try:
        for name, schema in schemas.items():
            url = _schema_url(args.database_url, schema)
            n = args.schedules if name == "sched" else 0
            sink = delays if name == "sched" else ignored
            workers, threads = fleet(url, args.workers, n, counters[name], sink, args.cron)
            running += list(zip(workers, threads, strict=True))
        for _, thread in running:
            thread.start()
        time.sleep(60)  # start-up left out
        delays.clear()
        for counter in counters.values():
            counter.counting = True
        started = time.monotonic()
        time.sleep(args.minutes * 60)
        elapsed = (time.monotonic() - started) / 60
        for counter in counters.values():
            counter.counting = False
        measured = sorted(delays)
    finally:
        for worker, _ in running:
            worker.stop()
        for _, thread in running:
            thread.join(60)
        for worker, _ in running:
            worker.store.dispose()
        with admin.begin() as conn:
            for schema in schemas.values():
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    base, sched = counters["base"], counters["sched"]
    print(f"{args.workers} workers per fleet, {args.schedules} schedules '{args.cron}', "
          f"{elapsed:.1f} min measured after 1 min of start-up")  # fmt: skip
    print(f"statements/min  base fleet: {base.total / elapsed:.0f}  "
          f"with schedules: {sched.total / elapsed:.0f}  "
          f"difference: {(sched.total - base.total) / elapsed:+.0f}  "
          f"(naming outbox_schedules: {sched.schedules / elapsed:.0f})")  # fmt: skip
    if measured:
        p99 = measured[min(len(measured) - 1, int(len(measured) * 0.99))]
        print(f"slot -> job start: n={len(measured)} p50={statistics.median(measured)*1000:.0f} ms "
              f"p99={p99 * 1000:.0f} ms max={measured[-1] * 1000:.0f} ms")  # fmt: skip
    else:
        print("slot -> job start: no job ran")
    return 0
