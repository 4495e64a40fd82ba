"""``python -m bench jobs``: claim+finish throughput of no-op jobs, ours vs procrastinate.

Both run against the same PostgreSQL database in the same run, each in its own fresh
schema (dropped afterwards). Ours: ``N`` threads of one :class:`consumer.Worker` calling
``run_once()`` (fair batch claim with FOR UPDATE SKIP LOCKED, a no-op handler, one fenced
``finish_batch`` per cycle; every job keeps its own epoch compare-and-set and history row).
Procrastinate: a worker with ``concurrency=N`` draining deferred no-op tasks (``wait=False``).
Figures are jobs per second and the ratio at each concurrency; the machine is shared, so
read ratios, not absolutes.

Options: ``--jobs`` (ours, per concurrency), ``--procrastinate-jobs``, ``--concurrency 1,4,8``,
``--batch-size``, ``--database-url``, ``--skip-procrastinate``.

``--slots``: issue 44's cells (``bench/jobs_slots.py``): one ``Worker(concurrency=16)``
against 16 threads of a hand-written ``FOR UPDATE SKIP LOCKED`` loop, CPU per job, the
default concurrency, and enqueue -> handler start at ``--rate`` jobs/s.

``--steady SECONDS``: ours only, at the first ``--concurrency`` level: the claim rate per
10-s window while a producer keeps ``--steady-backlog`` jobs READY (does it decay as
finished jobs leave dead tuples behind?).

``--slots --hold SECONDS [--steady-backlog 4000] [--claim-ahead] [--prometheus]``: one
``Worker.run()`` at ``concurrency=16`` while a producer process keeps the backlog READY, per
10-s window (``--prometheus``: reporting to ``metrics.start_metrics``'s hooks;
``--hold-defaults``: at the default concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import types
import uuid
from typing import Any

import sqlalchemy as sa

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def _seed(engine: sa.Engine, count: int, tag: str) -> None:
    from consumer.jobs.schema import jobs

    rows = [
        {"tenant": "bench", "action": f"noop-{tag}-{i}", "created_at": 0.0, "updated_at": 0.0}
        for i in range(count)
    ]
    with engine.begin() as conn:
        for start in range(0, count, 5000):
            conn.execute(sa.insert(jobs), rows[start : start + 5000])
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE outbox_jobs"))


def run_ours(url: str, count: int, concurrency: int, batch_size: int, tag: str) -> float:
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    store = Store(url)
    _seed(store.engine, count, tag)
    worker = Worker(store, batch_size=batch_size, concurrency=concurrency)
    worker.register("noop", lambda job: None)
    done = [0] * concurrency

    def loop(index: int) -> None:
        while True:
            handled = worker.run_once()
            if not handled:
                return
            done[index] += handled

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    counts = store.counts()
    worker.stop()
    store.dispose()
    if counts["DONE"] < count or sum(done) != count:
        raise RuntimeError(f"ours: expected {count} DONE, got {counts} ({sum(done)} handled)")
    return count / elapsed


def keep_ready(
    url: str, backlog: int, stop: Any, made: Any, *, chunk: int, pause: float, kinds: int = 0
) -> None:
    """A producer through the public API: ``Store.enqueue_many`` of ``chunk`` no-op jobs
    whenever fewer than ``backlog`` are READY, else a ``pause``, until ``stop`` (an Event,
    threading's or multiprocessing's) is set; ``made.value`` counts the jobs enqueued (a
    shared ``Value`` when it runs in a process of its own). Module-level, so that a spawned
    process can run it (``bench/jobs_slots.py``'s held backlog)."""
    from consumer.jobs.store import Store

    producer = Store(url)
    # The READY count from the partial READY index (Store.counts() groups the whole table,
    # which grows by every finished job: after a few minutes the producer's own count
    # starved the workers and the bench measured the producer, not the claim).
    counter = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)
    ready = sa.text("SELECT count(*) FROM outbox_jobs WHERE state = 'READY'")
    try:
        while not stop.is_set():
            with counter.connect() as conn:
                waiting = int(conn.execute(ready).scalar_one())
            if waiting >= backlog:
                stop.wait(pause)
                continue
            first = made.value
            producer.enqueue_many(
                [
                    {
                        "tenant": f"t{i % 4}",
                        "action": f"noop-{i}",
                        "kind": f"w{i % kinds}" if kinds else "noop",
                    }
                    for i in range(first, first + chunk)
                ]
            )
            made.value = first + chunk
    finally:
        producer.dispose()
        counter.dispose()


