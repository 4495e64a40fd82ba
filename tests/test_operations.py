"""Operation intents and receipts (guarantee 8): one customer-visible effect.

The provider is the connector simulator service (``outbox-simulator serve``, a real process
reached through ``HttpProvider``): its fault plan makes a send act and then lose its
answer (``reset``, ``hang``) or be rejected (``bad_request``), and ``GET /effects`` is what it did.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer.errors import OperationError, OperationUnresolved, PermanentFailure, ProviderTimeout
from consumer.jobs.http import HttpProvider
from consumer.jobs.operations import ACCEPTED, FAILED, UNKNOWN, OperationInFlight, Operations
from consumer.jobs.states import DONE, READY, WAITING_REVIEW
from consumer.jobs.store import Store
from tests.services import wait_for
from tests.simulator_support import SimulatorProcess

ROOT = Path(__file__).resolve().parent.parent
#: The provider call's timeout (its deadline): short, so the tests wait little for it, long
#: enough for the steps a test takes before it on a loaded machine.
CALL_TIMEOUT = 2.0
#: The next send acts, then the connection is reset without an answer: the client cannot
#: know whether it landed (ProviderTimeout, as for a read timeout), and it knows at once,
#: well before the call's deadline.
ACCEPT_THEN_TIME_OUT = {"kind": "reset", "count": 1}


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path / "simulator.db") as sim:
        yield sim


def provider(
    simulator: SimulatorProcess,
    *,
    lookup: bool,
    idempotency: bool,
    timeout: float = CALL_TIMEOUT,
) -> HttpProvider:
    """An HttpProvider named "sim" with the capabilities asked for."""
    return HttpProvider(
        "sim",
        simulator.send_url,
        lookup_url=simulator.lookup_url if lookup else None,
        idempotency_header="Idempotency-Key" if idempotency else None,
        timeout=timeout,
    )


def refs(simulator: SimulatorProcess) -> list[str]:
    """The provider references of the effects the simulator made, in order."""
    return [effect["id"] for effect in simulator.effects()]


def past_deadline(store: Store, ops: Operations, operation_id: str) -> None:
    """Wait (observing the database clock) until the receipt's call deadline has passed."""
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.call_deadline is not None
    deadline = receipt.call_deadline

    def passed() -> bool:
        with store.driver.connect() as conn:
            return store.driver.clock_read(conn, None) > deadline

    wait_for(passed, "the call deadline to pass", timeout=30)


def _claim(store: Store, action: str = "email-1"):  # type: ignore[no-untyped-def]
    store.enqueue("t", action, subject="ann@example.com")
    lease = store.claim_next("w", ttl=1)
    assert lease is not None
    return lease


@pytest.mark.slow  # the simulator and call timeouts (~9 s under load)
def test_a_timeout_leaves_the_receipt_unknown_and_lookup_reconciles(
    db_url: str, simulator: SimulatorProcess
) -> None:
    store = Store(db_url)
    sim = provider(simulator, lookup=True, idempotency=False)
    simulator.faults(ACCEPT_THEN_TIME_OUT)
    ops = Operations(store, {"sim": sim})
    lease = _claim(store)
    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "send", "sim", {"to": "ann"})
    operation_id = f"{lease.job_id}:send"
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.state == UNKNOWN  # never FAILED
    assert receipt.attempts == 1 and receipt.call_deadline is not None
    assert store.fail(lease, error="timeout") == READY
    simulator.faults()  # no rules: the simulator answers normally from now on
    # Before the call's deadline nobody looks it up: the job is handed back until then.
    early = store.claim_next("w", now=10**10)
    assert early is not None
    with pytest.raises(OperationInFlight) as info:
        ops.dispatch(early, "send", "sim", {"to": "ann"})
    assert info.value.deadline == pytest.approx(receipt.call_deadline)
    job = store.get(lease.job_id)
    assert job.state == READY and job.run_after == pytest.approx(receipt.call_deadline)
    past_deadline(store, ops, operation_id)
    again = store.claim_next("w", now=10**10)
    assert again is not None
    result = ops.dispatch(again, "send", "sim", {"to": "ann"})
    assert result.state == ACCEPTED and result.reconciled
    assert refs(simulator) == [result.provider_ref]
    assert ops.receipt(operation_id).attempts == 1  # type: ignore[union-attr]  # no lookups
    # a later retry of the same job does not repeat the effect either
    assert ops.dispatch(again, "send", "sim", {"to": "ann"}).provider_ref == result.provider_ref
    assert len(simulator.effects()) == 1
    with pytest.raises(OperationError):
        ops.dispatch(again, "send", "sim", {"to": "bob"})  # same operation, other request
    store.dispose()


@pytest.mark.slow  # the simulator and call timeouts (~8 s under load)
def test_idempotency_key_reconciles_without_lookup(
    db_url: str, simulator: SimulatorProcess
) -> None:
    store = Store(db_url)
    sim = provider(simulator, lookup=False, idempotency=True)
    simulator.faults(ACCEPT_THEN_TIME_OUT)
    ops = Operations(store, {"sim": sim})
    lease = _claim(store)
    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "send", "sim", {"to": "ann"})
    simulator.faults()  # no rules: the resend is answered normally
    past_deadline(store, ops, f"{lease.job_id}:send")
    result = ops.dispatch(lease, "send", "sim", {"to": "ann"})
    assert result.state == ACCEPTED and len(simulator.effects()) == 1
    assert result.reconciled
    assert ops.receipt(f"{lease.job_id}:send").attempts == 2  # type: ignore[union-attr]
    store.dispose()


