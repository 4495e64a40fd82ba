"""``python -m bench job_wake``: enqueue -> handler latency of an idle worker, LISTEN/NOTIFY
against polling, on PostgreSQL.

A :class:`consumer.Worker` runs ``run()`` (concurrency 1) in a thread while another Store
(as a consumer's would be) enqueues jobs one at a time, ``--gap`` seconds apart, each
committed on its own. The handler records ``perf_counter() - enqueued``. Two modes in the
same run, each in a fresh schema: ``listen`` (the default: enqueues NOTIFY, the idle worker
claims at once) and ``poll`` (``listen=False``, ``StoreConfig(notify=False)``: the worker finds
the job at its next poll, ``--poll-interval`` at most). Figures: p50 / p99 / max in ms.

Options: ``--database-url``, ``--jobs`` (per mode), ``--gap``, ``--poll-interval``.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def run_mode(url: str, jobs: int, gap: float, poll_interval: float, listen: bool) -> list[float]:
    from consumer import Store, StoreConfig, Worker

    config = StoreConfig(notify=listen)
    store = Store(url, config=config)
    producer = Store(url, config=config, create_schema=False)
    worker = Worker(store, poll_interval=poll_interval, listen=listen, batch_size=10)
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
        time.sleep(1.0)  # the worker is idle and (listen mode) LISTENing
        for n in range(jobs):
            action = f"wake-{n}"
            sent[action] = time.perf_counter()
            producer.enqueue("bench", action)
            time.sleep(gap)
        done.wait(60)
    finally:
        worker.stop()
        runner.join(30)
        producer.dispose()
        store.dispose()
    return sorted(seen)


def _summary(name: str, ms: list[float]) -> str:
    if not ms:
        return f"  {name:<7} nothing handled"
    p50 = ms[len(ms) // 2]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"  {name:<7} {len(ms)} jobs: p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {ms[-1]:7.1f} ms"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench job_wake", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between enqueues")
    parser.add_argument("--poll-interval", type=float, default=0.5)
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")
    print(
        f"job wake-up: {args.jobs} jobs per mode, one every {args.gap * 1000:.0f} ms, "
        f"poll interval {args.poll_interval} s, PostgreSQL"
    )
    try:
        for name, listen in (("listen", True), ("poll", False)):
            schema = f"bench_wake_{uuid.uuid4().hex[:8]}"
            with admin.connect() as conn:
                conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            try:
                seconds = run_mode(
                    _schema_url(args.database_url, schema),
                    args.jobs,
                    args.gap,
                    args.poll_interval,
                    listen,
                )
                print(_summary(name, [s * 1000 for s in seconds]), flush=True)
            finally:
                with admin.connect() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        admin.dispose()
    return 0
