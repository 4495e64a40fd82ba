"""Writer-side figures for the outbox, on PostgreSQL: every way in against a hand-written
INSERT of the same row on the same path (issues 2, 10 and 14).

Each domain transaction updates one row and writes its event(s). For each path the
baseline is the same transaction with a hand-written ``INSERT`` of the same row (the same
event id, key hash, JSON payload) through ``text()``, as a user would write it:

- ``session``   ``with outbox.transaction() as tx: tx.emit(...)``   vs Session + INSERT
- ``decorator`` ``@outbox.transactional``                          vs Session + INSERT
- ``connection`` ``with engine.begin() as c: outbox.emit(c, ...)``  vs Connection + INSERT
- ``emit_many`` ``tx.emit_many`` of 10 events                       vs Session + executemany

Ways are run in alternating short rounds so that drift hits all alike; each figure is the
median of the rounds, the ratio is time per transaction of the way / of its baseline (target:
at most 1.05). It runs at 1 and 16 threads, on the schema ``create_schema()`` makes by
default (with the NOTIFY trigger) and with ``notify=False``.

``--async`` measures AsyncOutbox instead: one event loop, 16 concurrent tasks, a bare
transaction, one ``tx.emit``, and a hand-written async INSERT on the same AsyncSession path.

    python -m bench outbox_write [--threads 1,16] [--notify both|on|off] [--seconds S]
    python -m bench outbox_write --async [--tasks 16]
    python -m bench outbox_write --throughput     # events/s of 4 writers, 1 and 100 per tx
    python -m bench outbox_write --minimal --notify default --threads 1,8
                      # the default writer against a minimal hand-written outbox (issue 25)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from bench.procstat import local_postmaster, postgres_cpu
from outbox import AsyncOutbox, Outbox, make_engine
from outbox.aio import make_async_engine
from outbox.event import key_hash
from outbox.ids import new_event_id

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
UPDATE = sa.text("UPDATE bench_quotes SET version = version + 1 WHERE id = :id")
HAND_INSERT = sa.text(
    "INSERT INTO outbox_events (event_id, topic, key, key_hash, tenant, identity, payload, "
    "headers) VALUES (:event_id, :topic, :key, :key_hash, :tenant, :identity, "
    "CAST(:payload AS jsonb), CAST(:headers AS jsonb))"
)
PAYLOAD_PAD = "x" * 200

# The minimal hand-written outbox a user might write instead of ours (issue 25): an identity
# key, topic, key, a jsonb payload, created_at, published_at and one partial index on the
# pending rows, no trigger. ``--minimal`` compares our writer against an INSERT into it, on
# the same transaction path.
MINIMAL_DDL = (
    "CREATE TABLE bench_minimal_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
    "topic text NOT NULL, key text NOT NULL, payload jsonb NOT NULL, "
    "created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz)",
    "CREATE INDEX bench_minimal_pending ON bench_minimal_outbox (id) WHERE published_at IS NULL",
)
MINIMAL_INSERT = sa.text(
    "INSERT INTO bench_minimal_outbox (topic, key, payload) "
    "VALUES (:topic, :key, CAST(:payload AS jsonb))"
)


def minimal_row(i: int, key: str) -> dict[str, Any]:
    payload = json.dumps({"total": i, "n": PAYLOAD_PAD})
    return {"topic": "quote.approved", "key": key, "payload": payload}


def hand_row(i: int, key: str) -> dict[str, Any]:
    """The row a hand-written INSERT writes: what emit writes, built by hand."""
    event_id = new_event_id()
    return {
        "event_id": event_id,
        "topic": "quote.approved",
        "key": key,
        "key_hash": key_hash(key),
        "tenant": None,
        "identity": event_id,
        "payload": json.dumps({"total": i, "n": PAYLOAD_PAD}),
        "headers": None,
    }


def _setup(url: str, notify: bool | None) -> tuple[str, str, sa.Engine]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    schema_url = f"{url}?options=-csearch_path%3D{schema}"
    box = Outbox(schema_url)
    box.create_schema(notify=notify)
    with box.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE bench_quotes (id INTEGER PRIMARY KEY, version INTEGER)"))
        conn.execute(sa.text("INSERT INTO bench_quotes SELECT g, 0 FROM generate_series(0, 63) g"))
        for ddl in MINIMAL_DDL:
            conn.execute(sa.text(ddl))
    box.engine.dispose()
    return schema_url, schema, admin


def _drop(admin: sa.Engine, schema: str) -> None:
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


Way = Callable[[int, int], None]  # (thread number, iteration) -> one domain transaction


def sync_ways(box: Outbox) -> dict[str, Way]:
    engine = box.engine

    def bare(n: int, i: int) -> None:
        with Session(engine) as s, s.begin():
            s.execute(UPDATE, {"id": n})

    def session_hand(n: int, i: int) -> None:
        with Session(engine) as s, s.begin():
            s.execute(UPDATE, {"id": n})
            s.execute(HAND_INSERT, hand_row(i, f"quote-{n}"))

    def session_minimal(n: int, i: int) -> None:
        with Session(engine) as s, s.begin():
            s.execute(UPDATE, {"id": n})
            s.execute(MINIMAL_INSERT, minimal_row(i, f"quote-{n}"))

    def connection_minimal(n: int, i: int) -> None:
        with engine.begin() as c:
            c.execute(UPDATE, {"id": n})
            c.execute(MINIMAL_INSERT, minimal_row(i, f"quote-{n}"))

    def session_emit(n: int, i: int) -> None:
        with box.transaction() as tx:
            tx.session.execute(UPDATE, {"id": n})
            tx.emit("quote.approved", key=f"quote-{n}", payload={"total": i, "n": PAYLOAD_PAD})

    @box.transactional
    def decorated(tx: Any, n: int, i: int) -> None:
        tx.session.execute(UPDATE, {"id": n})
        tx.emit("quote.approved", key=f"quote-{n}", payload={"total": i, "n": PAYLOAD_PAD})

    def connection_bare(n: int, i: int) -> None:
        with engine.begin() as c:
            c.execute(UPDATE, {"id": n})

    def connection_hand(n: int, i: int) -> None:
        with engine.begin() as c:
            c.execute(UPDATE, {"id": n})
            c.execute(HAND_INSERT, hand_row(i, f"quote-{n}"))

    def connection_emit(n: int, i: int) -> None:
        with engine.begin() as c:
            c.execute(UPDATE, {"id": n})
            box.emit(c, "quote.approved", key=f"quote-{n}", payload={"total": i, "n": PAYLOAD_PAD})

    def many_hand(n: int, i: int) -> None:
        with Session(engine) as s, s.begin():
            s.execute(UPDATE, {"id": n})
            s.execute(HAND_INSERT, [hand_row(i + j, f"quote-{n}") for j in range(10)])

    def many_emit(n: int, i: int) -> None:
        with box.transaction() as tx:
            tx.session.execute(UPDATE, {"id": n})
            tx.emit_many(
                [
                    {
                        "topic": "quote.approved",
                        "key": f"quote-{n}",
                        "payload": {"total": i + j, "n": PAYLOAD_PAD},
                    }
                    for j in range(10)
                ]
            )

    return {
        "session bare": bare,
        "session + hand INSERT": session_hand,
        "session (transaction)": session_emit,
        "decorator": decorated,
        "connection bare": connection_bare,
        "connection + hand INSERT": connection_hand,
        "connection (emit)": connection_emit,
        "session + hand executemany x10": many_hand,
        "emit_many x10": many_emit,
        "session + minimal INSERT": session_minimal,
        "connection + minimal INSERT": connection_minimal,
    }


MINIMAL_WAYS = (
    "session + minimal INSERT",
    "session (transaction)",
    "connection + minimal INSERT",
    "connection + hand INSERT",
    "connection (emit)",
)
MINIMAL_COMPARISONS = [
    ("session (transaction)", "session + minimal INSERT"),
    ("connection (emit)", "connection + minimal INSERT"),
]
# Where the connection path's gap lies: the table (a hand-written INSERT of our row into our
# table against the minimal INSERT) and the writer (emit against that same hand INSERT).
MINIMAL_SPLIT = [
    ("table", "connection + hand INSERT", "connection + minimal INSERT"),
    ("writer", "connection (emit)", "connection + hand INSERT"),
]


# (way, its hand-written baseline)
COMPARISONS = [
    ("session (transaction)", "session + hand INSERT"),
    ("decorator", "session + hand INSERT"),
    ("connection (emit)", "connection + hand INSERT"),
    ("emit_many x10", "session + hand executemany x10"),
]


def run_round(
    way: Way, threads: int, seconds: float, per_round: int, postmaster: int | None = None
) -> tuple[float, float, float]:
    """Transactions per second of ``way``, and this process's and (when it runs here,
    ``postmaster``) PostgreSQL's CPU seconds per transaction: one thread runs ``per_round``
    transactions; several run for ``seconds``."""
    cpu = time.process_time()
    server = postgres_cpu(postmaster) if postmaster else 0.0

    def per_tx(count: int) -> tuple[float, float]:
        used = (postgres_cpu(postmaster) - server) if postmaster else 0.0
        return (time.process_time() - cpu) / count, used / count

    if threads == 1:
        start = time.perf_counter()
        for i in range(per_round):
            way(0, i)
        elapsed = time.perf_counter() - start
        return (per_round / elapsed, *per_tx(per_round))
    stop = threading.Event()
    counts = [0] * threads

    def loop(n: int) -> None:
        i = 0
        while not stop.is_set():
            way(n, i)
            i += 1
        counts[n] = i

    pool = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in pool:
        thread.join()
    total = max(1, sum(counts))
    return (total / (time.perf_counter() - start), *per_tx(total))


@dataclass
class Figures:
    """Per way: the median tx/s, and the median client and server (PostgreSQL, when it runs
    on this machine; else 0) CPU microseconds per transaction; ``samples`` holds each
    round's tx/s."""

    rates: dict[str, float]
    cpus: dict[str, float]
    servers: dict[str, float]
    samples: dict[str, list[float]]


