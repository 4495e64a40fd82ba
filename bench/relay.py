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
import math
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

from bench.procstat import cpu_seconds
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


def batched_loop(
    where: Place, r: redis.Redis, batch: int, progress: Callable[[int], None] | None = None
) -> int:
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
            if progress is not None:
                progress(done)


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


# -- (g) draining a backlog: linearity, and whatever the planner statistics say ---------------

STATS_MODES = ("fresh", "none", "stale")


def write_backlog(where: Place, n: int, stats: str, threads: int = 2) -> float:
    """Write ``n`` events through the public API (``emit_many``, 1,000 per transaction) while
    no relay runs; return the write rate. ``stats``: ``fresh`` ANALYZEs the table afterwards,
    ``none`` leaves it never analyzed (a new table, autovacuum off or lagging), ``stale``
    ANALYZEs it while empty, before the writes (what the planner then believes: no rows)."""
    if stats == "stale":
        with psycopg.connect(where.conninfo, autocommit=True) as conn:
            conn.execute(f"ANALYZE {TABLE}")
    per_tx = 1000
    issued = [0]
    lock = threading.Lock()

    def run() -> None:
        outbox = Outbox(make_engine(where.url, pool_size=1))
        while True:
            with lock:
                first = issued[0]
                issued[0] += per_tx
            if first >= n:
                break
            events = [
                {
                    "topic": TOPICS[i % len(TOPICS)],
                    "key": f"key-{i % KEYS}",
                    "payload": {"n": i, "pad": "p" * 120},
                    "tenant": "bench",
                }
                for i in range(first, min(n, first + per_tx))
            ]
            with outbox.transaction() as tx:
                tx.emit_many(events)
        outbox.engine.dispose()

    started = time.perf_counter()
    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    rate = n / (time.perf_counter() - started)
    if stats == "fresh":
        with psycopg.connect(where.conninfo, autocommit=True) as conn:
            conn.execute(f"ANALYZE {TABLE}")
    return rate


