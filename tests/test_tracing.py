"""OpenTelemetry (issue 23, ``outbox.tracing``), in one process with the SDK's in-memory
exporter, on PostgreSQL and SQLite: one event's trace from the domain span through the
relay's publish (a link), the consumer's process span, the job's run span and the dispatch's
client span to the provider's request (a real HTTP provider, the connector simulator, which
records the ``traceparent`` it received); a duplicate's span says so; a retried dispatch is
in the same trace. Also: what the rows and entries carry, the logs, the migration, and the
toolkit without opentelemetry installed at all."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from consumer import Consumer, ConsumerConfig
from consumer.consumer import ConsumerTx
from consumer.event import ConsumedEvent
from consumer.jobs.http import HttpProvider
from consumer.jobs.store import Store
from consumer.jobs.worker import JobContext, Worker
from outbox import Outbox, tracing
from outbox.codec import decode, encode_entry
from outbox.db import make_engine
from outbox.logs import JsonFormatter
from relay import Relay, RelayConfig
from relay.redis.publisher import RedisStreamPublisher
from tests.services import wait_for
from tests.simulator_support import SimulatorProcess
from tests.tracing_support import Spans, attributes, ids, parent_id, spans, traceparent_ids

# The fast tier (`pytest -m "not slow"`) stays under 2 minutes: these start processes,
# clusters or servers, and run in the whole suite (CI) only.
pytestmark = pytest.mark.slow

__all__ = ["spans"]  # the fixture, imported for this module

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "quote.approved"
CALL_TIMEOUT = 2.0


@pytest.fixture
def simulator(tmp_path: Path) -> Iterator[SimulatorProcess]:
    with SimulatorProcess(tmp_path / "simulator.db") as sim:
        yield sim


class Pipeline:
    """The whole path in this process: an outbox, a relay, a consumer that enqueues a job
    per event, a worker whose handler dispatches to the simulator."""

    def __init__(
        self, db_url: str, redis_url: str, client: redis.Redis, prefix: str, sim: SimulatorProcess
    ) -> None:
        self.outbox = Outbox(db_url)
        self.outbox.create_schema()
        self.store = Store(db_url)
        template = f"{prefix}.{{topic}}"
        self.relay = Relay(
            self.outbox, RedisStreamPublisher(client, template), RelayConfig(publish_deadline=5)
        )
        self.consumer = Consumer(
            db_url,
            redis_url,
            group="billing",
            topics=[TOPIC],
            stream=template,
            config=ConsumerConfig(block_ms=50),
        )
        store = self.store

        @self.consumer.handler(TOPIC)
        def on_quote(event: ConsumedEvent, tx: ConsumerTx) -> None:
            store.enqueue(
                event.tenant or "t", f"send-{event.subject}", kind="send", session=tx.session
            )

        provider = HttpProvider(
            "sim", sim.send_url, lookup_url=sim.lookup_url, timeout=CALL_TIMEOUT
        )
        self.worker = Worker(store, providers={"sim": provider}, batch_size=10)

        @self.worker.handler("send")
        def send(job: JobContext) -> None:
            job.dispatch("email", "sim", {"quote": job.action})

    def emit(self, key: str, identity: str | None = None) -> str:
        tracer = trace.get_tracer("domain")
        with tracer.start_as_current_span("approve quote"), self.outbox.transaction() as tx:
            return tx.emit(TOPIC, key=key, payload={"total": 120}, identity=identity)

    def close(self) -> None:
        self.consumer.engine.dispose()
        self.store.dispose()
        self.outbox.engine.dispose()


@pytest.fixture
def pipeline(
    db_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    stream_prefix: str,
    simulator: SimulatorProcess,
) -> Iterator[Pipeline]:
    made = Pipeline(db_url, redis_url, redis_client, stream_prefix, simulator)
    yield made
    made.close()


def _row_headers(outbox: Outbox, event_id: str) -> dict[str, str]:
    with outbox.engine.connect() as conn:
        raw = conn.execute(
            sa.select(outbox.table.c.headers).where(outbox.table.c.event_id == event_id)
        ).scalar_one()
    return dict(json.loads(raw) if isinstance(raw, str) else raw)


def test_one_event_is_one_trace_from_the_domain_span_to_the_providers_request(
    spans: Spans, pipeline: Pipeline, simulator: SimulatorProcess, redis_client: redis.Redis
) -> None:
    event_id = pipeline.emit("q-1")
    domain = spans.one("approve quote")
    trace_id, domain_span = ids(domain)
    # The event row carries the domain span's context.
    headers = _row_headers(pipeline.outbox, event_id)
    assert traceparent_ids(headers["traceparent"]) == (trace_id, domain_span)

    assert pipeline.relay.run_once() == 1
    publish = spans.one("publish ")
    assert publish.name == f"publish {TOPIC}" and publish.kind is SpanKind.PRODUCER
    assert publish.parent is None  # its own trace: a batch serves many
    assert [(link.context.trace_id, link.context.span_id) for link in publish.links] == [
        (trace_id, domain_span)
    ]
    assert attributes(publish)["messaging.system"] == "redis"
    assert attributes(publish)["messaging.batch.message_count"] == 1
    assert attributes(publish)["messaging.operation"] == "publish"
    # The stream entry carries the event's context, as a CloudEvents attribute.
    [(_, entry)] = redis_client.xrange(attributes(publish)["messaging.destination.name"])
    assert traceparent_ids(entry[b"traceparent"].decode()) == (trace_id, domain_span)

    assert pipeline.consumer.run_once(block=False) == 1
    process = spans.one("process ")
    assert process.name == f"process {TOPIC}" and process.kind is SpanKind.CONSUMER
    assert ids(process)[0] == trace_id and parent_id(process) == domain_span
    process_attributes = attributes(process)
    assert process_attributes["outbox.inbox.decision"] == "handled"
    assert process_attributes["outbox.event.id"] == event_id
    assert process_attributes["outbox.key"] == "q-1"
    assert process_attributes["messaging.consumer.group.name"] == "billing"
    assert process_attributes["messaging.message.id"] == entry_id_of(redis_client, publish)
    # The job row keeps the process span's context.
    job = pipeline.store.get("t", "send-q-1")
    assert job.trace_context is not None
    carried = json.loads(job.trace_context)["traceparent"]
    assert traceparent_ids(carried) == ids(process)

    assert pipeline.worker.run_once() == 1
    run = spans.one("run ")
    assert run.name == "run send" and ids(run)[0] == trace_id
    assert parent_id(run) == ids(process)[1]
    assert attributes(run)["outbox.job.id"] == job.id
    assert attributes(run)["outbox.job.outcome"] == "done"
    dispatch = spans.one("dispatch ")
    assert dispatch.name == "dispatch sim" and dispatch.kind is SpanKind.CLIENT
    assert ids(dispatch)[0] == trace_id and parent_id(dispatch) == ids(run)[1]
    assert attributes(dispatch)["outbox.operation.id"] == f"{job.id}:email"
    assert attributes(dispatch)["outbox.receipt.state"] == "ACCEPTED"
    assert attributes(dispatch)["outbox.provider"] == "sim"
    # The provider received the dispatch span's context.
    [effect] = simulator.effects()
    assert traceparent_ids(effect["headers"]["traceparent"]) == ids(dispatch)


def entry_id_of(client: redis.Redis, publish: Any) -> str:
    [(entry_id, _)] = client.xrange(attributes(publish)["messaging.destination.name"])
    return str(entry_id.decode())


def test_an_async_handlers_dispatch_continues_the_run_span(
    spans: Spans, pipeline: Pipeline, simulator: SimulatorProcess
) -> None:
    """``async def`` handlers and ``adispatch`` (the plan's parts in other threads, its steps
    on the loop) keep the trace: the provider's async request carries the dispatch span."""
    pipeline.emit("q-6")
    assert pipeline.relay.run_once() == 1
    assert pipeline.consumer.run_once(block=False) == 1

    @pipeline.worker.handler("send")
    async def send(job: JobContext) -> None:
        await job.adispatch("email", "sim", {"quote": job.action})

    assert pipeline.worker.run_once() == 1
    process, run, dispatch = spans.one("process "), spans.one("run "), spans.one("dispatch ")
    assert parent_id(run) == ids(process)[1] and parent_id(dispatch) == ids(run)[1]
    assert attributes(dispatch)["outbox.receipt.state"] == "ACCEPTED"
    [effect] = simulator.effects()
    assert traceparent_ids(effect["headers"]["traceparent"]) == ids(dispatch)


