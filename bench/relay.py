"""PostgreSQL -> Redis Streams relay figures, side by side in one run.

``python -m bench relay`` (default, ~1-2 min): preload N events into a fresh outbox table per
variant and measure how fast each empties it into Redis Streams:

  (a) naive loop: select a batch, XADD one entry at a time, UPDATE one row at a time
      (what most outbox libraries do);
  (b) batched loop: ``SELECT ... FOR UPDATE SKIP LOCKED LIMIT 500``, one pipelined XADD,
      one UPDATE for the batch;
  (c) our relay, one ``outbox-relay run`` process;
  (d) our relay, two processes.

(a) and (b) run in this process with psycopg 3 and redis-py (hiredis), on the same table
layout and with the same CloudEvents entry fields as the relay, so the difference is what
the relay does (intents, receipts, per-key order) and how it overlaps round trips. (c) and
(d) are timed from the first entry they publish to the last (process start-up excluded),
by watching the streams' lengths.

``--full``: the issue's sizes (200,000 events; naive on 40,000 since its rate is its rate).
``--steady SECONDS``: writers keep inserting at ``--steady-rate`` while one relay drains;
prints per 10-s window the publish rate, backlog, and how long the head-of-queue scan takes
(dead index entries left by published rows make it slower: the decay the issue measured).
``--latency``: offer ``--rate`` events/s (one event per transaction) for
``--latency-seconds`` and report commit-to-stream latency p50/p99 with LISTEN/NOTIFY and
with polling only (``--no-listen``). Latency = the stream entry's id time (Redis's clock when
XADD ran) minus the writer's clock right after its COMMIT returned (same machine).

Every variant uses its own PostgreSQL schema and stream prefix, removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
import redis
import sqlalchemy as sa

from outbox import Outbox
from outbox.codec import EntryEncoder
from outbox.db import make_engine
from outbox.ids import new_event_id

DEFAULT_PG = os.environ.get("OUTBOX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DEFAULT_REDIS = os.environ.get("OUTBOX_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TOPICS = ("bench.a", "bench.b", "bench.c", "bench.d")
KEYS = 1000
TABLE = "outbox_events"
SOURCE = "bench"

COLUMNS = "seq, event_id, topic, key, key_hash, tenant, identity, payload::text, created_at"


# -- places: a schema and a stream prefix per variant ---------------------------------------


@dataclass
class Place:
    base_url: str
    schema: str
    prefix: str

    @property
    def url(self) -> str:
        """SQLAlchemy URL whose connections land in this schema (also for subprocesses)."""
        return f"{self.base_url}?options=-csearch_path%3D{self.schema}"

    @property
    def conninfo(self) -> str:
        """The same for a plain psycopg connection."""
        plain = sa.make_url(self.base_url).set(drivername="postgresql")
        return plain.render_as_string(hide_password=False) + (
            f"?options=-csearch_path%3D{self.schema}"
        )

    @property
    def template(self) -> str:
        return f"{self.prefix}.{{topic}}"

    def stream(self, topic: str) -> str:
        return f"{self.prefix}.{topic}"


@contextmanager
def place(base_url: str, r: redis.Redis, label: str) -> Iterator[Place]:
    schema = f"bench_{label}_{uuid.uuid4().hex[:8]}"
    where = Place(base_url, schema, f"bench{uuid.uuid4().hex[:8]}")
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT", pool_size=1)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(where.url, pool_size=1)
    Outbox(engine).create_schema()
    engine.dispose()
    try:
        yield where
    finally:
        keys = list(r.scan_iter(match=f"{where.prefix}*", count=1000))
        if keys:
            r.delete(*keys)
        with admin.connect() as conn:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE pid <> pg_backend_pid() AND query ILIKE :q"
                ),
                {"q": f"%{schema}%"},
            )
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def preload(where: Place, n: int) -> None:
    """COPY ``n`` events (~300-byte entries) into the outbox table, in insertion order."""
    pad = "p" * 120
    with psycopg.connect(where.conninfo) as conn, conn.cursor() as cur:
        with cur.copy(
            f"COPY {TABLE} (event_id, topic, key, key_hash, tenant, identity, payload) FROM STDIN"
        ) as copy:
            for i in range(n):
                key = f"key-{i % KEYS}"
                event_id = new_event_id()
                payload = json.dumps({"n": i, "key": key, "pad": pad})
                copy.write_row(
                    (
                        event_id,
                        TOPICS[i % len(TOPICS)],
                        key,
                        zlib.crc32(key.encode()),
                        "bench",
                        event_id,
                        payload,
                    )
                )
        cur.execute(f"ANALYZE {TABLE}")


def stream_total(r: redis.Redis, where: Place) -> int:
    return sum(int(r.xlen(where.stream(t))) for t in TOPICS)


_ENCODER = EntryEncoder(SOURCE)


def entry(row: tuple[object, ...]) -> dict[str, str]:
    """The stream entry of a row, in the relay's format (:mod:`outbox.codec`)."""
    _seq, event_id, topic, key, _hash, tenant, identity, payload, created_at = row
    assert isinstance(created_at, datetime)
    return _ENCODER.fields(
        event_id=str(event_id),
        topic=str(topic),
        data=str(payload),
        key=str(key),
        time=created_at.astimezone(UTC).isoformat(),
        tenant=str(tenant),
        identity=str(identity),
    )


