"""Job store contract suite: PostgreSQL and SQLite through the ``db_url`` fixture.

The guarantees of fenced jobs and of waiting that costs storage, not a process (timers).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from consumer.errors import (
    Conflict,
    IllegalTransition,
    JobError,
    JobNotFound,
)
from consumer.jobs.retry import RetryPolicy
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    TRANSITIONS,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
)
from consumer.jobs.store import Store, StoreConfig
from outbox.db import make_engine


def test_seed_example_runs_exactly_as_written() -> None:
    from consumer import Conflict, Store

    store = Store()  # in-memory SQLite; Store(url_or_engine) otherwise
    store.enqueue("studio", "send-quote-017")
    epoch = store.claim("studio", "send-quote-017", "worker-a", now=100, ttl=30)  # -> 1
    # a second claim by another worker is refused until the lease expires (now < 130), then epoch 2 for the next worker  # noqa: E501
    store.finish("studio", "send-quote-017", "worker-a", epoch, now=132)  # Conflict if fenced out

    assert epoch == 1
    assert store.get("studio", "send-quote-017").state == DONE
    assert Conflict is not None


def test_seed_story_second_claim_refused_then_epoch_two_fences_the_first() -> None:
    from consumer import Conflict, Store

    store = Store()
    store.enqueue("studio", "send-quote-017")
    assert store.claim("studio", "send-quote-017", "worker-a", now=100, ttl=30) == 1
    assert store.claim("studio", "send-quote-017", "worker-b", now=129.9, ttl=30) is None
    assert store.claim("studio", "send-quote-017", "worker-b", now=130, ttl=30) == 2
    with pytest.raises(Conflict):
        store.finish("studio", "send-quote-017", "worker-a", 1, now=132)
    store.finish("studio", "send-quote-017", "worker-b", 2, now=132)
    history = store.history("studio", "send-quote-017")
    assert [(a.worker, a.epoch, a.outcome) for a in history] == [
        ("worker-a", 1, "expired"),
        ("worker-b", 2, "done"),
    ]


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def test_enqueue_is_idempotent_per_tenant(store: Store) -> None:
    first = store.enqueue("studio", "send-quote-017", subject="quote-017", payload={"n": 1})
    again = store.enqueue("studio", "send-quote-017", payload={"n": 2})
    other = store.enqueue("atelier", "send-quote-017")
    assert not first.duplicate and again.duplicate
    assert again.job_id == first.job_id
    assert other.job_id != first.job_id and not other.duplicate
    assert store.get(first.job_id).payload == {"n": 1}


def test_a_claimed_lease_carries_the_job_as_written(store: Store) -> None:
    """The claim's row becomes the Lease (PostgreSQL: prepared text, psycopg's own types):
    JSON payload, names, numbers and an unset timer come back as they were written."""
    store.enqueue(
        "studio",
        "send-quote-017",
        kind="email",
        subject="quote-017",
        subject_version="v3",
        payload={"n": 1, "to": ["a@example.com"], "ok": True, "x": 1.5, "none": None},
        provider="mail",
    )
    [lease] = store.claim_batch("worker-a", 10, ttl=60, now=100)
    assert (lease.tenant, lease.action, lease.kind, lease.subject) == (
        "studio",
        "send-quote-017",
        "email",
        "quote-017",
    )
    assert lease.payload == {"n": 1, "to": ["a@example.com"], "ok": True, "x": 1.5, "none": None}
    assert (lease.subject_version, lease.provider) == ("v3", "mail")
    assert (lease.attempts, lease.epoch) == (1, 1)
    assert (lease.worker, lease.expires_at, lease.timer) == ("worker-a", 160.0, None)
    assert isinstance(lease.job_id, int) and isinstance(lease.expires_at, float)
    result = store.finish_batch([lease])
    assert (result.done, result.conflicts) == ([lease.job_id], [])
    assert store.finish_batch([lease]).conflicts == [lease.job_id]  # already finished


def test_finish_batch_fences_each_lease_on_its_own_epoch(store: Store) -> None:
    """One batch, one statement (per database): every lease is checked against its own
    epoch and owner; the stale one is a conflict, left as it is, with no history row, and
    the others are DONE with theirs, in the batch's order."""
    for n in (1, 2, 3):
        store.enqueue("studio", f"send-quote-{n}")
    first = store.claim_batch("worker-a", 10, ttl=60, now=100)
    by_action = {lease.action: lease for lease in first}
    store.release(by_action["send-quote-2"], now=101)
    [again] = store.claim_batch("worker-a", 10, ttl=60, now=102)  # a new epoch of job 2
    stale = by_action["send-quote-2"]
    order = [by_action["send-quote-3"], stale, by_action["send-quote-1"]]
    result = store.finish_batch(order, now=110)
    assert result.done == sorted(
        [by_action["send-quote-1"].job_id, by_action["send-quote-3"].job_id]
    )
    assert result.conflicts == [stale.job_id]
    assert store.get(stale.job_id).state == "LEASED"
    assert [a.outcome for a in store.history(stale.job_id)] == ["released"]
    for action in ("send-quote-1", "send-quote-3"):
        lease = by_action[action]
        assert store.get(lease.job_id).state == "DONE"
        assert [(a.worker, a.epoch, a.outcome, a.at) for a in store.history(lease.job_id)] == [
            ("worker-a", lease.epoch, "done", 110.0)
        ]
    assert store.finish_batch([again], now=111).done == [again.job_id]


