"""Periodic duties as named objects (issue 26): ``outbox.duty``'s Interval and Duty, on a
clock the test moves, and the duties each loop names."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from consumer import Consumer, Store, Worker
from outbox.duty import Duty, Interval, weakly


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_interval_is_due_at_once_or_one_interval_after_it_is_made() -> None:
    clock = Clock()
    now_first = Interval(5.0, clock=clock)
    later = Interval(5.0, first="later", clock=clock)
    assert now_first.due() and not later.due()
    clock.now += 4.9
    assert not later.due() and later.remaining() == pytest.approx(0.1)
    clock.now += 0.1
    assert later.due() and later.remaining() == 0.0


def test_done_books_the_next_one_interval_later_or_sooner_and_make_due_brings_it_now() -> None:
    clock = Clock()
    interval = Interval(5.0, clock=clock)
    interval.done()
    assert not interval.due() and interval.next_at == 105.0
    interval.done(102.0, again_in=0.5)  # a backoff shorter than the interval
    assert not interval.due(102.4) and interval.due(102.5)
    interval.done(103.0)  # the interval again after the next round
    assert interval.next_at == 108.0
    interval.make_due()
    assert interval.due()


def test_an_interval_reads_its_seconds_at_every_check() -> None:
    clock = Clock()
    settings = {"seconds": 10.0}
    interval = Interval(lambda: settings["seconds"], clock=clock)
    interval.done()
    clock.now += 2.0
    assert not interval.due()
    settings["seconds"] = 1.0  # a config replaced after the loop was made
    assert interval.due()


def test_a_duty_runs_when_due_and_books_its_round_before_running_it() -> None:
    clock = Clock()
    runs: list[float] = []
    duty = Duty("count", 1.0, lambda: runs.append(clock.now), clock=clock)
    assert duty.name == "count"
    assert duty.maybe_run() and runs == [100.0]
    assert not duty.maybe_run()  # not due again yet
    clock.now += 1.0
    assert duty.maybe_run() and runs == [100.0, 101.0]
    duty.run_once()  # a round now, whatever the interval; the schedule is left alone
    assert runs == [100.0, 101.0, 101.0] and not duty.due()
    duty.make_due()
    assert duty.maybe_run() and len(runs) == 4


def test_a_failed_round_waits_one_interval_unless_it_retries_at_once() -> None:
    clock = Clock()

    def fail() -> None:
        raise ConnectionError("down")

    patient = Duty("patient", 5.0, fail, clock=clock)
    eager = Duty("eager", 5.0, fail, retry_failed=True, clock=clock)
    for duty in (patient, eager):
        with pytest.raises(ConnectionError):
            duty.maybe_run()
    assert not patient.due() and eager.due()


def test_a_round_that_says_more_is_due_brings_the_next_forward() -> None:
    clock = Clock()
    backlog = [3, 3, 1]
    duty = Duty(
        "purge",
        60.0,
        lambda: backlog.pop(0),
        again_in=lambda removed: 0.0 if removed >= 3 else None,
        clock=clock,
    )
    assert duty.run_now() == 3 and duty.due()  # a full batch: again at once
    assert duty.run_now() == 3 and duty.due()
    assert duty.run_now() == 1 and not duty.due()  # caught up: the interval again
    assert duty.interval.next_at == 160.0


def test_the_relay_names_its_duties_with_their_intervals(tmp_path: Path) -> None:
    import redis

    from outbox import Outbox
    from relay.config import RelayConfig
    from relay.redis.publisher import RedisStreamPublisher
    from relay.relay import RECONCILE_INTERVAL, Relay

    box = Outbox(f"sqlite:///{tmp_path}/duties.db")
    client = redis.Redis(port=1)  # never contacted: nothing runs here
    config = RelayConfig(retention_interval=7.0, redis_check_interval=11.0, vacuum_interval=3.0)
    relay = Relay(box, RedisStreamPublisher(client, "outbox.{topic}"), config)
    try:
        assert relay.vacuum is not None
        duties = [relay.reconciliation, relay.redis_check, relay.retention, relay.vacuum]
        assert [d.name for d in duties] == [
            "reconcile",
            "Redis check",
            "outbox retention",
            "outbox vacuum",
        ]
        assert [d.interval.seconds for d in duties] == [RECONCILE_INTERVAL, 11.0, 7.0, 3.0]
        # Reconciliation, the check and retention are due at the first cycle; the vacuum
        # one interval after the relay was made.
        assert [d.due() for d in duties] == [True, True, True, False]
        off = Relay(
            box, RedisStreamPublisher(client, "outbox.{topic}"), RelayConfig(vacuum_interval=0)
        )
        assert off.vacuum is None
        off.store.close()
    finally:
        relay.store.close()


def test_the_worker_names_its_duties_with_their_intervals(tmp_path: Path) -> None:
    from consumer import Store, Worker

    store = Store(f"sqlite:///{tmp_path}/jobs.db")
    store.create_schema()
    worker = Worker(
        store, recover_interval=2.0, reconcile_interval=5.0, liveness_interval=0.5, liveness_ttl=3
    )
    duties = [worker.recovery, worker.reconciliation, worker.liveness, worker.retention]
    assert [d.name for d in duties if d is not None] == [
        "recovery",
        "receipt sweep",
        "liveness",
        "job retention",
    ]
    assert [worker.recovery.interval.seconds, worker.reconciliation.interval.seconds] == [2.0, 5.0]
    assert worker.liveness.interval.seconds == 0.5
    # Recovery is due at once; the receipt sweep one interval after start.
    assert worker.recovery.due() and not worker.reconciliation.due()
    assert worker.recovery.run_once() is False  # one round now: nothing to recover
    beat = worker.liveness.run_once()  # one beat: this worker's row, nobody to recover
    assert (beat.requeued, beat.needs_attention) == (0, 0)
    assert worker.reconciliation.run_once() is None  # no providers: nothing to sweep
    store.dispose()


def test_weakly_does_not_keep_its_object_alive() -> None:
    class Owner:
        def answer(self) -> int:
            return 42

    owner = Owner()
    call = weakly(owner.answer)
    assert call() == 42
    gone = weakref.ref(owner)
    del owner
    assert gone() is None
    with pytest.raises(ReferenceError):
        call()


def test_a_dropped_consumer_or_worker_is_freed_at_once(
    sqlite_url: str, redis_url: str, stream_prefix: str
) -> None:
    """Their duties call back through weak references: no reference cycle keeps a consumer
    or a worker (their engines, their connections) alive after the user drops it, whether or
    not the cyclic garbage collector runs (it is off here)."""
    gc.disable()
    try:
        consumer = Consumer(sqlite_url, redis_url, group="g", streams=[f"{stream_prefix}.s"])
        consumer.add_handler("t", lambda event, tx: None)
        consumer.run_once(block=False)
        worker = Worker(Store(sqlite_url))
        worker.register("send", lambda job: None)
        worker.run_once()
        gone = [weakref.ref(consumer), weakref.ref(worker)]
        del consumer, worker
        assert [ref() for ref in gone] == [None, None]
    finally:
        gc.enable()
