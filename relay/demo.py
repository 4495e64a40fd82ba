"""``outbox-relay demo``: the whole loop on one screen.

Quotes are approved in transactions, each emitting an event (one in ten is approved twice,
as a retrying client would, with the same business identity); a relay publishes the events
to a Redis Stream; a consumer group reads them, deduplicates by identity in its inbox and
enqueues one "send the quote" job per quote in the same transaction; a worker claims the
jobs under fenced leases and finishes them. The live view shows each step.

On the embedded default it needs nothing installed: a SQLite file (``outbox.db``) and an
embedded Redis server (``outbox-redis.db``) in the working directory. Ctrl-C (or
``--duration``) stops it cleanly: the writer stops, the relay drains what is committed.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import threading
import time
from typing import Any

from sqlalchemy import text

from consumer.consumer import Consumer, ConsumerConfig
from consumer.event import ConsumedEvent
from consumer.jobs.store import Store
from consumer.jobs.worker import JobContext, Worker, WorkerConfig
from outbox.core import Outbox
from outbox.hooks import Hooks
from outbox.lifecycle import GracefulStop
from outbox.logs import setup_logging
from outbox.redis_client import is_cluster_url, redis_client
from relay.admin import status
from relay.config import RelayConfig
from relay.publisher import RedisStreamPublisher
from relay.relay import Relay

TENANTS = ("studio", "bakery", "garage")
STREAM = "outbox.{topic}"


def _setup_domain(outbox: Outbox) -> int:
    outbox.create_schema()
    with outbox.engine.begin() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS demo_quotes (id INTEGER PRIMARY KEY, "
                "tenant VARCHAR(50) NOT NULL, total INTEGER NOT NULL, state VARCHAR(20) NOT NULL)"
            )
        )
        return int(conn.execute(text("SELECT coalesce(max(id), 0) FROM demo_quotes")).scalar() or 0)


class _Counts(Hooks):
    """Counts what the consumer reports (the demo's view of deduplication)."""

    def __init__(self) -> None:
        self.handled = 0
        self.duplicates = 0

    def consumer_handled(self, group: str, stream: str, count: int) -> None:
        self.handled += count

    def consumer_duplicate(self, group: str, count: int) -> None:
        self.duplicates += count


def _consumer_and_worker(
    outbox: Outbox, client: Any, counts: _Counts
) -> tuple[Consumer, Store, Worker]:
    consumer = Consumer(
        outbox.engine,
        client,
        group="billing",
        topics=["quote.approved"],
        stream=STREAM,
        config=ConsumerConfig(block_ms=100, batch_size=100),
        hooks=counts,
    )
    store = Store(outbox.engine)

    @consumer.handler("quote.approved")
    def on_quote_approved(event: ConsumedEvent, tx: Any) -> None:
        # Same transaction as the inbox row of event.identity: one job per quote, however
        # often the event arrives.
        store.enqueue(
            event.tenant or "-",
            f"send-quote-{event.data['quote']}",
            subject=event.subject,
            payload=event.data,
            session=tx.session,
        )

    worker = Worker(store, config=WorkerConfig(poll_interval=0.1, batch_size=20))

    @worker.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        pass  # a real worker would call the mail provider through consumer.jobs.operations

    return consumer, store, worker


def _writer(
    outbox: Outbox, rate: float, start_id: int, stop: threading.Event, counter: list[int]
) -> None:
    """Approve quotes at a steady rate: the state change and its event in one transaction."""
    rng = random.Random()
    interval = 1.0 / rate
    next_at = time.monotonic()
    for quote_id in itertools.count(start_id + 1):
        if stop.is_set():
            return
        tenant = rng.choice(TENANTS)
        total = rng.randrange(50, 5000)
        try:
            key = f"quote-{quote_id:05d}"
            payload = {"quote": quote_id, "total": total, "currency": "EUR"}
            identity = f"{tenant}:send-quote-{quote_id}"
            with outbox.transaction() as tx:
                tx.session.execute(
                    text(
                        "INSERT INTO demo_quotes (id, tenant, total, state) "
                        "VALUES (:id, :tenant, :total, 'approved')"
                    ),
                    {"id": quote_id, "tenant": tenant, "total": total},
                )
                tx.emit(
                    "quote.approved", key=key, payload=payload, tenant=tenant, identity=identity
                )
            counter[0] += 1
            if quote_id % 10 == 0:
                # A client retried the approval: a second event, same business identity.
                with outbox.transaction() as tx:
                    tx.emit(
                        "quote.approved", key=key, payload=payload, tenant=tenant, identity=identity
                    )
                counter[1] += 1
        except Exception as exc:  # keep the demo going; show the problem
            print(f"\nwriter: {type(exc).__name__}: {exc}", file=sys.stderr)
            stop.wait(1.0)
        next_at += interval
        stop.wait(max(0.0, next_at - time.monotonic()))


def _view(
    outbox: Outbox,
    client: Any,
    relay: Relay,
    written: list[int],
    counts: _Counts,
    store: Store,
    elapsed: float,
) -> str:
    report = status(outbox.engine, outbox.schema)
    stream = "outbox.quote.approved"
    try:
        length = client.xlen(stream)
        sample = client.xrevrange(stream, count=3)
    except Exception as exc:
        length, sample = -1, []
        print(f"redis: {exc}", file=sys.stderr)
    jobs = store.counts()
    lines = [
        f"outbox demo  {elapsed:6.1f}s   (Ctrl-C to stop)",
        f"  quotes approved:             {written[0]}  (+{written[1]} retried: duplicate events)",
        f"  published by the relay:      {relay.stats.published}",
        f"  backlog:                     {report['pending']}",
        f"  oldest unpublished age:      {report['oldest_unpublished_age_seconds']:.3f}s",
        f"  quarantined:                 {report['quarantined']}",
        f"  stream {stream}: {length} entries; latest:",
    ]
    for entry_id, entry in sample:
        f = {k.decode(): v.decode() for k, v in entry.items()}
        lines.append(
            f"    {entry_id.decode()}  {f.get('subject')}  tenant={f.get('tenant')}  "
            f"data={f.get('data')}"
        )
    lines += [
        f"  consumer group billing:      {counts.handled} handled, "
        f"{counts.duplicates} duplicates skipped by the inbox",
        f"  jobs: {jobs['DONE']} sent (DONE), {jobs['READY']} ready, {jobs['LEASED']} leased, "
        f"{jobs['NEEDS_ATTENTION']} need attention",
    ]
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    setup_logging("warning")
    outbox = Outbox(args.database_url, table=args.table, schema=args.schema)
    start_id = _setup_domain(outbox)
    if getattr(args, "redis_cluster", False) or is_cluster_url(args.redis_url):
        client: Any = redis_client(args.redis_url, cluster=True)
    else:
        client = redis_client(args.redis_url)
    client.ping()
    if args.rate <= 0:
        print("outbox-relay demo: --rate must be positive", file=sys.stderr)
        return 2
    publisher = RedisStreamPublisher(client, STREAM)
    relay = Relay(outbox, publisher, RelayConfig(poll_interval=0.02, max_poll_interval=0.2))
    counts = _Counts()
    consumer, store, worker = _consumer_and_worker(outbox, client, counts)
    # Every table exists before the threads start: on SQLite, DDL racing the writer's
    # transactions only meets "database is locked" and retries.
    consumer.create_schema()
    store.create_schema()
    stop = GracefulStop().install()
    writer_stop = threading.Event()
    relay_stop = threading.Event()
    consumer_stop = threading.Event()
    counter = [0, 0]
    writer = threading.Thread(
        target=_writer, args=(outbox, args.rate, start_id, writer_stop, counter), daemon=True
    )
    relayer = threading.Thread(target=relay.run, args=(relay_stop,), daemon=True)
    reader = threading.Thread(target=consumer.run, args=(consumer_stop,), daemon=True)
    working = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    for thread in (relayer, reader, working, writer):
        thread.start()
    tty = sys.stdout.isatty()
    started = time.monotonic()
    try:
        while not stop.stopped:
            elapsed = time.monotonic() - started
            if args.duration is not None and elapsed >= args.duration:
                break
            view = _view(outbox, client, relay, counter, counts, store, elapsed)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + view + "\n")
            else:
                sys.stdout.write(view + "\n\n")
            sys.stdout.flush()
            stop.wait(0.5 if tty else 1.0)
    finally:
        writer_stop.set()
        writer.join(timeout=10)
        # Let the relay drain what was committed, then stop it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and status(outbox.engine, outbox.schema)["pending"]:
            time.sleep(0.1)
        relay_stop.set()
        relayer.join(timeout=10)
        # Then the consumer and the worker catch up with what was published.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and store.counts()["DONE"] < counter[0]:
            time.sleep(0.1)
        consumer_stop.set()
        worker.stop()
        reader.join(timeout=10)
        working.join(timeout=10)
    report = status(outbox.engine, outbox.schema)
    jobs = store.counts()
    print(
        f"stopped: {counter[0]} quotes approved (+{counter[1]} duplicate events), "
        f"{relay.stats.published} events published, {report['pending']} pending, "
        f"{report['quarantined']} quarantined; stream outbox.quote.approved has "
        f"{client.xlen('outbox.quote.approved')} entries; consumer handled {counts.handled}, "
        f"skipped {counts.duplicates} duplicates; {jobs['DONE']} quotes sent, one job each"
    )
    # Close what the threads opened before exiting: connections to the embedded Redis and the
    # database pools (the embedded server itself is released at exit, issue 16).
    client.close()
    outbox.engine.dispose()
    store.engine.dispose()
    logging.shutdown()
    return 0
