"""``python -m bench horizon``: the job worker and the relay while one transaction holds the
vacuum horizon (issue 60).

Three phases per cell, on a database of its own (``bench_horizon``, created if missing: a
transaction held in one database does not pin the horizon of another's tables, so the cell
neither disturbs other benchmarks on the server nor is disturbed by their transactions):

- **clean** (``--clean`` s): the steady load alone;
- **held** (``--hold`` s, the issue's target is 180): a second connection opens a
  REPEATABLE READ transaction, takes a read (its snapshot now pins the horizon: no row that
  dies after it may be vacuumed), and stays idle in transaction;
- **recovery** (``--recovery`` s): after it commits.

Cells:

- **jobs**: a producer process offering ``--rate`` jobs/s (default 400) through the public
  API, one ``Store.enqueue`` (one transaction) per job, and one ``Worker(concurrency=16)``
  with its defaults otherwise, running ``def`` jobs that sleep ``--work-ms`` (1 ms). Per
  window: completed/s, READY depth, claim latency (enqueue -> handler start, from
  ``Hooks.worker_job_started``'s ``enqueued_at``: the database clock on this machine) and the
  job table's dead tuples (``pg_stat_user_tables.n_dead_tup``).
- **relay**: writers committing ``--relay-rate`` events/s (default 2,000; ``--per-tx``
  events per transaction through ``Outbox.transaction``) and one ``outbox-relay run``
  process publishing to Redis Streams. Per window: committed/s, published/s, pending
  backlog, the outbox table's dead tuples.

The figures are medians and minima of ``--window``-second windows per phase. The machine is
shared: name its load (``uptime``) beside the figures, and compare phases within one run.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa

from outbox.hooks import Hooks

DEFAULT_SERVER = os.environ.get(
    "OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
DATABASE = "bench_horizon"
DEFAULT_REDIS = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
HOLDER = "bench-horizon-holder"
PHASES = ("clean", "held", "recovery")


@dataclass(frozen=True)
class Timeline:
    clean: float
    hold: float
    recovery: float
    window: float

    def phase(self, elapsed: float) -> str:
        if elapsed <= self.clean:
            return "clean"
        return "held" if elapsed <= self.clean + self.hold else "recovery"

    def __str__(self) -> str:
        return (
            f"clean {self.clean:g} s, held {self.hold:g} s, recovery {self.recovery:g} s, "
            f"{self.window:g}-s windows"
        )

    @property
    def total(self) -> float:
        return self.clean + self.hold + self.recovery


@dataclass
class Window:
    """One window's figures: ``at`` seconds from the start, its phase, and named values."""

    at: float
    phase: str
    values: dict[str, float] = field(default_factory=dict)


def ensure_database(server_url: str) -> str:
    """The URL of :data:`DATABASE` on ``server_url``'s server, created when missing."""
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        with admin.connect() as conn:
            found = conn.execute(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": DATABASE}
            ).first()
            if found is None:
                conn.execute(sa.text(f'CREATE DATABASE "{DATABASE}"'))
    finally:
        admin.dispose()
    return sa.make_url(server_url).set(database=DATABASE).render_as_string(hide_password=False)


def conninfo(url: str) -> str:
    """A plain libpq URL for psycopg from a SQLAlchemy one."""
    plain = sa.make_url(url).set(drivername="postgresql")
    return plain.render_as_string(hide_password=False)


class Holder:
    """A transaction that pins the horizon: REPEATABLE READ, one read, then idle."""

    def __init__(self, url: str, table: str) -> None:
        self.url, self.table = url, table
        self.conn: psycopg.Connection[Any] | None = None
        self.opened = 0.0

    def open(self) -> None:
        self.conn = psycopg.connect(conninfo(self.url), application_name=HOLDER)
        self.conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        self.conn.execute(f"SELECT count(*) FROM (SELECT 1 FROM {self.table} LIMIT 10) t")
        self.opened = time.monotonic()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.commit()
            self.conn.close()
            self.conn = None


