"""The worker app of tests/test_inline_kill.py: a quick ``def`` handler (microseconds, no
wait), so that once the worker has learned it, the claims' own thread runs it; each run is
one line appended to ``INLINE_RUNS`` (job id, epoch, thread): a write to the page cache,
which a SIGKILL of the worker does not take back."""

from __future__ import annotations

import os
import threading
from typing import Any

from consumer import Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_runs = os.open(os.environ["INLINE_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def build() -> Worker:
    worker = Worker(
        Store(URL),
        concurrency=16,
        liveness_ttl=2.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )

    @worker.handler("tick")
    def tick(job: Any) -> None:
        line = f"{job.job_id} {job.lease.epoch} {threading.current_thread().name}\n"
        os.write(_runs, line.encode())  # one write, O_APPEND: lines never interleave

    return worker
