"""The worker app of tests/test_inline_kill.py: jobs of every shape in one queue (a no-op, a
1 ms, a 5 ms and a 50 ms wait, in ``def`` handlers, and a 1 ms ``async def`` one); each run
is one line appended to ``INLINE_RUNS`` (job id, epoch, kind) before the handler waits: a
write to the page cache, which a SIGKILL of the worker does not take back."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from consumer import Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_runs = os.open(os.environ["INLINE_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
WAITS = {"w0": 0.0, "w1": 0.001, "w5": 0.005, "w50": 0.05}


def _ran(job: Any) -> None:
    line = f"{job.job_id} {job.lease.epoch} {job.lease.kind}\n"
    os.write(_runs, line.encode())  # one write, O_APPEND: lines never interleave


def build() -> Worker:
    worker = Worker(
        Store(URL),
        concurrency=16,
        liveness_ttl=2.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )
    for kind, seconds in WAITS.items():

        def waits(job: Any, seconds: float = seconds) -> None:
            _ran(job)
            if seconds:
                time.sleep(seconds)

        worker.register(kind, waits)

    @worker.handler("a1")
    async def waits_async(job: Any) -> None:
        _ran(job)
        await asyncio.sleep(0.001)

    return worker