@pytest.mark.slow  # the simulator and call timeouts (~9 s under load)
def test_a_provider_without_lookup_or_idempotency_sends_the_job_to_review(
    db_url: str, simulator: SimulatorProcess
) -> None:
    store = Store(db_url)
    sim = provider(simulator, lookup=False, idempotency=False)
    simulator.faults(ACCEPT_THEN_TIME_OUT)
    ops = Operations(store, {"sim": sim})
    lease = _claim(store)
    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "send", "sim", {"to": "ann"})
    past_deadline(store, ops, f"{lease.job_id}:send")
    with pytest.raises(OperationUnresolved):
        ops.dispatch(lease, "send", "sim", {"to": "ann"})
    assert store.get(lease.job_id).state == WAITING_REVIEW
    receipt = ops.receipt(f"{lease.job_id}:send")
    assert receipt is not None and receipt.state == UNKNOWN
    assert len(simulator.effects()) == 1
    store.dispose()


def test_rejection_is_failed_and_a_fenced_worker_cannot_dispatch(
    db_url: str, simulator: SimulatorProcess
) -> None:
    from consumer.errors import Conflict

    store = Store(db_url)
    sim = provider(simulator, lookup=True, idempotency=False)
    simulator.faults({"kind": "bad_request"})  # every send: 400, nothing done
    ops = Operations(store, {"sim": sim})
    lease = _claim(store)
    with pytest.raises(PermanentFailure):
        ops.dispatch(lease, "send", "sim", {"to": "ann"})
    assert ops.receipt(f"{lease.job_id}:send") is not None
    assert ops.receipt(f"{lease.job_id}:send").state == FAILED  # type: ignore[union-attr]
    other = _claim(store, "email-2")
    store.recover(now=10**10)
    with pytest.raises(Conflict):
        ops.dispatch(other, "send", "sim", {"to": "bob"})
    assert ops.receipt(f"{other.job_id}:send") is None  # fenced out: no intent written
    assert simulator.effects() == []
    store.dispose()


def _worker(db_url: str, simulator: SimulatorProcess) -> subprocess.Popen[bytes]:
    """``outbox-worker run``: an HttpProvider with lookup (no idempotency key) to the
    simulator; a call may take 3 s (the kill lands well within it); lease ttl 1 s."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_DATABASE_URL": db_url,
        "SIM_URL": simulator.url,
        "SIM_LOOKUP": "1",
        "SIM_IDEMPOTENCY": "0",
        "SIM_TIMEOUT": "3",
        "JOBS_TTL": "1",
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumer.jobs.cli",
            "run",
            "tests.jobs_support:build_http",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_worker_killed_after_the_provider_accepted_gives_exactly_one_effect(
    pg_url: str, simulator: SimulatorProcess
) -> None:
    store = Store(pg_url)
    simulator.faults({"kind": "hang", "count": 1})  # the first send acts, then hangs
    store.enqueue("studio", "email-quote-017", subject="ann@example.com")
    first = _worker(pg_url, simulator)
    try:
        simulator.wait_for_effects(1, timeout=60)
        first.send_signal(signal.SIGKILL)  # after the provider accepted, before the receipt
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    ops = Operations(store)
    job_id = store.get("studio", "email-quote-017").id
    receipt = ops.receipt(f"{job_id}:send")
    assert receipt is not None and receipt.state == "PENDING"
    second = _worker(pg_url, simulator)
    try:
        wait_for(
            lambda: store.get("studio", "email-quote-017").state == DONE,
            "the job to finish",
            timeout=60,
        )
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        if second.poll() is None:
            second.kill()
    effects = simulator.effects()
    assert len(effects) == 1
    receipt = ops.receipt(f"{job_id}:send")
    assert receipt is not None and receipt.state == ACCEPTED
    assert receipt.provider_ref == effects[0]["id"]
    outcomes = [a.outcome for a in store.history("studio", "email-quote-017")]
    # The dead worker's lease expired; the next attempt settles the receipt. On a loaded
    # machine it may come before the killed call's deadline: it defers, it does not send.
    assert outcomes[0] == "expired" and outcomes[-1] == "done", outcomes
    assert set(outcomes[1:-1]) <= {"deferred"}, outcomes
    store.dispose()


@pytest.mark.slow  # the simulator and a sweeping worker (8-9 s under load)
def test_a_worker_sweeps_receipts_periodically(db_url: str, simulator: SimulatorProcess) -> None:
    """Worker(providers=...) runs Operations.reconcile every reconcile_interval, inside
    run_once: an UNKNOWN receipt is settled while its job waits for its retry."""
    from consumer.jobs.worker import Worker

    store = Store(db_url)
    sim = provider(simulator, lookup=True, idempotency=False)
    simulator.faults(ACCEPT_THEN_TIME_OUT)
    worker = Worker(store, providers={"sim": sim}, reconcile_interval=0.01)
    worker.register("email", lambda job: job.dispatch("send", "sim", {"to": job.subject}))
    job_id = store.enqueue("t", "email-1", subject="ann").job_id
    assert worker.run_once() == 1  # the call timed out after the provider acted
    operation_id = f"{job_id}:send"
    assert Operations(store).receipt(operation_id).state == UNKNOWN  # type: ignore[union-attr]
    job = store.get(job_id)
    assert job.state == READY
    store.schedule(job_id, 10**10, "not before the sweep")  # the retry is far away
    past_deadline(store, Operations(store), operation_id)
    assert worker.run_once() == 0  # nothing claimed, the sweep ran
    receipt = Operations(store).receipt(operation_id)
    assert receipt is not None and receipt.state == ACCEPTED
    assert refs(simulator) == [receipt.provider_ref]
    store.dispose()
