"""Time a caller controls (issue 24): ``Store(clock=...)`` replaces the database clock in the
whole job pipeline (leases, backoffs, timers, operation intents' deadlines), and
``Consumer.run_once(now=...)`` claims back entries idle by the caller's clock. On PostgreSQL
and SQLite (``db_url``), with the shared Redis."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest
import redis

from consumer import Consumer, ConsumerConfig, Operations, Store, TransientFailure
from consumer.event import ConsumedEvent, encode_entry
from consumer.jobs.operations import PENDING
from consumer.jobs.states import LEASED, READY, WAITING_EXTERNAL
from outbox.errors import ConfigError

DAY = 86400.0


class Clock:
    """Real time plus what the test advanced: never behind the database's clock."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class Recording:
    name = "mail"
    supports_lookup = True
    supports_idempotency = False
    timeout = 7.0

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        self.sent.append(operation_id)
        return f"ref-{len(self.sent)}"

    def lookup(self, operation_id: str) -> str | None:
        return None


def test_a_store_clock_moves_leases_backoffs_timers_and_deadlines(db_url: str) -> None:
    clock = Clock()
    clock.offset = 10 * DAY  # far from the database's clock: any use of the latter shows
    store = Store(db_url, clock=clock)
    try:
        store.enqueue("studio", "send-quote-17")
        (lease,) = store.claim_batch("w1", 5, ttl=30)
        assert lease.expires_at == pytest.approx(clock() + 30, abs=5)
        store.fail(lease, error=TransientFailure("provider down"))
        job = store.get("studio", "send-quote-17")
        assert job.state == READY and job.run_after is not None
        assert job.run_after >= clock() - 5  # the backoff runs from the store's clock

        clock.offset += 3600  # the backoff is over
        (lease,) = store.claim_batch("w2", 5, ttl=30)
        receipt_deadline = _dispatch_and_read_deadline(store, lease)
        assert receipt_deadline == pytest.approx(clock() + 7.0, abs=5)

        # A lease expires by the store's clock: recovery without ``now`` takes it back.
        assert store.get(lease.job_id).state == LEASED
        assert store.recover().requeued == 0
        clock.offset += 60
        assert store.recover().requeued == 1

        # A timer fires by the store's clock.
        (lease,) = store.claim_batch("w3", 5, ttl=30)
        store.wait_external(lease, reason="reply", until=clock() + 3 * DAY)
        assert store.recover().woken == 0
        clock.offset += 3 * DAY + 1
        assert store.recover().woken == 1
        assert store.get(lease.job_id).state == READY
    finally:
        store.dispose()


def _dispatch_and_read_deadline(store: Store, lease: Any) -> float:
    provider = Recording()
    operations = Operations(store, {"mail": provider})
    # An intent's deadline is the store's clock + the provider's timeout: seen through a
    # provider that fails the call, so the receipt stays as the intent wrote it.

    class Failing(Recording):
        def send(
            self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
        ) -> str:
            raise KeyboardInterrupt  # a kill: nothing after the call is recorded

    operations.register(Failing())
    with pytest.raises(KeyboardInterrupt):
        operations.dispatch(lease, "email", "mail", {"to": "a@example.com"})
    receipt = operations.receipt(f"{lease.job_id}:email")
    assert receipt is not None and receipt.state == PENDING
    assert receipt.call_deadline is not None
    return receipt.call_deadline


def test_a_store_clock_must_be_callable() -> None:
    with pytest.raises(ConfigError) as err:
        Store(clock=12.0)  # type: ignore[arg-type]
    assert err.value.setting == "clock"


def test_without_a_clock_the_database_clock_decides(db_url: str) -> None:
    store = Store(db_url)
    try:
        store.enqueue("studio", "a")
        (lease,) = store.claim_batch("w1", 1, ttl=30)
        assert lease.expires_at == pytest.approx(time.time() + 30, abs=5)
        store.wait_external(lease, until=time.time() + DAY)
        assert store.get(lease.job_id).state == WAITING_EXTERNAL
        assert store.recover().woken == 0
    finally:
        store.dispose()


def test_consumer_run_once_now_claims_back_by_the_callers_clock(
    db_url: str, redis_url: str, stream_prefix: str, redis_client: redis.Redis
) -> None:
    stream = f"{stream_prefix}.outbox.quote.approved"
    calls: list[str] = []

    def handler(event: ConsumedEvent, tx: Any) -> None:
        calls.append(event.id)
        if len(calls) == 1:
            raise ValueError("the first delivery fails")

    consumer = Consumer(
        db_url,
        redis_url,
        group="billing",
        streams=[stream],
        config=ConsumerConfig(claim_idle_ms=60_000, block_ms=50),
    )
    consumer.add_handler("quote.approved", handler)
    fields = encode_entry("quote.approved", {"n": 1}, event_id="evt-1", subject="quote-17")
    redis_client.xadd(stream, fields)  # type: ignore[arg-type]
    try:
        assert consumer.run_once(block=False) == 0  # the handler failed: left pending
        assert consumer.run_once(block=False) == 0  # not idle for a minute yet
        assert consumer.run_once(block=False, now=time.time() + 30) == 0
        assert calls == ["evt-1"]
        assert consumer.run_once(block=False, now=time.time() + 61) == 1
        assert calls == ["evt-1", "evt-1"]
        assert redis_client.xpending(stream, "billing")["pending"] == 0
    finally:
        consumer.engine.dispose()