def test_a_duplicate_events_span_says_so(
    spans: Spans, pipeline: Pipeline, redis_client: redis.Redis
) -> None:
    first = pipeline.emit("q-2", identity="studio:send-q-2")
    again = pipeline.emit("q-2", identity="studio:send-q-2")
    assert pipeline.relay.run_once() == 2
    assert pipeline.consumer.run_once(block=False) == 2
    by_event = {attributes(s)["outbox.event.id"]: s for s in spans.named("process ")}
    assert attributes(by_event[first])["outbox.inbox.decision"] == "handled"
    assert attributes(by_event[again])["outbox.inbox.decision"] == "duplicate"
    # Each in its own event's trace.
    domains = spans.named("approve quote")
    assert {ids(s)[0] for s in domains} == {ids(s)[0] for s in by_event.values()}
    # The duplicate enqueued nothing: one job.
    assert pipeline.store.counts()["READY"] == 1


@pytest.mark.slow  # the simulator process and a retried dispatch (~8 s under load)
def test_a_retried_dispatch_is_in_the_same_trace(
    spans: Spans, pipeline: Pipeline, simulator: SimulatorProcess
) -> None:
    pipeline.emit("q-3")
    trace_id = ids(spans.one("approve quote"))[0]
    assert pipeline.relay.run_once() == 1
    assert pipeline.consumer.run_once(block=False) == 1
    # The provider acts, then the connection is reset: the outcome is unknown.
    simulator.faults({"kind": "reset", "count": 1})
    assert pipeline.worker.run_once() == 1
    simulator.faults()
    job = pipeline.store.get("t", "send-q-3")
    assert job.state == "READY"
    operation_id = f"{job.id}:email"
    receipt = pipeline.worker.operations.receipt(operation_id)  # type: ignore[union-attr]
    assert receipt is not None and receipt.state == "UNKNOWN"

    def deadline_passed() -> bool:
        with pipeline.store.driver.connect() as conn:
            clock = pipeline.store.driver.clock_read(conn, None)
        return clock > float(receipt.call_deadline or 0)

    wait_for(deadline_passed, "the first call's deadline to pass", timeout=30)
    # The retry, past its backoff: the lookup finds the first call's effect.
    assert pipeline.worker.run_once(now=10**10) == 1
    assert pipeline.store.get(job.id).state == "DONE"
    runs = spans.named("run ")
    dispatches = spans.named("dispatch ")
    [reconcile] = spans.named("reconcile ")
    assert len(runs) == 2 and len(dispatches) == 2
    everything = [*runs, *dispatches, reconcile]
    assert {ids(s)[0] for s in everything} == {trace_id}
    process = spans.one("process ")
    assert {parent_id(r) for r in runs} == {ids(process)[1]}  # both attempts continue it
    first, second = sorted(dispatches, key=lambda s: s.start_time or 0)
    assert attributes(first)["outbox.receipt.state"] == "UNKNOWN"
    assert first.status.status_code is trace.StatusCode.ERROR
    assert attributes(second)["outbox.receipt.state"] == "ACCEPTED"
    assert parent_id(reconcile) == ids(second)[1]  # the lookup of the first call
    assert sorted(attributes(r)["outbox.job.attempt"] for r in runs) == [1, 2]
    [effect] = simulator.effects()  # one effect, sent under the first dispatch's context
    assert traceparent_ids(effect["headers"]["traceparent"]) == ids(first)