def steady(url: str, seconds: float, concurrency: int, batch_size: int, backlog: int) -> None:
    """Workers claim and finish no-op jobs for ``seconds`` while a producer keeps about
    ``backlog`` READY jobs waiting (``enqueue_many``, 1,000 per call), so the workers are
    never starved and the claim rate is theirs. Every finished job leaves a dead tuple and a
    dead entry at the head of the READY index: the rate per 10-s window shows whether they
    pile up (without autovacuum the worker vacuums the job tables itself)."""
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    store = Store(url)
    worker = Worker(store, batch_size=batch_size, concurrency=concurrency)
    worker.register("noop", lambda job: None)
    stop = threading.Event()
    done = [0] * concurrency
    made = types.SimpleNamespace(value=0)

    def produce() -> None:
        keep_ready(url, backlog, stop, made, chunk=1000, pause=0.05)

    def loop(index: int) -> None:
        while not stop.is_set():
            handled = worker.run_once()
            done[index] += handled
            if not handled:
                stop.wait(0.01)

    threads = [threading.Thread(target=produce)]
    threads += [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    print(
        f"steady jobs run: {seconds:.0f} s, {concurrency} worker thread(s), batch {batch_size}, "
        f"about {backlog:,} READY jobs kept waiting",
        flush=True,
    )
    print("  window   claimed/s   READY   dead tuples   vacuums   head-scan ms", flush=True)
    for thread in threads:
        thread.start()
    rates: list[float] = []
    probe = sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_size=1)
    try:
        started = time.monotonic()
        last = 0
        while time.monotonic() - started < seconds:
            time.sleep(10.0)
            total = sum(done)
            rates.append((total - last) / 10.0)
            last = total
            with probe.connect() as conn:
                stats = conn.execute(
                    sa.text(
                        "SELECT n_dead_tup, vacuum_count + autovacuum_count "
                        "FROM pg_stat_user_tables "
                        "WHERE schemaname = current_schema() AND relname = 'outbox_jobs'"
                    )
                ).one()
                ready = conn.execute(
                    sa.text("SELECT count(*) FROM outbox_jobs WHERE state = 'READY'")
                ).scalar()
                t0 = time.perf_counter()
                conn.execute(
                    sa.text(
                        "SELECT id FROM outbox_jobs WHERE state = 'READY' AND tenant = 't0' "
                        "ORDER BY priority DESC, id LIMIT 100"
                    )
                ).all()
                scan = (time.perf_counter() - t0) * 1000
            print(
                f"  {time.monotonic() - started:5.0f}s {rates[-1]:>11,.0f} {ready:>7}"
                f" {stats[0]:>13} {stats[1]:>9} {scan:>14.2f}",
                flush=True,
            )
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        probe.dispose()
        worker.stop()
        store.dispose()
    if len(rates) >= 4:
        half = len(rates) // 2
        first, second = rates[:half], rates[half:]
        print(
            f"  claim rate: first half median {sorted(first)[len(first) // 2]:,.0f}/s, second "
            f"half median {sorted(second)[len(second) // 2]:,.0f}/s, last / first window "
            f"{rates[-1] / max(rates[0], 1):.2f}",
            flush=True,
        )


