"""consumer.jobs.slots: one path for every job.

- A stop lets the jobs in the slots run to their end and claims nothing more.
- A draining worker never holds more leases than slots; most finishes go with the next claim.
- A freed slot starts its next job at once: short jobs flow through one slot while a long
  job holds the other (no slot waits on another's cycle or a batch of slots).
- ``def`` and ``async def`` handlers, quick and waiting, in one queue: every job once.
- ``claim_ahead`` is deprecated and without effect.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from consumer import Store, Worker, WorkerConfig
from tests.services import wait_for


def _states(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outbox_jobs GROUP BY state"))
        return {state: int(n) for state, n in rows}


def test_a_stop_lets_running_jobs_end_and_claims_nothing_more(pg_url: str) -> None:
    store = Store(pg_url)
    store.enqueue_many([{"tenant": "t", "action": f"hold-{i}"} for i in range(20)])
    go = threading.Event()
    started: list[int] = []
    worker = Worker(store, concurrency=2, poll_interval=0.05)

    @worker.handler("hold")
    def hold(job: object) -> None:
        started.append(1)
        go.wait(60)

    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    leased: list[int] = []
    try:
        wait_for(lambda: len(started) == 2, "both slots busy", timeout=60)
        for _ in range(20):  # a while with both slots busy: the lease count stays bounded
            leased.append(_states(store).get("LEASED", 0))
        worker.stop()
        assert _states(store).get("LEASED", 0) == 2  # the two running jobs keep theirs
    finally:
        go.set()
        runner.join(60)
    assert not runner.is_alive()
    assert max(leased) <= 2
    assert len(started) == 2
    assert _states(store) == {"DONE": 2, "READY": 18}
    store.dispose()


def test_a_freed_slot_starts_its_next_job_while_another_slot_is_held(pg_url: str) -> None:
    store = Store(pg_url)
    store.enqueue("t", "hold-0")
    store.enqueue_many([{"tenant": "t", "action": f"quick-{i}"} for i in range(200)])
    go = threading.Event()
    quick: list[int] = []
    worker = Worker(store, concurrency=2, poll_interval=0.05)

    @worker.handler("hold")
    def hold(job: object) -> None:
        go.wait(60)

    @worker.handler("quick")
    def run_quick(job: Any) -> None:
        quick.append(job.job_id)

    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        # The held slot never frees; the other slot runs all 200, one after another.
        wait_for(lambda: len(quick) == 200, "every quick job through one slot", timeout=60)
        wait_for(lambda: _states(store).get("DONE", 0) == 200, "their finishes", timeout=60)
        assert _states(store) == {"LEASED": 1, "DONE": 200}
    finally:
        go.set()
        worker.stop()
        runner.join(60)
    assert _states(store) == {"DONE": 201}
    store.dispose()


def test_def_and_async_handlers_quick_and_waiting_in_one_queue_each_run_once(
    db_url: str,
) -> None:
    store = Store(db_url)
    kinds = ("w0", "w1", "w5", "a0", "a5")
    store.enqueue_many(
        [{"tenant": f"t{i % 3}", "action": f"job-{i}", "kind": kinds[i % 5]} for i in range(300)]
    )
    seen: list[int] = []
    worker = Worker(store, concurrency=8)
    for kind, seconds in (("w0", 0.0), ("w1", 0.001), ("w5", 0.005)):

        def waits(job: Any, seconds: float = seconds) -> None:
            seen.append(job.job_id)
            time.sleep(seconds)

        worker.register(kind, waits)
    for kind, seconds in (("a0", 0.0), ("a5", 0.005)):

        async def waits_async(job: Any, seconds: float = seconds) -> None:
            seen.append(job.job_id)
            await asyncio.sleep(seconds)

        worker.register(kind, waits_async)
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: _states(store).get("DONE", 0) == 300, "every job DONE", timeout=120)
    finally:
        worker.stop()
        runner.join(60)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 300
    store.dispose()


def test_claim_ahead_is_deprecated_and_changes_nothing() -> None:
    with pytest.warns(DeprecationWarning, match="claim_ahead"):
        config = WorkerConfig(claim_ahead=True)
    assert config.concurrency == WorkerConfig().concurrency


def test_a_draining_worker_never_holds_more_leases_than_slots(pg_url: str) -> None:
    """The default path: the claim that takes a finished job's slot writes its finish in
    the same statement (``Store.finish_and_claim``), so at no moment does the worker hold
    more leases than slots, and each job runs once."""
    store = Store(pg_url)
    store.enqueue_many([{"tenant": f"t{i % 3}", "action": f"noop-{i}"} for i in range(600)])
    carried: list[int] = []
    finish_and_claim = store.finish_and_claim

    def counted(finished: Any, *args: Any, **kwargs: Any) -> Any:
        carried.append(len(finished))
        return finish_and_claim(finished, *args, **kwargs)

    store.finish_and_claim = counted  # type: ignore[method-assign]
    seen: list[int] = []
    worker = Worker(store, concurrency=4)
    worker.register("noop", lambda job: seen.append(job.job_id))
    owner = worker.config.name
    leased: list[int] = []
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        with store.engine.connect() as conn:
            while len(leased) < 100_000:
                row = conn.execute(
                    text(
                        "SELECT count(*) FILTER (WHERE state = 'LEASED' AND lease_owner = :w),"
                        " count(*) FILTER (WHERE state = 'DONE') FROM outbox_jobs"
                    ),
                    {"w": owner},
                ).one()
                conn.rollback()
                leased.append(int(row[0]))
                if row[1] == 600:
                    break
    finally:
        worker.stop()
        runner.join(60)
    assert _states(store) == {"DONE": 600}
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 600
    assert max(leased) <= 4, max(leased)
    assert sum(carried) > 300, carried  # most finishes went with the next claim
    store.dispose()
