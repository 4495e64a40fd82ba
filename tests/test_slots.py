"""consumer.jobs.slots: claim ahead (``WorkerConfig(claim_ahead=True)``) and its bounds.

A worker with 2 slots and claim ahead keeps a small buffer of claimed jobs beside its busy
slots, never more than its slots again; a stop hands the buffer back at once (READY for
any worker), while the jobs in its slots run to their end. Without claim ahead (the
default), it never leases more jobs than it has slots."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import text

from consumer import Store, Worker
from tests.services import wait_for


def _states(store: Store) -> dict[str, int]:
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outbox_jobs GROUP BY state"))
        return {state: int(n) for state, n in rows}


@pytest.mark.parametrize("ahead", [True, False], ids=["claim-ahead", "default"])
def test_the_buffer_is_bounded_and_handed_back_at_a_stop(pg_url: str, ahead: bool) -> None:
    store = Store(pg_url)
    store.enqueue_many([{"tenant": "t", "action": f"hold-{i}"} for i in range(20)])
    go = threading.Event()
    started: list[int] = []
    worker = Worker(store, concurrency=2, claim_ahead=ahead, poll_interval=0.05)

    @worker.handler("hold")
    def hold(job: object) -> None:
        started.append(1)
        go.wait(60)

    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    leased: list[int] = []
    try:
        wait_for(lambda: len(started) == 2, "both slots busy", timeout=60)
        if ahead:  # the buffer fills beside the busy slots (claims that come back full)
            wait_for(
                lambda: leased.append(_states(store).get("LEASED", 0)) or leased[-1] >= 3,
                "a buffered job",
                timeout=60,
            )
        for _ in range(20):  # a while with both slots busy: the lease count stays bounded
            leased.append(_states(store).get("LEASED", 0))
        worker.stop()
        # The buffer goes back at once, the two running jobs keep their leases.
        wait_for(lambda: _states(store).get("LEASED", 0) == 2, "the buffer handed back", 60)
        assert len(started) == 2
    finally:
        go.set()
        runner.join(60)
    assert max(leased) <= (4 if ahead else 2)
    assert _states(store) == {"DONE": 2, "READY": 18}
    store.dispose()


def test_claim_ahead_drains_a_backlog_with_every_job_once(pg_url: str) -> None:
    store = Store(pg_url)
    store.enqueue_many([{"tenant": f"t{i % 3}", "action": f"noop-{i}"} for i in range(300)])
    seen: list[int] = []
    worker = Worker(store, concurrency=4, claim_ahead=True)
    worker.register("noop", lambda job: seen.append(job.job_id))
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: _states(store).get("DONE", 0) == 300, "every job DONE", timeout=120)
    finally:
        worker.stop()
        runner.join(60)
    assert sorted(seen) == sorted(set(seen)) and len(seen) == 300
    store.dispose()


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
