"""``python -m bench jobs --slots``: one worker's slots against the simplest hand-written loop.

Issue 44's cells, each in one run on the same PostgreSQL, in fresh schemas, alternated:

- **hand loop**: 16 threads of the classic loop on a bare table (claim one row with
  ``FOR UPDATE SKIP LOCKED`` and commit, mark it done and commit), draining ``--jobs`` rows;
- **worker, concurrency=16**: one ``Worker(concurrency=16).run()`` with a no-op handler
  draining ``--jobs`` jobs enqueued before it started (defaults otherwise), and the same
  with ``claim_ahead=True``;
- **CPU per job**: this process's CPU (the worker, or the hand loop) plus that of the
  PostgreSQL backends serving it (``/proc/PID/stat`` of the backends whose
  ``application_name`` is the cell's), per job;
- **default concurrency**: the worker with its defaults;
- **latency**: enqueue -> handler start at ``--rate`` jobs/s for ``--seconds``, 16 slots
  (p50, p99), with the defaults and with ``claim_ahead``.

The tables are read as a user's are: written through the public API (the worker's) or one
INSERT (the hand loop's), with no ANALYZE or VACUUM of the bench's own; autovacuum runs as
it would. The machine is shared: read the ratios inside one run, not the absolutes.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from outbox.hooks import Hooks

TICKS = os.sysconf("SC_CLK_TCK")


def _url(base: str, schema: str, app: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}&application_name={app}"


def _backend_cpu(admin: sa.Engine, app: str) -> dict[int, float]:
    with admin.connect() as conn:
        pids = conn.execute(
            sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :a"), {"a": app}
        ).scalars()
        found: dict[int, float] = {}
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                found[pid] = (int(fields[11]) + int(fields[12])) / TICKS
            except (OSError, IndexError, ValueError):
                continue
    return found


class _Cpu:
    """This process's CPU and its PostgreSQL backends' (by application_name) over a span."""

    def __init__(self, admin: sa.Engine, app: str) -> None:
        self.admin, self.app = admin, app
        self.backends = _backend_cpu(admin, app)
        self.process = time.process_time()

    def spent(self) -> tuple[float, float]:
        process = time.process_time() - self.process
        after = _backend_cpu(self.admin, self.app)
        server = sum(cpu - self.backends.get(pid, 0.0) for pid, cpu in after.items())
        return process, server


def _shape(work: tuple[float, ...]) -> str:
    """A cell's job shape as the bench prints it: ``no-op``, ``5 ms`` or ``mix 0/1/5/50 ms``."""
    if work == (0.0,):
        return "no-op"
    ms = "/".join(f"{w * 1000:g}" for w in work)
    return f"mix {ms} ms" if len(work) > 1 else f"{ms} ms"


def _handlers(work: tuple[float, ...], asynchronous: bool) -> dict[str, Callable[..., Any]]:
    """One handler per job kind ``w{i}``: it waits ``work[i]`` seconds, as a handler waiting
    on I/O does (``time.sleep`` in a ``def`` handler, ``asyncio.sleep`` in an ``async def``
    one); ``0`` returns at once."""
    import asyncio

    def make(seconds: float) -> Callable[..., Any]:
        if asynchronous:

            async def waits_async(job: Any) -> None:
                if seconds:
                    await asyncio.sleep(seconds)

            return waits_async

        def waits(job: Any) -> None:
            if seconds:
                time.sleep(seconds)

        return waits

    return {f"w{i}": make(seconds) for i, seconds in enumerate(work)}