def measure(
    ways: dict[str, Way],
    threads: int,
    rounds: int,
    seconds: float,
    per_round: int,
    postmaster: int | None = None,
) -> Figures:
    """The ways run in turn, in reverse order every other round (so that no way always
    follows the same one)."""
    for way in ways.values():  # warm up pools, prepared statements, plan caches
        run_round(way, 1, 0, 30)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    cpus: dict[str, list[float]] = {name: [] for name in ways}
    servers: dict[str, list[float]] = {name: [] for name in ways}
    for n in range(rounds):
        order = list(ways.items())
        for name, way in reversed(order) if n % 2 else order:
            rate, cpu, server = run_round(way, threads, seconds, per_round, postmaster)
            rates[name].append(rate)
            cpus[name].append(cpu * 1e6)
            servers[name].append(server * 1e6)

    def medians(values: dict[str, list[float]]) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in values.items()}

    return Figures(medians(rates), medians(cpus), medians(servers), rates)


def print_minimal_table(title: str, figures: Figures) -> None:
    """``--minimal``: our writer against the minimal hand-written outbox (target <= 1.10).
    Three figures per pair: the ratio of the two medians; the median of the rounds' own
    ratios (a way and its baseline run side by side in each round, so the machine's drift
    between rounds cancels out), with the rounds' range; and the ratio of the CPU each
    transaction costs, client and PostgreSQL together, which the machine's scheduling moves
    least (with 8 threads on 2 cores the time per transaction is that CPU, shared out)."""
    print(title)
    rates, cpus, servers, samples = figures.rates, figures.cpus, figures.servers, figures.samples
    for name, rate in rates.items():
        server = f"   server CPU {servers[name]:6.0f} us/tx" if servers[name] else ""
        print(f"  {name:34s} {rate:8.0f} tx/s   client CPU {cpus[name]:6.0f} us/tx{server}")

    def paired(way: str, base: str) -> list[float]:
        return [b / w for b, w in zip(samples[base], samples[way], strict=True)]

    for way, base in MINIMAL_COMPARISONS:
        pairs = paired(way, base)
        both = (cpus[way] + servers[way]) / (cpus[base] + servers[base])
        print(
            f"  ratio {way:24s} / {base:30s} {rates[base] / rates[way]:5.3f}  "
            f"paired {statistics.median(pairs):5.3f} ({min(pairs):.2f}-{max(pairs):.2f})"
            f"  CPU {both:5.3f}  (target <= 1.10)"
        )
    for part, way, base in MINIMAL_SPLIT:
        print(
            f"  split: the {part:6s} {way:24s} / {base:30s} {rates[base] / rates[way]:5.3f}  "
            f"paired {statistics.median(paired(way, base)):5.3f}"
        )