# -- (a) and (b): the hand-written loops -----------------------------------------------------


def naive_loop(where: Place, r: redis.Redis, batch: int) -> int:
    done = 0
    with psycopg.connect(where.conninfo) as conn, conn.cursor() as cur:
        while True:
            cur.execute(
                f"SELECT {COLUMNS} FROM {TABLE} WHERE state = 'pending' ORDER BY seq LIMIT %s",
                (batch,),
            )
            rows = cur.fetchall()
            if not rows:
                conn.commit()
                return done
            for row in rows:
                stream = where.stream(str(row[2]))
                entry_id: bytes = r.xadd(stream, entry(row))  # type: ignore[arg-type,assignment]
                cur.execute(
                    f"UPDATE {TABLE} SET state = 'published', stream = %s, stream_id = %s, "
                    "published_at = now() WHERE seq = %s",
                    (stream, entry_id.decode(), row[0]),
                )
            conn.commit()
            done += len(rows)


def batched_loop(where: Place, r: redis.Redis, batch: int) -> int:
    done = 0
    with psycopg.connect(where.conninfo) as conn, conn.cursor() as cur:
        while True:
            cur.execute(
                f"SELECT {COLUMNS} FROM {TABLE} WHERE state = 'pending' ORDER BY seq "
                "LIMIT %s FOR UPDATE SKIP LOCKED",
                (batch,),
            )
            rows = cur.fetchall()
            if not rows:
                conn.commit()
                return done
            pipe = r.pipeline(transaction=False)
            streams = []
            for row in rows:
                stream = where.stream(str(row[2]))
                streams.append(stream)
                pipe.xadd(stream, entry(row))  # type: ignore[arg-type]
            ids = [i.decode() for i in pipe.execute()]
            # %b: binary arrays (a Python list bound with %s is sent as text, slowly).
            cur.execute(
                f"UPDATE {TABLE} t SET state = 'published', stream = u.stream, "
                "stream_id = u.sid, published_at = now() "
                "FROM unnest(%b::bigint[], %b::text[], %b::text[]) AS u(seq, stream, sid) "
                "WHERE t.seq = u.seq",
                ([row[0] for row in rows], streams, ids),
            )
            conn.commit()
            done += len(rows)


def time_loop(
    name: str,
    loop: Callable[[Place, redis.Redis, int], int],
    where: Place,
    r: redis.Redis,
    batch: int,
) -> float:
    start = time.perf_counter()
    n = loop(where, r, batch)
    elapsed = time.perf_counter() - start
    rate = n / elapsed
    print(f"  {name:<34} {n:>8} events in {elapsed:6.2f} s = {rate:>9,.0f} events/s", flush=True)
    return rate


