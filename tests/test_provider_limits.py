"""Provider limits in one process, on both databases: what a call does with its reserved start.

The fleet-wide behaviour (two worker processes, a rate measured at the server, a pause
beside a healthy provider) is in tests/test_effects_slots.py; these pin the rules it rests
on, without timing anything: a call that is past its reserved start by more than ``LATE``
takes a new one (the row's ``next_call_at`` moves on by one more spacing), every call on a
ticket takes a start of its own, a call out of time is handed back without reserving, and
an ``HttpProvider`` that could write its first byte only past :func:`send_by` sends nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from consumer import HttpProvider, Store
from consumer.errors import ProviderThrottled
from consumer.jobs import limits
from consumer.jobs.limits import LATE, FleetLimits, ProviderGate, StartMissed
from consumer.jobs.plan import Step
from consumer.jobs.schema import provider_limits
from tests.services import wait_for
from tests.simulator_support import SimulatorProcess, max_per_window


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    store = Store(db_url)
    yield store
    store.dispose()


def gate(store: Store, rate: float = 5.0) -> ProviderGate:
    return ProviderGate("mail", FleetLimits(store), rate_limit=rate, slots=4)


def booked(store: Store) -> float:
    with store.engine.connect() as conn:
        return float(
            conn.execute(
                select(provider_limits.c.next_call_at).where(provider_limits.c.provider == "mail")
            ).scalar_one()
        )


def test_a_start_missed_by_more_than_late_is_reserved_again(store: Store) -> None:
    g = gate(store)
    ticket = g.enter()
    first = booked(store)
    missed = ticket.started = time.monotonic() - 10 * LATE  # kept away past it (a busy machine)
    g.hold(ticket)
    assert booked(store) >= first + g.spacing - 1e-6  # one more start reserved
    assert ticket.held and ticket.started > missed  # the call goes at the new one


def test_every_call_on_a_ticket_takes_a_start_of_its_own(store: Store) -> None:
    g = gate(store, rate=50.0)
    calls: list[str] = []
    ticket = g.enter()
    first = booked(store)
    lookup = Step(lambda: calls.append("lookup"), lambda run: asyncio.sleep(0))
    send = Step(lambda: calls.append("send"), lambda run: asyncio.sleep(0))
    g.call(ticket, lookup).sync()
    g.call(ticket, send).sync()  # a resend after a lookup found nothing: a second call
    assert calls == ["lookup", "send"]
    assert booked(store) >= first + g.spacing - 1e-6


def test_a_call_out_of_time_for_a_new_start_is_throttled_without_reserving(store: Store) -> None:
    g = gate(store)
    ticket = g.enter()
    first = booked(store)
    ticket.started = time.monotonic() - 10 * LATE
    ticket.latest = time.monotonic() - 1.0  # its deadline allows no later start
    with pytest.raises(ProviderThrottled):
        g.hold(ticket)
    assert booked(store) == first


def test_a_start_missed_at_the_first_byte_is_taken_again(store: Store) -> None:
    g = gate(store, rate=50.0)
    ticket = g.enter()
    first = booked(store)
    tries: list[float | None] = []

    def send() -> str:
        tries.append(limits.send_by())
        if len(tries) == 1:
            raise StartMissed  # the client could not write in time: nothing sent
        return "ref-1"

    assert g.call(ticket, Step(send, lambda run: asyncio.sleep(0))).sync() == "ref-1"
    assert len(tries) == 2 and None not in tries
    assert booked(store) >= first + g.spacing - 1e-6
    assert limits.send_by() is None  # reset once the call is made


# -- HttpProvider keeps to send_by at its first byte, sync and async --------------------------


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatorProcess]:
    path: Path = tmp_path_factory.mktemp("sim") / "mail.db"
    with SimulatorProcess(path) as process:
        yield process


@pytest.mark.parametrize("form", ["sync", "async"])
def test_http_provider_sends_nothing_past_send_by(sim: SimulatorProcess, form: str) -> None:
    provider = HttpProvider("mail", sim.send_url, lookup_url=sim.lookup_url, timeout=5.0)
    operation_id = f"late-{form}-{time.monotonic_ns()}"

    def send() -> str:
        kwargs = {"operation_id": operation_id, "idempotency_key": operation_id}
        if form == "sync":
            return provider.send({"to": "a@example.com"}, **kwargs)

        async def go() -> str:
            try:
                return await provider.asend({"to": "a@example.com"}, **kwargs)
            finally:
                await provider.aclose()

        return asyncio.run(go())

    token = limits._SEND_BY.set(time.monotonic() - 1.0)  # its start is a second gone
    try:
        with pytest.raises(StartMissed):
            send()
    finally:
        limits._SEND_BY.reset(token)
    assert [a for a in sim.arrivals() if a["operation_id"] == operation_id] == []
    assert send()  # no reserved start: it goes
    assert len(sim.effects(operation_id)) == 1
    provider.close()


def test_a_fast_providers_permits_do_not_shrink_on_the_workers_own_delays() -> None:
    """A provider answering in 50 µs, sampled through a busy worker (a call now and then
    20-60 ms, the thread scheduled late): that is the machine, not a queue at the provider.
    Before the floor every such call took 10 % off, the limit fell to 1 and the worker
    handed back nearly every job (seen at load 30 in the soak)."""
    permits = limits.AdaptiveLimit(16)
    for i in range(400):
        assert permits.try_acquire()
        permits._last_decrease = 0.0  # each late call comes after the cool-down
        permits.release(0.06 if i % 3 == 0 else 0.00005)
    assert permits.limit >= 15


def test_a_slow_providers_queue_still_shrinks_the_permits() -> None:
    """The floor leaves real providers alone: a 100 ms provider that starts answering in
    1 s (a queue at it, which shortens as the calls are cut) loses permits, and a timeout
    halves them."""
    permits = limits.AdaptiveLimit(16)
    for _ in range(20):
        assert permits.try_acquire()
        permits.release(0.1)
    assert permits.limit == 16
    for _ in range(40):
        assert permits.try_acquire()
        permits._last_decrease = 0.0  # each slow answer comes after the cool-down
        permits.release(1.0 * permits.limit / 16)  # the queue: as long as our calls
    assert permits.limit < 16 * 0.9**7
    before = permits.limit
    assert permits.try_acquire()
    permits._last_decrease = 0.0
    permits.release(5.0, timed_out=True)
    assert permits.limit <= max(1.0, before * 0.5)


def test_a_parked_slot_wakes_on_a_permit_no_waiting_job_takes() -> None:
    """The slot of a handed-back job waits (``ProviderGate.aparked``) until a permit comes
    back that no job waiting for one takes, or its time is up: a permit taken by a waiting
    job leaves it parked (claiming then would only hand another job back)."""

    async def scenario() -> None:
        permits = limits.AdaptiveLimit(1)
        assert permits.try_acquire()
        waiting = asyncio.ensure_future(permits.aacquire(5.0))  # a job waiting for a permit
        parked = asyncio.ensure_future(permits.aparked(5.0))
        await asyncio.sleep(0.05)
        permits.release(None)  # the waiting job takes it: the slot stays parked
        assert await waiting
        await asyncio.sleep(0.05)
        assert not parked.done()
        permits.release(None)  # nobody waits for this one: the parked slot wakes
        await asyncio.wait_for(parked, 1.0)
        assert not permits._parked
        await permits.aparked(0.01)  # its time up, nothing released: it returns too
        assert not permits._parked

    asyncio.run(scenario())


def test_the_wait_grows_with_each_hand_back_until_a_permit_is_free_at_once() -> None:
    """0.25 s, doubled for each of the provider's hand-backs since a call found a permit
    free at once, at most ``PARK_MAX``; a permit free at once starts again from the first."""
    waits: list[float] = []
    made = ProviderGate("mail", None, rate_limit=None, slots=4)

    async def parked(seconds: float) -> None:
        waits.append(seconds)

    made.permits.aparked = parked  # type: ignore[method-assign]
    for _ in range(6):
        asyncio.run(made.aparked())
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, limits.PARK_MAX]
    made.leave(made.enter())  # a permit free at once
    asyncio.run(made.aparked())
    assert waits[-1] == limits.PARK_BASE


def test_a_jittery_provider_on_a_busy_machine_keeps_its_permits() -> None:
    """A provider answering in 100 ms ± 50 %, sampled through a busy worker (one call in
    eight held up to 400 ms): no queue at the provider, so no permits lost. Judged call by
    call against the fastest answer, such calls held a worker at 1-2 calls in flight, and
    the chaos matrix with this provider drained every backlog at ~31 effects/s instead of 90
    (p99 45-100 s after a restart of PostgreSQL, never recovered)."""
    permits = limits.AdaptiveLimit(64)
    for i in range(1000):
        assert permits.try_acquire()
        permits._last_decrease = 0.0  # every slow call comes after the cool-down
        latency = 0.05 + 0.1 * ((i * 37) % 100) / 100  # 50-150 ms, spread evenly
        permits.release(0.4 if i % 8 == 0 else latency)
    assert permits.limit >= 60


# -- the line for a rate-limited provider's next start ----------------------------------------


class CountingFleet(FleetLimits):
    """Counts the reservations asked of the database."""

    asked = 0

    def reserve(self, provider: str, spacing: float, max_wait: float) -> tuple[float, float | None]:
        CountingFleet.asked += 1
        return super().reserve(provider, spacing, max_wait)


def enter_all(made: ProviderGate, jobs: int) -> tuple[list[float], int]:
    """``jobs`` threads entering at once: their reserved starts, and how many were handed
    back (ProviderThrottled)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> float | None:
        try:
            ticket = made.enter()
        except ProviderThrottled:
            return None
        made.leave(ticket)
        return ticket.started

    with ThreadPoolExecutor(jobs) as pool:
        got = list(pool.map(one, range(jobs)))
    return sorted(s for s in got if s is not None), got.count(None)


