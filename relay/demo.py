"""``outbox-relay demo``: the whole loop on one screen.

Quotes are approved in transactions, each emitting an event (one in ten is approved twice,
as a retrying client would, with the same business identity); a relay publishes the events
to a Redis Stream (or, with ``--broker-url nats://...``, to NATS JetStream); a consumer group
reads them, deduplicates by identity in its inbox and enqueues one "send the quote" job per
quote in the same transaction; a worker claims the jobs under fenced leases and finishes
them. The live view shows each step.

On the embedded default it needs nothing installed: a SQLite file (``outbox.db``) and an
embedded Redis server (``outbox-redis.db``), in one folder, ``.outbox/`` in the working
directory (``--data-dir``, ``OUTBOX_DATA_DIR``; git ignores it). Each run starts fresh: the
earlier run's database, stream and simulator effects in that folder are removed first; on a
database or broker of ``--database-url``/``--broker-url`` nothing is removed and the demo says
that it reuses them. Ctrl-C (or ``--duration``) stops it cleanly: the writer stops, the relay
drains what is committed.

``--chaos`` (:mod:`relay.demo_chaos`) shows the point of it all (guarantee 8, one
customer-visible effect). The jobs are done by ``--workers`` worker *processes*
(``outbox-worker run relay.demo_app:build_worker``) that send each quote's email through
``HttpProvider`` to the connector simulator service (``outbox-simulator serve``, its effects
in ``simulator.db`` in the data directory), whose fault plan answers some sends late and
some slowly. Every 1-2 s the demo SIGKILLs a worker process, one with a call in flight when
there is one (its receipt still PENDING), and starts another. The live view counts the
emails the simulator sent (``GET /effects``) against the quotes approved, the duplicate
effects (more than one email for a quote: 0), the receipts and the kills. The summary's last
line: ``chaos: N quotes approved, N emails sent, 0 duplicate effects, K workers killed
(...)``. Every child process is stopped (SIGTERM, then SIGKILL) and reaped at exit; the
workers and the simulator also stop by themselves when the demo process is gone (a SIGKILLed
demo; its embedded Redis is adopted by the next run).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
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
from outbox.db import default_database_url
from outbox.hooks import Hooks
from outbox.lifecycle import GracefulStop
from outbox.logs import setup_logging
from outbox.redis_client import is_cluster_url, redis_client
from relay.admin import status
from relay.broker import Broker, broker_for, broker_kind
from relay.config import RelayConfig
from relay.demo_chaos import Chaos
from relay.demo_stream import NatsView, RedisView
from relay.redis.publisher import RedisStreamPublisher
from relay.relay import Relay

TENANTS = ("studio", "bakery", "garage")
STREAM = "outbox.{topic}"


STREAM_KEY = "outbox.quote.approved"

DEMO_FILES = ("outbox.db", "outbox.db-wal", "outbox.db-shm", "simulator.db", "demo-chaos.log")
"""The demo's own files in its data directory, removed at start: a run's totals are its own."""


def _start_fresh(data_dir: str) -> None:
    """Remove the files an earlier run left in the demo's data directory (``.outbox/``)."""
    removed = []
    for name in DEMO_FILES:
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            os.remove(path)
            removed.append(name)
    if "outbox.db" in removed:
        print(f"starting fresh: removed the earlier run's files in {data_dir}", flush=True)


def _say_what_is_reused(args: argparse.Namespace, start_id: int, client: Any) -> None:
    """A demo on the user's own database or Redis keeps what is there: say so."""
    if args.database_url is not None and start_id > 0:
        print(
            f"reusing the database of --database-url: it holds {start_id} quotes of earlier "
            "runs; the totals below count them too",
            flush=True,
        )
    if args.redis_url is not None and client.exists():
        print(
            f"reusing the stream {STREAM_KEY} of --broker-url: its entries of earlier runs "
            "count in the totals below",
            flush=True,
        )


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
    stream = STREAM_KEY
    try:
        length = client.length()
        sample = client.latest(3)
    except Exception as exc:
        length, sample = -1, []
        print(f"broker: {exc}", file=sys.stderr)
    by_state = store.counts()
    lines = [
        f"outbox demo  {elapsed:6.1f}s   (Ctrl-C to stop)",
        f"  quotes approved:             {written[0]}  (+{written[1]} retried: duplicate events)",
        f"  published by the relay:      {relay.stats.published}",
        f"  backlog:                     {report['pending']}",
        f"  oldest unpublished age:      {report['oldest_unpublished_age_seconds']:.3f}s",
        f"  quarantined:                 {report['quarantined']}",
        f"  stream {stream}: {length} entries; latest:",
    ]
    for entry_id, f in sample:
        lines.append(
            f"    {entry_id}  {f.get('subject')}  tenant={f.get('tenant')}  data={f.get('data')}"
        )
    lines += [
        f"  consumer group billing:      {counts.handled} handled, "
        f"{counts.duplicates} duplicates skipped by the inbox",
        f"  jobs: {by_state['DONE']} sent (DONE), {by_state['READY']} ready, "
        f"{by_state['LEASED']} leased, {by_state['NEEDS_ATTENTION']} need attention",
    ]
    return "\n".join(lines)