def paced(rate: float, stop: threading.Event, act: Callable[[int], int]) -> None:
    """Call ``act(i)`` on a schedule of ``rate`` items per second (it returns how many items
    it offered): a late call is not skipped, the schedule catches up."""
    started, i = time.monotonic(), 0
    while not stop.is_set():
        pause = started + i / rate - time.monotonic()
        if pause > 0:
            stop.wait(pause)
        i += act(i)


def run_timeline(
    timeline: Timeline, holder: Holder, sample: Callable[[float], dict[str, float]]
) -> list[Window]:
    """The three phases: ``sample(seconds)`` after each window, the holder opened at the end
    of the clean phase and committed at the end of the held one. Prints each window."""
    windows: list[Window] = []
    started = time.monotonic()
    held = False
    for n in range(1, int(timeline.total / timeline.window) + 1):
        end = started + n * timeline.window
        at = n * timeline.window
        # Open/close the holder at phase edges, which fall on window edges.
        if not held and timeline.phase(at) == "held" and holder.conn is None:
            holder.open()
            held = True
            print(f"  -- {at - timeline.window:5.0f} s: transaction held open", flush=True)
        time.sleep(max(0.0, end - time.monotonic()))
        values = sample(timeline.window)
        windows.append(Window(at, timeline.phase(at), values))
        print(f"  {at:5.0f} s {windows[-1].phase:<9} " + _row(values), flush=True)
        if held and timeline.phase(at + timeline.window) == "recovery" and holder.conn:
            holder.close()
            print(f"  -- {at:5.0f} s: transaction committed", flush=True)
    holder.close()
    return windows


def _row(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:,.0f}" if abs(v) >= 10 else f"{k} {v:.2g}" for k, v in values.items())


def summarise(windows: list[Window], rate_key: str, depth_key: str, extra: tuple[str, ...]) -> None:
    """Per phase: the rate (median, min), the depth (median / max), the extras' median and
    max."""
    for phase in PHASES:
        found = [w.values for w in windows if w.phase == phase]
        if not found:
            continue
        rates = [v[rate_key] for v in found]
        depths = [v[depth_key] for v in found]
        parts = [
            f"{rate_key} median {statistics.median(rates):,.0f} min {min(rates):,.0f}",
            f"{depth_key} median {statistics.median(depths):,.0f} max {max(depths):,.0f}",
        ]
        for key in extra:
            vals = [v[key] for v in found if key in v and not math.isnan(v[key])]
            if vals:
                parts.append(f"{key} median {statistics.median(vals):,.1f} max {max(vals):,.1f}")
        print(f"  {phase:<9} " + "; ".join(parts), flush=True)
    last = [w for w in windows if w.phase == "held"]
    if last:
        print(f"  depth when the transaction closed: {last[-1].values[depth_key]:,.0f}", flush=True)


def _dead(conn: psycopg.Connection[Any], schema: str, table: str) -> float:
    return _stat(conn, schema, table)[0]


def _stat(conn: psycopg.Connection[Any], schema: str, table: str) -> tuple[float, float]:
    """The table's dead tuples, and the vacuums it has had (manual and auto)."""
    row = conn.execute(
        "SELECT n_dead_tup, vacuum_count + autovacuum_count FROM pg_stat_user_tables "
        "WHERE schemaname = %s AND relname = %s",
        (schema, table),
    ).fetchone()
    return (float(row[0]), float(row[1])) if row else (float("nan"), float("nan"))


# -- the job cell ------------------------------------------------------------------------------


