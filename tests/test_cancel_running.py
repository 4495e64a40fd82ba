"""Cancelling a job while a worker runs it (issue 38), on PostgreSQL and SQLite, with
``Worker.run`` in a thread: an ``async def`` handler's task is cancelled; a provider call in
flight is never cut (its receipt is recorded, then the task is cancelled); a ``def``
handler sees ``job.cancelled``. Each job ends CANCELLED."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from consumer import JobCancelled, JobContext, Store, Worker
from consumer.jobs.states import CANCELLED, LEASED
from tests.services import wait_for


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


class Gate:
    """A provider whose call blocks until the test opens the gate (a slow provider)."""

    name = "mail"
    supports_lookup = False
    supports_idempotency = True
    timeout = 60.0

    def __init__(self) -> None:
        self.calling = threading.Event()
        self.open = threading.Event()
        self.sent: list[str] = []

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        self.calling.set()
        assert self.open.wait(60)
        self.sent.append(operation_id)
        return f"msg-{len(self.sent)}"

    def lookup(self, operation_id: str) -> str | None:  # pragma: no cover - no lookup
        return None


def running(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    thread.start()
    return thread


def stopped(worker: Worker, thread: threading.Thread) -> None:
    worker.stop()
    thread.join(60)
    assert not thread.is_alive()


def state(store: Store, job_id: int) -> str:
    return store.get(job_id).state


def test_an_async_handlers_task_is_cancelled(store: Store) -> None:
    worker = Worker(store, poll_interval=0.05)
    seen: list[str] = []
    started = threading.Event()

    @worker.handler("long")
    async def long(job: JobContext) -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    job = store.enqueue("studio", "long-1").job_id
    thread = running(worker)
    try:
        assert started.wait(60)
        assert store.cancel(job, reason="quote withdrawn") == LEASED
        wait_for(lambda: state(store, job) == CANCELLED, "the job to end CANCELLED", timeout=60)
    finally:
        stopped(worker, thread)
    assert seen == ["cancelled"]
    assert store.get(job).wait_reason == "quote withdrawn"


def test_a_call_in_flight_is_not_cut_and_keeps_its_receipt(store: Store) -> None:
    gate = Gate()
    worker = Worker(store, providers={"mail": gate}, poll_interval=0.05)
    after: list[str] = []
    running_ctx: list[JobContext] = []

    @worker.handler("send")
    async def send(job: JobContext) -> None:
        running_ctx.append(job)
        await job.adispatch("email", "mail", {"to": "ann"})
        after.append("returned")
        await asyncio.sleep(60)  # cancelled here, after the receipt is recorded
        after.append("never")

    job = store.enqueue("studio", "send-1").job_id
    thread = running(worker)
    try:
        assert gate.calling.wait(60)
        store.cancel(job, reason="too late")
        (ctx,) = running_ctx
        # The worker has told the run of the request (it waits for the call to return):
        wait_for(lambda: ctx.cancel_requested, "the worker to see the cancel request", timeout=60)
        assert state(store, job) == LEASED and after == []
        gate.open.set()
        wait_for(lambda: state(store, job) == CANCELLED, "the job to end CANCELLED", timeout=60)
    finally:
        gate.open.set()
        stopped(worker, thread)
    assert after == ["returned"] and gate.sent == [f"{job}:email"]
    receipt = worker.operations.receipt(f"{job}:email")  # type: ignore[union-attr]
    assert receipt is not None and receipt.state == "ACCEPTED"


def test_a_def_handler_sees_cancelled_and_dispatch_refuses(store: Store) -> None:
    gate = Gate()
    gate.open.set()
    worker = Worker(store, providers={"mail": gate}, poll_interval=0.05)
    refused: list[str] = []
    started = threading.Event()

    @worker.handler("steps")
    def steps(job: JobContext) -> None:
        started.set()
        wait_for(lambda: job.cancelled, "the cancel request seen by the run", timeout=60)
        try:
            job.dispatch("email", "mail", {"to": "ann"})
        except JobCancelled as exc:
            refused.append(str(exc))
            raise

    job = store.enqueue("studio", "steps-1").job_id
    thread = running(worker)
    try:
        assert started.wait(60)
        store.cancel(job, reason="withdrawn")
        wait_for(lambda: state(store, job) == CANCELLED, "the job to end CANCELLED", timeout=60)
    finally:
        stopped(worker, thread)
    assert len(refused) == 1 and gate.sent == []
    assert [a.outcome for a in store.history(job)][-2:] == ["cancel_requested", "cancelled"]
