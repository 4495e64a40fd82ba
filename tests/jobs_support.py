"""Support for the job-store tests: worker apps for ``outbox-worker`` subprocesses."""

from __future__ import annotations

import os

from consumer.worker import JobContext, Worker


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