# -- (c) and (d): our relay as real processes ----------------------------------------------


def relay_argv(where: Place, redis_url: str, batch: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "relay",
        "run",
        "--database-url",
        where.url,
        "--redis-url",
        redis_url,
        "--stream",
        where.template,
        "--batch-size",
        str(batch),
        *extra,
    ]


@contextmanager
def relay_processes(argv: list[str], count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    procs = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        for _ in range(count)
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.returncode not in (0, None):
                err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
                print(f"    relay exited {proc.returncode}: {err}", file=sys.stderr)


def time_relay(
    name: str, where: Place, r: redis.Redis, redis_url: str, n: int, batch: int, count: int
) -> float:
    argv = relay_argv(where, redis_url, batch)
    with relay_processes(argv, count) as procs:
        deadline = time.monotonic() + 60
        while stream_total(r, where) == 0:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(
                    f"{name}: the relay published nothing (exit codes {[p.poll() for p in procs]})"
                )
            time.sleep(0.002)
        start = time.perf_counter()
        first = stream_total(r, where)
        deadline = time.monotonic() + 600
        while (seen := stream_total(r, where)) < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: only {seen} of {n} published after 600 s")
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
    rate = (seen - first) / elapsed
    dup = f" ({seen - n} more entries than events!)" if seen > n else ""
    print(
        f"  {name:<34} {seen - first:>8} events in {elapsed:6.2f} s = {rate:>9,.0f} events/s{dup}",
        flush=True,
    )
    return rate


def throughput(args: argparse.Namespace, r: redis.Redis) -> None:
    n, naive_n, batch = args.events, args.naive_events, args.batch_size
    print(
        f"PostgreSQL -> Redis Streams, events already in the table, batch {batch} "
        f"({n} events; naive loop on {naive_n})",
        flush=True,
    )
    rates: dict[str, float] = {}
    variants = [v.strip() for v in args.only.split(",")] if args.only else list("abcd")
    for variant in variants:
        size = naive_n if variant == "a" else n
        with place(args.database_url, r, variant) as where:
            preload(where, size)
            if variant == "a":
                rates[variant] = time_loop("(a) naive loop", naive_loop, where, r, batch)
            elif variant == "b":
                rates[variant] = time_loop("(b) batched loop", batched_loop, where, r, batch)
            elif variant == "c":
                rates[variant] = time_relay(
                    "(c) our relay, 1 process", where, r, args.redis_url, size, batch, 1
                )
            elif variant == "d":
                rates[variant] = time_relay(
                    "(d) our relay, 2 processes", where, r, args.redis_url, size, batch, 2
                )
            else:
                raise SystemExit(f"unknown variant {variant!r}: choose from a, b, c, d")
    if "b" in rates:
        print("ratios against the batched loop (b), same run:")
        for variant, rate in rates.items():
            print(f"  ({variant}) / (b) = {rate / rates['b']:.2f}")


# -- (e) steady draining while writers insert -------------------------------------------------


def insert_stream(where: Place, rate: float, stop: threading.Event, counter: list[int]) -> None:
    """Insert through the real write path (``emit_many``), 500 events per transaction."""
    outbox = Outbox(make_engine(where.url, pool_size=1))
    per_tx = 500
    started = time.monotonic()
    i = 0
    while not stop.is_set():
        due = started + i / rate
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        events = [
            {
                "topic": TOPICS[(i + j) % len(TOPICS)],
                "key": f"key-{(i + j) % KEYS}",
                "payload": {"n": i + j, "pad": "p" * 120},
                "tenant": "bench",
            }
            for j in range(per_tx)
        ]
        with outbox.transaction() as tx:
            tx.emit_many(events)
        i += per_tx
        counter[0] = i
    outbox.engine.dispose()


def head_scan_ms(conn: psycopg.Connection[tuple[object, ...]]) -> float:
    """How long the claim's head-of-queue scan takes right now (dead entries slow it)."""
    start = time.perf_counter()
    conn.execute(
        f"SELECT seq FROM {TABLE} WHERE state = 'pending' ORDER BY seq LIMIT 500"
    ).fetchall()
    return (time.perf_counter() - start) * 1000


def steady(args: argparse.Namespace, r: redis.Redis) -> None:
    seconds, rate = args.steady, args.steady_rate
    print(
        f"steady run: {seconds} s, writers offer {rate:,.0f} events/s "
        f"(preloaded {args.steady_preload}), one relay, batch {args.batch_size}",
        flush=True,
    )
    with place(args.database_url, r, "steady") as where:
        preload(where, args.steady_preload)
        stop = threading.Event()
        counter = [0]
        writer = threading.Thread(target=insert_stream, args=(where, rate, stop, counter))
        argv = relay_argv(where, args.redis_url, args.batch_size)
        with relay_processes(argv, 1), psycopg.connect(where.conninfo, autocommit=True) as conn:
            writer.start()
            start = time.monotonic()
            last_pub, last_ins = stream_total(r, where), 0
            rates: list[float] = []
            scans: list[float] = []
            print(
                "  window   published/s   inserted/s   backlog   head-scan ms   dead tuples",
                flush=True,
            )
            window = 10.0
            while time.monotonic() - start < seconds:
                time.sleep(window)
                pub, ins = stream_total(r, where), counter[0]
                backlog = conn.execute(
                    f"SELECT count(*) FROM {TABLE} WHERE state = 'pending'"
                ).fetchone()
                dead = conn.execute(
                    "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s "
                    "AND schemaname = %s",
                    (TABLE, where.schema),
                ).fetchone()
                scan = head_scan_ms(conn)
                scans.append(scan)
                rates.append((pub - last_pub) / window)
                elapsed = time.monotonic() - start
                print(
                    f"  {elapsed:5.0f}s {rates[-1]:>12,.0f} {(ins - last_ins) / window:>12,.0f}"
                    f" {backlog[0] if backlog else '?':>9} {scan:>14.2f}"
                    f" {dead[0] if dead else '?':>13}",
                    flush=True,
                )
                last_pub, last_ins = pub, ins
            stop.set()
            writer.join()
        if len(rates) >= 3:
            # The first window also drains the preload; compare the steady windows only.
            steady_rates = rates[1:]
            print(
                f"  steady windows: median {statistics.median(steady_rates):,.0f}/s, last / "
                f"first = {steady_rates[-1] / max(steady_rates[0], 1):.2f}; head-scan "
                f"{scans[0]:.1f} ms -> {scans[-1]:.1f} ms (a relay that keeps up shows its "
                "decay as backlog and scan time, not as rate: offer more than it can take "
                "with --steady-rate to see the rate itself fall)"
            )


# -- (f) commit-to-stream latency --------------------------------------------------------------


def offer(where: Place, rate: float, seconds: float, threads: int) -> dict[str, float]:
    """Commit one event per transaction at ``rate``/s; return event id -> commit time (s)."""
    committed: dict[str, float] = {}
    lock = threading.Lock()
    total = int(rate * seconds)
    issued = [0]
    started = time.monotonic() + 0.2

    def run() -> None:
        outbox = Outbox(make_engine(where.url, pool_size=1))
        while True:
            with lock:
                i = issued[0]
                issued[0] += 1
            if i >= total:
                break
            due = started + i / rate
            if due > time.monotonic():
                time.sleep(due - time.monotonic())
            with outbox.transaction() as tx:
                event_id = tx.emit(
                    TOPICS[i % len(TOPICS)],
                    key=f"key-{i % KEYS}",
                    payload={"n": i, "pad": "p" * 120},
                    tenant="bench",
                )
            at = time.time()
            with lock:
                committed[event_id] = at
        outbox.engine.dispose()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return committed


def arrivals(r: redis.Redis, where: Place) -> dict[str, float]:
    out: dict[str, float] = {}
    for topic in TOPICS:
        start = "-"
        while True:
            page: list[Any] = r.xrange(where.stream(topic), min=start, max="+", count=5000)  # type: ignore[assignment]
            for entry_id, fields in page:
                out[fields[b"id"].decode()] = int(entry_id.split(b"-")[0]) / 1000
            if len(page) < 5000:
                break
            start = "(" + page[-1][0].decode()
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(args: argparse.Namespace, r: redis.Redis) -> None:
    print(
        f"commit-to-stream latency at {args.rate:,.0f} events/s offered for "
        f"{args.latency_seconds} s (one event per transaction, {args.writers} writer threads)",
        flush=True,
    )
    results = {}
    for label, extra in (("LISTEN/NOTIFY", []), ("polling only (--no-listen)", ["--no-listen"])):
        with place(args.database_url, r, "lat") as where:
            argv = relay_argv(where, args.redis_url, args.batch_size, *extra)
            with relay_processes(argv, 1):
                # Warm up: wait until the relay publishes a first event, so start-up is out.
                outbox = Outbox(make_engine(where.url, pool_size=1))
                with outbox.transaction() as tx:
                    tx.emit(TOPICS[0], key="warm-up", payload={})
                deadline = time.monotonic() + 60
                while stream_total(r, where) == 0:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{label}: the relay published nothing in 60 s")
                    time.sleep(0.01)
                outbox.engine.dispose()
                started = time.monotonic()
                committed = offer(where, args.rate, args.latency_seconds, args.writers)
                achieved = len(committed) / (time.monotonic() - started)
                deadline = time.monotonic() + 60
                while stream_total(r, where) < len(committed) + 1:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            seen = arrivals(r, where)
        lat = [(seen[e] - t) * 1000 for e, t in committed.items() if e in seen]
        missing = len(committed) - len(lat)
        p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
        results[label] = (p50, p99)
        print(
            f"  {label:<28} achieved {achieved:,.0f}/s  p50 {p50:7.1f} ms  "
            f"p90 {percentile(lat, 0.9):7.1f} ms  p99 {p99:7.1f} ms  max {max(lat):7.1f} ms"
            + (f"  ({missing} not published!)" if missing else ""),
            flush=True,
        )
    (n50, n99), (p50, p99) = results.values()
    print(f"  polling / NOTIFY: p50 x{p50 / max(n50, 0.001):.1f}, p99 x{p99 / max(n99, 0.001):.1f}")


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    if "--cluster" in argv:
        # One relay vs one Redis, then one and two vs a 3-master cluster (bench/cluster.py).
        from bench.cluster import main as cluster_main

        return cluster_main([a for a in argv if a != "--cluster"])
    parser = argparse.ArgumentParser(
        prog="python -m bench relay", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_PG, help="PostgreSQL (a schema per run)")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--events", type=int, default=50_000, help="preloaded events (b, c, d)")
    parser.add_argument("--naive-events", type=int, default=10_000, help="preloaded for (a)")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--only", help="comma-separated variants among a,b,c,d")
    parser.add_argument("--full", action="store_true", help="the issue's sizes (200,000)")
    parser.add_argument("--steady", type=float, metavar="SECONDS", help="steady-drain mode")
    parser.add_argument("--steady-rate", type=float, default=5000, help="events/s offered")
    parser.add_argument("--steady-preload", type=int, default=50_000)
    parser.add_argument("--latency", action="store_true", help="commit-to-stream latency mode")
    parser.add_argument("--rate", type=float, default=1000, help="latency mode: events/s")
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--writers", type=int, default=8, help="latency mode: writer threads")
    args = parser.parse_args(argv)
    if args.full:
        args.events, args.naive_events = 200_000, 40_000
    r = redis.Redis.from_url(args.redis_url)
    try:
        if args.steady:
            steady(args, r)
        elif args.latency:
            latency(args, r)
        else:
            throughput(args, r)
    finally:
        r.close()
    return 0