def spread(starts: list[float]) -> str:
    return str([round(t - starts[0], 3) for t in starts])


def test_jobs_behind_a_rate_limit_wait_in_line_instead_of_being_handed_back(
    store: Store,
) -> None:
    """Behind a backlog a rate-limited provider's starts are booked a second ahead; a job
    that cannot have one waits in this process's line (the head alone asks the database)
    instead of being handed back, which cost a claim, a move and an attempt row each: 2,500
    -5,500 hand-backs for 300 effects across two workers (``python -m bench limits``)."""
    CountingFleet.asked = 0
    made = ProviderGate("mail", CountingFleet(store), rate_limit=20.0, slots=64)  # 16 a second
    starts, handed_back = enter_all(made, 30)
    assert handed_back == 0 and len(starts) == 30
    # Each start is the database's booking read through the thread that made it: never early,
    # late by however long the thread was held up after the commit (on a loaded machine a gap
    # looked half the spacing). What the provider must see: no second holds more calls than
    # the rate limit, and 30 starts spread over 29 spacings, less such a delay.
    assert max_per_window(starts) <= 20, spread(starts)
    assert starts[-1] - starts[0] >= 29 * made.spacing * 0.9, spread(starts)
    assert CountingFleet.asked < 30 + 30  # the waiting jobs did not all poll the database