def print_table(title: str, rates: dict[str, float], cpus: dict[str, float]) -> None:
    """tx/s is what the issue asks for; the client CPU per transaction (this process, all
    threads) is the steadier figure on a busy machine: the server's share is the same for a
    way and its baseline, the Python we run is what differs."""
    print(title)
    for name, rate in rates.items():
        print(f"  {name:34s} {rate:8.0f} tx/s   client CPU {cpus[name]:6.0f} us/tx")
    for way, base in COMPARISONS:
        ratio = rates[base] / rates[way]
        print(
            f"  ratio {way:28s} / {base:32s} {ratio:5.3f}  (target <= 1.05)   "
            f"CPU {cpus[way] / cpus[base]:5.3f}"
        )
    print(
        f"  hand INSERT cost over a bare session transaction: "
        f"{rates['session bare'] / rates['session + hand INSERT']:5.3f}"
    )


def sync_bench(args: argparse.Namespace) -> None:
    modes: list[bool | None] = {
        "both": [True, False],
        "on": [True],
        "off": [False],
        "default": [None],
    }[args.notify]
    threads_list = [int(t) for t in args.threads.split(",")]
    for notify in modes:
        url, schema, admin = _setup(args.database_url, notify)
        box = Outbox(make_engine(url, pool_size=max(threads_list) + 2))
        postmaster = local_postmaster(admin)
        try:
            for threads in threads_list:
                ways = sync_ways(box)
                if args.minimal:
                    ways = {name: ways[name] for name in MINIMAL_WAYS}
                figures = measure(
                    ways, threads, args.rounds, args.seconds, args.per_round, postmaster
                )
                label = {True: "with NOTIFY trigger", False: "notify=False"}.get(
                    notify, "default schema"
                )
                title = f"{threads} thread(s), {label}:"
                if args.minimal:
                    print_minimal_table(title, figures)
                else:
                    print_table(title, figures.rates, figures.cpus)
                sys.stdout.flush()
        finally:
            box.engine.dispose()
            _drop(admin, schema)


