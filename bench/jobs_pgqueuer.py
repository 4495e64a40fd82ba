"""pgqueuer's async worker on the job shape of ``python -m bench jobs --slots --async``.

The peer cell of issue 52: pgqueuer (PyPI, a dev dependency) in a fresh schema of the same
PostgreSQL, ``count`` jobs enqueued through its public API before its worker starts, then one
``QueueManager.run()`` with 16 jobs in flight whose entrypoints ``await asyncio.sleep(w)``,
timed until every job's finish is written, as ``jobs_slots.worker_drain`` times ours.

Its settings, from its performance-tuning guide: a single asyncpg connection for the
``QueueManager`` (its "use a direct asyncpg connection for the QueueManager"), the producer on
a connection of its own; ``max_concurrent_tasks=16`` (the 16 in flight) and ``batch_size=8``,
the largest batch it accepts under that cap (it requires ``max_concurrent_tasks >=
2 * batch_size``; its guide: raise ``batch_size`` for jobs shorter than a second). Its
defaults otherwise (durability, dequeue timeout, heartbeats, log aggregation, the plain
asyncio loop).

Not psycopg's driver (``driver="psycopg"`` keeps it, to show why): pgqueuer's
``PsycopgDriver`` listens and queries on one ``AsyncConnection``, and psycopg's
``notifies()`` holds the connection's lock while it waits (up to its 1-s timeout, or the next
NOTIFY), so each of the worker's queries waits for it: 25-46 jobs/s on 1-ms jobs here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import sqlalchemy as sa
from pgqueuer import Job, Queries, QueueManager
from pgqueuer.ports.driver import Driver

from bench.jobs_slots import _Cpu, _url

ENQUEUE_BATCH = 1000


def settings(concurrency: int) -> dict[str, int]:
    """``QueueManager.run``'s options for ``concurrency`` jobs in flight: the cap, and the
    largest batch pgqueuer accepts under it."""
    return {"max_concurrent_tasks": concurrency, "batch_size": max(1, concurrency // 2)}


class _Connect:
    """Connections to the cell's schema (search_path) under its application_name, through
    pgqueuer's asyncpg or psycopg driver."""

    def __init__(self, base: str, schema: str, app: str, driver: str) -> None:
        if driver not in ("asyncpg", "psycopg"):
            raise ValueError(f"driver: 'asyncpg' or 'psycopg', not {driver!r}")
        url = sa.engine.make_url(base).set(drivername="postgresql")
        self.dsn = url.render_as_string(hide_password=False)
        self.conninfo = _conninfo(base, schema, app)
        self.settings = {"search_path": schema, "application_name": app}
        self.driver = driver

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[Driver]:
        if self.driver == "asyncpg":
            conn = await asyncpg.connect(self.dsn, server_settings=self.settings)
            try:
                yield Queries.from_asyncpg_connection(conn).driver
            finally:
                await conn.close()
            return
        async with await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True) as pconn:
            yield Queries.from_psycopg_connection(pconn).driver


def _conninfo(base: str, schema: str, app: str) -> str:
    """A libpq URI (psycopg's) with the cell's search_path and application_name."""
    url = sa.engine.make_url(_url(base, schema, app)).set(drivername="postgresql")
    return url.render_as_string(hide_password=False)


class _Finished(Queries):
    """pgqueuer's Queries, counting the finishes its worker writes (``log_jobs``: the jobs
    leave the queue table for the log table), as our worker's hooks count ours."""

    def __init__(self, driver: Any, target: int) -> None:
        super().__init__(driver)
        self.target, self.done, self.failed = target, 0, 0
        self.reached = asyncio.Event()

    async def log_jobs(self, job_status: Any) -> None:
        await super().log_jobs(job_status)
        self.done += len(job_status)
        self.failed += sum(1 for _, status, _ in job_status if status != "successful")
        if self.done >= self.target:
            self.reached.set()


def pgqueuer_drain(
    admin: sa.Engine,
    base: str,
    count: int,
    work: tuple[float, ...] = (0.0,),
    concurrency: int = 16,
    driver: str = "asyncpg",
) -> dict[str, float]:
    """``count`` jobs (entrypoint ``w{i % len(work)}`` waits ``work[i % len(work)]``)
    drained by one pgqueuer ``QueueManager`` with ``concurrency`` in flight: jobs per second
    from its start to the last finish written, and CPU per job (this process and its
    PostgreSQL backends)."""
    schema, app = f"bench_pgq_{uuid.uuid4().hex[:8]}", f"pgq{uuid.uuid4().hex[:6]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    connect = _Connect(base, schema, app, driver)
    try:
        return asyncio.run(_drain(admin, connect, app, count, work, concurrency))
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


async def _enqueue(connect: _Connect, count: int, kinds: list[str]) -> None:
    """pgqueuer's schema in the cell's (its search_path), and ``count`` jobs through its
    batch enqueue, on a producer connection of their own."""
    async with connect() as producer:
        queries = Queries(producer)
        await queries.install()
        for start in range(0, count, ENQUEUE_BATCH):
            size = min(count - start, ENQUEUE_BATCH)
            await queries.enqueue(
                [kinds[i % len(kinds)] for i in range(start, start + size)],
                [None] * size,
                [0] * size,
            )


async def _drain(
    admin: sa.Engine,
    connect: _Connect,
    app: str,
    count: int,
    work: tuple[float, ...],
    concurrency: int,
) -> dict[str, float]:
    kinds = [f"w{i}" for i in range(len(work))]
    await _enqueue(connect, count, kinds)
    async with connect() as driver:
        finished = _Finished(driver, count)
        manager = QueueManager(finished)
        for kind, seconds in zip(kinds, work, strict=True):

            async def waits(job: Job, seconds: float = seconds) -> None:
                if seconds:
                    await asyncio.sleep(seconds)

            manager.entrypoint(kind)(waits)
        cpu = _Cpu(admin, app)
        started = time.perf_counter()
        running = asyncio.create_task(manager.run(**settings(concurrency)))
        reached = asyncio.create_task(finished.reached.wait())
        await asyncio.wait((running, reached), timeout=600, return_when=asyncio.FIRST_COMPLETED)
        elapsed = time.perf_counter() - started
        process, server = cpu.spent()
        manager.shutdown.set()
        reached.cancel()
        await asyncio.wait_for(running, 60)  # raises what the worker raised, if it did
    if finished.done < count or finished.failed:
        raise RuntimeError(
            f"pgqueuer: {finished.done} of {count} finished, {finished.failed} not done"
        )
    return {"rate": count / elapsed, "cpu_ms": (process + server) / count * 1000}
