"""``python -m bench relay_latency``: commit -> stream latency of a real ``outbox-relay run``
at a steady rate, on PostgreSQL (issue 25: <= 20 ms p99 at 1,000 events/s without NOTIFY).

Writer threads commit ``--per-tx`` events per transaction at ``--rate`` events/s in all
(paced on a schedule, not as fast as they can) and note each event's commit time; a reader
process of its own XREADs the stream and notes each entry's arrival (in the writers' process
it waited for their GIL, and arrivals were stamped late); the relay is a subprocess with the
defaults (``--poll-interval`` to try others). The schema is ``create_schema()``'s default
(no NOTIFY trigger) or, with ``--notify``, the trigger. Figures after ``--warmup`` seconds:
p50 / p99 / max of arrival - commit (the same host's clock), and the rates reached.

    python -m bench relay_latency [--rate 1000] [--per-tx 10] [--seconds 20] [--notify]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import redis
import sqlalchemy as sa

from outbox import Outbox

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench relay_latency", description=__doc__)
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS)
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s in all [1000]")
    parser.add_argument("--per-tx", type=int, default=10, help="events per transaction [10]")
    parser.add_argument("--writers", type=int, default=4, help="writer threads [4]")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured run [20]")
    parser.add_argument("--warmup", type=float, default=3.0, help="not counted [3]")
    parser.add_argument("--notify", action="store_true", help="with the NOTIFY trigger")
    parser.add_argument("--poll-interval", default=None, help="the relay's, if not default")
    args = parser.parse_args(argv)

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = f"{args.database_url}?options=-csearch_path%3D{schema}"
    box = Outbox(url)
    box.create_schema(notify=True if args.notify else None)
    stream = f"{schema}.quote"
    client = redis.Redis.from_url(args.redis_url)
    command = [
        sys.executable,
        "-m",
        "relay",
        "run",
        "--database-url",
        url,
        "--redis-url",
        args.redis_url,
        "--stream",
        f"{schema}.{{topic}}",
        "--log-level",
        "warning",
    ]
    if args.poll_interval is not None:
        command += ["--poll-interval", str(args.poll_interval)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    relay = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    # The relay is up (imports, partitions taken) once a probe event reaches the stream: the
    # writers start then, so start-up is not measured as latency.
    with box.transaction() as tx:
        tx.emit("quote", key="probe", payload={})
    deadline = time.time() + 120
    while not client.xlen(stream) and time.time() < deadline:
        time.sleep(0.05)
    probe = client.xrevrange(stream, count=1)
    after = probe[0][0].decode() if probe else "0"
    committed: dict[str, float] = {}
    stop = threading.Event()
    spawn = multiprocessing.get_context("spawn")
    reader_stop = spawn.Event()
    reader_ready = spawn.Event()
    ours, theirs = spawn.Pipe(duplex=False)
    reader = spawn.Process(
        target=read_stream,
        args=(args.redis_url, stream, after, reader_ready, reader_stop, theirs),
    )
    lock = threading.Lock()
    tx_interval = args.per_tx * args.writers / args.rate  # per writer

    def write(n: int) -> None:
        due = start + n * tx_interval / args.writers
        while not stop.is_set() and due < end:
            pause = due - time.time()
            if pause > 0:
                time.sleep(pause)
            with box.transaction() as tx:
                ids = [
                    tx.emit("quote", key=f"q-{n}-{i % 50}", payload={"n": i})
                    for i in range(args.per_tx)
                ]
            now = time.time()
            with lock:
                for event_id in ids:
                    committed[str(event_id)] = now
            due += tx_interval

    threads = [threading.Thread(target=write, args=(n,)) for n in range(args.writers)]
    arrivals: list[tuple[str, float, float]] = []
    try:
        reader.start()
        # The writers start once the reader reads (a spawned process takes seconds to
        # import on a busy machine; entries read late would be stamped late).
        if not reader_ready.wait(120):
            raise RuntimeError("the reader process did not start")
        start = time.time() + 0.5
        end = start + args.warmup + args.seconds
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(1.0)  # the last events reach the stream
        reader_stop.set()
        arrivals = ours.recv()
    finally:
        stop.set()
        reader_stop.set()
        reader.join(30)
        relay.send_signal(signal.SIGTERM)
        relay.wait(30)
        client.delete(stream)
        client.close()
        box.engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    arrived = [(committed[e], t - committed[e], x) for e, t, x in arrivals if e in committed]
    measured = sorted(lat for at, lat, _x in arrived if at >= start + args.warmup)
    # Where it went: commit -> XADD (the entry id's Redis clock, ms) and XADD -> read.
    xadd = sorted(x - at for at, _lat, x in arrived if at >= start + args.warmup)
    read_lag = sorted(at + lat - x for at, lat, x in arrived if at >= start + args.warmup)
    written = sum(1 for at in committed.values() if at >= start + args.warmup)
    if not measured:
        print(f"no events measured ({len(arrivals)} read, {len(committed)} committed)")
        return 1
    ms = [x * 1000 for x in measured]
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    label = "NOTIFY trigger" if args.notify else "default schema (no trigger)"
    print(
        f"commit -> stream, {label}, poll interval "
        f"{args.poll_interval or 'default'}: {written / args.seconds:.0f} events/s committed, "
        f"{len(measured)} measured: p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
        f"max {ms[-1]:.1f} ms"
    )

    def p(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(len(values) * q))] * 1000

    print(
        f"  commit -> XADD (entry id, Redis clock): p50 {p(xadd, 0.5):.0f} ms, "
        f"p99 {p(xadd, 0.99):.0f} ms; XADD -> read: p50 {p(read_lag, 0.5):.0f} ms, "
        f"p99 {p(read_lag, 0.99):.0f} ms (entry ids are whole milliseconds)"
    )
    return 0


def read_stream(redis_url: str, stream: str, after: str, ready: Any, stop: Any, out: Any) -> None:
    """The reader process: XREAD ``stream`` from entry ``after`` (``ready`` set once it
    can) until ``stop`` is set, then send (event id, arrival time) of every entry read
    through ``out``."""
    reader = redis.Redis.from_url(redis_url)
    reader.ping()
    ready.set()
    arrivals: list[tuple[str, float, float]] = []
    last = after
    while not stop.is_set():
        found = reader.xread({stream: last}, count=1000, block=200)
        now = time.time()
        for _name, entries in found or []:
            for entry_id, fields in entries:
                last = entry_id
                xadd_ms = int(entry_id.split(b"-")[0])
                arrivals.append((fields[b"id"].decode(), now, xadd_ms / 1000))
    reader.close()
    out.send(arrivals)
