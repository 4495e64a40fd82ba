"""``python -m bench retention_soak``: the whole loop with every retention window shortened,
to see each table's row count go flat once its window has passed (issue 25).

One process, on the shared PostgreSQL (a fresh schema) and Redis (fresh stream keys): a
writer commits ``--rate`` events/s, a relay publishes them (outbox retention ``--window``/2,
stream retention the same), a consumer turns each into a job (inbox window ``--window``), a
worker finishes the jobs (job retention ``--window``, which the safety rule allows: it is at
least the inbox window and the outbox/stream retention + a margin of ``--window``/4). Every
duty runs every 10 s. Every ``--every`` seconds it prints each table's row count; after the
first windows the counts stop growing (they hover around rate x window).

    python -m bench retention_soak [--rate 50] [--window 120] [--seconds 300] [--every 15]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import redis
import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
TABLES = ("outbox_events", "consumer_inbox", "outbox_jobs", "outbox_job_attempts")


def main(argv: list[str]) -> int:
    from consumer import Consumer, Store, Worker
    from consumer.consumer import ConsumerConfig
    from consumer.jobs.retention import JobRetentionConfig
    from outbox import Outbox
    from relay import RedisStreamPublisher, Relay, RelayConfig

    parser = argparse.ArgumentParser(prog="python -m bench retention_soak", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--rate", type=float, default=50.0, help="events/s [50]")
    parser.add_argument("--window", type=float, default=120.0, help="job/inbox window, s [120]")
    parser.add_argument("--seconds", type=float, default=300.0, help="run length [300]")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    args = parser.parse_args(argv)

    schema = f"soak_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = f"{args.database_url}?options=-csearch_path%3D{schema}"
    short = args.window / 2
    box = Outbox(url)
    box.create_schema()
    client = redis.Redis.from_url(args.redis_url)
    publisher = RedisStreamPublisher(client, f"{schema}.{{topic}}", stream_retention=short)
    relay = Relay(box, publisher, RelayConfig(retention_seconds=short, retention_interval=10.0))
    store = Store(box.engine)
    consumer = Consumer(
        box.engine,
        args.redis_url,
        group="soak",
        topics=["quote"],
        stream=f"{schema}.{{topic}}",
        config=ConsumerConfig(
            inbox_retention_seconds=args.window, purge_interval_seconds=10.0, block_ms=200
        ),
    )

    @consumer.handler("quote")
    def on_quote(event, tx):  # type: ignore[no-untyped-def]
        store.enqueue(event.tenant or "t", f"send-{event.identity}", session=tx.session)

    retention = JobRetentionConfig(
        job_retention_seconds=args.window,
        inbox_window_seconds=args.window,
        outbox_retention_seconds=short,
        stream_retention_seconds=short,
        redelivery_margin_seconds=args.window / 4,
        purge_interval=10.0,
    )
    worker = Worker(store, retention=retention, batch_size=50, poll_interval=0.05)

    @worker.handler("send")
    def send(job):  # type: ignore[no-untyped-def]
        return None

    stop = threading.Event()
    written = [0]

    def write() -> None:
        n = 0
        start = time.monotonic()
        while not stop.is_set():
            due = start + n / args.rate
            pause = due - time.monotonic()
            if pause > 0:
                stop.wait(pause)
            with box.transaction() as tx:
                tx.emit("quote", key=f"q-{n % 100}", payload={"n": n}, tenant="t")
            n += 1
            written[0] = n

    threads = [
        threading.Thread(target=write, daemon=True),
        threading.Thread(target=relay.run, args=(stop,), daemon=True),
        threading.Thread(target=consumer.run, args=(stop,), daemon=True),
        threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True),
    ]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    print(
        f"{'t (s)':>6} {'written/s':>9} " + " ".join(f"{t:>20}" for t in TABLES) + f" {'stream':>8}"
    )
    last_written, last_at = 0, started
    try:
        while time.monotonic() - started < args.seconds:
            time.sleep(args.every)
            with box.engine.connect() as conn:
                counts = [
                    int(conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one())
                    for t in TABLES
                ]
            length = client.xlen(f"{schema}.quote")
            now = time.monotonic()
            rate = (written[0] - last_written) / (now - last_at)
            last_written, last_at = written[0], now
            print(
                f"{now - started:6.0f} {rate:9.1f} "
                + " ".join(f"{c:20d}" for c in counts)
                + f" {length:8d}"
            )
    finally:
        stop.set()
        worker.stop()
        for thread in threads:
            thread.join(30)
        client.delete(f"{schema}.quote")
        client.close()
        box.engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    return 0
