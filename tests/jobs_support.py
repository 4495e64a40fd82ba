"""Support for the job-store tests: worker apps for ``outbox-worker`` subprocesses."""

from __future__ import annotations

import os

from consumer.jobs.worker import JobContext, Worker
from tests.services import wait_for


def build() -> Worker:
    """A worker whose ``noop`` handler appends the job's action to $JOBS_EFFECTS_FILE."""
    worker = Worker(batch_size=int(os.environ.get("JOBS_BATCH", "5")), poll_interval=0.05)

    @worker.handler("noop")
    def noop(job: JobContext) -> None:
        path = os.environ.get("JOBS_EFFECTS_FILE")
        if path:
            with open(path, "a") as fh:
                fh.write(job.action + "\n")

    return worker


not_a_worker = 42


def build_http() -> Worker:
    """A worker whose ``email`` handler dispatches through ``HttpProvider`` to the connector
    simulator at $SIM_URL, with the capabilities $SIM_LOOKUP / $SIM_IDEMPOTENCY (1 or 0) and
    the call timeout $SIM_TIMEOUT; lease ttl $JOBS_TTL."""
    from consumer.jobs.http import HttpProvider

    url = os.environ["SIM_URL"]
    provider = HttpProvider(
        "mail",
        f"{url}/send",
        lookup_url=f"{url}/lookup/{{operation_id}}"
        if os.environ.get("SIM_LOOKUP") == "1"
        else None,
        idempotency_header="Idempotency-Key" if os.environ.get("SIM_IDEMPOTENCY") == "1" else None,
        timeout=float(os.environ.get("SIM_TIMEOUT", "3")),
    )
    worker = Worker(
        providers={"mail": provider},
        batch_size=1,
        ttl=float(os.environ.get("JOBS_TTL", "1")),
        recover_interval=0.2,
        poll_interval=0.05,
        reconcile_interval=0.5,
    )

    @worker.handler("email")
    def email(job: JobContext) -> None:
        job.dispatch("send", "mail", {"to": job.subject})

    return worker


def build_slow() -> Worker:
    """A worker whose ``slow`` handler appends ``PID ACTION ATTEMPT`` to $JOBS_EFFECTS_FILE,
    then holds its first attempt until the process is killed (the job the test kills a
    worker in); a later attempt finishes at once. Default settings otherwise (lease ttl
    30 s)."""
    import threading

    worker = Worker(batch_size=1, poll_interval=0.05)

    @worker.handler("slow")
    def slow(job: JobContext) -> None:
        with open(os.environ["JOBS_EFFECTS_FILE"], "a") as fh:
            fh.write(f"{os.getpid()} {job.action} {job.attempt}\n")
        if job.attempt == 1:
            threading.Event().wait()  # nothing sets it: held until the test kills us

    return worker


def build_routed() -> Worker:
    """A worker with one handler per name in $JOBS_HANDLERS (comma-separated). Each appends
    ``PID HANDLER QUEUE ACTION LEASED`` to $JOBS_EFFECTS_FILE, where LEASED is how many jobs
    of the job's tenant and queue are LEASED at that moment (read from the database, over
    every worker), then sleeps $JOBS_SLEEP seconds (default 0). The jobs of queue
    $JOBS_HOLD_QUEUE, if set, then wait until the file $JOBS_RELEASE_FILE exists (holding
    their slots and leases, reporting progress)."""
    import time
    from pathlib import Path

    import sqlalchemy as sa

    worker = Worker(poll_interval=0.05)
    pause = float(os.environ.get("JOBS_SLEEP", "0"))
    hold = os.environ.get("JOBS_HOLD_QUEUE")
    release = Path(os.environ.get("JOBS_RELEASE_FILE", "/nonexistent"))

    def make(name: str) -> None:
        @worker.handler(name)
        def run(job: JobContext) -> None:
            with job.store.engine.connect() as conn:
                leased = conn.execute(
                    sa.text(
                        "SELECT count(*) FROM outbox_jobs WHERE state = 'LEASED' "
                        "AND tenant = :t AND queue = :q"
                    ),
                    {"t": job.tenant, "q": job.lease.queue},
                ).scalar_one()
            with open(os.environ["JOBS_EFFECTS_FILE"], "a") as fh:
                fh.write(f"{os.getpid()} {name} {job.lease.queue} {job.action} {leased}\n")
            if pause:
                time.sleep(pause)  # the scenario: the handler's work, its jobs overlap meanwhile
            if hold is not None and job.lease.queue == hold:
                # Until the test releases it, reporting progress (the lease stays renewed).
                wait_for(
                    lambda: job.progress() or release.exists(),
                    "the test to create $JOBS_RELEASE_FILE",
                    timeout=120,
                    interval=0.02,
                )

    for name in os.environ["JOBS_HANDLERS"].split(","):
        make(name)
    return worker