@pytest.mark.slow  # the simulator process and a reconciling worker (~13 s under load)
def test_the_reconciliation_sweep_is_a_span_in_the_jobs_trace(
    spans: Spans, pipeline: Pipeline, simulator: SimulatorProcess
) -> None:
    pipeline.emit("q-4")
    assert pipeline.relay.run_once() == 1
    assert pipeline.consumer.run_once(block=False) == 1
    simulator.faults({"kind": "reset", "count": 1})
    assert pipeline.worker.run_once() == 1
    simulator.faults()
    job = pipeline.store.get("t", "send-q-4")
    operations = pipeline.worker.operations
    assert operations is not None
    receipt = operations.receipt(f"{job.id}:email")
    assert receipt is not None

    def settled() -> bool:
        return operations.reconcile().accepted == 1

    wait_for(settled, "the sweep to settle the receipt", timeout=30)
    [reconcile] = spans.named("reconcile ")
    process = spans.one("process ")
    assert ids(reconcile)[0] == ids(process)[0] and parent_id(reconcile) == ids(process)[1]
    assert attributes(reconcile)["outbox.operation.id"] == f"{job.id}:email"
    assert attributes(reconcile)["outbox.receipt.state"] == "ACCEPTED"


@pytest.mark.slow  # the simulator process and the whole pipeline (~10 s under load)
def test_without_an_sdk_the_context_still_travels_through_the_job(
    pipeline: Pipeline, simulator: SimulatorProcess
) -> None:
    """No SDK in these processes (the API's no-op provider): no span is recorded, but the
    context an upstream process wrote on the event reaches the job row and the provider."""
    assert not tracing.recording()
    upstream = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with pipeline.outbox.transaction() as tx:
        tx.emit(TOPIC, key="q-5", payload={}, headers={"traceparent": upstream})
    assert pipeline.relay.run_once() == 1
    assert pipeline.consumer.run_once(block=False) == 1
    job = pipeline.store.get("t", "send-q-5")
    assert json.loads(job.trace_context or "{}")["traceparent"] == upstream
    assert pipeline.worker.run_once() == 1
    [effect] = simulator.effects()
    assert effect["headers"]["traceparent"] == upstream


