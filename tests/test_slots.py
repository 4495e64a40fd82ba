"""consumer.jobs.slots: claim ahead (``WorkerConfig(claim_ahead=True)``) and its bounds.

A worker with 2 slots and claim ahead keeps a small buffer of claimed jobs beside its busy
slots, never more than its slots again; a stop hands the buffer back at once (READY for
any worker), while the jobs in its slots run to their end. Without claim ahead (the
default), it never leases more jobs than it has slots."""

from __future__ import annotations

import threading

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
