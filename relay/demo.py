"""``outbox-relay demo``: quotes approved in transactions, each emitting an event, while a
relay publishes them to a Redis Stream; a live view of what happens.

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

from outbox.core import Outbox
from outbox.runtime import GracefulStop, redis_client, setup_logging
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
            with outbox.transaction() as tx:
                tx.session.execute(
                    text(
                        "INSERT INTO demo_quotes (id, tenant, total, state) "
                        "VALUES (:id, :tenant, :total, 'approved')"
                    ),
                    {"id": quote_id, "tenant": tenant, "total": total},
                )
                tx.emit(
                    "quote.approved",
                    key=f"quote-{quote_id:05d}",
                    payload={"quote": quote_id, "total": total, "currency": "EUR"},
                    tenant=tenant,
                    identity=f"{tenant}:send-quote-{quote_id}",
                )
            counter[0] += 1
        except Exception as exc:  # keep the demo going; show the problem
            print(f"\nwriter: {type(exc).__name__}: {exc}", file=sys.stderr)
            stop.wait(1.0)
        next_at += interval
        stop.wait(max(0.0, next_at - time.monotonic()))


def _view(outbox: Outbox, client: Any, relay: Relay, written: int, elapsed: float) -> str:
    report = status(outbox.engine, outbox.schema)
    stream = "outbox.quote.approved"
    try:
        length = client.xlen(stream)
        sample = client.xrevrange(stream, count=3)
    except Exception as exc:
        length, sample = -1, []
        print(f"redis: {exc}", file=sys.stderr)
    lines = [
        f"outbox demo  {elapsed:6.1f}s   (Ctrl-C to stop)",
        f"  written (committed quotes):  {written}",
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
    return "\n".join(lines)


def run_demo(args: argparse.Namespace) -> int:
    setup_logging("warning")
    outbox = Outbox(args.database_url, table=args.table, schema=args.schema)
    start_id = _setup_domain(outbox)
    client = redis_client(args.redis_url)
    client.ping()
    if args.rate <= 0:
        print("outbox-relay demo: --rate must be positive", file=sys.stderr)
        return 2
    publisher = RedisStreamPublisher(client, STREAM)
    relay = Relay(outbox, publisher, RelayConfig(poll_interval=0.02, max_poll_interval=0.2))
    stop = GracefulStop().install()
    writer_stop = threading.Event()
    relay_stop = threading.Event()
    counter = [0]
    writer = threading.Thread(
        target=_writer, args=(outbox, args.rate, start_id, writer_stop, counter), daemon=True
    )
    relayer = threading.Thread(target=relay.run, args=(relay_stop,), daemon=True)
    relayer.start()
    writer.start()
    tty = sys.stdout.isatty()
    started = time.monotonic()
    try:
        while not stop.stopped:
            elapsed = time.monotonic() - started
            if args.duration is not None and elapsed >= args.duration:
                break
            view = _view(outbox, client, relay, counter[0], elapsed)
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
    report = status(outbox.engine, outbox.schema)
    print(
        f"stopped: {counter[0]} quotes approved, {relay.stats.published} events published, "
        f"{report['pending']} pending, {report['quarantined']} quarantined; "
        f"stream outbox.quote.approved has {client.xlen('outbox.quote.approved')} entries"
    )
    logging.shutdown()
    return 0
