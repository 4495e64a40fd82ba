"""The worker of ``outbox-relay demo --chaos``, run as its own process.

The demo starts ``outbox-worker run relay.demo_app:build_worker`` processes (and SIGKILLs
them mid-send). Each sends the "quote approved" email of a ``send-quote-N`` job through an
:class:`~consumer.jobs.http.HttpProvider` to the connector simulator service whose URL is in
``OUTBOX_DEMO_SIMULATOR_URL`` (``outbox-simulator serve``, started by the demo), with both
reconciliation aids on: lookup by operation id and the ``Idempotency-Key`` header.

A demo worker stops by itself when the demo process is gone (its parent changed), so a demo
that was killed does not leave its workers polling the database. The demo's simulator is
``outbox-simulator serve`` run through ``python -m relay.demo_app simulator ARGS...``, which
adds only that: it gets SIGTERM when the demo is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a worker is built: the simulator process needs neither
    from consumer.jobs.worker import JobContext, Worker

#: The environment variable naming the simulator's base URL (set by the demo).
SIMULATOR_URL_VARIABLE = "OUTBOX_DEMO_SIMULATOR_URL"
#: The environment variable with the demo's pid (set by the demo): its workers stop when
#: they are no longer its children.
PARENT_PID_VARIABLE = "OUTBOX_DEMO_PID"
#: Seconds one provider call may take (the intent's call deadline; the simulator's "late"
#: answers in the demo come well before it).
CALL_TIMEOUT = 2.0


def build_worker() -> Worker:
    """A Worker with one handler, ``send-quote``: one email per quote, exactly once."""
    from consumer.jobs.http import HttpProvider
    from consumer.jobs.worker import Worker

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
    _watch_parent(worker.stop, worker.stop_flag.event)


def _watch_parent(stop: Callable[[], None], stopped: threading.Event) -> None:
    """Call ``stop`` once the demo is gone (this process was re-parented)."""
    # The pid the demo passed, not os.getppid() now: a demo killed while this process was
    # still starting would otherwise leave it watching its new parent (init) forever.
    raw = os.environ.get(PARENT_PID_VARIABLE, "")
    parent = int(raw) if raw.isdigit() else os.getppid()

    def watch() -> None:
        while not stopped.is_set():
            if os.getppid() != parent:
                stop()
                return
            stopped.wait(0.5)

    threading.Thread(target=watch, name="demo-parent-watch", daemon=True).start()


def simulator_main(argv: list[str]) -> int:
    """``outbox-simulator serve ARGS...`` that stops (SIGTERM to itself) when the demo is
    gone."""
    from consumer.jobs.simulator import main

    _watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM), threading.Event())
    return main(["serve", *argv])


if __name__ == "__main__":  # python -m relay.demo_app simulator ARGS...
    if sys.argv[1:2] != ["simulator"]:
        print("usage: python -m relay.demo_app simulator [serve flags...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(simulator_main(sys.argv[2:]))
