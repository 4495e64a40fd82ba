"""``python -m bench dispatch``: external dispatches per second through ``HttpProvider``
against the connector simulator (``outbox-simulator serve``, a real process).

Three figures, from the same run, against the same simulator and database:

- **bare HTTP**: ``HttpProvider.send`` in a loop from one thread (keep-alive connection,
  an idempotency key per call): the baseline, no database at all;
- **dispatch**: ``Operations.dispatch`` from one thread on jobs claimed beforehand (the
  fenced intent write with its deadline, the same HTTP call, the receipt write). The ratio
  dispatch/bare and the milliseconds per dispatch above the bare call are the cost of the
  intent and the receipt;
- **workers**: ``outbox-worker run`` processes whose handler does ``job.dispatch(...)``:
  1 worker with concurrency 1, and 4 workers each with concurrency 8, draining jobs enqueued
  once they are all running (claim, intent, HTTP, receipt, finish). Every effect is counted
  at the simulator afterwards: the figure is only printed with exactly one effect per job.

The machine is shared (2 cores for the simulator, the database, the workers and this
driver): read ratios, not absolutes. Options: ``--database-url`` (PostgreSQL, a fresh schema
dropped afterwards; ``sqlite:///FILE`` works too), ``--calls`` (bare and dispatch),
``--jobs`` (per worker configuration), ``--skip-workers``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
ROOT = Path(__file__).resolve().parent.parent


# -- the worker app (imported by the outbox-worker subprocesses) -------------------------------


def build_worker() -> Any:
    """``outbox-worker run bench.dispatch:build_worker``: an ``email`` handler dispatching
    one operation through an HttpProvider to ``$BENCH_SIMULATOR_URL``."""
    from consumer import HttpProvider, JobContext, Worker

    url = os.environ["BENCH_SIMULATOR_URL"]
    provider = HttpProvider(
        "mail", f"{url}/send", lookup_url=f"{url}/lookup/{{operation_id}}", timeout=10.0
    )
    worker = Worker(providers={"mail": provider}, poll_interval=0.02)

    @worker.handler("email")
    def email(job: JobContext) -> None:
        job.dispatch("send", "mail", {"to": job.subject, "template": "quote-approved"})

    return worker


# -- the simulator -------------------------------------------------------------------------------


class Simulator:
    def __init__(self, data: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumer.jobs.simulator",
                "serve",
                "--port",
                "0",
                "--data",
                data,
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"simulator did not start: {line!r}")
        self.url = line.split()[-1]

    def effects(self) -> list[dict[str, Any]]:
        import httpx

        return list(httpx.get(f"{self.url}/effects", timeout=60).json()["effects"])

    def clear(self) -> None:
        import httpx

        httpx.delete(f"{self.url}/effects", timeout=60).raise_for_status()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


# -- the figures ---------------------------------------------------------------------------------


def bare_http(url: str, calls: int) -> tuple[float, float]:
    """(calls/s, median ms) of HttpProvider.send alone."""
    from consumer import HttpProvider

    tag = uuid.uuid4().hex[:8]
    latencies: list[float] = []
    with HttpProvider("mail", f"{url}/send", timeout=10.0) as provider:
        provider.send({"warm": True}, operation_id=f"warm-{tag}", idempotency_key=None)
        started = time.perf_counter()
        for i in range(calls):
            t0 = time.perf_counter()
            provider.send(
                {"to": f"bare-{i}@example.com", "template": "quote-approved"},
                operation_id=f"bare-{tag}-{i}",
                idempotency_key=f"bare-{tag}-{i}",
            )
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
    return calls / elapsed, statistics.median(latencies) * 1000


def bare_commit(db_url: str, commits: int) -> float:
    """Median ms of one committed single-row INSERT: what the disk's flush costs here."""
    engine = sa.create_engine(db_url)
    table = f"bench_commit_{uuid.uuid4().hex[:8]}"
    latencies: list[float] = []
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, v TEXT)"))
        for i in range(commits):
            t0 = time.perf_counter()
            with engine.begin() as conn:
                conn.execute(sa.text(f"INSERT INTO {table} VALUES (:i, 'x')"), {"i": i})
            latencies.append(time.perf_counter() - t0)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        engine.dispose()
    return statistics.median(latencies) * 1000


def direct_dispatch(db_url: str, url: str, calls: int) -> tuple[float, float, float, float]:
    """(dispatches/s, median ms, commits and rows written per dispatch) of
    Operations.dispatch on leases claimed beforehand."""
    from consumer import HttpProvider, Operations, Store

    store = Store(db_url)
    tag = uuid.uuid4().hex[:8]
    store.enqueue_many(
        [
            {"tenant": "bench", "action": f"direct-{tag}-{i}", "subject": f"d{i}@example.com"}
            for i in range(calls + 1)
        ]
    )
    leases = store.claim_batch("bench-driver", calls + 1, ttl=3600)
    latencies: list[float] = []
    with HttpProvider(
        "mail", f"{url}/send", lookup_url=f"{url}/lookup/{{operation_id}}", timeout=10.0
    ) as provider:
        ops = Operations(store, {"mail": provider})
        ops.dispatch(leases[0], "send", "mail", {"warm": True})
        before = _server_counts(store.engine)
        started = time.perf_counter()
        for lease in leases[1:]:
            t0 = time.perf_counter()
            receipt = ops.dispatch(lease, "send", "mail", {"to": lease.subject})
            latencies.append(time.perf_counter() - t0)
            if receipt.state != "ACCEPTED":
                raise RuntimeError(f"dispatch ended {receipt.state}")
        elapsed = time.perf_counter() - started
        after = _server_counts(store.engine)
    store.finish_batch(leases)
    store.dispose()
    n = len(latencies)
    commits, rows = (after[0] - before[0]) / n, (after[1] - before[1]) / n
    return n / elapsed, statistics.median(latencies) * 1000, commits, rows