NON_TTY_INTERVAL = 5.0
"""Seconds between the progress lines when stdout is not a terminal."""


def _line(
    outbox: Outbox,
    relay: Relay,
    written: list[int],
    counts: _Counts,
    store: Store,
    elapsed: float,
    chaos: Chaos | None,
) -> str:
    """The live view in one line, for an output that is not a terminal."""
    report = status(outbox.engine, outbox.schema)
    done = store.counts()["DONE"]
    line = (
        f"demo {elapsed:5.1f}s: {written[0]} quotes approved (+{written[1]} retried), "
        f"{relay.stats.published} published by the relay, backlog {report['pending']}, "
        f"{counts.handled} handled, {counts.duplicates} duplicates skipped, {done} jobs DONE"
    )
    if chaos is not None:
        try:
            r = chaos.report()
            line += (
                f"; chaos: {r['emails']} emails sent, {r['duplicates']} duplicate effects, "
                f"{r['kills']} workers killed"
            )
        except Exception as exc:
            line += f"; chaos: {type(exc).__name__}: {exc}"
    return line


def run_demo(args: argparse.Namespace) -> int:
    setup_logging("warning")
    if args.rate <= 0:
        print("outbox-relay demo: --rate must be positive", file=sys.stderr)
        return 2
    chaos_mode = bool(getattr(args, "chaos", False))
    workers = int(getattr(args, "workers", 3) or 3)
    if workers < 1:
        print("outbox-relay demo: --workers must be at least 1", file=sys.stderr)
        return 2
    latency = float(getattr(args, "provider_latency", 0.0) or 0.0)
    if not 0 <= latency < 60:
        print("outbox-relay demo: --provider-latency must be 0 to 60 seconds", file=sys.stderr)
        return 2
    data_dir = os.path.abspath(args.data_dir)
    os.makedirs(data_dir, exist_ok=True)
    database_url = args.database_url or default_database_url(data_dir)
    if args.database_url is None:
        _start_fresh(data_dir)
    outbox = Outbox(database_url, table=args.table, schema=args.schema)
    start_id = _setup_domain(outbox)
    client, publisher, source = _broker(args, data_dir)
    if args.redis_url is None and args.database_url is None:
        # The embedded server in the data directory is the demo's own, as is the database
        # just removed: its stream, group and markers go too.
        client.flush()
    _say_what_is_reused(args, start_id, client)
    relay = Relay(outbox, publisher, RelayConfig(poll_interval=0.02, max_poll_interval=0.2))
    counts = _Counts()
    consumer, store, worker = _consumer_and_worker(outbox, source, counts)
    # Every table exists before the threads start: on SQLite, DDL racing the writer's
    # transactions only meets "database is locked" and retries.
    consumer.create_schema()
    store.create_schema()
    chaos: Chaos | None = None
    if chaos_mode:
        chaos = Chaos(store, database_url, workers, start_id, data_dir, latency)
    try:
        return _run(args, outbox, client, relay, counts, consumer, store, worker, start_id, chaos)
    finally:
        if chaos is not None:
            chaos.close()  # idempotent: every child stopped and reaped, whatever happened
        # Close what the threads opened before exiting: connections to the embedded Redis and
        # the database pools (the embedded server itself is released at exit, issue 16).
        client.close()
        outbox.engine.dispose()
        store.engine.dispose()
        logging.shutdown()


def _broker(args: argparse.Namespace, data_dir: str) -> tuple[Any, Broker, Any]:
    """The stream view, the relay's broker and what the consumer reads from, for
    ``--broker-url`` (a Redis client shared by all three, or a NATS URL)."""
    if broker_kind(args.redis_url) == "nats":
        view = NatsView(args.redis_url, STREAM_KEY)
        return view, broker_for(args.redis_url, stream_template=STREAM), args.redis_url
    if getattr(args, "redis_cluster", False) or is_cluster_url(args.redis_url):
        client: Any = redis_client(args.redis_url, cluster=True)
    else:
        client = redis_client(args.redis_url, directory=data_dir)
    client.ping()
    return RedisView(client, STREAM_KEY), RedisStreamPublisher(client, STREAM), client