async def async_rates(
    url: str, tasks: int, rounds: int, seconds: float
) -> tuple[dict[str, float], dict[str, float]]:
    box = AsyncOutbox(make_async_engine(url, pool_size=tasks + 2))

    async def bare(n: int, i: int) -> None:
        async with AsyncSession(box.engine) as s, s.begin():
            await s.execute(UPDATE, {"id": n})

    async def hand(n: int, i: int) -> None:
        async with AsyncSession(box.engine) as s, s.begin():
            await s.execute(UPDATE, {"id": n})
            await s.execute(HAND_INSERT, hand_row(i, f"quote-{n}"))

    async def emit(n: int, i: int) -> None:
        async with box.transaction() as tx:
            await tx.session.execute(UPDATE, {"id": n})
            tx.emit("quote.approved", key=f"quote-{n}", payload={"total": i, "n": PAYLOAD_PAD})

    async def connection_hand(n: int, i: int) -> None:
        async with box.engine.begin() as c:
            await c.execute(UPDATE, {"id": n})
            await c.execute(HAND_INSERT, hand_row(i, f"quote-{n}"))

    async def connection_emit(n: int, i: int) -> None:
        async with box.engine.begin() as c:
            await c.execute(UPDATE, {"id": n})
            await box.emit(
                c, "quote.approved", key=f"quote-{n}", payload={"total": i, "n": PAYLOAD_PAD}
            )

    ways = {
        "async session bare": bare,
        "async session + hand INSERT": hand,
        "async transaction + emit": emit,
        "async connection + hand INSERT": connection_hand,
        "async connection (emit)": connection_emit,
    }

    async def run(way: Any, duration: float) -> tuple[float, float]:
        count = 0
        deadline = time.perf_counter() + duration
        cpu = time.process_time()

        async def task(n: int) -> None:
            nonlocal count
            i = 0
            while time.perf_counter() < deadline:
                await way(n, i)
                i += 1
                count += 1

        start = time.perf_counter()
        await asyncio.gather(*(task(n) for n in range(tasks)))
        total = max(1, count)
        return total / (time.perf_counter() - start), (time.process_time() - cpu) / total

    for way in ways.values():
        await run(way, 0.3)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    cpus: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            rate, cpu = await run(way, seconds)
            rates[name].append(rate)
            cpus[name].append(cpu * 1e6)
    await box.dispose()
    return (
        {name: statistics.median(values) for name, values in rates.items()},
        {name: statistics.median(values) for name, values in cpus.items()},
    )


