"""Workers: handler outcomes, business timers, heartbeats, hooks, and the outbox-worker CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from consumer.errors import AuthFailure, PermanentFailure
from consumer.jobs.driver import READY_CHANNEL_SQL
from consumer.jobs.retry import RetryPolicy
from consumer.jobs.states import (
    CANCELLED,
    DONE,
    LEASED,
    NEEDS_ATTENTION,
    READY,
    WAITING_EXTERNAL,
    WAITING_REVIEW,
)
from consumer.jobs.store import Store, StoreConfig
from consumer.jobs.worker import JobContext, Worker
from outbox.hooks import Hooks
from tests.services import wait_for

DAY = 86400.0
ROOT = Path(__file__).resolve().parent.parent


class RecordingHooks(Hooks):
    def __init__(self) -> None:
        self.finished: list[tuple[str, str]] = []
        self.conflicts: list[str] = []
        self.cycles = 0

    def worker_job_finished(self, action: str, outcome: str, duration_seconds: float) -> None:
        self.finished.append((action, outcome))

    def worker_lease_conflict(self, action: str) -> None:
        self.conflicts.append(action)

    def worker_cycle_ok(self, timestamp: float) -> None:
        self.cycles += 1


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url, config=StoreConfig(retry=RetryPolicy(base=0.01, ceiling=0.02)))
    yield s
    s.dispose()


# -- timers with business meaning (guarantee 9) ----------------------------------------------

INVOICES = sa.Table(
    "test_invoices",
    sa.MetaData(),
    sa.Column("id", sa.String(50), primary_key=True),
    sa.Column("due", sa.Float, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("paid", sa.Boolean, nullable=False),
)


def test_invoice_reminders_are_replanned_or_cancelled_when_their_subject_changed(
    store: Store,
) -> None:
    INVOICES.metadata.create_all(store.engine)
    now = time.time()
    with store.engine.begin() as conn:
        for name in ("inv-1", "inv-2", "inv-3"):
            conn.execute(sa.insert(INVOICES).values(id=name, due=now + DAY, version=1, paid=False))
    for name in ("inv-1", "inv-2", "inv-3"):
        job = store.enqueue("studio", f"remind-{name}", subject=name, subject_version=1)
        # remind three days before the due date; due in one day, so the timer is due now
        store.schedule(
            job.job_id,
            now + DAY - 3 * DAY,
            "payment reminder",
            1,
            {"field": "paid", "equals": True},
        )
    with store.engine.begin() as conn:  # the domain changes its facts meanwhile
        conn.execute(
            sa.update(INVOICES)
            .where(INVOICES.c.id == "inv-2")
            .values(due=now + 30 * DAY, version=2)
        )
        conn.execute(
            sa.update(INVOICES).where(INVOICES.c.id == "inv-3").values(paid=True, version=2)
        )

    sent: list[str] = []
    worker = Worker(store, batch_size=10)

    @worker.handler("remind")
    def remind(job: JobContext) -> None:
        assert job.timer is not None and job.timer.reason == "payment reminder"
        with store.engine.connect() as conn:
            invoice = conn.execute(sa.select(INVOICES).where(INVOICES.c.id == job.subject)).one()
        condition = job.timer.cancellation_condition
        holds = getattr(invoice, condition["field"]) == condition["equals"]
        if job.recheck(invoice.version, cancelled=holds, replan_at=invoice.due - 3 * DAY):
            sent.append(str(job.subject))

    assert worker.run_once() == 3
    assert sent == ["inv-1"]
    assert store.get("studio", "remind-inv-1").state == DONE
    replanned = store.get("studio", "remind-inv-2")
    assert replanned.state == READY and replanned.timer is not None
    assert replanned.timer.subject_version == "2"
    assert replanned.run_after == pytest.approx(now + 27 * DAY)
    assert replanned.timer.cancellation_condition == {"field": "paid", "equals": True}
    assert store.get("studio", "remind-inv-3").state == CANCELLED
    assert worker.run_once() == 0  # the re-planned reminder waits for its new time
    assert worker.run_once(now=now + 27 * DAY) == 1
    assert sent == ["inv-1", "inv-2"]


def test_a_timer_on_a_waiting_job_wakes_it(store: Store) -> None:
    job = store.enqueue("t", "chase-reply")
    lease = store.claim_next("w")
    assert lease is not None
    store.wait_external(lease, reason="customer reply")
    store.schedule(job.job_id, 1000.0, "chase after a week", None)  # long due
    assert store.get(job.job_id).state == WAITING_EXTERNAL
    assert store.recover().woken == 1
    again = store.claim_next("w")
    assert again is not None and again.timer is not None
    assert again.timer.reason == "chase after a week"


# -- outcomes ---------------------------------------------------------------------------------


def test_a_database_error_mid_batch_hands_the_leases_back_at_once(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's connection is cut after its handlers ran (``finish_batch`` fails): the
    worker is alive, so no peer recovers its leases; it hands them back itself, and the jobs
    run again on the next cycle instead of after the lease ttl (here a day)."""
    ran: list[str] = []
    worker = Worker(store, batch_size=5, ttl=DAY)
    worker.register("send", lambda job: ran.append(job.subject or ""))
    for n in range(3):
        store.enqueue("t", f"send-{n}", subject=f"q{n}", kind="send")
    real_finish = store.finish_batch
    calls = {"n": 0}

    def cut_once(leases: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            raise sa.exc.OperationalError("COMMIT", {}, Exception("server closed the connection"))
        return real_finish(leases)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "finish_batch", cut_once)
    with pytest.raises(sa.exc.OperationalError):
        worker.run_once()
    assert {store.get("t", f"send-{n}").state for n in range(3)} == {READY}
    assert worker.run_once() == 3
    assert {store.get("t", f"send-{n}").state for n in range(3)} == {DONE}
    assert sorted(ran) == ["q0", "q0", "q1", "q1", "q2", "q2"]  # handlers are re-run safely


