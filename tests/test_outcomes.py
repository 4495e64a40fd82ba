"""consumer.jobs.outcomes: one settle and one finish for every way a handler runs.

The same handler outcome ends the same way whether a ``def`` handler ran in
``Worker.run_once`` or an ``async def`` one did; a finish whose lease was taken over is
refused, job by job."""

from __future__ import annotations

import time
from typing import Any

import pytest

from consumer import Store, TransientFailure, Worker
from consumer.jobs.outcomes import Outcome, Settled


def _failing_sync(job: Any) -> None:
    raise TransientFailure("try later")


async def _failing_async(job: Any) -> None:
    raise TransientFailure("try later")


@pytest.mark.parametrize("handler", [_failing_sync, _failing_async], ids=["def", "async"])
def test_a_failure_settles_alike_on_both_paths(sqlite_url: str, handler: Any) -> None:
    store = Store(sqlite_url)
    worker = Worker(store)
    worker.register("send", handler)
    store.enqueue("t", "send-1")
    assert worker.run_once() == 1
    job = store.get("t", "send-1")
    assert job.state == "READY" and job.attempts == 1 and "try later" in (job.last_error or "")
    store.dispose()


def test_a_stale_finish_is_refused_job_by_job(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    store.enqueue("t", "a")
    store.enqueue("t", "b")
    worker = Worker(store, ttl=30.0)
    worker.register("a", lambda job: None)
    worker.register("b", lambda job: None)
    runner = worker.runner
    leases = runner.claim(2, None, now=100)
    stolen = next(lease for lease in leases if lease.action == "b")
    store.claim("t", "b", "thief", now=200, ttl=30)  # b's lease expired and was taken over
    finished: list[tuple[str, str]] = []
    runner.hooks.worker_job_finished = (  # type: ignore[method-assign]
        lambda action, outcome, *args, **facts: finished.append((action, outcome))
    )
    settled = [
        Settled(runner.context(lease), Outcome.DONE, lease.action, time.monotonic())
        for lease in leases
    ]
    # The worker's one writer of finishes (its statement; with no slot to claim: alone).
    assert runner.finish_and_claim(settled, 0, None) == []
    assert sorted(finished) == [("a", "done"), ("b", "conflict")]
    assert stolen.action == "b"
    assert store.get("t", "a").state == "DONE"
    assert store.get("t", "b").state == "LEASED"  # the thief's
    store.dispose()