class Deciles:
    """Times at which 10 %, 20 %, ... of ``n`` events were drained; rate per tenth."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start = 0.0
        self.marks: list[float] = []
        self.done, self.last = 0, 0.0

    def begin(self) -> None:
        self.start = time.perf_counter()

    def seen(self, done: int) -> None:
        self.done, self.last = done, time.perf_counter()
        while len(self.marks) < 10 and done >= (len(self.marks) + 1) * self.n / 10:
            self.marks.append(time.perf_counter())

    def rates(self) -> list[float]:
        out, last = [], self.start
        for mark in self.marks:
            out.append((self.n / 10) / max(mark - last, 1e-9))
            last = mark
        return out

    @property
    def total(self) -> float:
        """Events/s over the whole backlog, or over the part drained when cut short."""
        if len(self.marks) == 10:
            return self.n / max(self.marks[-1] - self.start, 1e-9)
        return self.done / max(self.last - self.start, 1e-9) if self.done else 0.0


def drain_relay(where: Place, r: redis.Redis, args: argparse.Namespace, n: int) -> Deciles:
    """One ``outbox-relay run`` process (``python -m relay run``, as users run it) drains the
    backlog; the clock starts when it publishes its first entry (start-up excluded)."""
    deciles = Deciles(n)
    argv = relay_argv(where, args.redis_url, args.batch_size)
    with relay_processes(argv, 1) as procs:
        deadline = time.monotonic() + 120
        while (seen := stream_total(r, where)) == 0:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise SystemExit(f"the relay published nothing (exit code {procs[0].poll()})")
            time.sleep(0.002)
        deciles.begin()
        deadline = time.monotonic() + 3600
        while seen < n:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {seen} of {n} published after an hour")
            time.sleep(0.01)
            seen = stream_total(r, where)
            deciles.seen(seen)
    return deciles


class _TimeUp(Exception):
    pass


def drain_batched(where: Place, r: redis.Redis, args: argparse.Namespace, n: int) -> Deciles:
    """The batched loop (b) drains the copy; ``--loop-seconds`` cuts it short (without
    statistics its cost per batch grows with the backlog: a million-event backlog would take
    hours), and its rate is then taken over the part it drained."""
    deciles = Deciles(n)
    deciles.begin()
    deadline = time.perf_counter() + args.loop_seconds if args.loop_seconds else math.inf

    def progress(done: int) -> None:
        deciles.seen(done)
        if time.perf_counter() > deadline:
            raise _TimeUp

    try:
        batched_loop(where, r, args.batch_size, progress)
    except _TimeUp:
        print(
            f"    (batched loop stopped after {args.loop_seconds:.0f} s, {deciles.done:,} of "
            f"{n:,} drained)",
            flush=True,
        )
    return deciles


def copy_backlog(source: Place, target: Place, stats: str) -> None:
    """Give ``target`` the same backlog as ``source`` (rows, seq values and all), with the
    same planner statistics state: the batched loop drains what the relay drains, and the
    events are written through the public API only once."""
    with psycopg.connect(target.conninfo, autocommit=True) as conn:
        if stats == "stale":
            conn.execute(f"ANALYZE {TABLE}")
        conn.execute(f'INSERT INTO {TABLE} SELECT * FROM "{source.schema}".{TABLE} ORDER BY seq')
        if stats == "fresh":
            conn.execute(f"ANALYZE {TABLE}")


def backlog(args: argparse.Namespace, r: redis.Redis) -> None:
    n = args.backlog
    modes = [m.strip() for m in args.stats.split(",")]
    for mode in modes:
        if mode not in STATS_MODES:
            raise SystemExit(f"--stats {mode!r}: choose from {', '.join(STATS_MODES)}")
    print(
        f"drain a backlog of {n:,} events written through outbox.transaction()/emit_many "
        f"(1,000 per transaction, 2 threads) while no relay ran; batch {args.batch_size}. "
        "relay: one `python -m relay run` process (as users run it), timed from its first "
        "published entry; batched: the hand-written loop (b) on a copy of the same backlog "
        "(INSERT ... SELECT, same statistics state). Events/s per tenth of the backlog:",
        flush=True,
    )
    print(
        f"  {'':<22}"
        + "".join(f"{f'{10 * (i + 1)}%':>8}" for i in range(10))
        + "     whole  written/s",
        flush=True,
    )
    results: dict[tuple[str, str], float] = {}
    for mode in modes:
        with (
            place(args.database_url, r, "blr") as ours,
            place(args.database_url, r, "blb") as theirs,
        ):
            wrote = write_backlog(ours, n, mode)
            copy_backlog(ours, theirs, mode)
            for name, where, drain in (
                ("relay", ours, drain_relay),
                ("batched", theirs, drain_batched),
            ):
                deciles = drain(where, r, args, n)
                print(
                    f"  {name + ' stats=' + mode:<22}"
                    + "".join(f"{rate:>8,.0f}" for rate in deciles.rates())
                    + f"{deciles.total:>10,.0f}"
                    + (f"{wrote:>11,.0f}" if name == "relay" else f"{'(copy)':>11}"),
                    flush=True,
                )
                results[(name, mode)] = deciles.total
    print("ratios (same run):")
    for mode in modes:
        relay_rate, loop_rate = results[("relay", mode)], results[("batched", mode)]
        print(f"  stats={mode:<6} relay / batched loop = {relay_rate / max(loop_rate, 1):.2f}")
    if "fresh" in modes:
        for mode in modes:
            if mode != "fresh":
                ratio = results[("relay", mode)] / max(results[("relay", "fresh")], 1)
                print(f"  relay stats={mode} / relay stats=fresh = {ratio:.2f}")


# -- (h) what an idle relay costs: polling without NOTIFY ------------------------------------


def _local_ports(pid: int) -> set[int]:
    """Local TCP ports of the sockets a process holds (its connections to PostgreSQL)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in handle.readlines()[1:]:
                parts = line.split()
                if parts[9] in inodes:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _backend_pids(where: Place, pid: int) -> list[int]:
    """The PostgreSQL backends serving the relay process ``pid`` (by its client ports; same
    machine, so their CPU can be read too)."""
    with psycopg.connect(where.conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)",
            (sorted(_local_ports(pid)),),
        ).fetchall()
    return [int(r[0]) for r in rows]