class _Probe(Hooks):
    """Counts finished jobs, and keeps each job's enqueue -> start wait."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.waits: list[float] = []

    def worker_job_started(self, action: str, **facts: Any) -> None:
        enqueued = facts.get("enqueued_at")
        if enqueued is not None:
            with self.lock:
                self.waits.append(time.time() - float(enqueued))

    def worker_job_finished(
        self, action: str, outcome: str, duration_seconds: float, **facts: Any
    ) -> None:
        with self.lock:
            self.done += 1

    def take(self) -> tuple[int, list[float]]:
        with self.lock:
            waits, self.waits = self.waits, []
            return self.done, waits


@contextmanager
def _schema(url: str, label: str) -> Iterator[str]:
    schema = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield schema
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def produce(url: str, rate: float, tenants: int, batch: int, stop: Any, made: Any) -> None:
    """The producer (a spawned process): ``rate`` jobs/s through ``Store.enqueue`` (one
    transaction per job), or ``Store.enqueue_many`` of ``batch`` jobs per call."""
    from consumer.jobs.store import Store

    store = Store(url)

    def offer(i: int) -> int:
        if batch <= 1:
            store.enqueue(f"t{i % tenants}", f"job-{i}", kind="w")
        else:
            store.enqueue_many(
                [
                    {"tenant": f"t{n % tenants}", "action": f"job-{n}", "kind": "w"}
                    for n in range(i, i + batch)
                ]
            )
        made.value = i + max(1, batch)
        return max(1, batch)

    try:
        paced(rate, stop, offer)
    finally:
        store.dispose()


def jobs_cell(
    url: str, timeline: Timeline, rate: float, work: float, tenants: int, batch: int
) -> None:
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    print(
        f"jobs cell: {rate:,.0f} jobs/s offered by a producer process ("
        + ("one Store.enqueue each" if batch <= 1 else f"Store.enqueue_many of {batch}")
        + f", {tenants} tenant(s)), "
        f"one Worker(concurrency=16), def jobs of {work * 1000:g} ms; {timeline}",
        flush=True,
    )
    with _schema(url, "hjobs") as schema:
        sep = "&" if "?" in url else "?"
        cell_url = f"{url}{sep}options=-csearch_path%3D{schema}&application_name=hjobs"
        store = Store(cell_url)
        probe = _Probe()
        worker = Worker(store, concurrency=16, hooks=probe)
        worker.register("w", lambda job: time.sleep(work))
        spawn = multiprocessing.get_context("spawn")
        stop, made = spawn.Event(), spawn.Value("q", 0)
        # A process of its own, as an application enqueueing jobs is: the worker's GIL is
        # not the producer's.
        producer = spawn.Process(
            target=produce, args=(cell_url, rate, tenants, batch, stop, made), daemon=True
        )
        runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        sampler = psycopg.connect(conninfo(url), autocommit=True)
        last = [0, 0]

        def sample(seconds: float) -> dict[str, float]:
            done, waits = probe.take()
            offered = made.value
            rate_, put = (done - last[0]) / seconds, (offered - last[1]) / seconds
            last[:] = [done, offered]
            ready = sampler.execute(
                f"SELECT count(*) FROM \"{schema}\".outbox_jobs WHERE state = 'READY'"
            ).fetchone()
            dead, vacuums = _stat(sampler, schema, "outbox_jobs")
            return {
                "offered/s": put,
                "completed/s": rate_,
                "READY": float(ready[0]) if ready else float("nan"),
                "claim p50 ms": statistics.median(waits) * 1000 if waits else float("nan"),
                "dead": dead,
                "vacuums": vacuums,
            }

        try:
            runner.start()
            producer.start()
            while made.value == 0 and producer.is_alive():  # its start-up is not the clean phase
                time.sleep(0.05)
            windows = run_timeline(timeline, Holder(cell_url, "outbox_jobs"), sample)
        finally:
            stop.set()
            producer.join(60)
            worker.stop()
            runner.join(60)
            sampler.close()
            store.dispose()
    print("jobs cell, per phase:", flush=True)
    summarise(windows, "completed/s", "READY", ("offered/s", "claim p50 ms", "dead"))


# -- the relay cell ----------------------------------------------------------------------------


def relay_cell(url: str, redis_url: str, timeline: Timeline, rate: float, per_tx: int) -> None:
    import redis

    from bench.relay import TABLE, TOPICS, place, relay_argv, relay_processes, stream_total
    from outbox import Outbox
    from outbox.db import make_engine

    print(
        f"relay cell: {rate:,.0f} events/s committed ({per_tx} per transaction), one "
        f"outbox-relay run process; {timeline}",
        flush=True,
    )
    r = redis.Redis.from_url(redis_url)
    with place(url, r, "hrelay") as where:
        outbox = Outbox(make_engine(where.url, pool_size=1))
        committed = [0]

        def write(i: int) -> int:
            events = [
                {
                    "topic": TOPICS[(i + j) % len(TOPICS)],
                    "key": f"key-{(i + j) % 1000}",
                    "payload": {"n": i + j, "pad": "p" * 120},
                    "tenant": "bench",
                }
                for j in range(per_tx)
            ]
            with outbox.transaction() as tx:
                tx.emit_many(events)
            committed[0] += per_tx
            return per_tx

        stop = threading.Event()
        writer = threading.Thread(target=paced, args=(rate, stop, write), daemon=True)
        sampler = psycopg.connect(where.conninfo, autocommit=True)
        last = [0, 0]

        def sample(seconds: float) -> dict[str, float]:
            pub, com = stream_total(r, where), committed[0]
            values = {
                "committed/s": (com - last[1]) / seconds,
                "published/s": (pub - last[0]) / seconds,
            }
            last[:] = [pub, com]
            backlog = sampler.execute(
                f"SELECT count(*) FROM {TABLE} WHERE state = 'pending'"
            ).fetchone()
            values["pending"] = float(backlog[0]) if backlog else float("nan")
            values["dead"] = _dead(sampler, where.schema, TABLE)
            return values

        try:
            with relay_processes(relay_argv(where, redis_url, 500), 1):
                time.sleep(2.0)  # the relay's start
                last[0] = stream_total(r, where)
                writer.start()
                windows = run_timeline(timeline, Holder(where.url, TABLE), sample)
                stop.set()
                writer.join(60)
        finally:
            stop.set()
            sampler.close()
            outbox.engine.dispose()
    print("relay cell, per phase:", flush=True)
    summarise(windows, "published/s", "pending", ("committed/s", "dead"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench horizon", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--database-url", default=DEFAULT_SERVER, help="the server (any database on it)"
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--clean", type=float, default=30.0, help="seconds before the hold")
    parser.add_argument(
        "--hold", type=float, default=60.0, help="seconds held (issue's target: 180)"
    )
    parser.add_argument("--recovery", type=float, default=30.0, help="seconds after the commit")
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=400.0, help="jobs/s offered")
    parser.add_argument("--work-ms", type=float, default=1.0, help="each job's sleep")
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1, help="jobs per enqueue (1: Store.enqueue)")
    parser.add_argument("--relay-rate", type=float, default=2000.0, help="events/s committed")
    parser.add_argument("--per-tx", type=int, default=20, help="events per transaction")
    parser.add_argument("--cells", default="jobs,relay", help="jobs, relay or both")
    args = parser.parse_args(argv)
    timeline = Timeline(args.clean, args.hold, args.recovery, args.window)
    url = ensure_database(args.database_url)
    one, five, _ = os.getloadavg()
    print(f"load: {one:.2f} {five:.2f} (1, 5 min), {os.cpu_count()} cores", flush=True)
    cells = {c.strip() for c in args.cells.split(",")}
    if "jobs" in cells:
        jobs_cell(url, timeline, args.rate, args.work_ms / 1000, args.tenants, args.batch)
    if "relay" in cells:
        relay_cell(url, args.redis_url, timeline, args.relay_rate, args.per_tx)
    return 0