def test_handler_outcomes_are_recorded_and_hooked(store: Store) -> None:
    hooks = RecordingHooks()
    worker = Worker(store, hooks=hooks, batch_size=20)
    for action in ("ok-1", "ok-2", "boom-1", "invalid-1", "auth-1", "ask-1", "mystery-1"):
        store.enqueue("t", action)
    store.enqueue("t", "custom", kind="ok")

    worker.register("ok", lambda job: None)

    @worker.handler("boom")
    def boom(job: JobContext) -> None:
        raise RuntimeError("provider timed out")

    @worker.handler("invalid")
    def invalid(job: JobContext) -> None:
        raise PermanentFailure("VAT number rejected")

    @worker.handler("auth")
    def auth(job: JobContext) -> None:
        raise AuthFailure("401")

    @worker.handler("ask")
    def ask(job: JobContext) -> None:
        job.wait_external("waiting for the customer")

    # The worker claims only what its handlers route: mystery-1 stays READY for a worker that
    # can run it (issue 27), it is not parked for review.
    assert worker.run_once() == 7
    states = {
        a: store.get("t", a).state
        for a in ("ok-1", "ok-2", "custom", "boom-1", "invalid-1", "auth-1", "ask-1", "mystery-1")
    }
    assert states == {
        "ok-1": DONE,
        "ok-2": DONE,
        "custom": DONE,
        "boom-1": READY,
        "invalid-1": WAITING_REVIEW,
        "auth-1": READY,
        "ask-1": WAITING_EXTERNAL,
        "mystery-1": READY,
    }
    assert "RuntimeError: provider timed out" in (store.get("t", "boom-1").last_error or "")
    assert sorted(hooks.finished) == sorted(
        [
            ("ok", "done"),
            ("ok", "done"),
            ("ok", "done"),
            ("boom", "failed_ready"),
            ("invalid", "failed_waiting_review"),
            ("auth", "failed_ready"),
            ("ask", "waiting_external"),
        ]
    )
    assert hooks.cycles == 1
    # authentication failures stop after a small bounded number
    wait_for(
        lambda: worker.run_once() == 0 and store.get("t", "auth-1").state != READY,
        "the authentication failures to stop",
        timeout=30,
    )
    assert store.get("t", "auth-1").state == NEEDS_ATTENTION


def test_heartbeat_renews_only_while_the_handler_progresses(pg_url: str) -> None:
    store = Store(pg_url)
    hooks = RecordingHooks()
    worker = Worker(store, hooks=hooks, ttl=0.6, batch_size=1)
    store.enqueue("t", "busy-1")
    store.enqueue("t", "stuck-1")
    release = threading.Event()
    renewed = threading.Event()

    @worker.handler("busy")
    def busy(job: JobContext) -> None:
        first = store.get(job.job_id).lease_expires_at
        while not release.is_set():
            job.progress()
            current = store.get(job.job_id).lease_expires_at
            if first is not None and current is not None and current > first + 0.5:
                renewed.set()
            release.wait(0.05)

    @worker.handler("stuck")
    def stuck(job: JobContext) -> None:
        release.wait(60)  # no progress reported: the lease must lapse

    runner = threading.Thread(target=worker.run_once)
    runner.start()
    assert renewed.wait(30)  # busy kept its lease alive beyond the first ttl
    release.set()
    runner.join(30)
    assert store.get("t", "busy-1").state == DONE

    release.clear()
    runner = threading.Thread(target=worker.run_once)
    runner.start()
    other = Store(pg_url, create_schema=False)
    wait_for(
        lambda: other.claim("t", "stuck-1", "rescuer", ttl=60) is not None,
        "the stuck lease to expire",
        timeout=30,
    )
    release.set()
    runner.join(30)
    job = store.get("t", "stuck-1")
    assert (job.state, job.lease_owner, job.lease_epoch) == (LEASED, "rescuer", 2)
    assert hooks.conflicts == ["stuck"]
    other.dispose()
    store.dispose()


