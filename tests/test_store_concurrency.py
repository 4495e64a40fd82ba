"""Concurrency and fairness of the job store (guarantee 7 under load)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest
import sqlalchemy as sa

from consumer.jobs.schema import attempts, jobs
from consumer.jobs.store import Store

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow


def _bulk_enqueue(store: Store, tenant: str, count: int, prefix: str = "job") -> None:
    # Seeding only: one executemany instead of `count` enqueue round trips.
    with store.engine.begin() as conn:
        conn.execute(
            sa.insert(jobs),
            [
                {"tenant": tenant, "action": f"{prefix}-{i}", "created_at": 0.0, "updated_at": 0.0}
                for i in range(count)
            ],
        )


@pytest.mark.slow
def test_no_job_is_ever_held_by_two_workers(pg_url: str) -> None:
    """8 worker threads against PostgreSQL, 5,000 jobs: each done exactly once, by one
    holder, and every history row agrees with the final epochs."""
    store = Store(pg_url)
    _bulk_enqueue(store, "t", 5000)
    finished: list[tuple[int, int, str]] = []
    conflicts: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            while True:
                leases = store.claim_batch(name, 25, ttl=60)
                if not leases:
                    return
                # alternate single fenced finishes and batch finishes
                if leases[0].job_id % 2:
                    for lease in leases:
                        store.finish(lease)
                    ok = [lease.job_id for lease in leases]
                    lost: list[int] = []
                else:
                    result = store.finish_batch(leases)
                    ok, lost = result.done, result.conflicts
                with lock:
                    finished.extend((x.job_id, x.epoch, name) for x in leases if x.job_id in ok)
                    conflicts.extend(lost)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert conflicts == []
    ids = Counter(job_id for job_id, _, _ in finished)
    assert len(ids) == 5000 and set(ids.values()) == {1}
    assert store.counts()["DONE"] == 5000
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.select(attempts.c.job_id, attempts.c.outcome, attempts.c.epoch, attempts.c.worker)
        ).all()
        epochs = dict(conn.execute(sa.select(jobs.c.id, jobs.c.lease_epoch)).all())
    assert len(rows) == 5000
    assert Counter(r.job_id for r in rows) == Counter(ids)
    assert {r.outcome for r in rows} == {"done"}
    assert all(epochs[r.job_id] == r.epoch == 1 for r in rows)
    by_job = {job_id: worker for job_id, _, worker in finished}
    assert all(by_job[r.job_id] == r.worker for r in rows)
    assert len({worker for _, _, worker in finished}) > 1
    store.dispose()


def test_fairness_small_tenant_is_not_starved_by_a_big_one(db_url: str) -> None:
    """Tenant A has 10,000 READY jobs, tenant B 10 (enqueued after A's). With two tenants
    B's fair share is half the claims: all of B's 10 are claimed within the first 20."""
    store = Store(db_url)
    _bulk_enqueue(store, "A", 10_000)
    _bulk_enqueue(store, "B", 10)
    claimed = []
    for _ in range(20):
        lease = store.claim_next("w", ttl=600)
        assert lease is not None
        claimed.append(lease.tenant)
    assert claimed.count("B") == 10
    # batches share too: a fresh store claiming 40 at once takes at most half from A
    other = Store(db_url, create_schema=False)
    _bulk_enqueue(store, "C", 10)
    batch = other.claim_batch("w2", 40, ttl=600)
    tally = Counter(lease.tenant for lease in batch)
    assert tally["C"] == 10 and tally["A"] <= 20 and "B" not in tally
    store.dispose()
    other.dispose()


def test_fairness_holds_across_concurrent_claimers(pg_url: str) -> None:
    store = Store(pg_url)
    _bulk_enqueue(store, "A", 2000)
    _bulk_enqueue(store, "B", 20)
    stores = [Store(pg_url, create_schema=False) for _ in range(4)]
    order: list[str] = []
    lock = threading.Lock()

    def work(s: Store, name: str) -> None:
        for _ in range(15):
            leases = s.claim_batch(name, 2, ttl=600)
            with lock:
                order.extend(lease.tenant for lease in leases)

    threads = [threading.Thread(target=work, args=(s, f"w{i}")) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert order[:60].count("B") == 20  # B done within its half of the first 60 claims
    for s in (store, *stores):
        s.dispose()


CREATE_ALL = textwrap.dedent(
    """
    import sys
    from consumer import Consumer, Store
    from outbox import Outbox

    url = sys.argv[1]
    print("ready", flush=True)
    sys.stdin.readline()  # all start at one moment: when the test says go
    Outbox(url).create_schema()
    Consumer(url, "redis://127.0.0.1:1/0", group="g", topics=["t"]).create_schema()
    Store(url).dispose()
    """
)


def test_processes_creating_the_tables_of_a_fresh_sqlite_file_at_once(tmp_path: Path) -> None:
    """The embedded default's first start: the app, the relay and the consumer each create
    their tables in the same new SQLite file at the same moment. create_all reads, then
    writes; in a plain BEGIN the loser's upgrade failed at once with "database is locked"
    (the FastAPI example's billing process died of it). BEGIN IMMEDIATE waits instead."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CREATE_ALL, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(6)
    ]
    for proc in procs:  # every process imported and ready, then all go at once
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, "\n".join(outputs)
