"""Slots and provider limits across real processes (issue 21).

Every piece is real: ``outbox-simulator serve`` processes as providers (with a latency per
send), ``outbox-worker run tests.effects_app:build`` processes, PostgreSQL. What is counted
comes from the simulator (its effects, and ``/arrivals``: when each send reached it) and
from the job table, never from what the workers say about themselves. Each test runs with a
``def`` handler and with an ``async def`` one: the same contract.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from consumer import Store
from consumer.jobs.states import DONE, READY
from tests.services import wait_for
from tests.simulator_support import ROOT, SimulatorProcess, max_per_window

pytestmark = pytest.mark.slow

HANDLERS = ["sync", "async"]


@contextlib.contextmanager
def simulator(path: Path) -> Iterator[SimulatorProcess]:
    process = SimulatorProcess(path)
    try:
        yield process.start(timeout=60)  # the shared machine may take a while to start one
    finally:
        process.close()


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    with simulator(tmp_path / "mail.db") as process:
        yield process


def start_worker(
    db_url: str,
    sim: SimulatorProcess,
    handler: str,
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    sms: SimulatorProcess | None = None,
    timeout: float | None = None,
    ttl: float | None = None,
) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=db_url,
        OUTBOX_LOG_LEVEL="warning",
        MAIL_URL=sim.url,
        HANDLER=handler,
    )
    if concurrency is not None:
        env["OUTBOX_CONCURRENCY"] = str(concurrency)
    if rate is not None:
        env["MAIL_RATE"] = str(rate)
    if sms is not None:
        env["SMS_URL"] = sms.url
    if timeout is not None:
        env["SIM_TIMEOUT"] = str(timeout)
    if ttl is not None:
        env["WORKER_TTL"] = str(ttl)
    return subprocess.Popen(
        [sys.executable, "-m", "consumer.jobs.cli", "run", "tests.effects_app:build"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"worker did not stop on SIGTERM:\n{err}") from None
    assert proc.returncode == 0, err
    return err


def enqueue(store: Store, count: int, *, provider: str = "mail", prefix: str = "q") -> list[int]:
    return [
        store.enqueue(
            "studio",
            f"email-{prefix}-{i}",
            subject=f"{prefix}{i}@example.com",
            payload={"provider": provider},
        ).job_id
        for i in range(count)
    ]


def states(store: Store, job_ids: list[int]) -> Counter[str]:
    return Counter(store.get(job_id).state for job_id in job_ids)


def all_done(store: Store, job_ids: list[int]) -> bool:
    return states(store, job_ids) == Counter({DONE: len(job_ids)})


def one_effect_each(sim: SimulatorProcess, job_ids: list[int]) -> None:
    made = Counter(e["operation_id"] for e in sim.effects())
    assert made == Counter({f"{job_id}:send": 1 for job_id in job_ids})


@pytest.mark.parametrize("handler", HANDLERS)
def test_no_job_is_leased_beyond_the_free_slots(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    sim.configure(latency=0.3)
    store = Store(pg_url)
    job_ids = enqueue(store, 40)
    leased: list[int] = []
    watching = threading.Event()

    def watch() -> None:  # the database's view: LEASED jobs, sampled all along
        with store.engine.connect() as conn:
            while not watching.wait(0.01):  # a sample every 10 ms until told to stop
                count = conn.execute(
                    text("SELECT count(*) FROM outbox_jobs WHERE state = 'LEASED'")
                ).scalar_one()
                leased.append(int(count))
                conn.commit()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    worker = start_worker(pg_url, sim, handler, concurrency=4)
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=90)
    finally:
        watching.set()
        watcher.join(10)
        stop(worker)
    assert max(leased) <= 4  # never more leases than slots
    assert max(leased) >= 2  # and the slots did run jobs side by side
    one_effect_each(sim, job_ids)
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_a_rate_limit_holds_at_the_provider_across_two_workers(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    store = Store(pg_url)
    job_ids = enqueue(store, 30)
    workers = [start_worker(pg_url, sim, handler, rate=5) for _ in range(2)]
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=90)
    finally:
        for worker in workers:
            stop(worker)
    calls = sim.arrivals()  # every call the server saw: sends and lookups
    arrivals = sorted(a["time"] for a in calls)
    assert len([a for a in calls if a["kind"] == "send"]) == 30
    # Every one-second window at the server, the two workers' calls together (not 5/s each:
    # that would put 9-10 in a second), from the first calls (two cold processes) on.
    assert max_per_window(arrivals) <= 5, str([round(t - arrivals[0], 3) for t in arrivals])
    one_effect_each(sim, job_ids)
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_lookups_and_resends_keep_to_the_rate_limit_too(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    # Half the sends make their effect and then lose the connection: UNKNOWN receipts,
    # settled by lookups (the job's own and the sweep's) and resends. Each of those is a
    # call at the provider, and takes a reserved start of its own.
    sim.faults({"kind": "reset", "probability": 0.5}, seed=7)
    store = Store(pg_url)
    job_ids = enqueue(store, 16)
    workers = [start_worker(pg_url, sim, handler, rate=5, timeout=1.0) for _ in range(2)]
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=120)
    finally:
        for worker in workers:
            stop(worker)
    calls = sim.arrivals()
    assert any(a["kind"] == "lookup" for a in calls)
    arrivals = sorted(a["time"] for a in calls)
    assert max_per_window(arrivals) <= 5, str([round(t - arrivals[0], 3) for t in arrivals])
    one_effect_each(sim, job_ids)
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_a_retry_after_pauses_the_provider_for_both_workers(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    sim.configure(latency=0.2)
    store = Store(pg_url)
    job_ids = enqueue(store, 60)
    workers = [start_worker(pg_url, sim, handler, concurrency=4) for _ in range(2)]
    try:
        sim.wait_for_effects(5, timeout=60)
        sim.faults({"kind": "rate_limit", "retry_after": 3, "count": 1})
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=120)
    finally:
        for worker in workers:
            stop(worker)
    arrivals = sim.arrivals()
    [limited] = [a["time"] for a in arrivals if a["fault"] == "rate_limit"]
    during = [a for a in arrivals if limited < a["time"] < limited + 2.9]
    # Only calls already on their way when the 429 was answered may arrive in the pause: at
    # most one per other slot of the two workers, all at its very start.
    assert len(during) <= 7
    assert all(a["time"] < limited + 0.5 for a in during), during
    assert any(a["time"] >= limited + 2.9 for a in arrivals)  # it resumed after the pause
    one_effect_each(sim, job_ids)
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_a_paused_provider_does_not_stop_a_healthy_one(
    pg_url: str, sim: SimulatorProcess, tmp_path: Path, handler: str
) -> None:
    store = Store(pg_url)
    mail_jobs = enqueue(store, 20, provider="mail", prefix="m")
    sms_jobs = enqueue(store, 20, provider="sms", prefix="s")
    sim.faults({"kind": "rate_limit", "retry_after": 60})  # every mail send: 429, 60 s
    with simulator(tmp_path / "sms.db") as sms:
        sms.configure(latency=0.1)
        worker = start_worker(pg_url, sim, handler, concurrency=4, sms=sms)
        try:
            wait_for(lambda: all_done(store, sms_jobs), "every sms job done", timeout=90)
            mail = states(store, mail_jobs)
        finally:
            stop(worker)
        one_effect_each(sms, sms_jobs)
    assert mail == Counter({READY: 20})  # handed back, holding no lease and no slot
    assert sim.effects() == []
    # The pause held: only the calls on their way when the first 429 came reached it.
    assert len([a for a in sim.arrivals() if a["kind"] == "send"]) <= 4
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_sigkill_while_jobs_wait_for_their_provider(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    store = Store(pg_url)
    job_ids = enqueue(store, 12)
    first = start_worker(pg_url, sim, handler, rate=3)
    try:
        sim.wait_for_effects(3, timeout=60)  # the others wait for the rate limit
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    assert not all_done(store, job_ids)
    second = start_worker(pg_url, sim, handler, rate=3)
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=90)
    finally:
        stop(second)
    one_effect_each(sim, job_ids)  # exactly one effect each: none lost, none doubled
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_no_lease_expires_under_every_slot_busy(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    # 600 jobs on the default 256 slots, a 300 ms provider, a 3 s lease: the first claim
    # takes every slot at once, and every job's lease must stay renewed until its finish is
    # recorded, however long the worker's own queues (its connection pool, its executor)
    # make it wait. Lost before: the heartbeat waited for a pooled connection behind the
    # slots, and a finished job waiting for its batch was not renewed at all.
    sim.configure(latency=0.3)
    store = Store(pg_url)
    job_ids = [
        lease.job_id
        for lease in store.enqueue_many(
            [
                {"tenant": "studio", "action": f"email-b-{i}", "subject": f"b{i}@example.com"}
                for i in range(600)
            ]
        )
    ]
    worker = start_worker(pg_url, sim, handler, ttl=3.0)
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=240)
    finally:
        err = stop(worker)
    assert "lease lost" not in err and "lease conflict" not in err, err[-3000:]
    with store.engine.connect() as conn:
        outcomes = Counter(
            str(o) for (o,) in conn.execute(text("SELECT outcome FROM outbox_job_attempts"))
        )
    assert outcomes["expired"] == 0, outcomes  # no lease expired under a live job
    one_effect_each(sim, job_ids)
    store.dispose()


@pytest.mark.parametrize("handler", HANDLERS)
def test_a_full_provider_does_not_make_the_slots_churn(
    pg_url: str, sim: SimulatorProcess, handler: str
) -> None:
    # A provider serving one send at a time, 100 ms each (10/s), 80 jobs on 32 slots: its
    # adaptive permits settle at a few calls in flight and 16 jobs wait for them; the other
    # slots have nothing useful to claim. Before, each of them claimed the next job at once
    # and handed it back (READY again, a "deferred" attempt) as fast as the database
    # answered: 70 (async) and 151 (sync) hand-backs for 80 effects, each a claim and a
    # write. A slot whose job was handed back now waits before it claims again, longer for
    # each hand-back in a row (consumer.jobs.limits): 13 and 15.
    sim.configure(latency=0.1, capacity=1)
    store = Store(pg_url)
    job_ids = enqueue(store, 80)
    worker = start_worker(pg_url, sim, handler, concurrency=32)
    try:
        wait_for(lambda: all_done(store, job_ids), "every job done", timeout=120)
    finally:
        stop(worker)
    with store.engine.connect() as conn:
        query = text("SELECT count(*) FROM outbox_job_attempts WHERE outcome = 'deferred'")
        handed_back = int(conn.execute(query).scalar_one())
    assert handed_back <= len(job_ids) // 2, handed_back
    one_effect_each(sim, job_ids)
    store.dispose()
