"""Guarantee 8 across real process boundaries: the seed's acceptance test.

> terminate the worker after provider acceptance, restart it, and observe one
> customer-visible effect with a reconciled receipt.

Every piece is a real process: the connector simulator (``outbox-simulator serve``), the
workers (``outbox-worker run`` with an ``HttpProvider``), the operator's ``outbox-worker
settle``. The simulator accepts the first send and then hangs (its fault plan); the test
SIGKILLs the worker once the simulator lists the effect, starts another worker, and counts
the effects the simulator made. For each capability of the provider:

- lookup: the second worker finds the effect by lookup, no second call;
- idempotency key: the second worker resends with the same key, the simulator replays;
- both: lookup first;
- neither: nothing can tell, so the job waits in WAITING_REVIEW with an UNKNOWN receipt
  until an operator settles it (``--accepted REF`` after checking the provider: the job
  finishes without a resend; ``--not-sent`` when the provider shows nothing: it sends once).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer import Operations, ProviderOutcomeUnknown, Store
from consumer.jobs.states import DONE, WAITING_REVIEW
from tests.services import wait_for
from tests.simulator_support import ROOT, SimulatorProcess

pytestmark = pytest.mark.slow

ACTION = "email-quote-017"
CAPABILITIES = {
    "lookup": {"SIM_LOOKUP": "1", "SIM_IDEMPOTENCY": "0"},
    "idempotency": {"SIM_LOOKUP": "0", "SIM_IDEMPOTENCY": "1"},
    "both": {"SIM_LOOKUP": "1", "SIM_IDEMPOTENCY": "1"},
    "neither": {"SIM_LOOKUP": "0", "SIM_IDEMPOTENCY": "0"},
}


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path / "provider.db") as process:
        yield process


def start_worker(
    db_url: str, sim: SimulatorProcess, capability: str, *, timeout: str = "2"
) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=db_url,
        OUTBOX_LOG_LEVEL="warning",
        SIM_URL=sim.url,
        SIM_TIMEOUT=timeout,
        JOBS_TTL="1",
        **CAPABILITIES[capability],
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumer.jobs.cli",
            "run",
            "tests.simulator_support:build_http_worker",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM and wait (a clean stop exits 0); the worker's stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"worker did not stop on SIGTERM:\n{err}") from None
    assert proc.returncode == 0, err
    return err


def settle(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", "settle", *args],
        cwd=ROOT,
        env=dict(os.environ, OUTBOX_DATABASE_URL=db_url, OUTBOX_LOG_LEVEL="warning"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def kill_after_acceptance(
    db_url: str, sim: SimulatorProcess, capability: str, fault: dict[str, object]
) -> None:
    """Start a worker, let the simulator meet ``fault`` on the first send, SIGKILL the
    worker while its call is in flight."""
    met = sim.stats()["faults"]
    sim.faults({**fault, "count": 1})
    first = start_worker(db_url, sim, capability)
    try:
        if fault["kind"] == "hang":  # accepted: the effect is listed while the call hangs
            sim.wait_for_effects(1, timeout=60)
        else:  # not acted yet: the request is in the simulator, nothing listed
            wait_for(lambda: _attempts(db_url) >= 1, "the first call to start", timeout=60)
            # The intent is written before the request leaves: kill only once the simulator
            # has met the fault, or the unspent fault would meet the next worker's resend.
            wait_for(
                lambda: sim.stats()["faults"] > met, "the request at the simulator", timeout=60
            )
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()


def _attempts(db_url: str) -> int:
    store = Store(db_url)
    try:
        receipts = Operations(store).receipts()
        return sum(r.attempts for r in receipts)
    finally:
        store.dispose()


@pytest.mark.parametrize("capability", ["lookup", "idempotency", "both"])
def test_killed_after_acceptance_one_effect_and_a_reconciled_receipt(
    pg_url: str, sim: SimulatorProcess, capability: str
) -> None:
    store = Store(pg_url)
    ops = Operations(store)
    store.enqueue("studio", ACTION, subject="ann@example.com")
    kill_after_acceptance(pg_url, sim, capability, {"kind": "hang"})
    job_id = store.get("studio", ACTION).id
    operation_id = f"{job_id}:send"
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.state == "PENDING"  # killed before the receipt
    assert receipt.attempts == 1  # counted when the call was made
    [effect] = sim.effects()

    second = start_worker(pg_url, sim, capability)
    try:
        wait_for(lambda: store.get("studio", ACTION).state == DONE, "the job to finish", timeout=60)
    finally:
        stop(second)

    assert [e["id"] for e in sim.effects()] == [effect["id"]]  # one customer-visible effect
    receipt = ops.receipt(operation_id)
    assert receipt is not None
    assert receipt.state == "ACCEPTED" and receipt.provider_ref == effect["id"]
    stats = sim.stats()
    if capability == "idempotency":
        assert receipt.attempts == 2  # the resend with the key, replayed by the provider
        assert effect["idempotency_key"] == operation_id
        assert (stats["sends"], stats["replays"], stats["lookups"]) == (2, 1, 0)
    else:
        assert receipt.attempts == 1  # found by lookup: no second call
        assert stats["sends"] == 1 and stats["lookups_found"] >= 1
    # an operator cannot overrule a reconciled receipt
    refused = settle(pg_url, operation_id, "--not-sent", "--reason", "test")
    assert refused.returncode == 1, refused.stderr
    assert len(sim.effects()) == 1
    store.dispose()


def test_neither_capability_waits_for_review_then_settle_accepted(
    pg_url: str, sim: SimulatorProcess
) -> None:
    store = Store(pg_url)
    ops = Operations(store)
    store.enqueue("studio", ACTION, subject="ann@example.com")
    kill_after_acceptance(pg_url, sim, "neither", {"kind": "hang"})
    job_id = store.get("studio", ACTION).id
    operation_id = f"{job_id}:send"
    [effect] = sim.effects()

    second = start_worker(pg_url, sim, "neither")
    try:
        wait_for(
            lambda: store.get("studio", ACTION).state == WAITING_REVIEW,
            "the job to wait for review",
            timeout=60,
        )
        receipt = ops.receipt(operation_id)
        assert receipt is not None and receipt.state == "UNKNOWN"
        assert len(sim.effects()) == 1  # nothing was resent blindly
        # the operator looks at the provider (here: the simulator's /effects) and decides
        done = settle(
            pg_url,
            operation_id,
            "--accepted",
            effect["id"],
            "--reason",
            "seen in the provider's dashboard",
            "--by",
            "ops-ann",
        )
        assert done.returncode == 0, done.stderr
        wait_for(lambda: store.get("studio", ACTION).state == DONE, "the job to finish", timeout=60)
    finally:
        stop(second)

    assert [e["id"] for e in sim.effects()] == [effect["id"]]
    receipt = ops.receipt(operation_id)
    assert receipt is not None
    assert receipt.state == "ACCEPTED" and receipt.provider_ref == effect["id"]
    assert receipt.settled_by == "ops-ann"
    assert receipt.settled_reason == "seen in the provider's dashboard"
    assert receipt.attempts == 1
    store.dispose()


def test_neither_capability_settled_not_sent_sends_exactly_once(
    pg_url: str, sim: SimulatorProcess
) -> None:
    store = Store(pg_url)
    ops = Operations(store)
    store.enqueue("studio", ACTION, subject="ann@example.com")
    # the simulator is slow: the worker is killed before the simulator acted
    kill_after_acceptance(pg_url, sim, "neither", {"kind": "slow", "delay": 30})
    job_id = store.get("studio", ACTION).id
    operation_id = f"{job_id}:send"

    second = start_worker(pg_url, sim, "neither")
    try:
        wait_for(
            lambda: store.get("studio", ACTION).state == WAITING_REVIEW,
            "the job to wait for review",
            timeout=60,
        )
        assert sim.effects() == []  # the slow request was abandoned with its client
        done = settle(pg_url, operation_id, "--not-sent", "--reason", "nothing at the provider")
        assert done.returncode == 0, done.stderr
        wait_for(lambda: store.get("studio", ACTION).state == DONE, "the job to finish", timeout=60)
    finally:
        stop(second)

    [effect] = sim.effects()  # sent once, after the decision
    receipt = ops.receipt(operation_id)
    assert receipt is not None
    assert receipt.state == "ACCEPTED" and receipt.provider_ref == effect["id"]
    assert receipt.attempts == 2  # the killed call and the one after the decision
    store.dispose()


@pytest.mark.parametrize("kind", ["slow", "late"])
def test_a_call_in_flight_past_the_lease_is_not_duplicated_by_another_worker(
    pg_url: str, sim: SimulatorProcess, kind: str
) -> None:
    """The lease is 1 s, the simulator takes 3 s (``slow``: it acts only at the end, so a
    lookup meanwhile would answer "not found"; ``late``: it acts at once and answers at the
    end). Two workers run; the provider has lookup only, the case where a resend makes a
    second effect. The intent's deadline (the 6 s timeout) keeps the lease, so the other
    worker neither claims nor looks up, and the call's own answer settles the receipt."""
    store = Store(pg_url)
    ops = Operations(store)
    sim.faults({"kind": kind, "delay": 3, "count": 1})
    workers = []
    try:
        for _ in range(2):
            proc = start_worker(pg_url, sim, "lookup", timeout="6")
            workers.append(proc)
        store.enqueue("studio", ACTION, subject="ann@example.com")
        wait_for(lambda: store.get("studio", ACTION).state == DONE, "the job to finish", timeout=60)
    finally:
        for proc in workers:
            stop(proc)
    job_id = store.get("studio", ACTION).id
    [effect] = sim.effects()
    receipt = ops.receipt(f"{job_id}:send")
    assert receipt is not None
    assert receipt.state == "ACCEPTED" and receipt.provider_ref == effect["id"]
    assert receipt.attempts == 1  # one call, never a second
    stats = sim.stats()
    assert stats["sends"] == 1
    assert stats["lookups"] == 0  # nobody looked it up while the call was in flight
    # Whoever held the job meanwhile (a lease can still be lost to load), no attempt of
    # another worker went past the in-flight guard: each one deferred to the deadline.
    outcomes = [a.outcome for a in store.history("studio", ACTION)]
    assert outcomes[-1] == "done"
    assert set(outcomes[:-1]) <= {"expired", "deferred", "conflict"}, outcomes
    store.dispose()


