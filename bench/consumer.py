"""Consumer throughput: messages/s through one consumer with inbox dedup and one job insert
per message, on PostgreSQL, in batches, beside a per-message-transaction baseline.

``python -m bench consumer [--messages 20000] [--baseline-messages 2000] [--batch-size 500]
[--rounds 3]``

Every mode reads the same stream with its own consumer group (so each reads every entry),
records each identity in the inbox and inserts one job row per new identity:

- ``per-message``: our Consumer with ``batch_size=1``: one transaction (and one XREADGROUP,
  XAUTOCLAIM, XACK) per message. The baseline.
- ``batched``: batches of ``--batch-size``, one transaction each, a plain handler issuing
  one INSERT per message (a round trip per message).
- ``batched+batch-handler``: the same with ``handler(..., batch=True)`` and
  ``tx.insert_many``: one statement for the batch's jobs. This is the figure the issue's
  target (>= 20,000/s for one process) refers to.
- ``batched+store-many``: a batch handler creating real jobs in the job store with
  ``Store.enqueue_many(..., session=tx.session)``: one statement per batch.
- ``batched+store``: the natural handler: a plain per-event handler calling
  ``Store.enqueue(..., session=tx.session)``. The consumer marks its batch session for
  deferred writes (``consumer.bulk``) and the Store buffers there, so a batch's jobs are
  written in one statement at its end; the target is >= 10,000 msgs/s and >= 0.6x
  ``batched+store-many``. These two run in ``--rounds`` alternating rounds (each round
  creates new jobs: its own tenant); the figure is the median of each and their ratio.
- ``batched+orm``: a plain handler doing ``tx.session.add(Job(...))`` (ORM objects, flushed
  together at the end of the handlers: insertmanyvalues).

Then ``read latency``: one consumer in ``run()`` (``block_ms=1000``) while entries arrive one
by one; XADD -> handler p50/p99/max. A blocking read returns as soon as an entry arrives, so
these stay far below the block time.

Figures are noisy on a shared 2-core machine; the ratios come from the same run, and the
consumer process's CPU per message (steadier when other processes compete for the cores) is
printed beside each rate.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import redis
import sqlalchemy as sa
from sqlalchemy import BigInteger, Column, MetaData, String, Table, insert
from sqlalchemy.orm import registry

from consumer.consumer import Consumer, ConsumerConfig, ConsumerTx
from consumer.event import ConsumedEvent, encode_entry

PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TOPIC = "quote.approved"

md = MetaData()
bench_jobs = Table(
    "bench_jobs",
    md,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("identity", String(200), nullable=False),
    Column("event_id", String(64), nullable=False),
)


class BenchJob:
    """An ORM object for the ``batched+orm`` mode."""

    def __init__(self, identity: str, event_id: str) -> None:
        self.identity = identity
        self.event_id = event_id


registry().map_imperatively(BenchJob, bench_jobs)


def publish(client: redis.Redis, stream: str, count: int) -> None:
    pipe = client.pipeline(transaction=False)
    for n in range(count):
        fields = encode_entry(
            TOPIC,
            {"quote": n, "total": 120, "lines": [1, 2, 3]},
            event_id=uuid.uuid4().hex,
            subject=f"quote-{n}",
            tenant="studio",
            identity=f"studio:send-quote-{n}",
        )
        pipe.xadd(stream, fields)  # type: ignore[arg-type]
        if n % 2000 == 1999:
            pipe.execute()
    pipe.execute()


def measure(
    name: str,
    url: str,
    stream: str,
    count: int,
    batch_size: int,
    register: Callable[[Consumer], None],
) -> float:
    consumer = Consumer(
        url,
        REDIS,
        group=f"bench-{name}",
        streams=[stream],
        config=ConsumerConfig(batch_size=batch_size, block_ms=100),
    )
    register(consumer)
    consumer.create_schema()
    handled = 0
    started = time.perf_counter()
    cpu = time.process_time()
    while handled < count:
        handled += consumer.run_once()
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu
    consumer.engine.dispose()
    rate = handled / elapsed
    print(
        f"  {name:<24} {handled:>7} msgs in {elapsed:6.2f} s  = {rate:9,.0f} msgs/s"
        f"  (consumer CPU {cpu / handled * 1e6:6.1f} us/msg)",
        flush=True,
    )
    return rate


def read_latency(url: str, client: redis.Redis, count: int) -> None:
    """XADD -> handler latency of one consumer in ``run()`` with a 1 s block time."""
    stream = f"bench.consumer.latency.{uuid.uuid4().hex[:8]}"
    consumer = Consumer(
        url,
        REDIS,
        group="bench-latency",
        streams=[stream],
        config=ConsumerConfig(block_ms=1000),
    )
    seen: list[float] = []
    done = threading.Event()

    @consumer.handler(TOPIC)
    def on_event(event: ConsumedEvent, tx: ConsumerTx) -> None:
        seen.append(time.perf_counter() - float(event.data["sent"]))
        if len(seen) >= count:
            done.set()

    consumer.create_schema()
    consumer.run_once(block=False)  # the group exists before the first entry
    runner = threading.Thread(target=consumer.run, args=(threading.Event(),), daemon=True)
    runner.start()
    try:
        for n in range(count):
            time.sleep(0.005)
            fields = encode_entry(
                TOPIC, {"sent": time.perf_counter()}, event_id=f"lat-{n}", identity=f"lat-{n}"
            )
            client.xadd(stream, fields)  # type: ignore[arg-type]
        done.wait(30)
    finally:
        consumer.stop()
        runner.join(5)
        client.delete(stream)
        consumer.engine.dispose()
    ms = sorted(x * 1000 for x in seen)
    if not ms:
        print("read latency: nothing received")
        return
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    print(
        f"read latency (block_ms=1000, {len(ms)} entries one by one): "
        f"p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, max {ms[-1]:.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench consumer", description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--baseline-messages", type=int, default=2_000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--skip-store", action="store_true", help="skip the Store.enqueue mode")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of the two job-store modes"
    )
    parser.add_argument(
        "--latency-messages", type=int, default=300, help="entries of the read-latency probe"
    )
    args = parser.parse_args(argv)
    if min(args.messages, args.baseline_messages, args.batch_size, args.rounds) <= 0:
        parser.error("sizes must be positive")

    schema = f"bench_consumer_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{PG}?options=-csearch_path%3D{schema}"
    client = redis.Redis.from_url(REDIS)
    stream = f"bench.consumer.{uuid.uuid4().hex[:8]}"
    try:
        engine = sa.create_engine(url)
        md.create_all(engine)
        engine.dispose()
        publish(client, stream, args.messages)
        print(
            f"consumer bench: {args.messages} messages (baseline {args.baseline_messages}), "
            f"batch {args.batch_size}, PostgreSQL + Redis on loopback"
        )

        def plain(consumer: Consumer) -> None:
            @consumer.handler(TOPIC)
            def on_event(event: ConsumedEvent, tx: ConsumerTx) -> None:
                tx.session.execute(
                    insert(bench_jobs).values(identity=event.identity, event_id=event.id)
                )

        def batch(consumer: Consumer) -> None:
            @consumer.handler(TOPIC, batch=True)
            def on_events(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
                tx.insert_many(
                    bench_jobs, [{"identity": e.identity, "event_id": e.id} for e in events]
                )

        def store_mode(round_: int) -> Callable[[Consumer], None]:
            def register(consumer: Consumer) -> None:
                from consumer import Store

                store = Store(consumer.engine)
                tenant = f"studio-{round_}"  # each round creates new jobs

                @consumer.handler(TOPIC)
                def on_event(event: ConsumedEvent, tx: ConsumerTx) -> None:
                    store.enqueue(tenant, event.identity, subject=event.subject, session=tx.session)

            return register

        def store_many_mode(round_: int) -> Callable[[Consumer], None]:
            def register(consumer: Consumer) -> None:
                from consumer import Store

                store = Store(consumer.engine)
                tenant = f"studio-many-{round_}"

                @consumer.handler(TOPIC, batch=True)
                def on_events(events: list[ConsumedEvent], tx: ConsumerTx) -> None:
                    store.enqueue_many(
                        [
                            {"tenant": tenant, "action": e.identity, "subject": e.subject}
                            for e in events
                        ],
                        session=tx.session,
                    )

            return register

        rates: dict[str, float] = {}
        rates["per-message"] = measure("per-message", url, stream, args.baseline_messages, 1, plain)
        rates["batched"] = measure("batched", url, stream, args.messages, args.batch_size, plain)
        rates["batched+batch-handler"] = measure(
            "batched+batch-handler", url, stream, args.messages, args.batch_size, batch
        )

        def orm_mode(consumer: Consumer) -> None:
            @consumer.handler(TOPIC)
            def on_event(event: ConsumedEvent, tx: ConsumerTx) -> None:
                tx.session.add(BenchJob(event.identity, event.id))

        # The natural handler against enqueue_many, in alternating rounds (the machine's
        # speed drifts by tens of percent over a minute): the medians and their ratio.
        many_rates: list[float] = []
        store_rates: list[float] = []
        for round_ in range(args.rounds):
            many_rates.append(
                measure(
                    f"batched+store-many#{round_}",
                    url,
                    stream,
                    args.messages,
                    args.batch_size,
                    store_many_mode(round_),
                )
            )
            if not args.skip_store:
                store_rates.append(
                    measure(
                        f"batched+store#{round_}",
                        url,
                        stream,
                        args.messages,
                        args.batch_size,
                        store_mode(round_),
                    )
                )
        rates["batched+store-many"] = statistics.median(many_rates)
        if store_rates:
            rates["batched+store"] = statistics.median(store_rates)
        rates["batched+orm"] = measure(
            "batched+orm", url, stream, args.messages, args.batch_size, orm_mode
        )
        base = rates["per-message"]
        print("ratios against the per-message-transaction baseline:")
        for name, rate in rates.items():
            print(f"  {name:<24} x{rate / base:6.1f}")
        if "batched+store" in rates:
            ratio = rates["batched+store"] / rates["batched+store-many"]
            pairs = ", ".join(f"x{a / b:.2f}" for a, b in zip(store_rates, many_rates, strict=True))
            print(
                f"natural handler (batched+store) / batched+store-many, medians of "
                f"{args.rounds} rounds: {rates['batched+store']:,.0f} / "
                f"{rates['batched+store-many']:,.0f} msgs/s = x{ratio:.2f} (per round: {pairs})"
            )
        read_latency(url, client, args.latency_messages)
    finally:
        client.delete(stream)
        client.close()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
    return 0
