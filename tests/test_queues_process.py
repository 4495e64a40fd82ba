"""Issue 27 with real ``outbox-worker run`` processes on one PostgreSQL database: two services
with different handlers, ``--queues``, a kind no worker runs, a paused queue, and the tenant
limit with two processes racing for a tenant's last place.

The worker app is ``tests.jobs_support:build_routed`` (handlers named by $JOBS_HANDLERS, each
writing ``PID HANDLER QUEUE ACTION LEASED`` to an effects file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer.jobs.states import DONE, READY, WAITING_REVIEW
from consumer.jobs.store import Store
from tests.services import wait_for

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


class Workers:
    """``outbox-worker run`` processes started by a test, stopped (SIGTERM, then kill) after."""

    def __init__(self, url: str, effects: Path) -> None:
        self.url = url
        self.effects = effects
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, handlers: str, *flags: str, **env: str) -> subprocess.Popen[bytes]:
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OUTBOX_DATABASE_URL": self.url,
            "JOBS_EFFECTS_FILE": str(self.effects),
            "JOBS_HANDLERS": handlers,
            "OUTBOX_LOG_LEVEL": "warning",
            **env,
        }
        command = [
            sys.executable,
            "-m",
            "consumer.jobs.cli",
            "run",
            "tests.jobs_support:build_routed",
        ]
        proc = subprocess.Popen(
            [*command, *flags],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.procs.append(proc)
        return proc

    def lines(self) -> list[list[str]]:
        if not self.effects.exists():
            return []
        return [line.split() for line in self.effects.read_text().splitlines() if line]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                assert proc.wait(30) == 0, (proc.stderr.read() if proc.stderr else b"").decode()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def workers(pg_url: str, tmp_path: Path) -> Iterator[Workers]:
    group = Workers(pg_url, tmp_path / "effects.txt")
    try:
        yield group
    finally:
        for proc in group.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _twice(store: Store, ran: list[list[str]]) -> list[tuple[str, object]]:
    """The jobs that ran more than once, with their attempt history (why: a lease expiry or
    a worker declared dead under load shows there as the attempt's outcome)."""
    counts = Counter(line[3] for line in ran)
    return [(action, store.history("acme", action)) for action, n in counts.items() if n > 1]


def _pids(procs: list[subprocess.Popen[bytes]]) -> list[str]:
    return [str(proc.pid) for proc in procs]


def test_two_services_on_one_database_each_run_only_their_kind(
    pg_url: str, workers: Workers
) -> None:
    """Issue 27's measurement: 200 send-invoice and 200 send-quote jobs, a billing worker and
    a mail worker. Before queues, 200 of the 400 ended in WAITING_REVIEW. A third kind that
    no running worker can run stays READY, never claimed, never parked."""
    store = Store(pg_url)
    store.enqueue_many([{"tenant": "acme", "action": f"send-invoice-{i}"} for i in range(200)])
    store.enqueue_many([{"tenant": "acme", "action": f"send-quote-{i}"} for i in range(200)])
    store.enqueue_many(
        [{"tenant": "acme", "action": f"r-{i}", "kind": "send-reminder"} for i in range(20)]
    )
    billing = workers.start("send-invoice", "--concurrency", "2")
    mail = workers.start("send-quote", "--concurrency", "2")
    wait_for(lambda: store.counts()[DONE] == 400, "400 jobs done", timeout=120)
    workers.stop()
    counts = store.counts()
    assert counts[WAITING_REVIEW] == 0 and counts[DONE] == 400 and counts[READY] == 20
    ran = workers.lines()
    assert len(ran) == 400, _twice(store, ran)  # each job run once
    by_pid = {str(billing.pid): "send-invoice", str(mail.pid): "send-quote"}
    for pid, handler, _queue, action, _leased in ran:
        assert action.startswith(by_pid[pid] + "-"), (pid, handler, action)
    assert Counter(handler for _, handler, *_ in ran) == {"send-invoice": 200, "send-quote": 200}
    # The reminders were never claimed: no attempt, no lease, no review; they show as depth.
    reminder = store.get("acme", "r-0")
    assert (reminder.state, reminder.attempts, reminder.lease_owner) == (READY, 0, None)
    assert store.depth()["default"].ready == 20
    store.dispose()


def test_the_same_with_queues(pg_url: str, workers: Workers) -> None:
    """Both workers could run both kinds; ``--queues`` decides which jobs each takes."""
    store = Store(pg_url)
    store.enqueue_many(
        [{"tenant": "acme", "action": f"send-invoice-{i}", "queue": "billing"} for i in range(200)]
    )
    store.enqueue_many(
        [{"tenant": "acme", "action": f"send-quote-{i}", "queue": "mail"} for i in range(200)]
    )
    both = "send-invoice,send-quote"
    billing = workers.start(both, "--queues", "billing")
    mail = workers.start(both, OUTBOX_QUEUES="mail")  # the variable, not the flag
    wait_for(lambda: store.counts()[DONE] == 400, "400 jobs done", timeout=120)
    workers.stop()
    assert store.counts()[WAITING_REVIEW] == 0
    ran = workers.lines()
    assert len(ran) == 400, _twice(store, ran)
    queue_of = {str(billing.pid): "billing", str(mail.pid): "mail"}
    assert all(queue_of[pid] == queue for pid, _, queue, _, _ in ran)
    assert Counter(queue for _, _, queue, _, _ in ran) == {"billing": 200, "mail": 200}
    store.dispose()


def test_a_paused_queue_is_not_claimed_and_resumes(pg_url: str, workers: Workers) -> None:
    store = Store(pg_url)
    pause = subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", "queues", "pause", "mail"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_DATABASE_URL": pg_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert pause.returncode == 0, pause.stderr
    assert store.paused_queues() == ["mail"]
    # Mail jobs first, then default ones: a worker that claimed the mail queue would have
    # taken them before the default jobs it finishes.
    store.enqueue_many([{"tenant": "t", "action": f"send-{i}", "queue": "mail"} for i in range(30)])
    store.enqueue_many([{"tenant": "u", "action": f"send-d{i}"} for i in range(30)])
    workers.start("send")
    wait_for(lambda: store.counts()[DONE] == 30, "the default queue's 30 jobs", timeout=60)
    assert store.depth()["mail"].ready == 30 and store.depth()["mail"].paused
    assert all(store.get("t", f"send-{i}").attempts == 0 for i in range(30))
    assert {queue for _, _, queue, _, _ in workers.lines()} == {"default"}
    listed = subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", "queues", "list", "--json"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_DATABASE_URL": pg_url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0 and '"paused": true' in listed.stdout
    store.resume_queue("mail")
    wait_for(lambda: store.counts()[DONE] == 60, "the mail queue's jobs once resumed", timeout=60)
    workers.stop()
    store.dispose()


def test_each_queue_has_its_own_slots_and_a_busy_one_takes_no_others(
    pg_url: str, workers: Workers, tmp_path: Path
) -> None:
    """``--concurrency 7 --queues billing=3,mail=2,default``: billing's jobs hold every one of
    its 3 slots (they wait for a release file), yet mail's and the default queue's jobs all
    run meanwhile, and billing never has a 4th job leased (its other jobs stay READY, with
    no attempt). No queue ever has more jobs leased than its slots (mail 2, default the
    remaining 2): each handler counts its queue's LEASED jobs over the whole database."""
    store = Store(pg_url)
    store.enqueue_many(
        [{"tenant": "b", "action": f"send-b{i}", "queue": "billing"} for i in range(12)]
    )
    store.enqueue_many(
        [{"tenant": "m", "action": f"send-m{i}", "queue": "mail"} for i in range(30)]
    )
    store.enqueue_many([{"tenant": "d", "action": f"send-d{i}"} for i in range(30)])
    release = tmp_path / "release"
    workers.start(
        "send",
        "--concurrency",
        "7",
        "--queues",
        "billing=3,mail=2,default",
        JOBS_SLEEP="0.02",
        JOBS_HOLD_QUEUE="billing",
        JOBS_RELEASE_FILE=str(release),
    )
    wait_for(lambda: store.counts()[DONE] == 60, "mail's and default's 60 jobs", timeout=120)
    # Billing is busy with exactly its own 3 slots; its 9 other jobs were never claimed.
    leased = [store.get("b", f"send-b{i}") for i in range(12)]
    assert sum(job.state == "LEASED" for job in leased) == 3
    assert sum(job.state == READY and job.attempts == 0 for job in leased) == 9
    assert store.depth("billing")["billing"].ready == 9
    release.touch()
    wait_for(lambda: store.counts()[DONE] == 72, "billing's jobs once released", timeout=120)
    workers.stop()
    ran = workers.lines()
    assert len(ran) == 72
    most = {queue: 0 for queue in ("billing", "mail", "default")}
    for _pid, _handler, queue, _action, count in ran:
        most[queue] = max(most[queue], int(count))
    # Never beyond a queue's slots, and each queue filled them (not merely never got there).
    assert most == {"billing": 3, "mail": 2, "default": 2}, most
    store.dispose()


def test_the_tenant_limit_holds_with_two_processes_racing(pg_url: str, workers: Workers) -> None:
    """Two worker processes with 8 slots each and ``--tenant-limit 2``: a tenant never has
    more than 2 jobs LEASED at once (each handler reads the count over the whole database
    while it holds its job), and a small tenant behind a big one is not held up by it."""
    store = Store(pg_url)
    store.enqueue_many([{"tenant": "big", "action": f"send-{i}"} for i in range(80)])
    store.enqueue_many([{"tenant": "small", "action": f"send-s{i}"} for i in range(10)])
    flags = ("--concurrency", "8", "--tenant-limit", "2")
    workers.start("send", *flags, JOBS_SLEEP="0.05")
    workers.start("send", *flags, JOBS_SLEEP="0.05")
    wait_for(lambda: store.counts()[DONE] == 90, "90 jobs done", timeout=120)
    workers.stop()
    ran = workers.lines()
    assert len(ran) == 90
    seen = [int(leased) for *_, leased in ran]
    assert max(seen) <= 2, Counter(seen)
    assert max(seen) == 2  # the limit was reached, not merely never approached
    assert len({pid for pid, *_ in ran}) == 2  # both processes took part
    # The small tenant's 10 jobs did not wait for the big tenant's 80 (fairness + limit).
    order = [action for _, _, _, action, _ in ran]
    last_small = max(i for i, action in enumerate(order) if action.startswith("send-s"))
    assert last_small < 45, last_small
    store.dispose()


RACE = """
import json, sys
from consumer.jobs.store import Store
store = Store(sys.argv[1], create_schema=False)
sys.stdin.readline()  # the start line: both processes claim at the same moment
taken = 0
for _ in range(int(sys.argv[3])):
    taken += len(store.claim_batch(sys.argv[2], 3, tenant_limit=5))
print(taken)
"""


def test_two_processes_claiming_at_once_never_pass_the_limit(pg_url: str) -> None:
    """The claim itself, raced by two processes in tight loops with no job ever finished:
    together they lease exactly the limit, never more (a count in the claim's own snapshot
    would let both fill the last places)."""
    for round_ in range(5):
        store = Store(pg_url)
        tenant = f"t{round_}"
        store.enqueue_many([{"tenant": tenant, "action": f"a-{i}"} for i in range(200)])
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RACE, pg_url, f"w{round_}-{n}", "40"],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for n in range(2)
        ]
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        taken = [int(proc.communicate(timeout=120)[0]) for proc in procs]
        assert sum(taken) == 5, taken
        assert store.counts()["LEASED"] == 5 + 5 * round_  # earlier rounds' tenants stay leased
        store.dispose()


