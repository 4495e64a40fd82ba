"""The application of the cluster end-to-end test: ``outbox-consumer run cluster_app:consumer``
and ``outbox-worker run cluster_app:worker`` (tests/ on PYTHONPATH), configured by
environment variables:

- ``CLUSTER_APP_STREAM``: the stream template (hash-tagged: ``prefix.{{{topic}}}``),
- ``CLUSTER_APP_TOPICS``: comma-separated topics (streams in different slots),
- ``CLUSTER_APP_EFFECTS``: the file the worker appends one line per job to (the "provider").

The consumer turns each business identity into one job (``notify-<identity>``) in the inbox
transaction; the worker performs it by appending the identity to the effects file. A
duplicate effect shows up as a repeated line.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from consumer import Consumer, ConsumerConfig, Store, Worker
from consumer.consumer import ConsumerTx
from consumer.event import ConsumedEvent
from consumer.jobs.worker import JobContext

_stores: dict[int, Store] = {}
_lock = threading.Lock()


def _store_for(tx: ConsumerTx) -> Store:
    engine: Any = tx.session.get_bind()
    with _lock:
        store = _stores.get(id(engine))
        if store is None:
            store = _stores[id(engine)] = Store(engine)
    return store


def consumer() -> Consumer:
    app = Consumer(
        group="cluster-app",
        topics=os.environ["CLUSTER_APP_TOPICS"].split(","),
        stream=os.environ["CLUSTER_APP_STREAM"],
        config=ConsumerConfig(block_ms=100, batch_size=100, maintenance_interval_seconds=0.5),
    )

    def on_event(event: ConsumedEvent, tx: ConsumerTx) -> None:
        action = f"notify-{event.identity}"
        _store_for(tx).enqueue(
            event.tenant or "-", action, subject=event.subject, session=tx.session
        )

    for topic in os.environ["CLUSTER_APP_TOPICS"].split(","):
        app.add_handler(topic, on_event)
    return app


def worker() -> Worker:
    app = Worker(batch_size=20, poll_interval=0.05)

    @app.handler("notify")
    def notify(job: JobContext) -> None:
        with open(os.environ["CLUSTER_APP_EFFECTS"], "a") as handle:
            handle.write(job.action.removeprefix("notify-") + "\n")

    return app
