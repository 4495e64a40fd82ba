"""The back office: a consumer turns each "quote.approved" into one "send the quote" job
(deduplicated by the event's identity in the inbox, in the same transaction), and a worker
runs those jobs. One process, two threads; SIGTERM/SIGINT stops both cleanly.

Settings from the environment (run.py sets them): QUOTES_DATABASE_URL, QUOTES_REDIS_URL
(default: the embedded Redis), QUOTES_STREAM (default outbox.{topic}), QUOTES_GROUP.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from consumer.consumer import Consumer, ConsumerConfig
from consumer.event import ConsumedEvent
from consumer.jobs.store import Store
from consumer.jobs.worker import JobContext, Worker, WorkerConfig
from outbox.db import default_database_url
from outbox.lifecycle import GracefulStop
from outbox.logs import setup_logging
from outbox.redis_client import redis_client


def main() -> None:
    setup_logging(os.environ.get("QUOTES_LOG_LEVEL", "info"))
    database_url = os.environ.get("QUOTES_DATABASE_URL") or default_database_url()
    client = redis_client(os.environ.get("QUOTES_REDIS_URL") or None)
    store = Store(database_url)
    consumer = Consumer(
        store.engine,
        client,
        group=os.environ.get("QUOTES_GROUP", "billing"),
        topics=["quote.approved"],
        stream=os.environ.get("QUOTES_STREAM", "outbox.{topic}"),
        config=ConsumerConfig(block_ms=200, batch_size=100),
    )

    @consumer.handler("quote.approved")
    def on_quote_approved(event: ConsumedEvent, tx: Any) -> None:
        store.enqueue(
            event.tenant or "-",
            f"send-quote-{event.data['quote']}",
            subject=event.subject,
            payload=event.data,
            session=tx.session,  # same transaction as the inbox row: one job per quote
        )

    worker = Worker(store, config=WorkerConfig(poll_interval=0.1, batch_size=20))

    @worker.handler("send-quote")
    def send_quote(job: JobContext) -> None:
        print(f"sending quote {job.payload['quote']} ({job.payload['total']} EUR)", flush=True)

    consumer.create_schema()
    stop = GracefulStop().install()
    reader = threading.Thread(target=consumer.run, args=(stop.event,), daemon=True)
    working = threading.Thread(target=worker.run, kwargs={"install_signals": False}, daemon=True)
    reader.start()
    working.start()
    stop.event.wait()
    worker.stop()
    reader.join(timeout=10)
    working.join(timeout=10)
    client.close()
    store.dispose()


if __name__ == "__main__":
    main()