def hand_loop(
    admin: sa.Engine, base: str, count: int, threads: int, work: tuple[float, ...] = (0.0,)
) -> dict[str, float]:
    schema, app = f"bench_hand_{uuid.uuid4().hex[:8]}", f"hand{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(
            sa.text(
                f'CREATE TABLE "{schema}".q (id bigserial PRIMARY KEY, state text NOT NULL '
                "DEFAULT 'ready', payload text)"
            )
        )
        conn.execute(sa.text(f"CREATE INDEX ON \"{schema}\".q (id) WHERE state = 'ready'"))
        conn.execute(
            sa.text(
                f'INSERT INTO "{schema}".q (payload) SELECT (CAST(:w AS float8[]))'
                "[1 + i % cardinality(CAST(:w AS float8[]))]::text "
                "FROM generate_series(0, :n - 1) AS i"
            ),
            {"n": count, "w": list(work)},
        )
    engine = sa.create_engine(_url(base, schema, app), pool_size=threads, max_overflow=0)
    try:
        with engine.connect():
            pass
        claim = sa.text(
            "UPDATE q SET state = 'running' WHERE id = (SELECT id FROM q WHERE state = 'ready' "
            "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id, payload"
        )
        done = sa.text("UPDATE q SET state = 'done' WHERE id = :id")

        def loop() -> None:
            with engine.connect() as conn:
                while True:
                    with conn.begin():
                        row = conn.execute(claim).first()
                    if row is None:
                        return
                    if float(row[1]):  # the job's work: waiting on I/O, as the worker's
                        time.sleep(float(row[1]))
                    with conn.begin():
                        conn.execute(done, {"id": row[0]})

        workers = [threading.Thread(target=loop) for _ in range(threads)]
        cpu = _Cpu(admin, app)
        started = time.perf_counter()
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        elapsed = time.perf_counter() - started
        process, server = cpu.spent()
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    return {"rate": count / elapsed, "cpu_ms": (process + server) / count * 1000}


