"""Delivery callbacks (issue 38): what a provider says later about an ACCEPTED effect, on
PostgreSQL and SQLite. Callbacks twice, out of order, before their receipt is ACCEPTED, and a
bounce that wakes the job waiting for its customer."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    Double,
    Index,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    insert,
    inspect,
    select,
    text,
)

from consumer.errors import JobError
from consumer.jobs.context import JobContext
from consumer.jobs.operations import ACCEPTED, Operations
from consumer.jobs.schema import DELIVERIES_TABLE, deliveries
from consumer.jobs.states import DONE, READY, WAITING_EXTERNAL
from consumer.jobs.store import Store
from outbox.testing import FakeProvider


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


@pytest.fixture
def mail() -> Iterator[FakeProvider]:
    provider = FakeProvider("mail")
    yield provider
    provider.close()


def sent(store: Store, ops: Operations, action: str = "send-quote-17") -> tuple[JobContext, str]:
    """A job that sent its email (ACCEPTED), still held by its run."""
    store.enqueue("studio", action)
    lease = store.claim_next("w")
    assert lease is not None
    ctx = JobContext(store, lease, ops)
    receipt = ctx.dispatch("email", "mail", {"to": "ann@example.com"})
    assert receipt.state == ACCEPTED
    return ctx, receipt.operation_id


def delivery(ops: Operations, operation_id: str) -> str | None:
    receipt = ops.receipt(operation_id)
    assert receipt is not None
    return receipt.delivery_status


def test_a_callback_gives_the_accepted_receipt_its_outcome_once(
    store: Store, mail: FakeProvider
) -> None:
    ops = Operations(store, {"mail": mail})
    _, op = sent(store, ops)
    first = ops.record_delivery(op, "delivered", ref="m-1", event_id="evt-1")
    again = ops.record_delivery(op, "delivered", ref="m-1", event_id="evt-1")
    assert (first.duplicate, first.applied, first.delivery_status) == (False, True, "delivered")
    assert (again.duplicate, again.applied) == (True, True)
    assert delivery(ops, op) == "delivered"
    receipt = ops.receipt(op)
    assert receipt is not None and receipt.delivery_at is not None


def test_callbacks_out_of_order_keep_the_furthest_outcome(store: Store, mail: FakeProvider) -> None:
    ops = Operations(store, {"mail": mail})
    _, op = sent(store, ops)
    ops.record_delivery(op, "opened", event_id="evt-2")
    ops.record_delivery(op, "delivered", event_id="evt-1")  # came late
    assert delivery(ops, op) == "opened"
    _, other = sent(store, ops, "send-quote-18")
    ops.record_delivery(other, "bounced", event_id="evt-3", detail="mailbox full")
    ops.record_delivery(other, "delivered", event_id="evt-4")
    assert delivery(ops, other) == "bounced"


class CallbackFirst:
    """A provider whose webhook beats the worker: the callback is recorded while the call is
    still in flight, before the worker records the receipt ACCEPTED."""

    def __init__(self, inner: FakeProvider) -> None:
        self.inner = inner
        self.ops: Operations | None = None
        self.name = inner.name
        self.supports_lookup = inner.supports_lookup
        self.supports_idempotency = inner.supports_idempotency
        self.timeout = inner.timeout
        self.results: list[Any] = []

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        ref = self.inner.send(request, operation_id=operation_id, idempotency_key=idempotency_key)
        assert self.ops is not None
        self.results.append(self.ops.record_delivery(operation_id, "delivered", event_id="e-1"))
        return ref

    def lookup(self, operation_id: str) -> str | None:
        return self.inner.lookup(operation_id)


def test_a_callback_before_its_receipt_is_kept_and_applied_when_it_is_accepted(
    store: Store, mail: FakeProvider
) -> None:
    racing = CallbackFirst(mail)
    ops = Operations(store, {"mail": racing})
    racing.ops = ops
    _, op = sent(store, ops)
    [early] = racing.results
    assert (early.duplicate, early.applied) == (False, False)  # PENDING then: kept
    assert delivery(ops, op) is None
    ops.reconcile()  # the workers' receipt sweep applies what waited
    assert delivery(ops, op) == "delivered"
    assert ops.record_delivery(op, "delivered", event_id="e-1").duplicate

    racing2 = CallbackFirst(mail)
    ops2 = Operations(store, {"mail": racing2})
    racing2.ops = ops2
    _, op2 = sent(store, ops2, "send-quote-18")
    # The next callback of the operation applies the one that waited, then itself.
    ops2.record_delivery(op2, "opened", event_id="e-2")
    assert delivery(ops2, op2) == "opened"


def test_a_bounce_wakes_the_job_waiting_for_its_customer(store: Store, mail: FakeProvider) -> None:
    ops = Operations(store, {"mail": mail})
    ctx, op = sent(store, ops)
    ctx.wait_external("the customer's answer", until=10**10)
    result = ops.record_delivery(op, "bounced", ref="m-1", detail="550 no such user", event_id="b1")
    assert result.woke and result.delivery_status == "bounced"
    job = store.get(ctx.job_id)
    assert job.state == READY
    lease = store.claim_next("w")
    assert lease is not None
    [reply] = JobContext(store, lease, ops).replies
    assert reply.source == "delivery" and reply.reply_id == "delivery:b1"
    assert reply.payload["status"] == "bounced" and reply.payload["operation_id"] == op
    assert reply.payload["detail"] == "550 no such user"
    # A delivered callback is an outcome, not news for the job: it wakes nothing.
    _, other = sent(store, ops, "send-quote-18")
    assert store.get(int(other.split(":")[0])).state != WAITING_EXTERNAL
    assert not ops.record_delivery(other, "delivered", event_id="d2").woke


def test_a_bounce_on_a_finished_job_is_kept_and_wakes_nothing(
    store: Store, mail: FakeProvider
) -> None:
    """Issue 59: the answer said ``woke`` although a finished job only keeps the bounce."""
    ops = Operations(store, {"mail": mail})
    ctx, op = sent(store, ops)
    store.finish_batch([ctx.lease])
    result = ops.record_delivery(op, "bounced", detail="550 no such user", event_id="b-done")
    assert (result.applied, result.delivery_status, result.woke) == (True, "bounced", False)
    assert store.get(ctx.job_id).state == DONE
    assert [r.reply_id for r in store.replies(ctx.job_id)] == ["delivery:b-done"]  # kept
    # A job still held by its run is woken: its next run sees the bounce.
    _, op2 = sent(store, ops, "send-quote-18")
    assert ops.record_delivery(op2, "bounced", event_id="b-run").woke
    assert not ops.record_delivery(op2, "bounced", event_id="b-run").woke  # a duplicate


def test_record_delivery_checks_its_arguments(store: Store, mail: FakeProvider) -> None:
    ops = Operations(store, {"mail": mail})
    for kwargs, field in (
        ({"operation_id": "1:email", "status": "lost", "event_id": "e"}, "status"),
        ({"operation_id": "1:email", "status": "delivered", "event_id": ""}, "event_id"),
        ({"operation_id": "", "status": "delivered", "event_id": "e"}, "operation_id"),
    ):
        with pytest.raises(JobError) as bad:
            ops.record_delivery(**kwargs)
        assert bad.value.field == field
    # An operation nobody knows (yet): kept, applied to nothing.
    kept = ops.record_delivery("999:email", "delivered", event_id="e-x")
    assert (kept.duplicate, kept.applied) == (False, False)


def test_the_same_event_id_for_two_operations_applies_to_both(
    store: Store, mail: FakeProvider
) -> None:
    """Deduplicated per operation (issue 53): a bounce of one email that reuses another
    email's event id is that email's bounce, not a duplicate."""
    ops = Operations(store, {"mail": mail})
    _, first = sent(store, ops, "send-quote-13")
    _, second = sent(store, ops, "send-quote-14")
    one = ops.record_delivery(first, "delivered", event_id="evt-7")
    two = ops.record_delivery(second, "bounced", event_id="evt-7")
    assert (one.duplicate, one.applied) == (False, True)
    assert (two.duplicate, two.applied, two.delivery_status) == (False, True, "bounced")
    assert (delivery(ops, first), delivery(ops, second)) == ("delivered", "bounced")
    assert ops.record_delivery(second, "bounced", event_id="evt-7").duplicate


def test_a_deliveries_table_keyed_by_event_id_alone_is_migrated(db_url: str) -> None:
    """A store made before issue 53 (``outbox_deliveries`` keyed by ``event_id``) is brought
    up to date at its next start: its rows kept, its key per operation."""
    engine = create_engine(db_url)
    Store(engine).dispose()
    before = MetaData()
    old = Table(
        DELIVERIES_TABLE,
        before,
        Column("event_id", String(400), primary_key=True),
        Column("operation_id", String(400), nullable=False),
        Column("status", String(16), nullable=False),
        Column("provider_ref", String(200), nullable=True),
        Column("detail", Text, nullable=True),
        Column("received_at", Double, nullable=False),
        Column("applied_at", Double, nullable=True),
        Index("ix_outbox_deliveries_operation", "operation_id"),
    )
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {DELIVERIES_TABLE}"))
        before.create_all(conn)
        conn.execute(
            insert(old).values(
                event_id="evt-1", operation_id="1:mail", status="delivered", received_at=1.0
            )
        )
    store = Store(engine)
    try:
        with engine.connect() as conn:
            key = inspect(conn).get_pk_constraint(DELIVERIES_TABLE)["constrained_columns"]
            rows = conn.execute(select(deliveries.c.operation_id, deliveries.c.event_id)).all()
        assert sorted(key) == ["event_id", "operation_id"]
        assert [tuple(r) for r in rows] == [("1:mail", "evt-1")]
        ops = Operations(store)
        assert not ops.record_delivery("2:mail", "delivered", event_id="evt-1").duplicate
        assert ops.record_delivery("1:mail", "delivered", event_id="evt-1").duplicate
        Store(engine).dispose()  # idempotent
    finally:
        store.dispose()
        engine.dispose()
