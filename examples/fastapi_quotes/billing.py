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

from consumer import (
    ConsumedEvent,
    Consumer,
    ConsumerConfig,
    JobContext,
    Store,
    Worker,
    WorkerConfig,
)
from outbox import default_database_url, setup_logging
from relay import GracefulStop


def main() -> None:
    setup_logging(os.environ.get("QUOTES_LOG_LEVEL", "info"))
    database_url = os.environ.get("QUOTES_DATABASE_URL") or default_database_url()
    store = Store(database_url)
    consumer = Consumer(
        store.engine,
        os.environ.get("QUOTES_REDIS_URL") or None,  # None: the embedded Redis
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
    store.dispose()


if __name__ == "__main__":
    main()