def test_enqueue_joins_the_callers_transaction(db_url: str) -> None:
    engine = make_engine(db_url)
    store = Store(engine)
    with Session(engine) as session:
        session.begin()
        result = store.enqueue("studio", "rolled-back", session=session)
        assert not result.duplicate
        session.rollback()
    with pytest.raises(JobNotFound):
        store.get("studio", "rolled-back")
    with engine.connect() as conn, conn.begin():
        store.enqueue("studio", "committed", session=conn)
    assert store.get("studio", "committed").state == READY
    engine.dispose()


def test_enqueue_many_one_statement_results_in_order(store: Store) -> None:
    existing = store.enqueue("studio", "send-2", payload={"n": "first"})
    results = store.enqueue_many(
        [
            {"tenant": "studio", "action": "send-1", "subject": "quote-1", "payload": {"n": 1}},
            {"tenant": "studio", "action": "send-2", "payload": {"n": 2}},  # exists already
            {"tenant": "atelier", "action": "send-1", "priority": 5},
            {"tenant": "studio", "action": "send-1"},  # repeated within the list
        ]
    )
    assert [r.duplicate for r in results] == [False, True, False, True]
    assert results[1].job_id == existing.job_id
    assert results[3].job_id == results[0].job_id
    assert len({r.job_id for r in results}) == 3
    assert store.get(results[0].job_id).payload == {"n": 1}
    assert store.get(results[1].job_id).payload == {"n": "first"}  # the existing job wins
    assert store.get(results[2].job_id).priority == 5
    assert store.get(results[0].job_id).state == READY
    assert store.enqueue_many([]) == []


def test_enqueue_many_large_batches_and_caller_transaction(db_url: str) -> None:
    engine = make_engine(db_url)
    store = Store(engine)
    specs = [{"tenant": f"t{i % 3}", "action": f"a-{i}"} for i in range(1200)]
    with Session(engine) as session:
        session.begin()
        assert len(store.enqueue_many(specs, session=session)) == 1200
        session.rollback()
    with pytest.raises(JobNotFound):
        store.get("t0", "a-0")
    with engine.connect() as conn, conn.begin():
        first = store.enqueue_many(specs, session=conn)
    again = store.enqueue_many(specs)
    assert not any(r.duplicate for r in first)
    assert all(r.duplicate for r in again)
    assert [r.job_id for r in again] == [r.job_id for r in first]
    engine.dispose()


def test_enqueue_many_validates_every_spec_before_writing(store: Store) -> None:
    bad_specs: list[Any] = [
        [{"tenant": "t", "action": "ok"}, {"tenant": "", "action": "x"}],
        [{"tenant": "t", "action": "ok"}, {"tenant": "t", "action": "x", "payload": {1, 2}}],
        [{"tenant": "t", "action": "ok"}, {"tenant": "t"}],
        [{"tenant": "t", "action": "ok"}, {"tenant": "t", "action": "x", "colour": "red"}],
        [{"tenant": "t", "action": "ok"}, "not a mapping"],
        {"tenant": "t", "action": "ok"},
    ]
    for specs in bad_specs:
        with pytest.raises(JobError):
            store.enqueue_many(specs)
    with pytest.raises(JobNotFound):
        store.get("t", "ok")