# -- the command line -------------------------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "consumer.jobs.cli", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow  # a process of its own (the fast tier stays under 2 minutes)
def test_cli_runs_a_worker_and_exits_zero_on_sigterm(db_url: str, tmp_path: Path) -> None:
    store = Store(db_url)
    for i in range(12):
        store.enqueue("t", f"noop-{i}")
    effects = tmp_path / "effects.txt"
    proc = _cli(
        "run",
        "tests.jobs_support:build",
        "--concurrency",
        "2",
        env={
            "OUTBOX_DATABASE_URL": db_url,
            "JOBS_EFFECTS_FILE": str(effects),
            "OUTBOX_LOG_LEVEL": "info",
        },
    )
    try:
        wait_for(lambda: store.counts()[DONE] == 12, "12 jobs done", timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert "worker stopped" in err
    assert sorted(effects.read_text().split()) == sorted(f"noop-{i}" for i in range(12))
    store.dispose()


def test_cli_usage_errors_exit_two_and_help_exits_zero() -> None:
    from consumer.jobs.cli import main

    assert main(["--help"]) == 0
    assert main([]) == 2
    assert main(["run", "no-colon"]) == 2
    assert main(["run", "tests.jobs_support:missing"]) == 2
    assert main(["run", "tests.jobs_support:not_a_worker"]) == 2
    assert (
        main(
            ["run", "tests.jobs_support:build", "--concurrency", "0", "--database-url", "sqlite://"]
        )
        == 2
    )


def test_run_until_stop_drains_and_returns(db_url: str) -> None:
    """One lifecycle for every runner: run() until SIGTERM or stop(), run_once() beside it."""
    store = Store(db_url)
    worker = Worker(store, poll_interval=0.05)
    seen: list[str] = []
    worker.register("noop", lambda job: seen.append(job.action))
    store.enqueue("t", "noop-1")
    assert worker.run_once() == 1
    store.enqueue("t", "noop-2")
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: store.get("t", "noop-2").state == DONE, "noop-2 done", timeout=30)
    finally:
        worker.stop()  # a failed wait must not leave the loop running past the test
        runner.join(30)
    assert not runner.is_alive()
    assert seen == ["noop-1", "noop-2"]
    store.dispose()


