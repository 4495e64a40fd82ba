"""One trace per quote across real processes (issue 23): a domain process, ``outbox-relay
run``, ``outbox-consumer run`` and ``outbox-worker run``, each under the standard agent
(``opentelemetry-instrument``, configured by ``OTEL_*`` variables only), export OTLP over
HTTP to a receiver in this test that decodes the protobuf; the connector simulator (a real
HTTP provider) records the ``traceparent`` of every request it receives. For every quote:
one trace id from the domain span to the provider's request. The spans are exported by a
batch processor whose schedule is longer than the test: only the flush at exit (SIGTERM,
drained) gets them out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import wait_for
from tests.simulator_support import SimulatorProcess
from tests.tracing_support import OtlpReceiver

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
QUOTES = 12


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    made = OtlpReceiver()
    yield made
    made.close()


def otel_env(receiver: OtlpReceiver, service: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OTEL_SERVICE_NAME": service,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        # Longer than the test: the spans leave only through the flush at exit.
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "OTEL_BSP_MAX_QUEUE_SIZE": "20000",
        **extra,
    }


def instrumented(*command: str) -> list[str]:
    return [str(BIN / "opentelemetry-instrument"), *command]


@pytest.mark.slow
def test_every_quote_is_one_trace_from_the_domain_span_to_the_providers_request(
    pg_url: str,
    redis_url: str,
    stream_prefix: str,
    receiver: OtlpReceiver,
    tmp_path: Path,
) -> None:
    stream = f"{stream_prefix}.outbox.quote.approved"
    template = f"{stream_prefix}.outbox.{{topic}}"
    with SimulatorProcess(tmp_path / "simulator.db") as simulator:
        app = {"TRACING_STREAM": stream, "TRACING_DATABASE_URL": pg_url, "SIM_URL": simulator.url}
        domain = subprocess.run(
            instrumented(sys.executable, str(ROOT / "tests" / "tracing_app.py"), pg_url, "12"),
            cwd=ROOT,
            env=otel_env(receiver, "domain", **app),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert domain.returncode == 0, domain.stderr[-3000:]
        common = ["--database-url", pg_url, "--redis-url", redis_url]
        commands = {
            "relay": instrumented(str(BIN / "outbox-relay"), "run", *common, "--stream", template),
            "consumer": instrumented(
                str(BIN / "outbox-consumer"), "run", "tests.tracing_app:consumer", *common
            ),
            "worker": instrumented(
                str(BIN / "outbox-worker"), "run", "tests.tracing_app:worker", *common[:2]
            ),
        }
        processes: dict[str, subprocess.Popen[str]] = {}
        worker_log = ""
        try:
            for service, command in commands.items():
                processes[service] = subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=otel_env(receiver, service, **app),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            wait_for(lambda: len(simulator.effects()) >= QUOTES, "every quote sent", timeout=120)
            assert not receiver.of("relay") and not receiver.of("worker")  # still buffered
            for proc in processes.values():
                proc.send_signal(signal.SIGTERM)
            for service, proc in processes.items():
                _, stderr = proc.communicate(timeout=60)
                assert proc.returncode == 0, f"{service}: {stderr[-3000:]}"
                if service == "worker":
                    worker_log = stderr
        finally:
            for proc in processes.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        effects = simulator.effects()

    domains = receiver.of("domain", "approve quote")
    assert len(domains) == QUOTES
    domain_traces = {s.trace_id for s in domains}
    assert len(domain_traces) == QUOTES  # a trace per quote
    # The relay's publish spans are traces of their own, linked to every quote's domain span.
    publishes = receiver.of("relay", "publish ")
    assert publishes and all(s.attributes["messaging.system"] == "redis" for s in publishes)
    linked = {link for s in publishes for link in s.links}
    assert {(s.trace_id, s.span_id) for s in domains} <= linked
    assert not domain_traces & {s.trace_id for s in publishes}
    # Consumer, worker and the provider's request: all in the quote's trace, parent to child.
    by_id = {s.span_id: s for s in receiver.spans}
    processes_ = receiver.of("consumer", "process ")
    assert len(processes_) == QUOTES
    for process in processes_:
        assert by_id[process.parent_span_id].name == "approve quote"
        assert process.attributes["outbox.inbox.decision"] == "handled"
    # A run span per claim. On a loaded machine a job may be claimed more than once (handed
    # back by its provider's adaptive limit, a call that timed out and is looked up by the
    # next run, a finish lost to a database error and run again, its receipt found): every
    # claim is in the quote's trace and says how it ended, and every job has one done.
    runs = receiver.of("worker", "run ")
    outcomes = Counter(str(run.attributes.get("outbox.job.outcome")) for run in runs)
    done = {
        run.attributes["outbox.job.id"]
        for run in runs
        if run.attributes.get("outbox.job.outcome") == "done"
    }
    assert len(done) == QUOTES, (outcomes, worker_log[-3000:])
    assert "None" not in outcomes, (outcomes, worker_log[-3000:])  # every run says how it ended
    for run in runs:
        assert by_id[run.parent_span_id].name.startswith("process ")
    dispatches = receiver.of("worker", "dispatch ")
    accepted = Counter(
        d.attributes["outbox.job.id"]
        for d in dispatches
        if d.attributes.get("outbox.receipt.state") == "ACCEPTED"
    )
    assert set(accepted) == done, (accepted, worker_log[-3000:])  # one effect each: below
    for dispatch in dispatches:
        assert by_id[dispatch.parent_span_id].name.startswith("run ")
    assert len(effects) == QUOTES
    for effect in effects:
        _, trace_id, span_id, _ = effect["headers"]["traceparent"].split("-")
        sender = by_id[span_id]
        assert sender.name == "dispatch sim" and sender.trace_id == trace_id
        chain = [sender]
        while chain[-1].parent_span_id:
            chain.append(by_id[chain[-1].parent_span_id])
        assert [s.service for s in chain] == ["worker", "worker", "consumer", "domain"]
        assert {s.trace_id for s in chain} == {trace_id}
    assert {effect["headers"]["traceparent"].split("-")[1] for effect in effects} == domain_traces
