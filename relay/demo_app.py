"""The worker of ``outbox-relay demo --chaos``, run as its own process.

The demo starts ``outbox-worker run relay.demo_app:build_worker`` processes (and SIGKILLs
them mid-send). Each sends the "quote approved" email of a ``send-quote-N`` job through an
:class:`~consumer.jobs.http.HttpProvider` to the connector simulator service whose URL is in
``OUTBOX_DEMO_SIMULATOR_URL`` (``outbox-simulator serve``, started by the demo), with both
reconciliation aids on: lookup by operation id and the ``Idempotency-Key`` header.

A demo worker stops by itself when the demo process is gone (its parent changed), so a demo
that was killed does not leave its workers polling the database.
"""

from __future__ import annotations

import os
import threading

from consumer.jobs.http import HttpProvider
from consumer.jobs.worker import JobContext, Worker

#: The environment variable naming the simulator's base URL (set by the demo).
SIMULATOR_URL_VARIABLE = "OUTBOX_DEMO_SIMULATOR_URL"
#: Seconds one provider call may take (the intent's call deadline; the simulator's "late"
#: answers in the demo come well before it).
CALL_TIMEOUT = 2.0


def build_worker() -> Worker:
    """A Worker with one handler, ``send-quote``: one email per quote, exactly once."""
    url = os.environ[SIMULATOR_URL_VARIABLE].rstrip("/")
    provider = HttpProvider(
        "mail",
        f"{url}/send",
        lookup_url=f"{url}/lookup/{{operation_id}}",
        timeout=CALL_TIMEOUT,
    )
    worker = Worker(
        providers={"mail": provider},
        concurrency=6,
        batch_size=2,
        ttl=2.0,
        poll_interval=0.05,
        recover_interval=0.2,
        reconcile_interval=0.5,
    )

    @worker.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        data = job.payload if isinstance(job.payload, dict) else {}
        job.dispatch(
            "email",
            "mail",
            {
                "to": f"{job.tenant}@example.com",
                "template": "quote-approved",
                "quote": data.get("quote"),
                "total": data.get("total"),
                "currency": data.get("currency"),
            },
        )

    _stop_with_parent(worker)
    return worker


def _stop_with_parent(worker: Worker) -> None:
    parent = os.getppid()

    def watch() -> None:
        while not worker.stop_flag.stopped:
            if os.getppid() != parent:  # the demo is gone: we were re-parented
                worker.stop()
                return
            worker.stop_flag.wait(0.5)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()
