"""The worker app of tests/test_worker_cuts.py: 16 slots, a handler that waits ~1 ms and, for
every other job, dispatches through an in-process provider (an intent and a receipt: the
dispatch path's own autocommit statements). ``CUT_HANDLER``: ``def`` (the default: a plain
handler, ``time.sleep`` and ``dispatch``) or ``async`` (``asyncio.sleep`` and
``adispatch``). Each run is one line appended to ``CUT_RUNS`` (job id, epoch): a write the
test reads after the worker stops."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

from consumer import JobContext, Operations, Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_runs = os.open(os.environ["CUT_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


class Echo:
    """A provider that answers at once: the id is the operation's."""

    name = "echo"
    supports_lookup = True
    supports_idempotency = True
    rate_limit: float | None = None
    timeout = 5.0

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str:
        return f"echo-{operation_id}"

    def lookup(self, operation_id: str) -> str | None:
        return f"echo-{operation_id}"


def build() -> Worker:
    store = Store(URL)
    operations = Operations(store, {"echo": Echo()})
    worker = Worker(
        store,
        concurrency=16,
        ttl=float(os.environ.get("WORKER_TTL", "5")),
        liveness_ttl=3.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )

    def ran(job: JobContext) -> None:
        line = f"{job.job_id} {job.lease.epoch}\n"
        os.write(_runs, line.encode())  # one write, O_APPEND: lines never interleave

    if os.environ.get("CUT_HANDLER", "def") == "async":

        @worker.handler("tick")
        async def tick_async(job: JobContext) -> None:
            await asyncio.sleep(0.001)
            if job.job_id % 2:
                await operations.adispatch(job, "send", "echo", {"job": job.job_id})
            ran(job)

    else:

        @worker.handler("tick")
        def tick(job: JobContext) -> None:
            time.sleep(0.001)
            if job.job_id % 2:
                operations.dispatch(job, "send", "echo", {"job": job.job_id})
            ran(job)

    return worker