def test_every_holder_move_with_a_stale_epoch_raises_conflict(store: Store) -> None:
    store.enqueue("t", "job")
    assert store.claim("t", "job", "a", now=100, ttl=10) == 1
    assert store.claim("t", "job", "b", now=111, ttl=10) == 2
    stale = ("t", "job", "a", 1)
    moves = [
        lambda: store.renew(*stale, now=112),
        lambda: store.finish(*stale, now=112),
        lambda: store.fail(*stale, error="x", now=112),
        lambda: store.fail(*stale, error="x", kind="permanent", now=112),
        lambda: store.wait_external(*stale, now=112),
        lambda: store.wait_review(*stale, now=112),
        lambda: store.cancel(*stale, now=112),
    ]
    for move in moves:
        with pytest.raises(Conflict):
            move()
    # the wrong worker with the right epoch is fenced too
    with pytest.raises(Conflict):
        store.finish("t", "job", "a", 2, now=112)
    job = store.get("t", "job")
    assert (job.state, job.lease_owner, job.lease_epoch) == (LEASED, "b", 2)
    store.finish("t", "job", "b", 2, now=112)


def test_stale_lease_object_cannot_reschedule(store: Store) -> None:
    store.enqueue("t", "job")
    old = store.claim_next("a", ttl=5, now=100)
    assert old is not None
    assert store.recover(now=106).requeued == 1
    new = store.claim_next("b", ttl=5, now=107)
    assert new is not None and new.epoch == old.epoch + 1
    with pytest.raises(Conflict):
        store.schedule(old, 500, "reminder")
    with pytest.raises(Conflict):
        store.finish(old)
    store.finish(new)


def test_a_live_lease_is_never_claimed(store: Store) -> None:
    store.enqueue("t", "job")
    lease = store.claim_next("a", ttl=30, now=1000)
    assert lease is not None and lease.epoch == 1
    for t in (1000, 1010, 1029.999):
        assert store.claim("t", "job", "b", now=t, ttl=30) is None
        assert store.claim_next("b", now=t) is None
        assert store.claim_batch("b", 10, now=t) == []
    store.renew(lease, ttl=30, now=1020)  # now expires at 1050
    assert store.claim("t", "job", "b", now=1049, ttl=30) is None
    assert store.recover(now=1049) == store.recover(now=1049)  # nothing to do
    assert store.get("t", "job").lease_owner == "a"
    assert store.claim("t", "job", "b", now=1050, ttl=30) == 2


def test_renew_never_shortens_a_lease(store: Store) -> None:
    """A heartbeat landing just after a dispatch extended the lease to its provider call's
    deadline leaves the longer lease alone (it would otherwise expire mid-call)."""
    store.enqueue("t", "job")
    lease = store.claim_next("a", ttl=30, now=1000)
    assert lease is not None
    with store.driver.begin() as conn:  # what a dispatch does for a call ending at 2000
        assert store.driver.job_lease_extend(conn, lease.job_id, "a", lease.epoch, 2000)
    assert store.renew(lease, ttl=5, now=1001) == pytest.approx(2000)
    assert store.get(lease.job_id).lease_expires_at == pytest.approx(2000)
    assert store.claim("t", "job", "b", now=1999, ttl=30) is None
    assert store.recover(now=1999).requeued == 0
    # a renewal reaching past the current expiry still extends it
    assert store.renew(lease, ttl=600, now=1500) == pytest.approx(2100)
    assert store.get(lease.job_id).lease_expires_at == pytest.approx(2100)


def test_renew_batch_renews_every_held_lease_in_one_call_and_names_the_lost(
    store: Store,
) -> None:
    for i in range(5):
        store.enqueue("t", f"job-{i}")
    leases = store.claim_batch("a", 5, ttl=10, now=1000)
    assert len(leases) == 5
    with store.driver.begin() as conn:  # one lease already lasts longer (a call in flight)
        assert store.driver.job_lease_extend(conn, leases[0].job_id, "a", leases[0].epoch, 5000)
    store.finish(leases[1], now=1001)  # finished meanwhile: not held any more
    assert store.renew_batch(leases[2:4], ttl=30, now=1005).done == [
        leases[2].job_id,
        leases[3].job_id,
    ]
    assert store.recover(now=1011).requeued == 1  # only the one not renewed expired...
    assert store.claim("t", "job-4", "b", ttl=10, now=1012) == 2  # ...another worker has it
    result = store.renew_batch(leases, ttl=30, now=1013)  # what the holder believes it holds
    assert result.done == sorted(x.job_id for x in (leases[0], leases[2], leases[3]))
    assert result.conflicts == sorted(x.job_id for x in (leases[1], leases[4]))
    assert store.get(leases[0].job_id).lease_expires_at == pytest.approx(5000)  # never shorter
    for lease in leases[2:4]:
        assert store.get(lease.job_id).lease_expires_at == pytest.approx(1043)
    job = store.get("t", "job-4")
    assert (job.lease_owner, job.lease_epoch) == ("b", 2)  # the other worker's lease stands
    assert store.renew_batch([], ttl=30).done == []