def idle(args: argparse.Namespace, r: redis.Redis) -> None:
    seconds = args.idle
    intervals = [float(v) for v in args.idle_polls.split(",")]
    print(
        f"idle relay CPU over {seconds:.0f} s on an empty outbox table (relay process + its "
        "PostgreSQL backends, from /proc/<pid>/stat; % of one core):",
        flush=True,
    )
    print(f"  {'wake-up':<34}{'relay %':>9}{'postgres %':>12}{'total %':>9}{'claims/s':>10}")
    variants: list[tuple[str, list[str]]] = [("LISTEN/NOTIFY (idle poll 1 s)", [])]
    for poll in intervals:
        variants.append(
            (
                f"no NOTIFY, idle poll {poll * 1000:.0f} ms",
                ["--no-listen", "--poll-interval", str(poll), "--max-poll-interval", str(poll)],
            )
        )
    for label, extra in variants:
        with place(args.database_url, r, "idle") as where:
            argv = relay_argv(where, args.redis_url, args.batch_size, *extra)
            with (
                relay_processes(argv, 1) as procs,
                psycopg.connect(where.conninfo, autocommit=True) as conn,
            ):
                time.sleep(3.0)  # start-up: imports, connections, the first rebalance
                backends = _backend_pids(where, procs[0].pid)
                deadline = time.monotonic() + 20
                while len(backends) < 2 and time.monotonic() < deadline:  # a loaded machine
                    time.sleep(0.5)
                    backends = _backend_pids(where, procs[0].pid)
                scans = (
                    "SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_indexes "
                    "WHERE schemaname = %s AND indexrelname = %s"
                )
                index = f"ix_{TABLE}_pending"
                scans0 = conn.execute(scans, (where.schema, index)).fetchone()
                pids = [procs[0].pid, *backends]
                before = {pid: cpu_seconds(pid, children=True) for pid in pids}
                started = time.monotonic()
                time.sleep(seconds)
                elapsed = time.monotonic() - started
                after = {pid: cpu_seconds(pid, children=True) for pid in pids}
                scans1 = conn.execute(scans, (where.schema, index)).fetchone()
        relay_cpu = (after[pids[0]] - before[pids[0]]) / elapsed * 100
        pg_cpu = sum(after[p] - before[p] for p in backends) / elapsed * 100
        claims = (int(scans1[0]) - int(scans0[0])) / elapsed if scans0 and scans1 else 0.0
        print(
            f"  {label:<34}{relay_cpu:>9.2f}{pg_cpu:>12.2f}{relay_cpu + pg_cpu:>9.2f}"
            f"{claims:>10.1f}",
            flush=True,
        )


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
    parser.add_argument(
        "--backlog", type=int, metavar="N", help="drain mode: write N events, then drain them"
    )
    parser.add_argument(
        "--stats",
        default="fresh",
        help="drain mode: planner statistics, comma-separated among fresh (ANALYZE after the "
        "writes), none (never analyzed), stale (ANALYZE on the empty table)",
    )
    parser.add_argument(
        "--no-analyze", action="store_true", help="drain mode: same as --stats none"
    )
    parser.add_argument(
        "--loop-seconds",
        type=float,
        default=0,
        help="drain mode: stop the batched loop after this long (0: let it finish)",
    )
    parser.add_argument(
        "--idle", type=float, metavar="SECONDS", help="idle mode: CPU of an idle relay"
    )
    parser.add_argument(
        "--idle-polls", default="0.01,0.02,0.05", help="idle mode: idle poll intervals (s)"
    )
    parser.add_argument("--latency", action="store_true", help="commit-to-stream latency mode")
    parser.add_argument("--rate", type=float, default=1000, help="latency mode: events/s")
    parser.add_argument("--latency-seconds", type=float, default=20)
    parser.add_argument("--writers", type=int, default=8, help="latency mode: writer threads")
    args = parser.parse_args(argv)
    if args.full:
        args.events, args.naive_events = 200_000, 40_000
    r = redis.Redis.from_url(args.redis_url)
    try:
        if args.idle:
            idle(args, r)
        elif args.backlog:
            if args.no_analyze:
                args.stats = "none"
            backlog(args, r)
        elif args.steady:
            steady(args, r)
        elif args.latency:
            latency(args, r)
        else:
            throughput(args, r)
    finally:
        r.close()
    return 0