def test_no_line_is_too_long_every_job_waits_for_its_start(store: Store) -> None:
    """Ten jobs behind a 5-per-second provider in a worker of 4 slots: each waits in line for
    a start of its own (its lease kept by progress), none is handed back to be claimed again
    (issue 37: a job claimed 34 times before its call on a starved machine)."""
    made = ProviderGate("mail", FleetLimits(store), rate_limit=5.0, slots=4)
    starts, handed_back = enter_all(made, 10)
    assert handed_back == 0 and len(starts) == 10
    assert max_per_window(starts) <= 5, spread(starts)


def test_jobs_wait_for_a_permit_in_turn_and_are_never_handed_back() -> None:
    """More jobs than permits: each waits (reporting progress) for a permit, in the order
    they came, however long the calls before it take."""
    import threading

    made = ProviderGate("mail", None, rate_limit=None, slots=2)
    made.permits.limit = 1.0
    order: list[int] = []
    progress = [0]
    lock = threading.Lock()
    lined_up = threading.Event()

    def one(i: int) -> None:
        def progressed() -> None:
            with lock:
                progress[0] += 1

        ticket = made.enter(progressed)
        order.append(i)
        if i == 0:  # the first call lasts until the five others are in line behind it
            assert lined_up.wait(60)
        made.leave(ticket)

    first = threading.Thread(target=one, args=(0,))
    first.start()
    wait_for(lambda: made.permits.in_flight == 1, "the first call", timeout=60)
    threads = []
    for i in range(1, 6):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        wait_for(lambda i=i: made.permits.waiting == i, f"{i} in line", timeout=60)
    assert order == [0]  # nobody passed the call in flight
    lined_up.set()
    for thread in [first, *threads]:
        thread.join(60)
        assert not thread.is_alive()
    assert sorted(order) == list(range(6))
    assert progress[0] >= 5  # each waiting job said so (the heartbeat renews its lease)