def test_recovery_returns_only_expired_leases(store: Store) -> None:
    for i in range(6):
        store.enqueue("t", f"job-{i}")
    short = store.claim_batch("short", 3, ttl=10, now=100)
    long = store.claim_batch("long", 3, ttl=100, now=100)
    assert len(short) == 3 and len(long) == 3
    assert store.recover(now=109).requeued == 0
    result = store.recover(now=110)
    assert result.requeued == 3 and result.needs_attention == 0
    for lease in short:
        assert store.get(lease.job_id).state == READY
        with pytest.raises(Conflict):
            store.finish(lease)
    for lease in long:
        job = store.get(lease.job_id)
        assert (job.state, job.lease_owner, job.lease_epoch) == (LEASED, "long", lease.epoch)
        store.finish(lease, now=111)
    assert [a.outcome for a in store.history(short[0].job_id)] == ["expired"]


def test_recovery_is_bounded_and_sends_spent_jobs_to_attention(db_url: str) -> None:
    store = Store(db_url, config=StoreConfig(retry=RetryPolicy(max_attempts=2)))
    store.enqueue("t", "flaky")
    for i in range(5):
        store.enqueue("t", f"other-{i}")
    store.claim_batch("w", 10, ttl=1, now=100)
    assert store.recover(now=200, limit=2).requeued == 2
    assert store.recover(now=200).requeued == 4
    assert store.claim("t", "flaky", "w", now=201, ttl=1) == 2
    result = store.recover(now=300)
    assert result.needs_attention == 1
    assert store.get("t", "flaky").state == NEEDS_ATTENTION
    store.dispose()


def test_illegal_transitions_raise(store: Store) -> None:
    store.enqueue("t", "job")
    with pytest.raises(IllegalTransition):
        store.resume("t", "job")  # READY -> READY is no resume
    epoch = store.claim("t", "job", "w", ttl=30)
    assert epoch == 1
    store.finish("t", "job", "w", epoch)
    with pytest.raises(IllegalTransition) as info:
        store.resume("t", "job")
    assert (info.value.current, info.value.target) == (DONE, READY)
    with pytest.raises(IllegalTransition):
        store.cancel("t", "job")
    with pytest.raises(IllegalTransition):
        store.schedule(("t", "job"), 10**9, "too late")
    assert store.claim("t", "job", "w") is None  # DONE is terminal
    assert TRANSITIONS[DONE] == frozenset() and TRANSITIONS[CANCELLED] == frozenset()


def test_waiting_states_release_the_worker_and_resume_makes_them_eligible(store: Store) -> None:
    store.enqueue("t", "ask-customer")
    store.enqueue("t", "check-vat")
    ask = store.claim_next("w", now=100)
    vat = store.claim_next("w", now=100)
    assert ask is not None and vat is not None
    store.wait_external(ask, reason="waiting for the customer's reply", now=101)
    store.wait_review(vat, reason="VAT number rejected", now=101)
    for lease, state in ((ask, WAITING_EXTERNAL), (vat, WAITING_REVIEW)):
        job = store.get(lease.job_id)
        assert job.state == state and job.lease_owner is None and job.lease_expires_at is None
    assert store.claim_next("w2", now=10**9) is None  # waiting costs storage, not a worker
    assert store.recover(now=10**9) == store.recover(now=10**9)
    store.resume(ask.job_id, now=102)  # the reply arrived
    store.resume("t", "check-vat", now=102)  # an operator decided
    again = store.claim_batch("w2", 10, now=103)
    assert sorted(x.job_id for x in again) == sorted([ask.job_id, vat.job_id])
    assert all(x.epoch == 2 for x in again)


def test_a_waiting_job_wakes_on_its_timer(store: Store) -> None:
    store.enqueue("t", "await-payment")
    lease = store.claim_next("w", now=100)
    assert lease is not None
    store.wait_external(lease, reason="payment", until=500, now=100)
    assert store.recover(now=499).woken == 0
    assert store.recover(now=500).woken == 1
    assert store.claim_next("w", now=501) is not None


