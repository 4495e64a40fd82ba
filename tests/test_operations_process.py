"""External effects across real process boundaries (guarantee 8, issue 11).

The connector simulator runs as its own HTTP server process (``outbox-simulator serve``),
workers are ``outbox-worker run`` subprocesses dispatching through ``HttpProvider``, and the
tests SIGKILL them after the simulator accepted. Whatever happens: exactly one effect, and a
reconciled receipt or, for a provider with neither lookup nor idempotency, WAITING_REVIEW
until an operator settles it (``outbox-worker settle``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer.jobs.http import HttpProvider
from consumer.jobs.operations import ACCEPTED, NOT_SENT, PENDING, UNKNOWN, Operations
from consumer.jobs.states import DONE, LEASED, READY, WAITING_REVIEW
from consumer.jobs.store import Store
from tests.services import wait_for
from tests.simulator_support import SimulatorProcess

ROOT = Path(__file__).resolve().parent.parent
ACTION = "email-quote-017"


def _capabilities(name: str) -> tuple[bool, bool]:
    """(lookup, idempotency) of a capability set's name."""
    return {"lookup": (True, False), "idempotency": (False, True), "both": (True, True)}.get(
        name, (False, False)
    )


def _worker(
    db_url: str,
    sim: SimulatorProcess,
    capability: str,
    *,
    timeout: float = 3.0,
    ttl: float = 1.0,
    concurrency: int | None = None,
) -> subprocess.Popen[bytes]:
    lookup, idempotency = _capabilities(capability)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_DATABASE_URL": db_url,
        "SIM_URL": sim.url,
        "SIM_LOOKUP": "1" if lookup else "0",
        "SIM_IDEMPOTENCY": "1" if idempotency else "0",
        "SIM_TIMEOUT": str(timeout),
        "JOBS_TTL": str(ttl),
    }
    if concurrency is not None:
        env["OUTBOX_CONCURRENCY"] = str(concurrency)
    return subprocess.Popen(
        [sys.executable, "-m", "consumer.jobs.cli", "run", "tests.jobs_support:build_http"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_DATABASE_URL": db_url}
    return subprocess.run(
        [sys.executable, "-m", "consumer.jobs.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path / "effects.db") as process:
        yield process


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["lookup", "idempotency", "both", "neither"])
def test_worker_killed_after_the_provider_accepted_gives_one_effect(
    pg_url: str, sim: SimulatorProcess, capability: str
) -> None:
    lookup, idempotency = _capabilities(capability)
    sim.configure(lookup=lookup, idempotency=idempotency)
    sim.faults({"kind": "hang", "count": 1})  # acts, then never answers
    store = Store(pg_url)
    job_id = store.enqueue("studio", ACTION, subject="ann@example.com").job_id
    operation_id = f"{job_id}:send"
    first = _worker(pg_url, sim, capability)
    try:
        sim.wait_for_effects(1)
        first.send_signal(signal.SIGKILL)  # after the provider acted, before the receipt
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
    ops = Operations(store)
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.state == PENDING
    assert receipt.attempts == 1  # counted when the call was made, not when it returned
    second = _worker(pg_url, sim, capability)
    try:
        if capability != "neither":
            wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
            receipt = ops.receipt(operation_id)
            assert receipt is not None and receipt.state == ACCEPTED
            effects = sim.effects()
            assert len(effects) == 1
            assert receipt.provider_ref == effects[0]["id"]
            # lookup finds the effect without a call; an idempotent resend is a second call
            assert receipt.attempts == (1 if lookup else 2)
        else:
            wait_for(
                lambda: store.get(job_id).state == WAITING_REVIEW,
                "the job to wait for review",
                timeout=60,
            )
            receipt = ops.receipt(operation_id)
            assert receipt is not None and receipt.state == UNKNOWN
            listed = _cli(pg_url, "receipts", "--state", "UNKNOWN", "--json")
            assert listed.returncode == 0, listed.stderr
            assert [r["operation_id"] for r in json.loads(listed.stdout)] == [operation_id]
            ref = sim.effects()[0]["id"]  # the operator looked at the provider's records
            settled = _cli(
                pg_url, "settle", operation_id, "--accepted", ref, "--reason", "seen", "--by", "ops"
            )
            assert settled.returncode == 0, settled.stderr
            wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
            receipt = ops.receipt(operation_id)
            assert receipt is not None and receipt.state == ACCEPTED
            assert receipt.provider_ref == ref and receipt.settled_by == "ops"
            assert receipt.settled_reason == "seen" and receipt.settled_at is not None
            again = _cli(pg_url, "settle", operation_id, "--not-sent")
            assert again.returncode == 1  # an ACCEPTED receipt is not settled again
            assert "ACCEPTED" in again.stderr
        assert len(sim.effects()) == 1
    finally:
        _stop(second)
    store.dispose()


@pytest.mark.slow
def test_not_sent_settlement_sends_once(pg_url: str, sim: SimulatorProcess) -> None:
    """A 500 before acting leaves the receipt UNKNOWN; with neither capability the job waits
    for review; the operator (who checked the provider) settles --not-sent: one send."""
    sim.configure(lookup=False, idempotency=False)
    sim.faults({"kind": "error_before", "count": 1, "status": 500})
    store = Store(pg_url)
    job_id = store.enqueue("studio", ACTION, subject="ann@example.com").job_id
    operation_id = f"{job_id}:send"
    worker = _worker(pg_url, sim, "neither", timeout=1.0)
    try:
        wait_for(
            lambda: store.get(job_id).state == WAITING_REVIEW,
            "the job to wait for review",
            timeout=60,
        )
        assert sim.effects() == []
        settled = _cli(pg_url, "settle", operation_id, "--not-sent", "--reason", "no effect")
        assert settled.returncode == 0, settled.stderr
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
    finally:
        _stop(worker)
    receipt = Operations(store).receipt(operation_id)
    assert receipt is not None and receipt.state == ACCEPTED
    assert receipt.settled_reason == "no effect"  # the decision stays on record
    assert len(sim.effects()) == 1
    store.dispose()


@pytest.mark.slow
def test_a_call_in_flight_past_the_lease_is_not_duplicated(
    pg_url: str, sim: SimulatorProcess
) -> None:
    """The simulator acts, then answers late. Meanwhile the job's lease is taken back and a
    second worker (and the sweep) reconcile: before the call's deadline neither looks it up,
    so the lookup-only provider's "not found" cannot cause a second send."""
    sim.configure(lookup=True, idempotency=False)
    sim.faults({"kind": "late", "count": 1, "delay": 3.0})
    store = Store(pg_url)
    job_id = store.enqueue("studio", ACTION, subject="ann@example.com").job_id
    operation_id = f"{job_id}:send"
    provider = HttpProvider("mail", sim.send_url, lookup_url=sim.lookup_url, timeout=6.0)
    ops = Operations(store, {"mail": provider})
    # One slot, busy with the late call: the test, not this worker, takes the job back.
    first = _worker(pg_url, sim, "lookup", timeout=6.0, ttl=1.0, concurrency=1)
    try:
        sim.wait_for_effects(1)
        receipt = ops.receipt(operation_id)
        assert receipt is not None and receipt.state == PENDING
        assert ops.reconcile().skipped == 0  # the sweep does not even list it yet
        assert ops.receipt(operation_id).state == PENDING  # type: ignore[union-attr]
        # The lease is lost (a long pause, a clock jump): recovery takes the job back.
        far = store.get(job_id).lease_expires_at
        assert far is not None
        store.recover(now=far + 1)
        lease = store.claim_next("second", ttl=30, now=far + 2)
        assert lease is not None and lease.job_id == job_id
        from consumer.errors import OperationInFlight

        with pytest.raises(OperationInFlight):
            ops.dispatch(lease, "send", "mail", {"to": "ann@example.com"})
        assert store.get(job_id).state == READY  # handed back until the deadline
        wait_for(lambda: store.get(job_id).state == DONE, "the job to finish", timeout=60)
    finally:
        _stop(first)
        provider.close()
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.state == ACCEPTED
    assert len(sim.effects()) == 1
    store.dispose()


@pytest.mark.slow  # a worker process and the simulator (10-15 s under load)
def test_the_sweep_settles_an_unknown_receipt_without_claiming_the_job(
    db_url: str, sim: SimulatorProcess
) -> None:
    sim.configure(lookup=True, idempotency=False)
    sim.faults({"kind": "error_after", "count": 1, "status": 500})  # acts, then 500
    store = Store(db_url)
    provider = HttpProvider("mail", sim.send_url, lookup_url=sim.lookup_url, timeout=0.3)
    ops = Operations(store, {"mail": provider})
    store.enqueue("studio", ACTION, subject="ann@example.com")
    lease = store.claim_next("w", ttl=30)
    assert lease is not None
    from consumer.errors import ProviderTimeout

    with pytest.raises(ProviderTimeout):
        ops.dispatch(lease, "send", "mail", {"to": "ann@example.com"})
    operation_id = f"{lease.job_id}:send"
    assert ops.receipt(operation_id).state == UNKNOWN  # type: ignore[union-attr]
    store.fail(lease, error="5xx", retry_after=3600)  # READY, but not for an hour
    epoch = store.get(lease.job_id).lease_epoch
    deadline = ops.receipt(operation_id).call_deadline  # type: ignore[union-attr]
    assert deadline is not None
    result = ops.reconcile(now=deadline + 0.001)
    assert result.accepted == 1
    receipt = ops.receipt(operation_id)
    assert receipt is not None and receipt.state == ACCEPTED
    assert receipt.provider_ref == sim.effects()[0]["id"]
    assert receipt.settled_by == "reconciler"
    job = store.get(lease.job_id)
    assert job.state == READY and job.lease_epoch == epoch  # never claimed
    provider.close()
    store.dispose()


@pytest.mark.parametrize(
    ("fault", "state", "job_state"),
    [
        ({"kind": "unauthorized"}, NOT_SENT, READY),
        ({"kind": "forbidden"}, NOT_SENT, READY),
        ({"kind": "rate_limit", "retry_after": 120}, NOT_SENT, READY),
        ({"kind": "unavailable", "retry_after": 120}, NOT_SENT, READY),
        ({"kind": "bad_request"}, "FAILED", WAITING_REVIEW),
        ({"kind": "error_after", "status": 502}, UNKNOWN, READY),
    ],
)
@pytest.mark.slow  # a worker process and the simulator per fault (12 cases, 7-14 s each under load)
def test_each_status_class_lands_in_its_receipt_state(
    db_url: str, sim: SimulatorProcess, fault: dict[str, object], state: str, job_state: str
) -> None:
    from consumer.jobs.worker import Worker

    sim.faults({**fault, "count": 1})
    store = Store(db_url)
    provider = HttpProvider("mail", sim.send_url, lookup_url=sim.lookup_url, timeout=2.0)
    worker = Worker(store, providers={"mail": provider})
    worker.register("email", lambda job: job.dispatch("send", "mail", {"to": "ann"}))
    job_id = store.enqueue("studio", ACTION).job_id
    assert worker.run_once() == 1
    receipt = Operations(store).receipt(f"{job_id}:send")
    assert receipt is not None and receipt.state == state
    assert receipt.attempts == 1
    job = store.get(job_id)
    assert job.state == job_state
    if "retry_after" in fault:  # honoured: not eligible before the provider's Retry-After
        assert job.run_after is not None and job.run_after >= job.updated_at + 119
        # and the provider is paused for every worker until then (database clock): the test
        # travels in time with ``now``, the pause lives on the real clock, so lift it
        limits = worker.operations.limits  # type: ignore[union-attr]
        assert (Operations(store).limits.paused_until("mail") or 0) >= job.updated_at + 119
        limits.unpause("mail")
    if state == NOT_SENT:  # the provider did not act: the retry sends, once
        store.resume(job_id) if job.state != READY else None
        assert worker.run_once(now=(job.run_after or 0) + 1) == 1
        assert store.get(job_id).state == DONE
        receipt = Operations(store).receipt(f"{job_id}:send")
        assert receipt is not None and receipt.state == ACCEPTED and receipt.attempts == 2
        assert len(sim.effects()) == 1
    provider.close()
    store.dispose()


@pytest.mark.slow  # worker processes and the simulator (~30 s under load)
def test_settle_in_code_validates_and_refuses(db_url: str) -> None:
    from consumer.errors import JobError, OperationError

    store = Store(db_url)
    ops = Operations(store)
    with pytest.raises(OperationError):
        ops.settle("1:nope", not_sent=True)
    with pytest.raises(JobError):
        ops.settle("1:nope")  # neither decision
    with pytest.raises(JobError):
        ops.settle("1:nope", accepted="ref", not_sent=True)
    with pytest.raises(JobError):
        ops.receipts("LOST")
    assert _cli(db_url, "settle", "1:nope", "--not-sent").returncode == 1
    assert _cli(db_url, "settle", "1:nope").returncode == 2
    listed = _cli(db_url, "receipts")
    assert listed.returncode == 0 and "OPERATION" in listed.stdout
    swept = _cli(db_url, "reconcile", "--json")
    assert swept.returncode == 0 and json.loads(swept.stdout)["accepted"] == 0
    store.dispose()


@pytest.mark.slow  # a worker process and a slow simulator (~7 s under load)
def test_lease_is_extended_to_the_call_deadline(db_url: str, sim: SimulatorProcess) -> None:
    store = Store(db_url)
    provider = HttpProvider("mail", sim.send_url, timeout=45.0)
    ops = Operations(store, {"mail": provider})
    store.enqueue("studio", ACTION)
    lease = store.claim_next("w", ttl=1)
    assert lease is not None
    ops.dispatch(lease, "send", "mail", {"to": "ann"})
    receipt = ops.receipt(f"{lease.job_id}:send")
    assert receipt is not None and receipt.call_deadline is not None
    job = store.get(lease.job_id)
    assert job.state == LEASED
    assert job.lease_expires_at == pytest.approx(receipt.call_deadline)
    provider.close()
    store.dispose()
