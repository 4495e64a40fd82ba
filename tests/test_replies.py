"""Replies to jobs and cancelling a running job (issue 38), on PostgreSQL and SQLite.

Replies: before, during and after the wait; the same reply twice; a reply to a finished job;
a run that fails (or loses its lease) after seeing a reply keeps it for the next run.
Cancels: at each point of a run (before the intent, between the intent and the call, after
acceptance), through ``JobContext`` and an in-process provider with the simulator's
semantics (``outbox.testing.FakeProvider``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from sqlalchemy.orm import Session

from consumer import JobCancelled
from consumer.consumer import ConsumerTx
from consumer.errors import Conflict, JobError, JobNotFound
from consumer.jobs.context import JobContext
from consumer.jobs.operations import ACCEPTED, Operations
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    READY,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
)
from consumer.jobs.store import Lease, Store
from outbox.testing import FakeProvider


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def claim(store: Store, ttl: float = 30, now: float | None = None) -> Lease:
    lease = store.claim_next("w", ttl=ttl, now=now)
    assert lease is not None
    return lease


def outcomes(store: Store, job: Any) -> list[str]:
    return [a.outcome for a in store.history(job)]


# -- replies ---------------------------------------------------------------------------------


def test_a_reply_during_the_wait_makes_the_job_ready_and_its_run_sees_it(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    ctx = JobContext(store, claim(store))
    assert ctx.replies == []
    ctx.wait_external("customer", until=10**10)

    result = store.reply(job, payload={"answer": "accepted"}, reply_id="mail-1", source="mail")

    assert (result.duplicate, result.resumed, result.state) == (False, True, READY)
    assert store.get(job).state == READY and store.get(job).run_after is None
    ctx = JobContext(store, claim(store))
    [reply] = ctx.replies
    assert (reply.reply_id, reply.source) == ("mail-1", "mail")
    assert reply.payload == {"answer": "accepted"}
    assert reply.received_at > 0
    store.finish_batch([ctx.lease])
    assert store.get(job).state == DONE
    [kept] = store.replies(job)
    assert kept.consumed_at is not None  # consumed by the run that ended DONE, still visible
    assert "reply" in outcomes(store, job)


def test_a_reply_before_the_first_run_is_seen_by_it(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    result = store.reply("studio", "quote-17", payload="yes", reply_id="r1")
    assert (result.resumed, result.state) == (False, READY)
    ctx = JobContext(store, claim(store))
    assert [r.payload for r in ctx.replies] == ["yes"]
    ctx.wait_external("next answer")  # a wait ends well: consumed
    assert store.get(job).state == WAITING_EXTERNAL
    store.reply(job, payload="second", reply_id="r2")
    ctx = JobContext(store, claim(store))
    assert [r.reply_id for r in ctx.replies] == ["r2"]  # r1 was consumed by the earlier run


def test_a_reply_while_the_job_runs_ends_its_wait_before_it_begins(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    ctx = JobContext(store, claim(store))
    assert ctx.replies == []  # claimed before the reply
    store.reply(job, payload="accepted", reply_id="r1")
    assert store.get(job).state == LEASED  # kept; the run in hand is not moved

    ctx.wait_external("customer", until=10**10)

    assert store.get(job).state == READY  # the reply did not wait behind the wait
    ctx = JobContext(store, claim(store))
    assert [r.payload for r in ctx.replies] == ["accepted"]


def test_the_same_reply_twice_changes_nothing_the_second_time(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    JobContext(store, claim(store)).wait_external("customer")
    first = store.reply(job, payload="accepted", reply_id="r1")
    second = store.reply(job, payload="accepted again", reply_id="r1")
    assert (first.duplicate, second.duplicate) == (False, True)
    assert second.resumed is False
    assert [r.payload for r in store.replies(job)] == ["accepted"]
    assert outcomes(store, job).count("reply") == 1


def test_a_reply_to_a_finished_job_is_kept_and_moves_nothing(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    store.finish_batch([claim(store)])
    result = store.reply(job, payload="late", reply_id="r1", source="mail")
    assert (result.duplicate, result.resumed, result.state) == (False, False, DONE)
    assert store.get(job).state == DONE
    assert [r.reply_id for r in store.replies(job)] == ["r1"]

    other = store.enqueue("studio", "quote-18").job_id
    store.cancel(other, reason="withdrawn")
    assert store.reply(other, payload="late", reply_id="r1").state == CANCELLED


def test_a_reply_to_a_job_in_review_waits_for_the_person(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    JobContext(store, claim(store)).wait_review("check the quote")
    assert store.reply(job, payload="x", reply_id="r1").state == WAITING_REVIEW
    store.resume(job)
    assert [r.reply_id for r in JobContext(store, claim(store)).replies] == ["r1"]


def test_a_run_that_fails_after_seeing_a_reply_leaves_it_for_the_next(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    store.reply(job, payload="accepted", reply_id="r1")
    ctx = JobContext(store, claim(store))
    assert len(ctx.replies) == 1
    store.fail(ctx.lease, error="provider down")
    row = store.get(job)
    assert row.state == READY and row.run_after is not None  # after its backoff
    ctx = JobContext(store, claim(store, now=row.run_after + 1))
    store.reply(job, payload="asked for a discount", reply_id="r2")  # after this claim
    assert [r.reply_id for r in ctx.replies] == ["r1"]
    store.finish_batch([ctx.lease])
    assert [r.consumed_at is not None for r in store.replies(job)] == [True, False]


def test_a_run_whose_lease_was_lost_consumes_nothing(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    store.reply(job, payload="accepted", reply_id="r1")
    stale = claim(store, ttl=1)
    store.recover(now=stale.expires_at + 1)  # the lease expired: READY again, epoch fenced
    fresh = claim(store)
    with pytest.raises(Conflict):
        store.wait_external(stale, reason="too late")
    assert store.finish_batch([stale]).conflicts == [job]
    assert [r.payload for r in JobContext(store, fresh).replies] == ["accepted"]


def test_reply_checks_its_arguments(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    with pytest.raises(JobError) as bad:
        store.reply(job, payload={"x": float("nan")}, reply_id="r1")
    assert bad.value.field == "payload"
    with pytest.raises(JobError) as bad:
        store.reply(job, payload=1, reply_id="")
    assert bad.value.field == "reply_id"
    with pytest.raises(JobNotFound):
        store.reply(10**9, payload=1, reply_id="r1")
    assert store.replies(job) == []


def test_consumer_tx_reply_joins_the_handler_transaction(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    JobContext(store, claim(store)).wait_external("customer")
    with pytest.raises(KeyError), Session(store.engine) as session, session.begin():
        tx = ConsumerTx(session=session, group="billing")
        assert tx.reply(job, payload="accepted", reply_id="evt-1").resumed
        raise KeyError("the handler failed: its reply goes with its entry")
    assert store.get(job).state == WAITING_EXTERNAL
    with Session(store.engine) as session, session.begin():
        tx = ConsumerTx(session=session, group="billing")
        tx.reply("studio", "quote-17", payload="accepted", reply_id="evt-1", source="event")
    assert store.get(job).state == READY
    assert [r.source for r in store.replies(job)] == ["event"]


# -- cancelling a running job ----------------------------------------------------------------


class Cancelling:
    """A provider that, when called, has an operator cancel the job first: the cancel lands
    between the intent (written) and the call (made), as a real one can."""

    def __init__(self, inner: FakeProvider, store: Store) -> None:
        self.inner, self.store = inner, store
        self.name = inner.name
        self.supports_lookup = inner.supports_lookup
        self.supports_idempotency = inner.supports_idempotency
        self.timeout = inner.timeout

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        job_id = int(operation_id.split(":")[0])
        assert self.store.cancel(job_id, reason="quote withdrawn") == LEASED
        return self.inner.send(request, operation_id=operation_id, idempotency_key=idempotency_key)

    def lookup(self, operation_id: str) -> str | None:
        return self.inner.lookup(operation_id)


@pytest.fixture
def mail() -> Iterator[FakeProvider]:
    provider = FakeProvider("mail")
    yield provider
    provider.close()


def test_a_cancel_before_the_intent_starts_no_effect(store: Store, mail: FakeProvider) -> None:
    ops = Operations(store, {"mail": mail})
    job = store.enqueue("studio", "send-quote-17").job_id
    ctx = JobContext(store, claim(store), ops)
    assert ctx.cancelled is False

    assert store.cancel(job, reason="quote withdrawn") == LEASED  # a request, not a move
    assert store.get(job).state == LEASED
    assert store.get(job).cancel_reason == "quote withdrawn"
    # A context that has not been told yet: the intent's own statement refuses it.
    with pytest.raises(JobCancelled):
        JobContext(store, ctx.lease, ops).dispatch("email", "mail", {"to": "ann"})
    assert ctx.cancelled is True
    with pytest.raises(JobCancelled):
        ctx.dispatch("email", "mail", {"to": "ann"})
    assert mail.effects == [] and ops.receipt(f"{job}:email") is None

    store.fail(ctx.lease, error="JobCancelled")  # whatever the run's end: CANCELLED
    assert store.get(job).state == CANCELLED
    assert outcomes(store, job)[-2:] == ["cancel_requested", "cancelled"]


def test_a_cancel_between_intent_and_call_keeps_the_effect_and_its_receipt(
    store: Store, mail: FakeProvider
) -> None:
    ops = Operations(store, {"mail": Cancelling(mail, store)})
    job = store.enqueue("studio", "send-quote-17").job_id
    ctx = JobContext(store, claim(store), ops)

    receipt = ctx.dispatch("email", "mail", {"to": "ann"})  # the intent was written first

    assert receipt.state == ACCEPTED and len(mail.effects) == 1
    assert ctx.cancelled is True
    with pytest.raises(JobCancelled):
        ctx.dispatch("reminder", "mail", {"to": "ann"})
    assert store.finish_batch([ctx.lease]).done == [job]
    assert store.get(job).state == CANCELLED
    saved = ops.receipt(f"{job}:email")
    assert saved is not None and saved.state == ACCEPTED  # a cancel cannot recall an email
    assert len(mail.effects) == 1


def test_a_cancel_after_acceptance_ends_the_run_cancelled(store: Store, mail: FakeProvider) -> None:
    ops = Operations(store, {"mail": mail})
    job = store.enqueue("studio", "send-quote-17").job_id
    ctx = JobContext(store, claim(store), ops)
    assert ctx.dispatch("email", "mail", {"to": "ann"}).state == ACCEPTED
    store.cancel(job, reason="quote withdrawn")
    store.cancel(job, reason="a second click")  # the first reason stays
    ctx.wait_external("customer")  # the run's end: CANCELLED instead of the wait
    row = store.get(job)
    assert (row.state, row.wait_reason) == (CANCELLED, "quote withdrawn")
    assert ops.receipt(f"{job}:email").state == ACCEPTED  # type: ignore[union-attr]


def test_a_cancel_of_a_job_that_is_not_running_moves_it_at_once(store: Store) -> None:
    job = store.enqueue("studio", "quote-17").job_id
    assert store.cancel(job, reason="withdrawn") == CANCELLED
    assert store.get(job).state == CANCELLED


def test_retention_takes_a_finished_jobs_replies_and_callbacks_with_it(
    store: Store, mail: FakeProvider
) -> None:
    import sqlalchemy as sa

    from consumer.jobs.retention import JobRetention, JobRetentionConfig
    from consumer.jobs.schema import deliveries, jobs, replies

    ops = Operations(store, {"mail": mail})
    old = store.enqueue("studio", "send-quote-1").job_id
    ctx = JobContext(store, claim(store), ops)
    op = ctx.dispatch("email", "mail", {"to": "ann"}).operation_id
    store.finish_batch([ctx.lease])
    store.reply(old, payload="late", reply_id="r1")
    ops.record_delivery(op, "delivered", event_id="e1")
    kept = store.enqueue("studio", "quote-2").job_id
    store.reply(kept, payload="keep me", reply_id="r1")
    with store.driver.begin() as conn:  # a month ago
        conn.execute(sa.update(jobs).where(jobs.c.id == old).values(updated_at=1.0))

    assert JobRetention(store, JobRetentionConfig()).purge_finished(100) == 1

    with store.driver.connect() as conn:
        left = [int(r[0]) for r in conn.execute(sa.select(replies.c.job_id))]
        callbacks = conn.execute(sa.select(sa.func.count()).select_from(deliveries)).scalar()
    assert left == [kept] and callbacks == 0


def test_a_cancelled_job_makes_no_new_call_for_an_earlier_intent(
    store: Store, mail: FakeProvider
) -> None:
    from consumer.errors import AuthFailure

    ops = Operations(store, {"mail": mail})
    job = store.enqueue("studio", "send-quote-17").job_id
    lease = claim(store)
    mail.fail_next("unauthorized")  # the provider did not act: NOT_SENT, a new call may go
    with pytest.raises(AuthFailure):
        JobContext(store, lease, ops).dispatch("email", "mail", {"to": "ann"})
    store.cancel(job, reason="withdrawn")
    with pytest.raises(JobCancelled):
        JobContext(store, lease, ops).dispatch("email", "mail", {"to": "ann"})
    assert mail.effects == []
    assert ops.receipt(f"{job}:email").state == "NOT_SENT"  # type: ignore[union-attr]