def test_failures_follow_the_retry_policy(db_url: str) -> None:
    policy = RetryPolicy(
        base=10,
        ceiling=60,
        provider_ceilings={"sms": 20},
        max_attempts=4,
        max_auth_failures=2,
        max_elapsed=1000,
    )
    store = Store(db_url, config=StoreConfig(retry=policy))
    rng = random.Random(7)
    store.enqueue("t", "mail", provider="sms")
    now = 100.0
    for attempt in (1, 2, 3):
        lease = store.claim_next("w", now=now)
        assert lease is not None and lease.attempts == attempt
        assert store.fail(lease, error=TimeoutError("slow"), now=now, rng=rng) == READY
        job = store.get(lease.job_id)
        assert job.run_after is not None and now <= job.run_after <= now + 20  # sms ceiling
        assert job.last_error == "TimeoutError: slow"
        assert store.claim_next("w", now=now - 1) is None
        now = job.run_after
    lease = store.claim_next("w", now=now)
    assert lease is not None
    assert store.fail(lease, error="still slow", now=now) == NEEDS_ATTENTION

    store.enqueue("t", "validate")
    lease = store.claim("t", "validate", "w", now=1)
    assert lease == 1
    assert store.fail("t", "validate", "w", 1, error="bad VAT", kind="permanent") == WAITING_REVIEW

    store.enqueue("t", "auth")
    states = []
    t = 100.0
    for _ in range(2):
        lease2 = store.claim_next("w", now=t + 10**6)
        assert lease2 is not None and lease2.action == "auth"
        states.append(store.fail(lease2, error="401", kind="auth", now=t))
    assert states == [READY, NEEDS_ATTENTION]
    history = store.history("t", "auth")
    assert [h.outcome for h in history] == ["retry", "needs_attention"]
    store.dispose()


def test_recovery_window_bounds_transient_retries(db_url: str) -> None:
    store = Store(db_url, config=StoreConfig(retry=RetryPolicy(max_elapsed=50)))
    store.enqueue("t", "job")
    lease = store.claim_next("w", now=100)
    assert lease is not None and store.fail(lease, error="e", now=100) == READY
    lease = store.claim_next("w", now=10**6)
    assert lease is not None and store.fail(lease, error="e", now=151) == NEEDS_ATTENTION
    store.resume(lease.job_id, now=152)  # an operator fixed it: the budget restarts
    lease = store.claim_next("w", now=152)
    assert lease is not None and lease.attempts == 1
    store.dispose()


def test_now_accepts_datetimes_and_defaults_to_the_database_clock(store: Store) -> None:
    store.enqueue("t", "job", run_after=datetime(2000, 1, 1, tzinfo=UTC))
    assert store.claim("t", "job", "w", now=datetime(1999, 12, 31)) is None
    epoch = store.claim("t", "job", "w", ttl=60)  # database clock: far after 2000
    assert epoch == 1
    job = store.get("t", "job")
    assert job.lease_expires_at is not None
    assert job.lease_expires_at - job.updated_at == pytest.approx(60)
    assert job.updated_at > datetime(2020, 1, 1, tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.enqueue("", "a"), "tenant"),
        (lambda s: s.enqueue("t", "  "), "action"),
        (lambda s: s.enqueue("t", "a", payload={1, 2}), "payload"),
        (lambda s: s.enqueue("t", "a", priority="high"), "priority"),
        (lambda s: s.claim("t", "a", "w", ttl=-1), "ttl"),
        (lambda s: s.claim("t", "a", "w", now="noon"), "now"),
        (lambda s: s.claim("t", "a", ""), "worker"),
        (lambda s: s.claim_batch("w", 0), "limit"),
        (lambda s: s.finish("t", "a", "w", 0), "epoch"),
        (lambda s: s.fail("t", "a", "w", 1, kind="weird"), "kind"),
        (lambda s: s.schedule(("t", "a"), 5, ""), "reason"),
    ],
)
def test_bad_input_raises_a_typed_error_naming_the_field(call: object, field: str) -> None:
    store = Store()
    with pytest.raises(JobError) as info:
        call(store)  # type: ignore[operator]
    assert info.value.field == field