def _server_counts(engine: sa.Engine) -> tuple[float, float]:
    """PostgreSQL's own count of committed transactions and of rows inserted or updated in
    this database (what the client's statements did, whether SQLAlchemy or raw psycopg sent
    them); NaN on SQLite. A backend reports its statistics late (up to 10 s when idle) but
    always when it exits: close the pool's connections first."""
    if engine.dialect.name != "postgresql":
        return float("nan"), float("nan")
    engine.dispose()
    time.sleep(1.0)
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
        commits, rows = conn.execute(
            sa.text(
                "SELECT xact_commit, tup_inserted + tup_updated FROM pg_stat_database"
                " WHERE datname = current_database()"
            )
        ).one()
    return float(commits), float(rows)


def worker_processes(
    db_url: str, sim: Simulator, jobs: int, processes: int, concurrency: int
) -> tuple[float, int]:
    """(dispatches/s, jobs handled including the warm-up) of ``processes`` outbox-worker
    processes draining ``jobs`` email jobs."""
    from consumer import Store

    store = Store(db_url)
    tag = uuid.uuid4().hex[:8]
    base = store.counts()["DONE"]  # jobs of earlier figures
    env = dict(
        os.environ,
        BENCH_SIMULATOR_URL=sim.url,
        OUTBOX_DATABASE_URL=db_url,
        OUTBOX_LOG_LEVEL="warning",
        PYTHONPATH=str(ROOT),
    )
    batch = max(1, concurrency)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumer.jobs.cli",
                "run",
                "bench.dispatch:build_worker",
                "--concurrency",
                str(concurrency),
                "--batch-size",
                str(batch),
            ],
            cwd=ROOT,
            env=env,
        )
        for _ in range(processes)
    ]
    try:
        # warm up: every loop of every process has handled a job before the clock starts
        warm = processes * concurrency * 2
        store.enqueue_many(
            [{"tenant": "bench", "action": f"email-warm-{tag}-{i}"} for i in range(warm)]
        )
        _wait_done(store, base + warm, procs)
        store.enqueue_many(
            [
                {"tenant": "bench", "action": f"email-{tag}-{i}", "subject": f"w{i}@example.com"}
                for i in range(jobs)
            ]
        )
        started = time.perf_counter()
        _wait_done(store, base + warm + jobs, procs)
        elapsed = time.perf_counter() - started
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    store.dispose()
    return jobs / elapsed, warm + jobs


def _wait_done(store: Any, total: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 900
    while True:
        counts = store.counts()
        if counts["DONE"] >= total:
            return
        stuck = {k: v for k, v in counts.items() if k not in ("DONE", "READY", "LEASED") and v}
        if stuck:
            raise RuntimeError(f"jobs left the happy path: {stuck}")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker process exited")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not drained: {counts}")
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench dispatch", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--calls", type=int, default=2000, help="bare and direct dispatch calls")
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per worker configuration")
    parser.add_argument("--skip-workers", action="store_true")
    args = parser.parse_args(argv)

    schema = None
    admin = None
    db_url = args.database_url
    if db_url.startswith("postgresql"):
        schema = f"bench_dispatch_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        sep = "&" if "?" in db_url else "?"
        db_url = f"{db_url}{sep}options=-csearch_path%3D{schema}"
    tmp = tempfile.TemporaryDirectory(prefix="bench-dispatch-")
    sim = Simulator(str(Path(tmp.name) / "effects.db"))
    try:
        print(f"simulator {sim.url}; database {sa.engine.make_url(db_url).get_backend_name()}")
        bare_rate, bare_ms = bare_http(sim.url, args.calls)
        print(
            f"bare HTTP (HttpProvider.send, 1 thread): {bare_rate:,.0f} calls/s, "
            f"median {bare_ms:.2f} ms",
            flush=True,
        )
        commit_ms = bare_commit(db_url, min(args.calls, 500))
        print(f"bare committed INSERT (the disk's flush): median {commit_ms:.2f} ms", flush=True)
        sim.clear()
        rate, ms, commits, rows = direct_dispatch(db_url, sim.url, args.calls)
        writes = ms - bare_ms
        print(
            f"Operations.dispatch (intent + HTTP + receipt, 1 thread): {rate:,.0f} dispatches/s,"
            f" median {ms:.2f} ms | ratio {ms / bare_ms:.2f}x the bare call"
            f" | intent+receipt writes {writes:.2f} ms per dispatch"
            f" = {writes / commit_ms:.1f} bare commits"
            f" ({commits:.1f} commits, {rows:.1f} rows written per dispatch, counted by"
            " the server)",
            flush=True,
        )
        if not args.skip_workers:
            for processes, concurrency in ((1, 1), (4, 8)):
                sim.clear()
                rate, handled = worker_processes(db_url, sim, args.jobs, processes, concurrency)
                effects = len(sim.effects())
                print(
                    f"{processes} worker process(es) x concurrency {concurrency}:"
                    f" {rate:,.0f} dispatches/s ({handled} jobs, {effects} effects,"
                    f" duplicates {effects - handled})",
                    flush=True,
                )
    finally:
        sim.stop()
        tmp.cleanup()
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            admin.dispose()
    return 0