# complexity: the demo's script of steps, read top to bottom (to split by step)
def _run(
    args: argparse.Namespace,
    outbox: Outbox,
    client: Any,
    relay: Relay,
    counts: _Counts,
    consumer: Consumer,
    store: Store,
    worker: Worker,
    start_id: int,
    chaos: Chaos | None,
) -> int:
    stop = GracefulStop().install()
    writer_stop = threading.Event()
    relay_stop = threading.Event()
    consumer_stop = threading.Event()
    chaos_stop = threading.Event()
    counter = [0, 0]
    writer = threading.Thread(
        target=_writer, args=(outbox, args.rate, start_id, writer_stop, counter), daemon=True
    )
    relayer = threading.Thread(target=relay.run, args=(relay_stop,), daemon=True)
    reader = threading.Thread(target=consumer.run, args=(consumer_stop,), daemon=True)
    threads = [relayer, reader, writer]
    monkey: threading.Thread | None = None
    if chaos is None:
        working = threading.Thread(
            target=worker.run, kwargs={"install_signals": False}, daemon=True
        )
        threads.insert(2, working)
    else:
        chaos.start()  # the simulator and the worker processes
        monkey = threading.Thread(target=chaos.run, args=(chaos_stop,), daemon=True)
        threads.insert(2, monkey)
    for thread in threads:
        thread.start()
    tty = sys.stdout.isatty()
    started = time.monotonic()
    try:
        while not stop.stopped:
            elapsed = time.monotonic() - started
            if args.duration is not None and elapsed >= args.duration:
                break
            if tty:
                view = _view(outbox, client, relay, counter, counts, store, elapsed)
                if chaos is not None:
                    view += "\n" + "\n".join(chaos.view(counter[0]))
                sys.stdout.write("\x1b[H\x1b[2J" + view + "\n")
            else:
                # Not a terminal (a pipe, a log file): one line per interval, never the whole
                # screen again (issue 26: 367 KB in 8 minutes).
                sys.stdout.write(
                    _line(outbox, relay, counter, counts, store, elapsed, chaos) + "\n"
                )
            sys.stdout.flush()
            pause = 0.5 if tty else NON_TTY_INTERVAL
            if args.duration is not None:
                pause = min(pause, max(0.05, args.duration - elapsed))
            stop.wait(pause)
    finally:
        writer_stop.set()
        if chaos is None or chaos.kills or stop.stopped:
            chaos_stop.set()  # no more kills: the workers finish what is left
        # (else the kills go on while the workers catch up, until the first one: a short run
        # on a slow machine, its workers slow to start, shows one all the same)
        writer.join(timeout=10)
        # Let the relay drain what was committed, then stop it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and status(outbox.engine, outbox.schema)["pending"]:
            time.sleep(0.1)
        relay_stop.set()
        relayer.join(timeout=10)
        # Then the consumer and the worker(s) catch up with what was published.
        if chaos is None:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and store.counts()["DONE"] < counter[0]:
                time.sleep(0.1)
        else:
            # Every quote of this run has its receipt ACCEPTED and its job DONE (the jobs of a
            # killed worker wait for their lease and their call's deadline first, then are
            # reconciled; a worker killed between the receipt and the job's last step leaves
            # an ACCEPTED receipt whose job another worker finishes after the lease).
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                if chaos.kills or stop.stopped:
                    chaos_stop.set()
                chaos.keep_alive()
                if (
                    chaos.report()["accepted"] >= counter[0]
                    and store.counts()["DONE"] >= counter[0]
                ):
                    break
                time.sleep(0.2)
            chaos_stop.set()
            if monkey is not None:
                monkey.join(timeout=10)
            chaos.stop_workers()
        consumer_stop.set()
        worker.stop()
        reader.join(timeout=10)
        for thread in threads:
            thread.join(timeout=10)
    report = status(outbox.engine, outbox.schema)
    jobs_by_state = store.counts()
    print(
        f"stopped: {counter[0]} quotes approved (+{counter[1]} duplicate events), "
        f"{relay.stats.published} events published, {report['pending']} pending, "
        f"{report['quarantined']} quarantined; stream outbox.quote.approved has "
        f"{client.length()} entries; consumer handled {counts.handled}, "
        f"skipped {counts.duplicates} duplicates; {jobs_by_state['DONE']} quotes sent, one job each"
    )
    if chaos is not None:
        r = chaos.report()
        print(
            f"chaos: {counter[0]} quotes approved, {r['emails']} emails sent, "
            f"{r['duplicates']} duplicate effects, {r['kills']} workers killed "
            f"({r['kills_in_flight']} mid-send); receipts {r['accepted']} ACCEPTED, "
            f"{r['unknown']} UNKNOWN, {r['pending']} PENDING"
        )
    return 0
