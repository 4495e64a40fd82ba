"""A consumer application for the subprocess tests (``outbox-consumer run consumer_app:build``
with the tests directory on PYTHONPATH), configured from environment variables:

- ``CONSUMER_APP_STREAM``: the stream to read (required),
- ``CONSUMER_APP_CLAIM_IDLE_MS`` / ``CONSUMER_APP_MAX_DELIVERIES``: ConsumerConfig values,
- ``CONSUMER_APP_FAIL_IDENTITY``: an identity whose handler raises (a poison message),
- ``CONSUMER_APP_HANG_IDENTITY``: an identity whose handler never returns (a process to
  kill mid-batch).

The database and Redis come from the CLI's ``--database-url`` / ``--redis-url``. The handler
inserts one row per event into ``consumer_app_jobs`` (no unique constraint: a duplicate
effect would show as a second row).
"""

from __future__ import annotations

import os
import threading

from sqlalchemy import Column, Integer, MetaData, String, Table, insert

from consumer import Consumer
from consumer.consumer import ConsumerConfig, ConsumerTx
from consumer.event import ConsumedEvent

metadata = MetaData()
jobs = Table(
    "consumer_app_jobs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("identity", String(200), nullable=False),
    Column("event_id", String(64), nullable=False),
    Column("worker", String(200), nullable=False),
)


def build() -> Consumer:
    config = ConsumerConfig(
        claim_idle_ms=int(os.environ.get("CONSUMER_APP_CLAIM_IDLE_MS", "30000")),
        max_deliveries=int(os.environ.get("CONSUMER_APP_MAX_DELIVERIES", "5")),
        block_ms=200,
        maintenance_interval_seconds=0.5,
    )
    consumer = Consumer(group="app", streams=[os.environ["CONSUMER_APP_STREAM"]], config=config)
    fail = os.environ.get("CONSUMER_APP_FAIL_IDENTITY")
    hang = os.environ.get("CONSUMER_APP_HANG_IDENTITY")

    @consumer.handler("job.requested")
    def on_job(event: ConsumedEvent, tx: ConsumerTx) -> None:
        if fail is not None and event.identity == fail:
            raise RuntimeError(f"cannot handle {event.identity}")
        if hang is not None and event.identity == hang:
            threading.Event().wait()  # nothing sets it: hung until the test kills us
        tx.session.execute(
            insert(jobs).values(identity=event.identity, event_id=event.id, worker=str(os.getpid()))
        )

    return consumer
