"""consumer.jobs.slots: quick ``def`` handlers run in their claim's own database thread.

Once the thread gate has learned that the handlers take microseconds
(``ThreadGate.quick``), the thread that claimed a cohort of jobs runs their handlers one
after another before handing the jobs to the event loop; the first job past ``QUICK_WALL``
ends it for the rest of its cohort, which go to the slots' threads. Either way every job
runs once and ends as its handler decided."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from sqlalchemy import text

from consumer import Store, Worker
from tests.services import wait_for


def _drain(store: Store, worker: Worker, done: int) -> None:
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: _count(store, "DONE") >= done, f"{done} jobs DONE", timeout=120)
    finally:
        worker.stop()
        runner.join(60)
    assert not runner.is_alive()


def _count(store: Store, state: str) -> int:
    with store.engine.connect() as conn:
        sql = "SELECT count(*) FROM outbox_jobs WHERE state = :s"
        return int(conn.execute(text(sql), {"s": state}).scalar_one())


def _attempts(store: Store) -> Counter[str]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT outcome, count(*) FROM outbox_job_attempts GROUP BY 1"))
        return Counter({outcome: int(n) for outcome, n in rows})


def test_quick_handlers_run_in_their_claims_thread_each_job_once(pg_url: str) -> None:
    store = Store(pg_url)
    store.enqueue_many([{"tenant": f"t{i % 3}", "action": f"noop-{i}"} for i in range(600)])
    runs: list[tuple[int, str]] = []
    worker = Worker(store, concurrency=16, name="inline")
    worker.register("noop", lambda job: runs.append((job.job_id, threading.current_thread().name)))
    _drain(store, worker, 600)
    ids = [job_id for job_id, _ in runs]
    assert len(ids) == 600 and len(set(ids)) == 600  # every job once
    places = Counter(name.split("_")[0] for _, name in runs)
    # learned quick after its first jobs (on the slots' threads), then in the claims' thread
    assert places["inline-slot"] >= 10 and places["inline-db"] >= 300, places
    assert _attempts(store) == Counter({"done": 600})
    store.dispose()


def test_a_slow_job_ends_the_inline_runs_and_its_cohort_mates_run_once(pg_url: str) -> None:
    store = Store(pg_url)
    specs: list[dict[str, Any]] = [{"tenant": "t", "action": f"noop-{i}"} for i in range(300)]
    specs[150] = {"tenant": "t", "action": "slow-150"}
    store.enqueue_many(specs)
    runs: list[tuple[str, str]] = []
    worker = Worker(store, concurrency=16, name="mixed")

    @worker.handler("noop")
    def noop(job: Any) -> None:
        runs.append((job.action, threading.current_thread().name))

    @worker.handler("slow")
    def slow(job: Any) -> None:
        time.sleep(0.05)  # a hundred times QUICK_WALL
        runs.append((job.action, threading.current_thread().name))

    _drain(store, worker, 300)
    actions = [action for action, _ in runs]
    assert len(actions) == 300 and len(set(actions)) == 300
    at = actions.index("slow-150")
    assert runs[at][1].startswith("mixed-db")  # quick by then: run by its claim's thread
    # Quick no more: the jobs after it go to the slots' threads until it is learned again.
    after = [name for _, name in runs[at + 1 : at + 6]]
    assert all(name.startswith("mixed-slot") for name in after), after
    assert _attempts(store) == Counter({"done": 300})
    store.dispose()


def test_a_quick_handler_that_raises_fails_its_own_job_only(pg_url: str) -> None:
    store = Store(pg_url)
    specs = [{"tenant": "t", "action": f"noop-{i}"} for i in range(200)]
    specs += [{"tenant": "t", "action": f"boom-{i}"} for i in range(3)]
    store.enqueue_many(specs)
    raised: list[str] = []
    seen: list[int] = []
    worker = Worker(store, concurrency=16, name="boom")
    worker.register("noop", lambda job: seen.append(job.job_id))

    @worker.handler("boom")
    def boom(job: Any) -> None:
        raised.append(threading.current_thread().name)
        raise ValueError("no")

    _drain(store, worker, 200)
    assert len(seen) == 200 and len(set(seen)) == 200
    assert len(raised) >= 3  # each boom job ran (and is retried later), none of the others twice
    with store.engine.connect() as conn:
        states = dict(
            conn.execute(
                text("SELECT action, state FROM outbox_jobs WHERE action LIKE 'boom-%'")
            ).all()
        )
    assert set(states) == {"boom-0", "boom-1", "boom-2"} and "DONE" not in states.values()
    assert _attempts(store)["done"] == 200
    store.dispose()