def async_bench(args: argparse.Namespace) -> None:
    modes: list[bool | None] = {
        "both": [True, False],
        "on": [True],
        "off": [False],
        "default": [None],
    }[args.notify]
    for notify in modes:
        url, schema, admin = _setup(args.database_url, notify)
        try:
            rates, cpus = asyncio.run(async_rates(url, args.tasks, args.rounds, args.seconds))
        finally:
            _drop(admin, schema)
        label = "with NOTIFY trigger" if notify else "notify=False"
        print(f"AsyncOutbox, one event loop, {args.tasks} concurrent tasks, {label}:")
        for name, rate in rates.items():
            print(f"  {name:34s} {rate:8.0f} tx/s   client CPU {cpus[name]:6.0f} us/tx")
        for way, base in [
            ("async transaction + emit", "async session + hand INSERT"),
            ("async connection (emit)", "async connection + hand INSERT"),
            ("async transaction + emit", "async session bare"),
        ]:
            print(
                f"  ratio {way:28s} / {base:32s} {rates[base] / rates[way]:5.3f}   "
                f"CPU {cpus[way] / cpus[base]:5.3f}"
            )


def throughput(box: Outbox, threads: int, seconds: float, batch: int) -> float:
    stop = threading.Event()
    counts = [0] * threads

    def run(n: int) -> None:
        i = 0
        while not stop.is_set():
            with box.transaction() as tx:
                tx.session.execute(UPDATE, {"id": n})
                tx.emit_many(
                    [
                        {"topic": "quote.approved", "key": f"quote-{n}", "payload": {"i": i + j}}
                        for j in range(batch)
                    ]
                )
            counts[n] += batch
            i += batch

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    start = time.perf_counter()
    for thread in pool:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in pool:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def throughput_bench(args: argparse.Namespace) -> None:
    url, schema, admin = _setup(args.database_url, True)
    box = Outbox(url)
    try:
        single = throughput(box, 4, args.seconds, 1)
        batched = throughput(box, 4, args.seconds, 100)
        print("events written per second, 4 writer threads:")
        print(f"  one event per transaction : {single:9.0f} events/s")
        print(f"  100 events per transaction: {batched:9.0f} events/s ({batched / single:.1f}x)")
    finally:
        box.engine.dispose()
        _drop(admin, schema)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench outbox_write",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--async", dest="use_async", action="store_true")
    parser.add_argument("--throughput", action="store_true")
    parser.add_argument("--threads", default="1,16", help="thread counts (default 1,16)")
    parser.add_argument("--tasks", type=int, default=16, help="async tasks (default 16)")
    parser.add_argument("--notify", choices=["both", "on", "off", "default"], default="both")
    parser.add_argument(
        "--minimal",
        action="store_true",
        help="against the minimal hand-written outbox (issue 25) instead of the same table",
    )
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument(
        "--per-round", type=int, default=150, help="transactions per round (1 thread)"
    )
    parser.add_argument("--seconds", type=float, default=1.5, help="round length (threads/tasks)")
    args = parser.parse_args(argv)
    if args.use_async:
        async_bench(args)
    elif args.throughput:
        throughput_bench(args)
    else:
        sync_bench(args)
    return 0
