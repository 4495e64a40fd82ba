"""The worker app of tests/test_steps_kill.py: diamonds of steps (a -> b, c -> d). Each run
appends one line to ``STEP_RUNS`` (job id, epoch, action, what it saw of its parents as
JSON) before it returns its result (``<action>@<epoch>``): a write to the page cache, which a
SIGKILL of the worker does not take back."""

from __future__ import annotations

import json
import os
from typing import Any

from consumer import Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_runs = os.open(os.environ["STEP_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def build() -> Worker:
    worker = Worker(
        Store(URL),
        concurrency=16,
        liveness_ttl=2.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )

    def step(job: Any) -> str:
        seen = {f"{t}/{a}": r for (t, a), r in job.results.items()}
        line = f"{job.job_id} {job.lease.epoch} {job.action} {json.dumps(seen)}\n"
        os.write(_runs, line.encode())  # one write, O_APPEND: lines never interleave
        return f"{job.action}@{job.lease.epoch}"

    for name in "abcd":
        worker.register(name, step)
    return worker