def run_procrastinate(conninfo: str, count: int, concurrency: int) -> float:
    import logging

    from procrastinate import App, PsycopgConnector

    logging.getLogger("procrastinate").setLevel(logging.WARNING)
    app = App(connector=PsycopgConnector(conninfo=conninfo, min_size=1, max_size=concurrency + 4))

    @app.task(name="noop", queue="bench")
    def noop() -> None:
        return None

    async def main() -> float:
        async with app.open_async():
            tables = await app.connector.execute_query_one_async(
                "SELECT to_regclass('procrastinate_jobs') IS NOT NULL AS present"
            )
            if not tables["present"]:
                await app.schema_manager.apply_schema_async()
            for start in range(0, count, 1000):
                await noop.batch_defer_async(*[{} for _ in range(min(1000, count - start))])
            started = time.perf_counter()
            await app.run_worker_async(
                queues=["bench"],
                concurrency=concurrency,
                wait=False,
                install_signal_handlers=False,
                listen_notify=False,
                fetch_job_polling_interval=0.05,
            )
            elapsed = time.perf_counter() - started
            left = await app.connector.execute_query_one_async(
                "SELECT count(*) AS n FROM procrastinate_jobs WHERE status = 'todo'"
            )
            if left["n"]:
                raise RuntimeError(f"procrastinate left {left['n']} jobs")
            return count / elapsed

    return asyncio.run(main())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench jobs", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--database-url", default=DEFAULT_URL)
    parser.add_argument("--jobs", type=int, default=20_000, help="our jobs per concurrency")
    parser.add_argument("--procrastinate-jobs", type=int, default=1_500)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--skip-procrastinate", action="store_true")
    parser.add_argument(
        "--steady", type=float, metavar="SECONDS", help="steady mode: claim rate per 10 s"
    )
    parser.add_argument("--steady-backlog", type=int, default=20_000)
    parser.add_argument(
        "--slots",
        action="store_true",
        help="issue 44's cells: one worker's slots against a 16-thread SKIP LOCKED loop, "
        "CPU per job, default concurrency, enqueue -> start latency (bench/jobs_slots.py)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="--slots: alternated rounds")
    parser.add_argument(
        "--work-ms",
        default="0",
        help="--slots: what each job's handler waits, in ms (time.sleep, or asyncio.sleep "
        "with --async); a comma list is a mix in one queue, cycled over the jobs "
        "(e.g. 0,1,5,50)",
    )
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="--slots: async def handlers (await asyncio.sleep) instead of def ones",
    )
    parser.add_argument("--rate", type=float, default=200.0, help="--slots: latency cell's jobs/s")
    parser.add_argument("--seconds", type=float, default=10.0, help="--slots: latency cell's run")
    parser.add_argument(
        "--hold",
        type=float,
        metavar="SECONDS",
        help="--slots: only the held-backlog cell, one worker at concurrency=16 for SECONDS "
        "while a producer process keeps --steady-backlog jobs READY",
    )
    parser.add_argument(
        "--hold-defaults",
        action="store_true",
        help="--hold: the worker at its default concurrency instead of 16",
    )
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="--hold: the worker reports to metrics.start_metrics's hooks (what outbox-worker "
        "run --metrics-port wires), scraped every 10 s",
    )
    args = parser.parse_args(argv)
    work = tuple(float(ms) / 1000 for ms in args.work_ms.split(",") if ms.strip()) or (0.0,)
    if args.slots and args.hold:
        from bench.jobs_slots import held_backlog

        held_backlog(
            args.database_url,
            args.hold,
            args.steady_backlog,
            prometheus=args.prometheus,
            concurrency=None if args.hold_defaults else 16,
            work=work,
            asynchronous=args.asynchronous,
        )
        return 0
    if args.slots:
        from bench.jobs_slots import run_cells

        run_cells(
            args.database_url,
            args.jobs,
            args.rounds,
            args.rate,
            args.seconds,
            work=work,
            asynchronous=args.asynchronous,
        )
        return 0
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    admin = sa.create_engine(args.database_url, isolation_level="AUTOCOMMIT")
    tag = uuid.uuid4().hex[:8]
    ours_schema, proc_schema = f"bench_jobs_{tag}", f"bench_procrastinate_{tag}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{ours_schema}"'))
        conn.execute(sa.text(f'CREATE SCHEMA "{proc_schema}"'))
    results: list[tuple[int, float, float | None]] = []
    try:
        ours_url = _schema_url(args.database_url, ours_schema)
        if args.steady:
            steady(ours_url, args.steady, levels[0], args.batch_size, args.steady_backlog)
            return 0
        plain = sa.engine.make_url(args.database_url).set(drivername="postgresql")
        conninfo = _schema_url(plain.render_as_string(hide_password=False), proc_schema)
        for level in levels:
            ours = run_ours(ours_url, args.jobs, level, args.batch_size, f"c{level}")
            theirs = (
                None
                if args.skip_procrastinate
                else run_procrastinate(conninfo, args.procrastinate_jobs, level)
            )
            results.append((level, ours, theirs))
            _print_row(level, ours, theirs)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{ours_schema}" CASCADE'))
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{proc_schema}" CASCADE'))
        admin.dispose()
    return 0


def _print_row(level: int, ours: float, theirs: float | None) -> None:
    ratio: Any = f"{ours / theirs:.1f}x" if theirs else "-"
    theirs_text = f"{theirs:,.0f}" if theirs else "-"
    print(
        f"concurrency {level}: ours {ours:,.0f} jobs/s | procrastinate {theirs_text} jobs/s"
        f" | ratio {ratio}",
        flush=True,
    )