def test_every_way_in_shares_one_gate(store: Store) -> None:
    """A user's own ``Operations`` and a worker's on the same database: one gate per
    provider, its permits at the most slots any of them has from the first call on."""
    from consumer import Operations, Worker

    class Mail:
        name = "mail"
        supports_lookup = False
        supports_idempotency = True
        rate_limit = None

        def send(self, request: object, *, operation_id: str, idempotency_key: object) -> str:
            return "ref"

        def lookup(self, operation_id: str) -> None:
            return None

    mine = Operations(store, {"mail": Mail()})  # built apart from any worker, defaults
    worker = Worker(store, providers={"mail": Mail()}, concurrency=300)
    assert worker.operations is not None
    gate = mine.gate(mine.providers["mail"])
    assert worker.operations.gate(worker.providers["mail"]) is gate
    assert Operations(Store(store.engine)).gate_named("mail") is gate  # another Store object
    assert gate.permits.limit == 300  # it starts wide open, it does not crawl up
    mine.limits.pause("mail", 30)
    assert worker.operations.limits.paused_locally("mail") is not None
    mine.limits.unpause("mail")


class Late:
    """A process running late by a fixed delay (``SchedulingDelay.recent``)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def recent(self) -> float:
        return self.seconds


def test_a_late_machine_is_not_read_as_a_slow_provider() -> None:
    """A 100 ms provider measured through a process running 300 ms late (a starved CPU):
    the permits stay; the same latencies with the process on time do shrink them, and a
    real queue at the provider (2 s answers) still shrinks them on the late machine."""
    for delay, answers, shrinks in ((0.3, 0.5, False), (0.0, 0.5, True), (0.3, 2.0, True)):
        permits = limits.AdaptiveLimit(16, delay=Late(delay))  # type: ignore[arg-type]
        for _ in range(20):
            assert permits.try_acquire()
            permits.release(0.1)
        for _ in range(20):
            assert permits.try_acquire()
            permits._last_decrease = 0.0
            permits.release(answers)
        assert (permits.limit < 16) is shrinks, (delay, answers, permits.limit)


def test_the_scheduling_delay_is_measured() -> None:
    """The probe's figure grows when the process's threads are held up (the GIL here)."""
    probe = limits.SchedulingDelay(tick=0.005, window=20)
    wait_for(lambda: probe.recent() >= 0.0 and len(probe._late) >= 10, "probe samples")
    calm = probe.recent()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:  # hold the GIL in long stretches
        sum(range(2_000_000))
    assert probe.recent() > calm


def test_a_pause_sends_the_line_back(store: Store) -> None:
    """A job in line when the provider is paused is handed back (nothing was sent)."""
    import threading

    fleet = FleetLimits(store)
    made = ProviderGate("mail", fleet, rate_limit=4.0, slots=16)  # 3 starts a second
    outcomes: list[str] = []

    def one() -> None:
        try:
            made.leave(made.enter())
            outcomes.append("start")
        except ProviderThrottled:
            outcomes.append("handed back")

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(made._line) >= 2, "jobs waiting in line")  # the first starts booked
    fleet.pause("mail", 30)
    for thread in threads:
        thread.join(30)
    assert outcomes.count("handed back") >= 3 and len(outcomes) == 8


def test_the_line_on_the_event_loop(store: Store) -> None:
    """The async form: the same line, the reservations through the executor."""
    CountingFleet.asked = 0
    made = ProviderGate("mail", CountingFleet(store), rate_limit=20.0, slots=64)

    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()

        def run(fn: object, *args: object) -> object:
            return loop.run_in_executor(None, fn, *args)  # type: ignore[arg-type]

        async def one() -> float:
            ticket = await made.aenter(run, read_pause=False)
            made.leave(ticket)
            return ticket.started

        return sorted(await asyncio.gather(*(one() for _ in range(30))))

    starts = asyncio.run(scenario())
    assert len(starts) == 30
    assert max_per_window(starts) <= 20, spread(starts)
    assert starts[-1] - starts[0] >= 29 * made.spacing * 0.9, spread(starts)
    assert CountingFleet.asked < 60


class SlowDown(Exception):
    """A user's SDK error: not ours, but it says when to call again."""

    def __init__(self, retry_after: object) -> None:
        super().__init__("slow down")
        self.retry_after = retry_after


