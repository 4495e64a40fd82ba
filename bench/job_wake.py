"""``python -m bench job_wake``: enqueue -> handler latency of an idle worker, and the
enqueue rate of concurrent writers, with and without NOTIFY, on PostgreSQL (issue 25).

Latency: a :class:`consumer.Worker` runs ``run()`` (concurrency 1, LISTENing as by default)
in a thread while another Store (as a consumer's would be) enqueues jobs one at a time,
``--gap`` seconds apart, each committed on its own. The handler records ``perf_counter() -
enqueued``. Two modes, each in a fresh schema: ``notify`` (``StoreConfig(notify=True)``:
enqueues NOTIFY, the idle worker claims at once) and ``default`` (``StoreConfig()``, no
NOTIFY: the worker polls, every 10 ms for a second after a claim that found work, then
backing off to ``--poll-interval``). ``--gap`` longer than a second measures a worker that
has gone idle. Figures: p50 / p99 / max in ms.

Throughput: ``--writers`` threads enqueue one job per transaction for ``--seconds`` per
round, alternating rounds with and without NOTIFY (a transaction that sent NOTIFY takes a
global lock at commit); medians of ``--rounds``. ``--skip-rate`` / ``--skip-latency``.

Options: ``--database-url``, ``--jobs`` (per mode), ``--gap``, ``--poll-interval``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

T = TypeVar("T")

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def run_mode(url: str, jobs: int, gap: float, poll_interval: float, notify: bool) -> list[float]:
    from consumer import Store, StoreConfig, Worker

    config = StoreConfig(notify=notify)
    store = Store(url, config=config)
    producer = Store(url, config=config, create_schema=False)
    worker = Worker(store, poll_interval=poll_interval, batch_size=10)
    sent: dict[str, float] = {}
    seen: list[float] = []
    done = threading.Event()

    def handle(job: object) -> None:
        action = job.action  # type: ignore[attr-defined]
        seen.append(time.perf_counter() - sent[action])
        if len(seen) >= jobs:
            done.set()

    worker.register("wake", handle)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        time.sleep(1.5)  # the worker is idle (backed off) and LISTENing
        for n in range(jobs):
            action = f"wake-{n}"
            sent[action] = time.perf_counter()
            producer.enqueue("bench", action)
            time.sleep(gap)
        done.wait(60 + jobs * poll_interval)
    finally:
        worker.stop()
        runner.join(30)
        producer.dispose()
        store.dispose()
    return sorted(seen)


def _enqueue_loop(store: Any, n: int, counts: list[int], stop: threading.Event) -> None:
    prefix = f"rate-{uuid.uuid4().hex[:8]}-{n}"
    while not stop.is_set():
        store.enqueue("bench", f"{prefix}-{counts[n]}")
        counts[n] += 1


def enqueue_rates(url: str, writers: int, seconds: float, rounds: int) -> tuple[float, float]:
    """Median jobs/s enqueued by ``writers`` threads (one job per transaction), with NOTIFY
    and without, in alternating rounds."""
    from consumer import Store, StoreConfig

    stores = {
        True: Store(url, config=StoreConfig(notify=True)),
        False: Store(url, config=StoreConfig(notify=False), create_schema=False),
    }
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        for notify in (True, False):  # warm the pools and prepared statements
            for _ in range(20):
                stores[notify].enqueue("bench", f"warm-{uuid.uuid4().hex}")
        for _ in range(rounds):
            for notify in (True, False):
                counts = [0] * writers
                stop = threading.Event()
                args = [(stores[notify], n, counts, stop) for n in range(writers)]
                threads = [threading.Thread(target=_enqueue_loop, args=a) for a in args]
                start = time.perf_counter()
                for thread in threads:
                    thread.start()
                time.sleep(seconds)
                stop.set()
                for thread in threads:
                    thread.join()
                rates[notify].append(sum(counts) / (time.perf_counter() - start))
    finally:
        for store in stores.values():
            store.dispose()
    return statistics.median(rates[True]), statistics.median(rates[False])


def _summary(name: str, ms: list[float]) -> str:
    if not ms:
        return f"  {name:<8} nothing handled"
    p50 = ms[len(ms) // 2]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"  {name:<8} {len(ms)} jobs: p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {ms[-1]:7.1f} ms"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench job_wake", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between enqueues")
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--writers", type=int, default=8, help="enqueue threads [8]")
    parser.add_argument("--seconds", type=float, default=1.0, help="per rate round [1]")
    parser.add_argument("--rounds", type=int, default=5, help="rate rounds per mode [5]")
    parser.add_argument("--skip-rate", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")

    def in_schema(run: Callable[[str], T]) -> T:
        schema = f"bench_wake_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            return run(_schema_url(args.database_url, schema))
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))

    try:
        if not args.skip_latency:
            print(
                f"job wake-up: {args.jobs} jobs per mode, one every {args.gap * 1000:.0f} ms, "
                f"poll interval {args.poll_interval} s, PostgreSQL"
            )
            for name, notify in (("notify", True), ("default", False)):
                seconds = in_schema(
                    lambda url, notify=notify: run_mode(
                        url, args.jobs, args.gap, args.poll_interval, notify
                    )
                )
                print(_summary(name, [s * 1000 for s in seconds]), flush=True)
        if not args.skip_rate:
            with_notify, without = in_schema(
                lambda url: enqueue_rates(url, args.writers, args.seconds, args.rounds)
            )
            print(
                f"enqueue rate, {args.writers} writers, one job per transaction (median of "
                f"{args.rounds} rounds of {args.seconds} s): notify {with_notify:.0f} jobs/s, "
                f"no notify {without:.0f} jobs/s, ratio {without / with_notify:.3f}"
            )
    finally:
        admin.dispose()
    return 0
