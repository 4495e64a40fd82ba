"""``python -m bench jobs_order``: order keys' cost to a worker's drain (issue 56).

Cells, each in a fresh schema of the same PostgreSQL, alternated over ``--rounds``:

- **keys**: ``--jobs`` jobs (default 10,000) over ``--keys`` order keys (default 1,000; job
  ``i`` has key ``i % keys``, so each key's jobs are spread over the whole enqueue), a 1 ms
  handler (``time.sleep(0.001)``), one ``Worker(concurrency=16)``: jobs/s from its start to
  the last job's end;
- **no keys**: the same jobs without an order key;
- **hot key**: ``--jobs`` jobs of which ``--hot`` (default 1,000) share ONE order key, the
  others have none: how long the others take to drain, against the same others alone (the
  hot key's line runs one job at a time beside them, in one slot at most).

The jobs are enqueued before the worker starts (``enqueue_many``, 5,000 a call); no ANALYZE
or VACUUM of the bench's own. The machine is shared: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from typing import Any

import sqlalchemy as sa

from outbox.hooks import Hooks

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


class _Counting(Hooks):
    """Counts the finished jobs of kind ``counted``; wakes at ``target``."""

    def __init__(self, target: int, counted: str) -> None:
        self.target, self.counted = target, counted
        self.done = 0
        self.reached = threading.Event()

    def worker_job_finished(
        self, action: str, outcome: str, duration_seconds: float, **facts: Any
    ) -> None:
        if facts.get("kind") == self.counted:
            self.done += 1
            if self.done >= self.target:
                self.reached.set()


def drain(base: str, specs: list[dict[str, Any]], counted: str, target: int) -> float:
    """Enqueue ``specs``, run one 16-slot worker until ``target`` jobs of kind ``counted``
    finished: the seconds that took."""
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    schema = f"bench_order_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    store = Store(f"{base}?options=-csearch_path%3D{schema}")
    try:
        for start in range(0, len(specs), 5000):
            store.enqueue_many(specs[start : start + 5000])
        hooks = _Counting(target, counted)
        worker = Worker(store, hooks=hooks, concurrency=16)
        worker.register("job", lambda job: time.sleep(0.001))
        worker.register("hot", lambda job: time.sleep(0.001))
        runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        started = time.perf_counter()
        runner.start()
        hooks.reached.wait(600)
        elapsed = time.perf_counter() - started
        worker.stop()
        runner.join(60)
        if hooks.done < target:
            raise RuntimeError(f"worker: {hooks.done} of {target} done")
    finally:
        store.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
    return elapsed


def _specs(count: int, keys: int | None, hot: int = 0) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    for i in range(count):
        spec: dict[str, Any] = {"tenant": f"t{i % 4}", "action": f"job-{i}", "kind": "job"}
        if keys:
            spec["order_key"] = f"key-{i % keys}"
        if hot and i % (count // hot) == 0:
            spec.update(action=f"hot-{i}", kind="hot", order_key="hot")
        specs.append(spec)
    return specs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench jobs_order", description=__doc__)
    parser.add_argument("--url", default=os.environ.get("OUTBOX_BENCH_PG", DEFAULT_URL))
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--hot", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    n = args.jobs
    others = n - args.hot
    cells = {
        "keys": lambda: n / drain(args.url, _specs(n, args.keys), "job", n),
        "no keys": lambda: n / drain(args.url, _specs(n, None), "job", n),
        "hot key, the others": lambda: (
            others / drain(args.url, _specs(n, None, args.hot), "job", others)
        ),
        "the others alone": lambda: (
            others
            / drain(
                args.url,
                [s for s in _specs(n, None, args.hot) if "order_key" not in s],
                "job",
                others,
            )
        ),
    }
    print(
        f"order keys: {n:,} jobs of 1 ms, 16 slots, {args.keys:,} keys; hot key {args.hot:,} "
        f"jobs; {args.rounds} alternated rounds, {os.cpu_count()} cores (shared)",
        flush=True,
    )
    results: dict[str, list[float]] = {name: [] for name in cells}
    for round_ in range(args.rounds):
        names = list(cells) if round_ % 2 == 0 else list(reversed(cells))
        for name in names:
            rate = cells[name]()
            results[name].append(rate)
            print(f"  round {round_ + 1} {name}: {rate:,.0f} jobs/s", flush=True)
    medians = {name: statistics.median(found) for name, found in results.items()}
    for name, rate in medians.items():
        print(f"{name}: median {rate:,.0f} jobs/s")
    print(f"keys / no keys: {medians['keys'] / medians['no keys']:.0%}")
    hot = medians["hot key, the others"] / medians["the others alone"]
    print(f"the others beside a hot key / alone: {hot:.0%}")
    return 0
