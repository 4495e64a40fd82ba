"""``python -m bench steps``: step-to-step latency of a 10-step chain (issue 57's target: p99
<= 20 ms at rest), against a chain whose handlers enqueue the next step themselves.

Shape: one :class:`consumer.Worker` (``run()``: the slots, ``--concurrency`` of them,
LISTENing, ``StoreConfig(notify=True)``) in a thread on PostgreSQL, each mode in a fresh
schema. ``--chains`` chains of ``--length`` steps run one after another (the worker has
nothing else to do: "at rest"), ``--gap`` seconds apart. A gap is measured from a step's
handler returning to the next step's handler starting (``perf_counter`` in the same
process): the finish's transaction (the result written, the child released), the wake-up
and the claim.

- ``after``: the whole chain is written by one ``enqueue_many`` with ``after=`` edges; each
  handler returns a small result, and each step reads its parent's (``job.results``).
- ``handler-enqueue`` (the baseline, what users write without steps): each handler
  enqueues the next step itself, in its own transaction, before returning (the gap is then
  measured from that enqueue's commit, the earliest the next step could be seen).

Figures: p50 / p99 / max of the gaps in ms per mode, and the ratio of the ``after`` p99 to
the baseline's. Print the machine's load beside them (``os.getloadavg`` is printed).

``--cost``: what steps cost jobs without any, in the part this cell can switch off: the
partial index of WAITING_PARENTS jobs the metrics count (``ix_outbox_jobs_waiting_parents``).
``--cost-jobs`` plain 1-job-per-handler no-op jobs are enqueued and drained by the worker
(``--concurrency`` slots), in rounds that alternate the index present and dropped, in one
schema; medians of ``--rounds`` rounds each, jobs/s, and their ratio. (Plain jobs finish on
the one-statement path, as before steps: the steps' own statements never run for them.)
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
WARM = 2  # chains run first and not counted
T = TypeVar("T")


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


class Chains:
    """The handlers of both modes and the times they record, by (chain, step)."""

    def __init__(self, store: Any, length: int, mode: str) -> None:
        self.store = store
        self.length = length
        self.mode = mode
        self.started: dict[tuple[int, int], float] = {}
        self.ended: dict[tuple[int, int], float] = {}
        self.finished = threading.Event()
        self.bad: list[str] = []

    def handle(self, job: Any) -> Any:
        now = time.perf_counter()
        _, chain, step = job.action.split("-")
        key = (int(chain), int(step))
        self.started[key] = now
        if self.mode == "after" and key[1] > 0:
            parent = (job.tenant, f"step-{key[0]}-{key[1] - 1}")
            if job.results.get(parent) != {"step": key[1] - 1}:
                self.bad.append(f"{job.action}: parent result {job.results.get(parent)!r}")
        if self.mode == "handler-enqueue" and key[1] + 1 < self.length:
            self.store.enqueue("bench", f"step-{key[0]}-{key[1] + 1}")
        self.ended[key] = time.perf_counter()
        if key[1] + 1 == self.length:
            self.finished.set()
        return {"step": key[1]}

    def start(self, chain: int) -> None:
        self.finished.clear()
        if self.mode == "handler-enqueue":
            self.store.enqueue("bench", f"step-{chain}-0")
            return
        items: list[dict[str, Any]] = [{"tenant": "bench", "action": f"step-{chain}-0"}]
        for step in range(1, self.length):
            parent = ("bench", f"step-{chain}-{step - 1}")
            items.append({"tenant": "bench", "action": f"step-{chain}-{step}", "after": [parent]})
        self.store.enqueue_many(items)

    def gaps_ms(self) -> list[float]:
        gaps = [
            (self.started[(c, s + 1)] - self.ended[(c, s)]) * 1000
            for (c, s) in self.ended
            if (c, s + 1) in self.started
        ]
        return sorted(gaps)


def run_mode(url: str, mode: str, chains: int, length: int, gap: float, slots: int) -> Chains:
    from consumer import Store, StoreConfig, Worker

    store = Store(url, config=StoreConfig(notify=True))
    producer = Store(url, config=StoreConfig(notify=True), create_schema=False)
    worker = Worker(store, concurrency=slots)
    record = Chains(producer if mode == "after" else store, length, mode)
    worker.register("step", record.handle)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        time.sleep(1.0)  # the worker is idle and LISTENing
        for chain in range(chains + WARM):  # the first WARM chains warm the pools
            record.start(chain)
            if not record.finished.wait(60):
                raise RuntimeError(f"{mode}: chain {chain} did not finish within 60 s")
            time.sleep(gap)
    finally:
        worker.stop()
        runner.join(60)
        producer.dispose()
        store.dispose()
    for key in [k for k in record.started if k[0] < WARM]:
        record.started.pop(key)
        record.ended.pop(key, None)
    return record


def drain_rate(url: str, jobs: int, rounds: int, slots: int) -> dict[bool, float]:
    """Median jobs/s of ``rounds`` drains of ``jobs`` no-op jobs, with the WAITING_PARENTS
    index (True) and without (False), alternating."""
    import statistics

    from consumer import Store, StoreConfig, Worker
    from consumer.jobs.schema import WAITING_PARENTS_INDEX

    store = Store(url, config=StoreConfig(notify=True))
    rates: dict[bool, list[float]] = {True: [], False: []}
    left = threading.Semaphore(0)
    worker = Worker(store, concurrency=slots)
    worker.register("noop", lambda job: left.release())
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        for n in range(rounds * 2 + 1):
            present = n % 2 == 1
            with store.engine.begin() as conn:
                if present:
                    WAITING_PARENTS_INDEX.create(conn, checkfirst=True)
                else:
                    WAITING_PARENTS_INDEX.drop(conn, checkfirst=True)
            store.enqueue_many([{"tenant": "b", "action": f"noop-{n}-{i}"} for i in range(jobs)])
            start = time.perf_counter()
            for _ in range(jobs):
                if not left.acquire(timeout=120):
                    raise RuntimeError("the drain stalled")
            if n:  # round 0 warms the pools
                rates[present].append(jobs / (time.perf_counter() - start))
    finally:
        worker.stop()
        runner.join(60)
        store.dispose()
    return {k: statistics.median(v) for k, v in rates.items()}


def _pick(ms: list[float], q: float) -> float:
    return ms[min(len(ms) - 1, int(len(ms) * q))]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench steps", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--chains", type=int, default=30, help="chains per mode [30]")
    parser.add_argument("--length", type=int, default=10, help="steps per chain [10]")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between chains [0.2]")
    parser.add_argument("--concurrency", type=int, default=16, help="the worker's slots [16]")
    parser.add_argument("--cost", action="store_true", help="the drain cell instead")
    parser.add_argument("--cost-jobs", type=int, default=2000, help="jobs per drain [2000]")
    parser.add_argument("--rounds", type=int, default=4, help="drains per variant [4]")
    args = parser.parse_args(argv)
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")

    def in_schema(run: Callable[[str], T]) -> T:
        schema = f"bench_steps_{uuid.uuid4().hex[:8]}"
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            return run(_schema_url(args.database_url, schema))
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))

    load = os.getloadavg()
    if args.cost:
        print(
            f"drain of {args.cost_jobs} no-op jobs, {args.concurrency} slots, NOTIFY on, "
            f"PostgreSQL, medians of {args.rounds} rounds per variant; load average "
            f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs"
        )
        try:
            rate = in_schema(
                lambda url: drain_rate(url, args.cost_jobs, args.rounds, args.concurrency)
            )
        finally:
            admin.dispose()
        print(
            f"  with the WAITING_PARENTS index {rate[True]:.0f} jobs/s, without "
            f"{rate[False]:.0f} jobs/s, ratio {rate[True] / rate[False]:.3f}"
        )
        return 0
    print(
        f"step-to-step latency: {args.chains} chains of {args.length} steps per mode, one at "
        f"a time, {args.gap * 1000:.0f} ms apart; one worker of {args.concurrency} slots, "
        f"NOTIFY on, PostgreSQL; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    p99: dict[str, float] = {}
    try:
        for mode in ("handler-enqueue", "after"):
            record = in_schema(
                lambda url, mode=mode: run_mode(
                    url, mode, args.chains, args.length, args.gap, args.concurrency
                )
            )
            ms = record.gaps_ms()
            if record.bad or len(ms) != args.chains * (args.length - 1):
                print(f"  {mode}: WRONG: {len(ms)} gaps, {record.bad[:3]}")
                return 1
            p99[mode] = _pick(ms, 0.99)
            print(
                f"  {mode:<16} {len(ms)} gaps: p50 {_pick(ms, 0.5):6.1f} ms  "
                f"p99 {p99[mode]:6.1f} ms  max {ms[-1]:6.1f} ms",
                flush=True,
            )
    finally:
        admin.dispose()
    print(f"  p99 after= / handler-enqueue: {p99['after'] / p99['handler-enqueue']:.2f}")
    load = os.getloadavg()
    print(f"  load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    return 0
