"""Writer-side figures for the outbox (issue 2), on PostgreSQL.

1. Writer overhead: a minimal domain transaction (UPDATE one row, COMMIT) with and without
   one ``emit``, alternating short rounds of each so drift and noise hit both alike; the
   ratio of medians is the figure (target: at most 1.15).
2. Events written per second by 4 writer threads: one event per transaction, and batches of
   100 per transaction (``emit_many``: one statement).

    python -m bench outbox_write [--database-url URL] [--rounds N] [--per-round N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa

from outbox import Outbox

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
UPDATE = sa.text("UPDATE bench_quotes SET version = version + 1 WHERE id = :id")


def _setup(url: str) -> tuple[Outbox, str, sa.Engine]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    box = Outbox(f"{url}?options=-csearch_path%3D{schema}")
    box.create_schema()
    with box.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE bench_quotes (id INTEGER PRIMARY KEY, version INTEGER)"))
        conn.execute(sa.text("INSERT INTO bench_quotes SELECT g, 0 FROM generate_series(0, 63) g"))
    return box, schema, admin


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("inf")


def overhead(box: Outbox, rounds: int, per_round: int) -> tuple[float, float]:
    def plain(i: int) -> None:
        with box.transaction() as tx:
            tx.session.execute(UPDATE, {"id": i % 64})

    def with_emit(i: int) -> None:
        with box.transaction() as tx:
            tx.session.execute(UPDATE, {"id": i % 64})
            tx.emit("quote.approved", key=f"quote-{i % 64}", payload={"total": i, "n": "x" * 200})

    def timed(fn: Callable[[int], None]) -> float:
        start = time.perf_counter()
        for i in range(per_round):
            fn(i)
        return _rate(per_round, time.perf_counter() - start)

    timed(plain), timed(with_emit)  # warm up the pool and plan caches
    plain_rates, emit_rates = [], []
    for _ in range(rounds):
        plain_rates.append(timed(plain))
        emit_rates.append(timed(with_emit))
    return statistics.median(plain_rates), statistics.median(emit_rates)


def writers(box: Outbox, threads: int, seconds: float, batch: int) -> float:
    stop = threading.Event()
    counts = [0] * threads

    def run(n: int) -> None:
        i = 0
        while not stop.is_set():
            with box.transaction() as tx:
                tx.session.execute(UPDATE, {"id": n})
                if batch == 1:
                    tx.emit("quote.approved", key=f"quote-{n}", payload={"i": i})
                else:
                    tx.emit_many(
                        [
                            {
                                "topic": "quote.approved",
                                "key": f"quote-{n}",
                                "payload": {"i": i + j},
                            }
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
    return _rate(sum(counts), time.perf_counter() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench outbox_write",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument("--per-round", type=int, default=300, help="transactions per round")
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each writer run")
    args = parser.parse_args(argv)
    box, schema, admin = _setup(args.database_url)
    try:
        plain, emitted = overhead(box, args.rounds, args.per_round)
        print("writer overhead (1 thread, UPDATE one row + COMMIT):")
        print(f"  without emit : {plain:8.0f} tx/s")
        print(f"  with one emit: {emitted:8.0f} tx/s")
        print(f"  ratio (time with / time without): {plain / emitted:.3f}   (target <= 1.15)")
        single = writers(box, 4, args.seconds, 1)
        batched = writers(box, 4, args.seconds, 100)
        print("events written per second, 4 writer threads:")
        print(f"  one event per transaction : {single:9.0f} events/s")
        print(
            f"  100 events per transaction: {batched:9.0f} events/s  "
            f"({batched / single:.1f}x single)"
        )
    finally:
        box.engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
    return 0