@pytest.mark.parametrize(
    "failure",
    ["transient", "attribute", "unavailable", "no number"],
)
def test_any_failure_with_retry_after_pauses_the_provider(store: Store, failure: str) -> None:
    """``TransientFailure(retry_after=S)``, any exception with a numeric ``retry_after``,
    ``ProviderUnavailable``: each pauses the provider for every Operations on the database;
    a ``retry_after`` that is not a number pauses nothing."""
    from consumer import Operations, TransientFailure
    from consumer.errors import ProviderUnavailable

    raised: Exception = {
        "transient": TransientFailure("429 from the API", retry_after=30),
        "attribute": SlowDown(30.0),
        "unavailable": ProviderUnavailable("503", status=503, retry_after=30),
        "no number": SlowDown("soon"),
    }[failure]

    class Mail:
        name = "mail"
        supports_lookup = True
        supports_idempotency = True

        def send(self, request: object, *, operation_id: str, idempotency_key: object) -> str:
            raise raised

        def lookup(self, operation_id: str) -> None:
            return None

    store.enqueue("t", "email-1")
    lease = store.claim_batch("w", 1, ttl=30)[0]
    ops = Operations(store, {"mail": Mail()})
    with pytest.raises(type(raised)):
        ops.dispatch(lease, "email", "mail", {"to": "a"})
    other = Operations(Store(store.engine))  # another way in, same database
    paused = other.limits.paused_until("mail")
    if failure == "no number":
        assert paused is None
    else:
        assert paused is not None
        other.limits.unpause("mail")


def test_a_falling_limit_sets_the_gauge_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 54: the calls in flight a provider is allowed are visible when they fall: the
    ``outbox_provider_limit`` gauge, and one line ``provider limit fell`` with the reason
    (at most one per ``FALL_LOG_EVERY`` seconds, counting the falls it stands for)."""
    from metrics.hooks import PrometheusHooks

    hooks = PrometheusHooks()
    gate = ProviderGate("mail", None, rate_limit=None, slots=16, hooks=hooks)
    permits = gate.permits
    caplog.set_level(logging.INFO, logger="consumer.jobs.permits")
    assert permits.try_acquire()
    permits.release(5.0, timed_out=True)  # a timeout halves the limit
    assert hooks.registry.get_sample_value("outbox_provider_limit", {"provider": "mail"}) == 8
    for _ in range(30):  # a queue at the provider: every answer 10 x slower than before
        assert permits.try_acquire()
        permits._last_decrease = 0.0
        permits.release(0.02 if _ < 10 else 2.0)
    fallen = hooks.registry.get_sample_value("outbox_provider_limit", {"provider": "mail"})
    assert fallen is not None and fallen == int(permits.limit) < 8
    lines = [r for r in caplog.records if r.getMessage() == "provider limit fell"]
    assert len(lines) == 1  # the first fall at once; the others within FALL_LOG_EVERY wait
    said = lines[0].fields  # type: ignore[attr-defined]
    assert said["provider"] == "mail" and said["limit"] == 8 and said["falls"] == 1
    assert "timed out" in said["reason"]
    gate.permits._samples.clear()
    for _ in range(200):  # fast again: it grows back, and the gauge follows
        assert permits.try_acquire()
        permits.release(0.01)
    grown = hooks.registry.get_sample_value("outbox_provider_limit", {"provider": "mail"})
    assert grown == int(permits.limit) > fallen


def test_cuts_that_do_not_shorten_the_latency_stop_at_half() -> None:
    """Issue 54: a provider slow whatever this process sends (the machine's load, other
    clients) is not a queue of its calls. The limit falls while the cuts bring the latency
    down; once they halved it with the latency as bad, it stops falling and grows back,
    instead of sitting at 2 calls in flight below the offered rate."""
    permits = limits.AdaptiveLimit(64)
    for _ in range(20):
        assert permits.try_acquire()
        permits.release(0.03)
    lowest = permits.limit
    for _ in range(300):
        assert permits.try_acquire()
        permits._last_decrease = 0.0
        permits.release(1.0)  # as slow at 64 calls in flight as at 8
        lowest = min(lowest, permits.limit)
    assert 64 / 2 * 0.9 <= lowest <= 64 / 2  # cut to half the limit, no further
    assert permits.limit > lowest  # and growing back
    for _ in range(300):  # a real queue after all: worse as the calls grow back
        assert permits.try_acquire()
        permits._last_decrease = 0.0
        permits.release(3.0 * permits.limit / 32)
    assert permits.limit < lowest
