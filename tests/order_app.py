"""The worker app of tests/test_order_kill.py: jobs of order keys (kind ``step``), each run
appending ``START action`` to ``ORDER_RUNS`` before its 2 ms wait and ``END action`` after
it: writes to the page cache, which a SIGKILL of the worker does not take back."""

from __future__ import annotations

import os
import time
from typing import Any

from consumer import Store, Worker

URL = os.environ["OUTBOX_DATABASE_URL"]
_runs = os.open(os.environ["ORDER_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def _step(job: Any) -> None:
    os.write(_runs, f"START {job.lease.action}\n".encode())  # one write, O_APPEND
    time.sleep(0.002)
    os.write(_runs, f"END {job.lease.action}\n".encode())


def build() -> Worker:
    worker = Worker(
        Store(URL),
        concurrency=16,
        liveness_ttl=2.0,
        liveness_interval=0.5,
        recover_interval=0.5,
    )
    worker.register("step", _step)
    return worker
