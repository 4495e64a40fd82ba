"""consumer.jobs.duties: the worker's duties, each with run_once().

The liveness beat takes back the leases of a worker whose liveness row expired and wakes
this worker's slots (``on_work``); recovery learns the earliest timer of a waiting job, so
an idle loop sleeps no longer than until it is due."""

from __future__ import annotations

import time

from consumer import Store, WorkerConfig
from consumer.jobs.duties import WorkerDuties
from outbox.hooks import NO_HOOKS
from tests.services import wait_for


def test_a_dead_workers_leases_come_back_and_wake_the_slots(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.enqueue("t", "a")
    store.worker_beat("dead", 0.2)  # alive for 0.2 s, then never again
    (lease,) = store.claim_batch("dead", 1, 300)
    woken: list[bool] = []
    duties = WorkerDuties(
        store, WorkerConfig(name="alive"), NO_HOOKS, None, lambda: woken.append(True)
    )
    wait_for(lambda: duties.liveness.run_once().requeued == 1, "the dead worker's job back", 30)
    assert woken == [True]
    assert store.get("t", "a").state == "READY" and lease.job_id == store.get("t", "a").id
    store.dispose()


def test_recovery_learns_the_earliest_timer(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    duties = WorkerDuties(store, WorkerConfig(), NO_HOOKS, None, lambda: None)
    assert duties.sleep_limit() is None
    store.enqueue("t", "a")
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    store.wait_external(lease, reason="a reply", until=time.time() + 3600)
    duties.learn_timer()
    limit = duties.sleep_limit()
    assert limit is not None and 3000 < limit <= 3700
    store.dispose()