def _listening(engine: sa.Engine) -> bool:
    """A session LISTENs on this schema's channel (other schemas' workers, of other tests
    running at the same time, must not count)."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity"
                    f" WHERE query = 'LISTEN \"' || {READY_CHANNEL_SQL} || '\"'"
                    " AND pid <> pg_backend_pid()"
                )
            ).scalar()
        )


def test_an_idle_worker_wakes_on_notify_not_on_its_poll(pg_url: str) -> None:
    """PostgreSQL: enqueue, resume and recovery NOTIFY; an idle worker whose poll interval is
    far away claims at once (polling stays the fallback). NOTIFY is off by default."""
    store = Store(pg_url, config=StoreConfig(notify=True))
    other = Store(pg_url, config=StoreConfig(notify=True))  # another process's, a consumer's
    worker = Worker(store, poll_interval=120.0)
    worker.register("noop", lambda job: None)
    reviewed: list[int] = []

    def review(job: JobContext) -> None:
        if not reviewed:
            reviewed.append(job.job_id)
            job.wait_review("ask a person")

    worker.register("review", review)
    assert worker.run_once() == 0  # nothing yet
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: _listening(store.engine), "the worker to LISTEN", timeout=60)
        other.enqueue("t", "noop-1")
        wait_for(lambda: store.get("t", "noop-1").state == DONE, "noop-1 done", timeout=60)
        job_id = other.enqueue("t", "review-1").job_id
        wait_for(lambda: store.get(job_id).state == WAITING_REVIEW, "review", timeout=60)
        other.resume(job_id)  # an operator's decision wakes the worker too
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
    finally:
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()
    store.dispose()
    other.dispose()


def test_without_notify_a_worker_that_just_worked_polls_quickly(db_url: str) -> None:
    """Issue 25: enqueues do not NOTIFY by default, so a LISTENing worker hears nothing; it
    polls every few milliseconds for a while after a claim that found work (then backs off
    toward its poll interval), not once per poll interval. Here the poll interval is two
    minutes: jobs enqueued while the worker is (recently) busy must not wait for it."""
    store = Store(db_url)
    other = Store(db_url, create_schema=False)  # another process's store, a consumer's
    worker = Worker(store, poll_interval=120.0)
    worker.register("noop", lambda job: None)
    other.enqueue("t", "noop-0")  # the first claim finds work: the worker is busy
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        for n in range(5):
            wait_for(lambda n=n: store.get("t", f"noop-{n}").state == DONE, "done", timeout=60)
            other.enqueue("t", f"noop-{n + 1}")
        wait_for(lambda: store.get("t", "noop-5").state == DONE, "noop-5 done", timeout=60)
    finally:
        worker.stop()
        runner.join(30)
    assert not runner.is_alive()
    store.dispose()
    other.dispose()


def test_notify_is_a_choice(pg_url: str) -> None:
    """Enqueues NOTIFY only for rows they create; StoreConfig(notify=False) never does."""
    import psycopg

    plain = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as listener:
        # The channel of this test's schema: other schemas' job stores must not count here.
        channel = listener.execute(f"SELECT {READY_CHANNEL_SQL}").fetchone()[0]  # type: ignore[index]
        listener.execute(f'LISTEN "{channel}"')

        def notified() -> int:
            return len(list(listener.notifies(timeout=0.3)))

        quiet = Store(pg_url)  # the default (issue 25): no NOTIFY, no commit lock
        quiet.enqueue("t", "a-1")
        quiet.enqueue_many([{"tenant": "t", "action": "a-2"}])
        assert notified() == 0
        loud = Store(pg_url, config=StoreConfig(notify=True))
        loud.enqueue("t", "a-3")
        assert notified() == 1
        loud.enqueue("t", "a-3")  # a duplicate creates nothing and wakes nobody
        assert notified() == 0
        loud.enqueue_many([{"tenant": "t", "action": "a-4"}, {"tenant": "t", "action": "a-5"}])
        assert notified() == 1  # one per transaction, however many rows it created
        loud.enqueue_many([{"tenant": "t", "action": "a-4"}, {"tenant": "t", "action": "a-5"}])
        assert notified() == 0  # all duplicates: nothing created, nobody woken
        quiet.dispose()
        loud.dispose()


def test_a_timer_already_due_when_learnt_still_fires(db_url: str) -> None:
    """The cycle that set a short wait outlasts it (a loaded machine): the worker learns a
    timer already due and must recover at once, not drop it until recover_interval (here an
    hour). Failed once in CI before the fix."""
    store = Store(db_url)
    worker = Worker(store, recover_interval=3600.0, poll_interval=0.05)
    calls: list[int] = []

    def remind(job: JobContext) -> None:
        calls.append(job.attempt)
        if len(calls) == 1:
            due = time.time() + 0.05
            job.wait_external("until the customer answers", until=due)
            # The cycle ends after the timer came due.
            wait_for(lambda: time.time() > due, "the timer to come due", interval=0.01)

    worker.register("remind", remind)
    job_id = store.enqueue("t", "remind-1").job_id
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=20)
    finally:
        worker.stop()
        runner.join(30)
    assert len(calls) == 2
    store.dispose()


def test_a_timer_fires_on_time_not_at_the_next_recovery(db_url: str) -> None:
    """The worker learns the earliest timer of a waiting job and recovers when it comes due,
    not only every recover_interval (here far longer than the test may take)."""
    store = Store(db_url)
    worker = Worker(store, recover_interval=3600.0, poll_interval=0.05)
    calls: list[int] = []

    def remind(job: JobContext) -> None:
        calls.append(job.attempt)
        if len(calls) == 1:
            job.wait_external("until the customer answers", until=time.time() + 0.5)

    worker.register("remind", remind)
    job_id = store.enqueue("t", "remind-1").job_id
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
    finally:
        worker.stop()
        runner.join(30)
    assert len(calls) == 2
    assert [a.outcome for a in store.history(job_id)] == [
        "waiting_external",
        "timer_fired",
        "done",
    ]
    store.dispose()
