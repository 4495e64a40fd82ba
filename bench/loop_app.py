"""The application of the whole-loop harness (``bench.loop``): writers, a consumer, a worker.

Each part runs as its own process, started by ``bench.loop.Loop``:

- ``python -m bench.loop_app write``: a writer. It approves quotes at ``--rate`` per second:
  one domain transaction per quote, ``UPDATE loop_quotes SET state = 'approved'`` plus
  ``tx.emit("quote.approved", identity="quote-N")``. A fraction (``--rollback``, 10 %) raises
  after the emit, so the transaction rolls back (the quote stays ``draft`` and must never
  reach the provider); a fraction (``--duplicates``) emits the event twice, one identity
  (one job, one effect). ``--poison`` mixes in records that can never succeed (see below).
  The database is the book of record: a quote is committed iff its row says ``approved``.
- ``outbox-consumer run bench.loop_app:consumer``: a consumer group ``billing`` whose batch
  handler creates one ``send-quote-N`` job per event with ``store.enqueue_many`` in the
  batch's transaction (the inbox deduplicates by identity, the job store by action).
- ``outbox-worker run bench.loop_app:worker``: a worker whose ``send-quote`` handler
  dispatches through ``HttpProvider`` to the provider at ``$LOOP_PROVIDER_URL`` (the connector
  simulator, ``outbox-simulator serve``), lookup and idempotency key on.

Poison records (``--poison P``: each approval also writes one with probability P):

- ``relay``: an event of topic ``poison.route``, whose stream key the harness made a plain
  Redis string: XADD answers WRONGTYPE, the relay must quarantine it and go on;
- ``handler``: a ``quote.approved`` event whose payload says ``poison``: the consumer's
  handler raises for it every time, it must be dead-lettered after ``max_deliveries``;
- raw stream entries that cannot be decoded are XADDed by the harness itself (no outbox
  row): the consumer must dead-letter them at decoding.

Settings the processes read from the environment (the harness sets them):
``OUTBOX_DATABASE_URL``, ``OUTBOX_REDIS_URL``, ``LOOP_PROVIDER_URL``,
``LOOP_PROVIDER_TIMEOUT`` (seconds, default 2), ``LOOP_CLAIM_IDLE_MS`` (unset: the
consumer's default), ``LOOP_WORKER_CONCURRENCY`` (default 4), ``LOOP_WORKER_TTL`` /
``LOOP_WORKER_RECOVER`` / ``LOOP_WORKER_POLL`` (unset: the worker's defaults).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text

QUOTES_DDL = (
    "CREATE TABLE IF NOT EXISTS loop_quotes ("
    " id BIGSERIAL PRIMARY KEY,"
    " state VARCHAR(16) NOT NULL DEFAULT 'draft',"
    " tenant VARCHAR(32) NOT NULL DEFAULT 'studio',"
    " approved_at DOUBLE PRECISION)"
)
TENANTS = ("studio", "bakery", "garage")
TOPIC = "quote.approved"
POISON_TOPIC = "poison.route"
ID_BLOCK = 200  # draft quotes created per statement: one round trip per 200 approvals


class _Rollback(Exception):
    """Raised inside a writer's transaction to roll it back on purpose."""


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


# -- writer ------------------------------------------------------------------------------------