def test_emit_keeps_an_explicit_traceparent_and_adds_the_active_spans_otherwise(
    spans: Spans, sqlite_url: str
) -> None:
    box = Outbox(sqlite_url)
    box.create_schema()
    given = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with trace.get_tracer("t").start_as_current_span("domain") as span, box.transaction() as tx:
        explicit = tx.emit("t", key="k", payload=1, headers={"traceparent": given, "a": "b"})
        implicit = tx.emit("t", key="k", payload=2)
    assert _row_headers(box, explicit) == {"traceparent": given, "a": "b"}
    assert traceparent_ids(_row_headers(box, implicit)["traceparent"]) == (
        span.get_span_context().trace_id,
        span.get_span_context().span_id,
    )
    with box.transaction() as tx:  # no active span: nothing added
        bare = tx.emit("t", key="k", payload=3)
    with box.engine.connect() as conn:
        stored = conn.execute(
            sa.select(box.table.c.headers).where(box.table.c.event_id == bare)
        ).scalar_one()
    assert stored is None
    box.engine.dispose()


def test_the_entry_carries_tracestate_as_an_attribute_and_gives_it_back() -> None:
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    headers["tracestate"] = "vendor=abc"
    fields = encode_entry("t", {"a": 1}, event_id="e1", headers={**headers, "x": "y"})
    assert fields["tracestate"] == "vendor=abc" and fields["header.x"] == "y"
    assert "header.tracestate" not in fields
    decoded = decode({k.encode(): v.encode() for k, v in fields.items()})
    assert decoded.headers == {**headers, "x": "y"}


def test_json_logs_carry_the_active_spans_ids(spans: Spans) -> None:
    formatter = JsonFormatter()

    def line() -> dict[str, Any]:
        record = logging.LogRecord("outbox", logging.INFO, __file__, 1, "hello", None, None)
        return dict(json.loads(formatter.format(record)))

    assert "trace_id" not in line() and "span_id" not in line()
    with trace.get_tracer("t").start_as_current_span("work") as span:
        entry = line()
    context = span.get_span_context()
    assert entry["trace_id"] == f"{context.trace_id:032x}"
    assert entry["span_id"] == f"{context.span_id:016x}"


def test_a_jobs_table_from_before_tracing_gains_the_trace_context_column(db_url: str) -> None:
    engine = make_engine(db_url)
    Store(engine).create_schema()
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox_jobs DROP COLUMN trace_context"))
    assert "trace_context" not in {c["name"] for c in sa.inspect(engine).get_columns("outbox_jobs")}
    store = Store(engine)
    store.create_schema()
    assert "trace_context" in {c["name"] for c in sa.inspect(engine).get_columns("outbox_jobs")}
    store.enqueue("t", "a")
    assert store.get("t", "a").trace_context is None
    engine.dispose()


HIDE_OPENTELEMETRY = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Hide())
"""

WITHOUT_OPENTELEMETRY = (
    HIDE_OPENTELEMETRY
    + """
import json, logging, sys
from outbox import Outbox, tracing
from outbox.codec import decode
from outbox.logs import JsonFormatter
from consumer.jobs.store import Store

assert tracing.AVAILABLE is False and not tracing.recording()
box = Outbox(sys.argv[1])
box.create_schema()
with box.transaction() as tx:
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    tx.emit("t", key="k", payload=1, headers={"traceparent": parent})
store = Store(sys.argv[1])
store.create_schema()
store.enqueue("t", "job-1")
lease = store.claim_next("w")
assert lease is not None and lease.trace_context is None
with tracing.running(lease), tracing.dispatching(lease, "1:x", "p", "x"):
    pass
tracing.flush()
record = logging.LogRecord("outbox", logging.INFO, "x.py", 1, "hi", None, None)
assert "trace_id" not in json.loads(JsonFormatter().format(record))
assert "opentelemetry" not in sys.modules
print("ok")
"""
)


def test_the_toolkit_works_without_opentelemetry_installed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_OPENTELEMETRY, url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