def test_unknown_jobs_raise_job_not_found(store: Store) -> None:
    with pytest.raises(JobNotFound):
        store.claim("t", "nope", "w")
    with pytest.raises(JobNotFound):
        store.finish("t", "nope", "w", 1)
    with pytest.raises(JobNotFound):
        store.resume(12345)


def test_schema_is_created_idempotently(db_url: str) -> None:
    engine = make_engine(db_url)
    Store(engine).create_schema()
    Store(engine).create_schema()
    assert {"outbox_jobs", "outbox_job_attempts"} <= set(sa.inspect(engine).get_table_names())
    engine.dispose()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.enqueue("stu\x00dio", "a"), "tenant"),
        (lambda s: s.enqueue("t", "send\x00"), "action"),
        (lambda s: s.enqueue("t", "a", subject="x" * 201), "subject"),
        (lambda s: s.enqueue("t", "a", payload={"to": "a\x00b"}), "payload"),
        (lambda s: s.enqueue_many([{"tenant": "t", "action": "a\x00"}]), "action"),
        (lambda s: s.claim_next("w\x00"), "worker"),
    ],
)
def test_bad_names_are_typed_errors_on_both_databases(
    db_url: str, call: object, field: str
) -> None:
    """The shared name rules (outbox.validate): PostgreSQL would raise DataError on NUL and
    SQLite would store it; both refuse it before anything is written."""
    store = Store(db_url)
    with pytest.raises(JobError) as info:
        call(store)  # type: ignore[operator]
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    assert sum(store.counts().values()) == 0
    store.dispose()


def test_the_store_reaches_the_database_only_through_its_driver(db_url: str) -> None:
    from consumer.jobs.driver import PostgresJobDriver, SqliteJobDriver

    store = Store(db_url)
    expected = PostgresJobDriver if db_url.startswith("postgresql") else SqliteJobDriver
    assert type(store.driver) is expected
    with store.driver.begin() as conn:
        assert store.driver.clock_read(conn, None) > 1.6e9
    store.dispose()


def _store_with_pending_receipts(db_url: str, count: int) -> Store:
    """A store whose operations table holds ``count`` PENDING receipts, ``op-0`` onwards."""
    from consumer.jobs.schema import operations

    store = Store(db_url)
    store.create_schema()
    with store.driver.begin() as conn:
        conn.execute(
            operations.insert(),
            [
                {
                    "operation_id": f"op-{i}",
                    "job_id": i,
                    "provider": "mail",
                    "request_digest": "d",
                    "state": "PENDING",
                    "attempts": 1,
                    "created_at": 0.0,
                    "updated_at": 0.0,
                }
                for i in range(count)
            ],
        )
    return store


def test_a_receipt_is_recorded_in_one_statement_with_its_filters(db_url: str) -> None:
    """``operation_record`` (PostgreSQL: prepared text, one per shape; SQLite: the generic
    UPDATE): values, clock stamps, and the state and attempts filters, alike on both."""
    store = _store_with_pending_receipts(db_url, 3)
    driver = store.driver

    def row(operation_id: str) -> Any:
        with driver.begin() as conn:
            return driver.operation_get(conn, operation_id)

    accepted = {"state": "ACCEPTED", "provider_ref": "ref-0", "last_error": None}
    assert driver.operation_record("op-0", accepted, stamp=("updated_at",))
    assert (row("op-0").state, row("op-0").provider_ref) == ("ACCEPTED", "ref-0")
    assert row("op-0").updated_at > 1.6e9  # the database clock
    # An ACCEPTED receipt never changes again; a stale attempt count or state matches nothing.
    unknown = {"state": "UNKNOWN", "provider_ref": None, "last_error": "timeout"}
    assert not driver.operation_record("op-0", unknown, unless_states=("ACCEPTED",))
    assert not driver.operation_record("op-1", unknown, if_attempts=2)
    assert not driver.operation_record("op-1", unknown, if_states=("UNKNOWN", "NOT_SENT"))
    assert not driver.operation_record("op-missing", unknown)
    assert row("op-0").state == "ACCEPTED" and row("op-1").state == "PENDING"
    # The same shapes again (cached statements on PostgreSQL), now matching.
    assert driver.operation_record("op-1", unknown, if_attempts=1, if_states=("PENDING",))
    settled = {"state": "NOT_SENT", "settled_by": "ops", "settled_reason": "checked"}
    assert driver.operation_record(
        "op-1", settled, stamp=("updated_at", "settled_at"), unless_states=("ACCEPTED",)
    )
    after = row("op-1")
    assert (after.state, after.last_error, after.settled_by) == ("NOT_SENT", "timeout", "ops")
    assert after.settled_at > 1.6e9 and row("op-2").state == "PENDING"
    with pytest.raises(ValueError, match="not a column"):
        driver.operation_record("op-2", {"stat": "ACCEPTED"})
    store.dispose()