class _Counting(Hooks):
    """Hooks: counts finished jobs, and wakes the bench when ``target`` are done."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.done = 0
        self.reached = threading.Event()

    def worker_job_finished(self, action: str, outcome: str, duration_seconds: float) -> None:
        self.done += 1
        if self.done >= self.target:
            self.reached.set()


def worker_drain(
    admin: sa.Engine,
    base: str,
    count: int,
    work: tuple[float, ...] = (0.0,),
    asynchronous: bool = False,
    **options: Any,
) -> dict[str, float]:
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    schema, app = f"bench_slots_{uuid.uuid4().hex[:8]}", f"slots{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    store = Store(_url(base, schema, app))
    try:
        for start in range(0, count, 5000):
            store.enqueue_many(
                [
                    {"tenant": f"t{i % 4}", "action": f"job-{i}", "kind": f"w{i % len(work)}"}
                    for i in range(start, min(count, start + 5000))
                ]
            )
        hooks = _Counting(count)
        worker = Worker(store, hooks=hooks, **options)
        for kind, handler in _handlers(work, asynchronous).items():
            worker.register(kind, handler)
        runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        cpu = _Cpu(admin, app)
        started = time.perf_counter()
        runner.start()
        hooks.reached.wait(600)
        elapsed = time.perf_counter() - started
        process, server = cpu.spent()
        worker.stop()
        runner.join(60)
        if hooks.done < count:
            raise RuntimeError(f"worker: {hooks.done} of {count} done")
    finally:
        store.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    return {"rate": count / elapsed, "cpu_ms": (process + server) / count * 1000}


def latency(
    admin: sa.Engine,
    base: str,
    rate: float,
    seconds: float,
    work: tuple[float, ...] = (0.0,),
    asynchronous: bool = False,
    **options: Any,
) -> str:
    """Enqueue -> handler start at ``rate`` jobs/s, one worker, jobs that then wait
    ``work`` (cycled): p50 and p99 in ms."""
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    schema, app = f"bench_lat_{uuid.uuid4().hex[:8]}", f"lat{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    store = Store(_url(base, schema, app))
    waits: list[float] = []
    try:
        worker = Worker(store, concurrency=16, **options)

        for kind, waits_for in _handlers(work, asynchronous).items():

            def started(job: Any, waits_for: Callable[..., Any] = waits_for) -> Any:
                waits.append(time.time() - float(job.payload["at"]))
                return waits_for(job)

            if asynchronous:

                async def started_async(job: Any, started: Callable[..., Any] = started) -> None:
                    await started(job)

                worker.register(kind, started_async)
            else:
                worker.register(kind, started)
        runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
        runner.start()
        time.sleep(1.0)  # the worker's first claim and its connections
        total = int(rate * seconds)
        begun = time.perf_counter()
        for i in range(total):
            due = begun + i / rate
            pause = due - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            kind = f"w{i % len(work)}"
            store.enqueue("t", f"job-{i}", kind=kind, payload={"at": time.time()})
        deadline = time.monotonic() + 30
        while len(waits) < total and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.stop()
        runner.join(60)
    finally:
        store.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    ms = sorted(w * 1000 for w in waits)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))] if ms else float("nan")
    return f"p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms ({len(ms)} jobs)"


def run_cells(
    url: str,
    count: int,
    rounds: int,
    rate: float,
    seconds: float,
    work: tuple[float, ...] = (0.0,),
    asynchronous: bool = False,
) -> None:
    """The drains (hand loop, ``concurrency=16``, defaults) of ``count`` jobs that each wait
    ``work`` (cycled over the jobs: a mix in one queue), alternated over ``rounds``, then the
    enqueue -> start latency at ``rate`` jobs/s with the same jobs."""
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    shape = _shape(work) + (" async def" if asynchronous else " def")
    print(
        f"slots cell: {count:,} jobs per drain ({shape}), {rounds} alternated rounds, "
        f"{os.cpu_count()} cores (shared: other processes run beside it)",
        flush=True,
    )
    drain = {"work": work, "asynchronous": asynchronous}
    cells: list[tuple[str, Callable[[], dict[str, float]]]] = [
        ("hand loop, 16 threads", lambda: hand_loop(admin, url, count, 16, work)),
        ("worker concurrency=16", lambda: worker_drain(admin, url, count, concurrency=16, **drain)),
        ("worker defaults", lambda: worker_drain(admin, url, count, **drain)),
    ]
    if asynchronous:  # the peer on the same jobs: pgqueuer's async worker, 16 in flight
        from bench.jobs_pgqueuer import pgqueuer_drain, settings

        shown = ", ".join(f"{k}={v}" for k, v in settings(16).items())
        print(f"pgqueuer: QueueManager.run({shown}), asyncpg, defaults otherwise", flush=True)
        cells.append(
            ("pgqueuer async, 16 in flight", lambda: pgqueuer_drain(admin, url, count, work))
        )
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in cells}
    for round_ in range(rounds):
        order = cells if round_ % 2 == 0 else list(reversed(cells))
        for name, cell in order:
            found = cell()
            results[name].append(found)
            print(
                f"  round {round_ + 1} {name}: {found['rate']:,.0f} jobs/s, "
                f"CPU {found['cpu_ms']:.3f} ms/job (process + its PostgreSQL backends)",
                flush=True,
            )
    hand = statistics.median(r["rate"] for r in results["hand loop, 16 threads"])
    for name, found in results.items():
        rate_ = statistics.median(r["rate"] for r in found)
        cpu = statistics.median(r["cpu_ms"] for r in found)
        print(
            f"{shape}, {name}: median {rate_:,.0f} jobs/s (x{rate_ / hand:.2f} the hand loop), "
            f"CPU {cpu:.3f} ms/job",
            flush=True,
        )
    if seconds > 0:
        print(
            f"enqueue -> start at {rate:.0f}/s, 16 slots, {shape}: "
            f"{latency(admin, url, rate, seconds, work=work, asynchronous=asynchronous)}",
            flush=True,
        )
    admin.dispose()


def held_backlog(
    url: str,
    seconds: float,
    backlog: int,
    *,
    prometheus: bool = False,
    concurrency: int | None = 16,
    work: tuple[float, ...] = (0.0,),
    asynchronous: bool = False,
    **options: Any,
) -> None:
    """One ``Worker(concurrency=16).run()`` for ``seconds`` while a producer process keeps
    about ``backlog`` jobs READY (the third-party harness's shape: 16 in flight, a backlog
    held at 4,000): jobs/s per 10-s window, and the dead tuples the churn leaves.

    ``prometheus``: the worker reports to ``metrics.start_metrics(0, engine=...)``'s hooks,
    as ``outbox-worker run --metrics-port`` wires them, scraped every 10 s; the rate is read
    from their ``outbox_worker_jobs_finished`` counter. ``concurrency`` None: the default."""
    import multiprocessing

    from bench.jobs import keep_ready
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    schema, app = f"bench_held_{uuid.uuid4().hex[:8]}", f"held{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    cell_url = _url(url, schema, app)
    store = Store(cell_url)  # creates the tables before the producer writes
    spawn = multiprocessing.get_context("spawn")
    stop, made = spawn.Event(), spawn.Value("q", 0)
    # In a process of its own, as the third-party harness runs it.
    producer = spawn.Process(
        target=keep_ready,
        args=(cell_url, backlog, stop, made),
        kwargs={"chunk": 500, "pause": 0.02, "kinds": len(work)},
    )
    counting = _Counting(10**12)
    hooks: Hooks = counting
    finished: Callable[[], float] = lambda: counting.done  # noqa: E731
    if prometheus:
        from metrics import start_metrics

        served = start_metrics(0, engine=store.engine)
        hooks = served
        name = "outbox_worker_jobs_finished_total"

        def finished() -> float:
            return sum(
                served.registry.get_sample_value(name, {"action": kind, "outcome": "done"}) or 0.0
                for kind in _handlers(work, asynchronous)
            )

    if concurrency is not None:
        options["concurrency"] = concurrency
    worker = Worker(store, hooks=hooks, **options)
    for kind, handler in _handlers(work, asynchronous).items():
        worker.register(kind, handler)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    shown = {**options, "metrics": "prometheus"} if prometheus else dict(options)
    shown["jobs"] = _shape(work) + (" async def" if asynchronous else " def")
    shown.setdefault("concurrency", "default")
    print(
        f"held backlog: {seconds:.0f} s, one worker, {shown}, a producer "
        f"process keeping about {backlog:,} READY",
        flush=True,
    )
    print("  window   jobs/s   READY   dead tuples", flush=True)
    rates: list[float] = []
    try:
        producer.start()
        while made.value < backlog:  # the backlog is there before the worker starts
            time.sleep(0.05)
        runner.start()
        started, last = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            time.sleep(10.0)
            if prometheus:  # a scrape each window (Prometheus's usual interval is 15-60 s)
                _scrape(hooks)
            done = int(finished())
            rates.append((done - last) / 10.0)
            last = done
            with admin.connect() as conn:
                ready, dead = conn.execute(
                    sa.text(
                        f'SELECT (SELECT count(*) FROM "{schema}".outbox_jobs '
                        "WHERE state = 'READY'), (SELECT n_dead_tup FROM pg_stat_user_tables "
                        "WHERE schemaname = :s AND relname = 'outbox_jobs')"
                    ),
                    {"s": schema},
                ).one()
            print(
                f"  {len(rates) * 10:>4} s  {rates[-1]:>7,.0f}  {ready:>6,}  {dead:>11,}",
                flush=True,
            )
    finally:
        stop.set()
        worker.stop()
        if runner.is_alive():
            runner.join(60)
        if producer.pid is not None:
            producer.join(60)
        if prometheus:
            hooks.close()  # type: ignore[attr-defined]
        store.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
    if rates:
        print(
            f"held backlog: median {statistics.median(rates):,.0f} jobs/s over {len(rates)} "
            f"windows (first {rates[0]:,.0f}, last {rates[-1]:,.0f})",
            flush=True,
        )


def _scrape(hooks: Any) -> None:
    """One scrape of the worker's metrics page, as Prometheus would make it."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{hooks.port}/metrics", timeout=30) as page:
        page.read()