RACE_ONE = """
import sys
from consumer.jobs.store import Store
store = Store(sys.argv[1], create_schema=False)
sys.stdin.readline()
taken = 0
for i in range(int(sys.argv[3])):
    if store.claim(sys.argv[4], f"a-{i}", sys.argv[2], tenant_limit=5) is not None:
        taken += 1
print(taken)
"""


def test_single_claims_and_batch_claims_racing_never_pass_the_limit(pg_url: str) -> None:
    """``Store.claim`` of named jobs in one process against ``claim_batch`` in another, and
    two ``claim`` processes against each other: they share one count of the tenant's LEASED
    jobs (the same advisory lock), so together they lease exactly the limit."""
    for round_, scripts in enumerate(((RACE_ONE, RACE), (RACE_ONE, RACE_ONE))):
        store = Store(pg_url)
        tenant = f"one{round_}"
        store.enqueue_many([{"tenant": tenant, "action": f"a-{i}"} for i in range(200)])
        procs = []
        for n, script in enumerate(scripts):
            args = [pg_url, f"w{round_}-{n}", "200" if script is RACE_ONE else "40"]
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", script, *args, tenant],
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        taken = [int(proc.communicate(timeout=120)[0]) for proc in procs]
        assert sum(taken) == 5, taken
        leased = store.counts()["LEASED"]
        assert leased == 5 * (round_ + 1), leased
        store.dispose()