def test_a_receipt_recorded_without_its_flush_leaves_the_connection_durable(
    db_url: str,
) -> None:
    """``durable=False`` (a receipt right after a call) records the same as a durable record;
    on PostgreSQL its ``synchronous_commit off`` holds for that statement only: the pooled
    connection it ran on commits the next intent durably again."""
    store = _store_with_pending_receipts(db_url, 1)
    driver = store.driver
    accepted = {"state": "ACCEPTED", "provider_ref": "ref-0", "last_error": None}
    unknown = {"state": "UNKNOWN", "provider_ref": None, "last_error": "timeout"}
    assert not driver.operation_record("op-0", unknown, if_attempts=2, durable=False)
    assert driver.operation_record("op-0", accepted, stamp=("updated_at",), durable=False)
    assert not driver.operation_record("op-0", unknown, unless_states=("ACCEPTED",), durable=False)
    with driver.begin() as conn:
        row = driver.operation_get(conn, "op-0")
        assert (row.state, row.provider_ref) == ("ACCEPTED", "ref-0")
        assert row.updated_at > 1.6e9
        if conn.dialect.name == "postgresql":
            # One connection served every call above (nothing ran beside them).
            assert driver.engine.pool.checkedin() == 0  # type: ignore[attr-defined]
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
    store.dispose()


def test_an_operations_table_from_before_call_deadlines_gains_the_new_columns(db_url: str) -> None:
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE outbox_operations (operation_id VARCHAR(400) PRIMARY KEY,"
                " job_id BIGINT NOT NULL, provider VARCHAR(200) NOT NULL,"
                " request_digest VARCHAR(64) NOT NULL, state VARCHAR(16) NOT NULL,"
                " provider_ref VARCHAR(200), attempts INTEGER NOT NULL DEFAULT 0,"
                " last_error TEXT, created_at FLOAT NOT NULL, updated_at FLOAT NOT NULL)"
            )
        )
    Store(engine).create_schema()
    names = {c["name"] for c in sa.inspect(engine).get_columns("outbox_operations")}
    assert {"call_deadline", "settled_by", "settled_reason", "settled_at"} <= names
    engine.dispose()


def test_enqueue_in_a_consumer_batch_session_is_buffered_and_flushed_once(db_url: str) -> None:
    """consumer.bulk's deferred writes: the consumer marks its batch Session, per-event
    enqueues are buffered and written in one statement at the flush; reading a result
    before that flushes first, so ``duplicate`` is always right."""
    from consumer.bulk import defer_writes, discard_deferred, flush_deferred
    from consumer.jobs.store import DeferredEnqueue, EnqueueResult

    store = Store(db_url)
    existing = store.enqueue("t", "a-0")

    def count(session: Session) -> int:
        return int(session.execute(sa.text("SELECT count(*) FROM outbox_jobs")).scalar_one())

    with Session(store.engine) as session, session.begin():
        defer_writes(session)
        first = store.enqueue("t", "a-1", session=session, payload={"n": 1})
        again = store.enqueue("t", "a-1", session=session)
        old = store.enqueue("t", "a-0", session=session)
        assert isinstance(first, DeferredEnqueue)
        assert count(session) == 1  # nothing written yet: no round trip per enqueue
        flush_deferred(session)
        assert count(session) == 2
        assert first == EnqueueResult(first.job_id, False)
        assert again.duplicate and again.job_id == first.job_id
        assert old.duplicate and old.job_id == existing.job_id
        late = store.enqueue("t", "a-2", session=session)
        assert late.duplicate is False  # read before the flush: flushed on access
        assert count(session) == 3
        dropped = store.enqueue("t", "a-3", session=session)
        discard_deferred(session)  # its handler's savepoint rolled back
        with pytest.raises(Conflict):
            _ = dropped.job_id
        flush_deferred(session)
    assert {store.get(r.job_id).action for r in (first, late)} == {"a-1", "a-2"}
    with pytest.raises(JobNotFound):
        store.get("t", "a-3")
    store.dispose()
