"""The relay on each broker, side by side in one run (issue 40): Redis Streams and NATS
JetStream, alternated so both see the same machine.

``python -m bench brokers`` (~2-3 min):

- **throughput**: preload ``--events`` events into a fresh outbox table and time one
  ``outbox-relay run --broker-url URL`` process emptying it, from its first published row
  to the last (process start-up excluded), counted in the table (``state = 'published'``),
  the same way for every broker; ``--rounds`` rounds, Redis and NATS alternated;
- **commit -> message latency** at ``--rate`` events/s for ``--latency-seconds``: events
  written as an application writes them (``@outbox.transactional``, one event per
  transaction) by ``--writer-processes`` processes of ``--writers`` threads each, on one
  steady schedule (event ``i`` is due at ``start + i / rate``, whatever came before it);
  the relay is ``outbox-relay run --broker-url URL --stream TEMPLATE`` with every other
  option at its default. The latency is the broker's own arrival time (a Redis entry id's
  milliseconds, a JetStream message's timestamp; one machine, one clock) minus the
  writer's clock right after its COMMIT returned; p50/p99 per broker and NATS/Redis, over
  ``--latency-rounds`` rounds with the brokers alternated, with the machine's load
  average (``os.getloadavg()``) beside each figure. ``--rounds 0`` runs the latency only.

Each variant has its own PostgreSQL schema and stream prefix, removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import redis

from bench.relay import (
    DEFAULT_PG,
    DEFAULT_REDIS,
    KEYS,
    TOPICS,
    Place,
    percentile,
    place,
    preload,
    relay_argv,
    relay_processes,
)
from outbox import Outbox
from outbox.db import make_engine

DEFAULT_NATS = os.environ.get("OUTBOX_BENCH_NATS", "nats://127.0.0.1:4222")


def published(where: Place) -> int:
    with psycopg.connect(where.conninfo) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_events WHERE state = 'published'")
        return int(row.fetchone()[0])  # type: ignore[index]


def argv_for(where: Place, url: str, batch: int | None) -> list[str]:
    """``outbox-relay run --broker-url URL`` on ``where``'s schema and streams; ``batch``
    None leaves ``--batch-size`` at the CLI's default."""
    argv = relay_argv(where, url, batch or 1)
    argv[argv.index("--redis-url")] = "--broker-url"
    if batch is None:
        at = argv.index("--batch-size")
        del argv[at : at + 2]
    return argv


def load() -> str:
    return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _write(
    url: str, part: int, parts: int, rate: float, total: int, threads: int, start: float
) -> tuple[dict[str, float], int]:
    """One writer process: events ``part, part + parts, ...`` of the schedule, each committed
    through ``@outbox.transactional`` at its due time (or as soon as a thread is free); the
    event id -> wall-clock time right after COMMIT, and how many began over 10 ms late."""
    outbox = Outbox(make_engine(url, pool_size=threads))

    @outbox.transactional
    def order_placed(tx: Any, i: int) -> str:
        return tx.emit(
            TOPICS[i % len(TOPICS)],
            key=f"key-{i % KEYS}",
            payload={"n": i, "pad": "p" * 120},
            tenant="bench",
        )

    committed: dict[str, float] = {}
    late = [0]
    lock = threading.Lock()
    mine = iter(range(part, total, parts))

    def run() -> None:
        while True:
            with lock:
                i = next(mine, None)
            if i is None:
                return
            due = start + i / rate
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            elif wait < -0.01:
                with lock:
                    late[0] += 1
            event_id = order_placed(i)
            at = time.time()
            with lock:
                committed[event_id] = at

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    outbox.engine.dispose()
    return committed, late[0]


def offer(args: argparse.Namespace, where: Place) -> tuple[dict[str, float], int, float]:
    """Commit ``--rate`` events/s for ``--latency-seconds`` from ``--writer-processes``
    processes on one schedule: event id -> commit time, the count that began late, and the
    rate achieved (events over the time from the first due time to the last commit)."""
    parts = args.writer_processes
    total = int(args.rate * args.latency_seconds)
    start = time.time() + 2.0  # the processes' start-up is before the schedule
    committed: dict[str, float] = {}
    late = 0
    with ProcessPoolExecutor(parts) as pool:
        futures = [
            pool.submit(_write, where.url, p, parts, args.rate, total, args.writers, start)
            for p in range(parts)
        ]
        for future in futures:
            got, behind = future.result()
            committed.update(got)
            late += behind
    achieved = len(committed) / max(1e-9, max(committed.values()) - start)
    return committed, late, achieved


@contextmanager
def broker_place(
    args: argparse.Namespace, r: redis.Redis, kind: str, label: str
) -> Iterator[Place]:
    with place(args.database_url, r, label) as where:
        try:
            yield where
        finally:
            if kind == "nats":
                _nats(args.nats_url, _delete_streams(where.prefix))


def _nats(url: str, step: Any) -> Any:
    import nats

    async def run() -> Any:
        nc = await nats.connect(url)
        try:
            return await step(nc.jetstream(timeout=30))
        finally:
            await nc.close()

    return asyncio.run(run())


def _delete_streams(prefix: str) -> Any:
    async def delete(js: Any) -> None:
        for info in await js.streams_info():
            if info.config.name.startswith(prefix):
                await js.delete_stream(info.config.name)

    return delete