def write(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loop_app write")
    parser.add_argument("--database-url", default=os.environ.get("OUTBOX_DATABASE_URL"))
    parser.add_argument("--rate", type=float, required=True, help="approvals per second")
    parser.add_argument("--seconds", type=float, default=None, help="stop after (default: SIGTERM)")
    parser.add_argument("--rollback", type=float, default=0.10)
    parser.add_argument("--duplicates", type=float, default=0.05)
    parser.add_argument("--poison", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if not args.database_url or args.rate <= 0:
        parser.error("--database-url and a positive --rate are required")

    from outbox.core import Outbox

    outbox = Outbox(args.database_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    rng = random.Random(args.seed)
    ids: list[int] = []
    interval = 1.0 / args.rate
    next_at = time.monotonic()
    ended_at = None if args.seconds is None else next_at + args.seconds
    counts = {"committed": 0, "rolled_back": 0, "failed": 0, "duplicates": 0, "poison": 0}
    while not stop.is_set() and (ended_at is None or time.monotonic() < ended_at):
        try:
            if not ids:
                with outbox.engine.begin() as conn:
                    ids = [
                        int(r[0])
                        for r in conn.execute(
                            text(
                                "INSERT INTO loop_quotes (state) "
                                "SELECT 'draft' FROM generate_series(1, :n) RETURNING id"
                            ),
                            {"n": ID_BLOCK},
                        )
                    ]
            quote = ids.pop()
            counts[_approve(outbox, quote, rng, args)] += 1
        except Exception as exc:  # the database is down or cut off: wait, go on
            counts["failed"] += 1
            print(f"writer: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)
            stop.wait(0.2)
            next_at = time.monotonic()
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        elif delay < -1.0:
            next_at = time.monotonic()  # fell behind by a second: do not burst to catch up
    outbox.engine.dispose()
    print("writer: " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    return 0


def _approve(outbox: Any, quote: int, rng: random.Random, args: argparse.Namespace) -> str:
    """One domain transaction: approve the quote and emit its event (or roll back)."""
    tenant = TENANTS[quote % len(TENANTS)]
    identity = f"quote-{quote}"
    roll_back = rng.random() < args.rollback
    duplicate = rng.random() < args.duplicates
    poison = rng.random() < args.poison
    try:
        with outbox.transaction() as tx:
            tx.session.execute(
                text(
                    "UPDATE loop_quotes SET state = 'approved', tenant = :tenant, "
                    "approved_at = extract(epoch from clock_timestamp()) WHERE id = :id"
                ),
                {"id": quote, "tenant": tenant},
            )
            payload = {"quote": quote, "t": time.time()}
            tx.emit(TOPIC, key=identity, payload=payload, tenant=tenant, identity=identity)
            if duplicate:  # a retrying client: a second event, the same business identity
                tx.emit(TOPIC, key=identity, payload=payload, tenant=tenant, identity=identity)
            if poison:
                if rng.random() < 0.5:
                    tx.emit(POISON_TOPIC, key=identity, payload={"quote": quote}, tenant=tenant)
                else:
                    tx.emit(
                        TOPIC,
                        key=f"poison-{quote}",
                        payload={"quote": quote, "poison": True},
                        tenant=tenant,
                        identity=f"poison-{quote}",
                    )
            if roll_back:
                raise _Rollback
    except _Rollback:
        return "rolled_back"
    if poison:
        return "poison"
    return "duplicates" if duplicate else "committed"


# -- consumer ----------------------------------------------------------------------------------


def consumer() -> Any:
    """The ``billing`` consumer: one job per quote, created in the batch's transaction."""
    from consumer.consumer import Consumer, ConsumerConfig, ConsumerTx
    from consumer.event import ConsumedEvent
    from consumer.jobs.store import Store

    options: dict[str, Any] = {"batch_size": 200, "block_ms": 1000}
    claim_idle = os.environ.get("LOOP_CLAIM_IDLE_MS")
    if claim_idle:
        options["claim_idle_ms"] = int(claim_idle)
    built = Consumer(group="billing", topics=[TOPIC], config=ConsumerConfig(**options))
    store = Store(os.environ["OUTBOX_DATABASE_URL"])

    @built.handler(TOPIC, batch=True)
    def on_quotes(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        for event in events:
            if isinstance(event.data, dict) and event.data.get("poison"):
                raise ValueError(f"poison record {event.identity}: this handler always fails")
        store.enqueue_many(
            [
                {
                    "tenant": event.tenant or "-",
                    "action": f"send-quote-{event.data['quote']}",
                    "subject": event.subject,
                    "payload": event.data,
                }
                for event in events
            ],
            session=tx.session,
        )

    return built


# -- worker ------------------------------------------------------------------------------------


def worker() -> Any:
    """Workers sending each quote through the HTTP provider, one operation intent each."""
    from consumer.jobs.http import HttpProvider
    from consumer.jobs.worker import JobContext, Worker

    url = os.environ["LOOP_PROVIDER_URL"].rstrip("/")
    provider = HttpProvider(
        "mail",
        f"{url}/send",
        lookup_url=f"{url}/lookup/{{operation_id}}",
        timeout=float(os.environ.get("LOOP_PROVIDER_TIMEOUT", "2")),
        # Which process made each effect: the chaos harness kills that one.
        headers={"X-Loop-Worker": str(os.getpid())},
    )
    # The worker's defaults (slots, issue 21) unless the run asks otherwise.
    options: dict[str, Any] = {}
    if os.environ.get("LOOP_WORKER_CONCURRENCY"):
        options["concurrency"] = int(os.environ["LOOP_WORKER_CONCURRENCY"])
    for name, key in (
        ("ttl", "LOOP_WORKER_TTL"),
        ("recover_interval", "LOOP_WORKER_RECOVER"),
        ("poll_interval", "LOOP_WORKER_POLL"),
        ("reconcile_interval", "LOOP_WORKER_RECONCILE"),
    ):
        value = _env_float(key)
        if value is not None:
            options[name] = value
    if os.environ.get("LOOP_PROVIDER") == "blocking":
        return _blocking_worker(url, options)
    built = Worker(providers={"mail": provider}, **options)

    @built.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        data = job.payload or {}
        job.dispatch("send", "mail", {"quote": data.get("quote"), "t": data.get("t")})

    return built


def _blocking_worker(url: str, options: dict[str, Any]) -> Any:
    """``LOOP_PROVIDER=blocking``: the user's path of issue 37, as the docs show it: a
    provider of their own around a blocking client (``tests.blocking_app.PostMail``: urllib,
    a new connection per call), an ``Operations`` built apart from the worker, a ``def``
    handler; the worker has no providers of its own."""
    from consumer import Operations, Store
    from consumer.jobs.worker import JobContext, Worker
    from tests.blocking_app import PostMail

    store = Store(os.environ["OUTBOX_DATABASE_URL"])
    mail = PostMail(url, timeout=float(os.environ.get("LOOP_PROVIDER_TIMEOUT", "2")))
    operations = Operations(store, {"postmail": mail})
    built = Worker(store, **options)

    @built.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        data = job.payload or {}
        request = {"quote": data.get("quote"), "t": data.get("t")}
        operations.dispatch(job, "send", "postmail", request)

    return built


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] != "write":
        print("usage: python -m bench.loop_app write --rate R [...]", file=sys.stderr)
        return 2
    return write(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
