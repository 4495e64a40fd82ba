"""OpenTelemetry for the tracing tests: the SDK's in-memory exporter installed as the global
tracer provider for one test (and removed after it, so other tests run without an SDK)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


class Spans:
    """The spans finished so far, with the lookups the tests need."""

    def __init__(self, exporter: InMemorySpanExporter) -> None:
        self.exporter = exporter

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name.startswith(prefix)]

    def one(self, prefix: str) -> ReadableSpan:
        found = self.named(prefix)
        assert len(found) == 1, [s.name for s in self.all()]
        return found[0]

    def clear(self) -> None:
        self.exporter.clear()


def _reset_global_provider() -> None:
    # The API lets a process set its provider once; a test that installs one must be able to
    # take it away again (what opentelemetry's own test utilities do).
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = None  # type: ignore[attr-defined]


@pytest.fixture
def spans() -> Iterator[Spans]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_global_provider()
    trace.set_tracer_provider(provider)
    yield Spans(exporter)
    provider.shutdown()
    _reset_global_provider()


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def ids(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


def traceparent_ids(value: str) -> tuple[int, int]:
    """(trace id, span id) of a W3C traceparent header."""
    version, trace_id, span_id, _flags = value.split("-")
    assert version == "00"
    return int(trace_id, 16), int(span_id, 16)


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})