def time_drain(args: argparse.Namespace, r: redis.Redis, kind: str, url: str) -> float:
    n = args.events
    with broker_place(args, r, kind, f"thr{kind}") as where:
        preload(where, n)
        with relay_processes(argv_for(where, url, args.batch_size), 1) as procs:
            deadline = time.monotonic() + 120
            while (first := published(where)) == 0:
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise SystemExit(f"{kind}: the relay published nothing")
                time.sleep(0.005)
            start = time.perf_counter()
            deadline = time.monotonic() + 600
            while (seen := published(where)) < n:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: only {seen} of {n} published after 600 s")
                time.sleep(0.01)
            elapsed = time.perf_counter() - start
    rate = (seen - first) / elapsed
    print(f"  {kind:<6} {seen - first:>7} events in {elapsed:6.2f} s = {rate:>8,.0f} events/s")
    return rate


def arrivals_redis(r: redis.Redis, where: Place) -> dict[str, float]:
    out: dict[str, float] = {}
    for topic in TOPICS:
        for entry_id, fields in r.xrange(where.stream(topic)):  # type: ignore[union-attr]
            out[fields[b"id"].decode()] = int(entry_id.split(b"-")[0]) / 1000
    return out


def arrivals_nats(url: str, where: Place) -> dict[str, float]:
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import AckPolicy, ConsumerConfig
    from nats.js.errors import FetchTimeoutError

    from outbox.nats_client import jetstream_name

    async def read(js: Any) -> dict[str, float]:
        out: dict[str, float] = {}
        for topic in TOPICS:
            stream = where.stream(topic)
            sub = await js.pull_subscribe(
                stream,
                stream=jetstream_name(stream),
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True),
            )
            try:
                while True:
                    try:
                        msgs = await sub.fetch(1000, timeout=1.0)
                    except (FetchTimeoutError, NatsTimeout, TimeoutError):
                        break
                    for msg in msgs:
                        out[json.loads(msg.data)["id"]] = msg.metadata.timestamp.timestamp()
            finally:
                await sub.unsubscribe()
        return out

    result: dict[str, float] = _nats(url, read)
    return result


def latency(
    args: argparse.Namespace, r: redis.Redis, kind: str, url: str
) -> tuple[float, float, float]:
    """One round on one broker: p50, p99 (ms) and the rate the writers achieved."""
    with broker_place(args, r, kind, f"lat{kind}") as where:
        with relay_processes(argv_for(where, url, None), 1):
            outbox = Outbox(make_engine(where.url, pool_size=1))
            with outbox.transaction() as tx:
                tx.emit(TOPICS[0], key="warm-up", payload={})
            deadline = time.monotonic() + 120
            while published(where) == 0:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{kind}: the relay published nothing in 120 s")
                time.sleep(0.01)
            outbox.engine.dispose()
            committed, late, achieved = offer(args, where)
            deadline = time.monotonic() + 60
            while published(where) < len(committed) + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        seen = arrivals_nats(url, where) if kind == "nats" else arrivals_redis(r, where)
    lat = [(seen[e] - t) * 1000 for e, t in committed.items() if e in seen]
    missing = len(committed) - len(lat)
    p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
    print(
        f"  {kind:<6} achieved {achieved:,.0f}/s ({late} of {len(committed)} began >10 ms "
        f"late)  p50 {p50:6.1f} ms  p99 {p99:6.1f} ms  max {max(lat):6.1f} ms  [{load()}]"
        + (f"  ({missing} not published!)" if missing else ""),
        flush=True,
    )
    return p50, p99, achieved


def latencies(args: argparse.Namespace, r: redis.Redis, urls: dict[str, str]) -> None:
    print(
        f"commit -> message latency at {args.rate:,.0f} events/s offered for "
        f"{args.latency_seconds} s ({args.writer_processes} writer processes x {args.writers} "
        f"threads, @outbox.transactional, one event per transaction; the relay at its CLI "
        f"defaults) [{load()}]",
        flush=True,
    )
    figures: dict[str, list[tuple[float, float, float]]] = {"redis": [], "nats": []}
    for _ in range(args.latency_rounds):
        for kind in ("redis", "nats"):
            figures[kind].append(latency(args, r, kind, urls[kind]))
    p50 = {k: statistics.median(f[0] for f in v) for k, v in figures.items()}
    p99 = {k: statistics.median(f[1] for f in v) for k, v in figures.items()}
    rate = {k: statistics.median(f[2] for f in v) for k, v in figures.items()}
    for kind in ("redis", "nats"):
        print(
            f"  median {kind:<6} p50 {p50[kind]:6.1f} ms  p99 {p99[kind]:6.1f} ms  "
            f"(achieved {rate[kind]:,.0f}/s)"
        )
    print(
        f"  nats/redis: p50 x{p50['nats'] / p50['redis']:.2f}, "
        f"p99 x{p99['nats'] / p99['redis']:.2f}  [{load()}]"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench brokers", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_PG)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--nats-url", default=DEFAULT_NATS)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=500, help="throughput only")
    parser.add_argument("--rounds", type=int, default=2, help="throughput rounds (0: none)")
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--writers", type=int, default=4, help="threads per writer process")
    parser.add_argument("--writer-processes", type=int, default=4)
    parser.add_argument("--latency-rounds", type=int, default=1)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args(argv)
    r = redis.Redis.from_url(args.redis_url)
    urls = {"redis": args.redis_url, "nats": args.nats_url}
    if args.rounds:
        print(
            f"relay throughput: {args.events} preloaded events, one relay, batch "
            f"{args.batch_size} [{load()}]"
        )
    rates: dict[str, list[float]] = {"redis": [], "nats": []}
    for _ in range(args.rounds):
        for kind in ("redis", "nats"):
            rates[kind].append(time_drain(args, r, kind, urls[kind]))
    if args.rounds:
        red, nat = statistics.median(rates["redis"]), statistics.median(rates["nats"])
        print(f"  median: redis {red:,.0f}/s, nats {nat:,.0f}/s: nats/redis x{nat / red:.2f}")
    if not args.skip_latency:
        latencies(args, r, urls)
    r.close()
    return 0
