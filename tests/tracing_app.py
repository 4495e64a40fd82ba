"""The applications of the tracing test across processes (tests/test_tracing_processes.py):
``outbox-consumer run tests.tracing_app:consumer`` enqueues a job per quote, ``outbox-worker
run tests.tracing_app:worker`` dispatches it to the connector simulator at $SIM_URL, and
``python tests/tracing_app.py DATABASE_URL N`` is the domain process that approves N quotes,
each in a span of its own. The stream is $TRACING_STREAM, the jobs' database
$TRACING_DATABASE_URL."""

from __future__ import annotations

import os
import sys

from consumer import Consumer, ConsumerConfig
from consumer.consumer import ConsumerTx
from consumer.event import ConsumedEvent
from consumer.jobs.http import HttpProvider
from consumer.jobs.store import Store
from consumer.jobs.worker import JobContext, Worker

TOPIC = "quote.approved"


def consumer() -> Consumer:
    built = Consumer(
        group="billing",
        streams=[os.environ["TRACING_STREAM"]],
        config=ConsumerConfig(block_ms=100),
    )
    store = Store(os.environ["TRACING_DATABASE_URL"])

    @built.handler(TOPIC)
    def on_quote(event: ConsumedEvent, tx: ConsumerTx) -> None:
        store.enqueue("studio", f"send-{event.subject}", kind="send", session=tx.session)

    return built


def worker() -> Worker:
    url = os.environ["SIM_URL"]
    provider = HttpProvider("sim", f"{url}/send", lookup_url=f"{url}/lookup/{{operation_id}}")
    built = Worker(providers={"sim": provider}, batch_size=10, poll_interval=0.05)

    @built.handler("send")
    def send(job: JobContext) -> None:
        job.dispatch("email", "sim", {"quote": job.action})

    return built


def approve_quotes(url: str, count: int) -> None:
    """The domain: each quote approved in its own span, the event emitted in its transaction."""
    from opentelemetry import trace

    from outbox import Outbox, tracing

    outbox = Outbox(url)
    outbox.create_schema()
    Store(url).create_schema()
    tracer = trace.get_tracer("domain")
    for n in range(count):
        with tracer.start_as_current_span("approve quote"), outbox.transaction() as tx:
            tx.emit(TOPIC, key=f"q-{n}", payload={"total": 100 + n})
    tracing.flush()


if __name__ == "__main__":
    approve_quotes(sys.argv[1], int(sys.argv[2]))