def reconcile_cli(db_url: str, sim: SimulatorProcess, capability: str) -> dict[str, int]:
    env = dict(
        os.environ,
        OUTBOX_DATABASE_URL=db_url,
        OUTBOX_LOG_LEVEL="warning",
        SIM_URL=sim.url,
        **CAPABILITIES[capability],
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumer.jobs.cli",
            "reconcile",
            "tests.simulator_support:build_http_worker",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


@pytest.mark.parametrize(
    ("fault", "settled"),
    [("error_after", "ACCEPTED"), ("error_before", "NOT_SENT")],
)
def test_the_sweep_settles_an_unknown_receipt_without_claiming_the_job(
    pg_url: str, sim: SimulatorProcess, fault: str, settled: str
) -> None:
    """A 5xx leaves the receipt UNKNOWN and the job waiting an hour for its retry;
    ``outbox-worker reconcile`` (a process, with the Worker's HttpProvider) looks the
    operation up once its deadline passed and settles the receipt, without a claim. The
    job's next run then makes no call (ACCEPTED) or sends once (NOT_SENT)."""
    from consumer import HttpProvider

    store = Store(pg_url)
    store.enqueue("studio", ACTION, subject="ann@example.com")
    lease = store.claim_next("worker-a", ttl=30)
    assert lease is not None
    sim.faults({"kind": fault, "status": 502, "count": 1})
    with HttpProvider("mail", sim.send_url, lookup_url=sim.lookup_url, timeout=0.5) as mail:
        ops = Operations(store, {"mail": mail})
        with pytest.raises(ProviderOutcomeUnknown):
            ops.dispatch(lease, "send", "mail", {"to": "ann@example.com"})
        operation_id = f"{lease.job_id}:send"
        receipt = ops.receipt(operation_id)
        assert receipt is not None and receipt.state == "UNKNOWN"
        store.fail(lease, error="502", retry_after=3600)  # the job waits an hour
        claims = len(store.history("studio", ACTION))
        wait_for(
            lambda: (ops.receipt(operation_id).call_deadline or 0) < time.time(),  # type: ignore[union-attr]
            "the call deadline to pass",
            timeout=60,
        )

        result = reconcile_cli(pg_url, sim, "lookup")

        assert result["accepted" if settled == "ACCEPTED" else "not_sent"] == 1
        receipt = ops.receipt(operation_id)
        assert receipt is not None and receipt.state == settled
        assert receipt.settled_by == "reconciler"
        job = store.get("studio", ACTION)
        assert job.lease_epoch == 1  # never claimed by the sweep
        assert [a.outcome for a in store.history("studio", ACTION)][:claims] == ["retry"]
        assert job.state == "READY"

        # the job's next run, whenever it comes
        when = max(job.run_after or 0.0, time.time()) + 1
        again = store.claim_next("worker-b", ttl=30, now=when)
        assert again is not None and again.job_id == lease.job_id
        final = ops.dispatch(again, "send", "mail", {"to": "ann@example.com"})
    effects = sim.effects(operation_id)
    assert [e["id"] for e in effects] == [final.provider_ref]  # one effect either way
    assert sim.stats()["sends"] == (1 if settled == "ACCEPTED" else 2)
    store.dispose()
