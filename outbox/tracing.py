"""OpenTelemetry tracing: one trace from the domain transaction to the provider's request.

Every piece of the toolkit's tracing is here; the rest of the code calls these functions at
the places where a trace has to cross something (a row, a stream entry, a process, an HTTP
call). The library depends on ``opentelemetry-api`` only, as an extra
(``pip install 'outbox-toolkit[otel]'``); the SDK and the exporter are the application's
choice (``opentelemetry-instrument`` configures both from the ``OTEL_*`` variables).

Three modes, decided per call, so a provider installed after import is picked up:

* **No opentelemetry-api installed.** Every function returns at its first line: a flag test.
* **The API without a configured SDK** (the global tracer provider is the API's proxy or its
  no-op one). No span is created, but a context that arrived with an event or a job is
  passed on: the consumer makes the event's context current while its handler runs, so the
  job it enqueues keeps the trace, and a worker makes the job's context current, so the
  provider's request carries it. A process without an SDK does not break the trace.
* **An SDK provider.** Spans, following the messaging semantic conventions
  (``messaging.system``, ``messaging.destination.name``, ``messaging.message.id``,
  ``messaging.operation``) plus the toolkit's own ``outbox.*`` attributes:

  =========================  ===========  =================================================
  span (bounded name)        kind         parent, links
  =========================  ===========  =================================================
  ``publish {topic}``        PRODUCER     a new trace per relay batch, LINKED to the context
                                          of every event in it (a batch serves many traces)
  ``process {topic}``        CONSUMER     the event's context (from the stream entry): the
                                          inbox decision is ``outbox.inbox.decision``
                                          (``handled``, ``duplicate``, ``failed``)
  ``run {handler}``          CONSUMER     the job's context (its row's ``trace_context``,
                                          recorded when the job was enqueued)
  ``dispatch {provider}``    CLIENT       the run span; ``outbox.receipt.state`` is the
                                          receipt recorded; ``HttpProvider`` sends its
                                          context as ``traceparent``
  ``reconcile {provider}``   INTERNAL     the job's context: an earlier call's lookup inside
                                          a dispatch, or the reconciliation sweep
  =========================  ===========  =================================================

  Span names carry only bounded values (topics, handler and provider names); keys, tenants,
  identities and ids are attributes.

What travels, and where (W3C trace context, always, whatever ``OTEL_PROPAGATORS`` says: the
formats below are the toolkit's):

* the event row: the ``traceparent`` and ``tracestate`` headers, taken from the active span
  at ``emit`` unless the caller set ``traceparent`` itself;
* the stream entry: ``traceparent`` and ``tracestate`` as CloudEvents attributes
  (the distributed tracing extension), from the row's headers;
* the job row: the ``trace_context`` column, JSON ``{"traceparent": ..., "tracestate": ...}``.

The HTTP request to a provider uses the global propagator (``OTEL_PROPAGATORS``, W3C trace
context and baggage by default), as every HTTP client instrumentation does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from types import TracebackType
from typing import Any

try:  # the optional extra: everything below is a no-op without it
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _W3C: Any = TraceContextTextMapPropagator()
    _NO_SDK: tuple[type, ...] = (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider)
    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised by the test that hides the package
    AVAILABLE = False

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = (TRACEPARENT, TRACESTATE)
INSTRUMENTATION_NAME = "outbox-toolkit"
MESSAGING_SYSTEM = "redis"

_provider: Any = None
_tracer: Any = None


def _get_tracer() -> Any:
    """The toolkit's tracer when an SDK provider is installed, else None (cheap: one global
    read and an identity test per call; the provider may be set after import)."""
    global _provider, _tracer
    provider = _trace.get_tracer_provider()
    if provider is _provider:
        return _tracer
    if isinstance(provider, _NO_SDK):
        return None
    _provider, _tracer = provider, provider.get_tracer(INSTRUMENTATION_NAME, _version())
    return _tracer


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-toolkit")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return None


def recording() -> bool:
    """Whether spans are being recorded here (the API is installed and an SDK configured)."""
    return AVAILABLE and _get_tracer() is not None


# -- carrying the context -------------------------------------------------------------------


def _current_carrier() -> dict[str, str] | None:
    # Formatted here rather than through the propagator's inject (a few times cheaper, and
    # this runs per event and per job): the W3C format is fixed, version 00.
    span_context = _trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    carrier = {
        TRACEPARENT: f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{span_context.trace_flags:02x}"
    }
    if span_context.trace_state:
        carrier[TRACESTATE] = span_context.trace_state.to_header()
    return carrier


def add_trace_headers(headers: MutableMapping[str, str]) -> None:
    """``emit``: record the active span's context in the event's headers (``traceparent``,
    ``tracestate``), unless the caller set ``traceparent`` explicitly (theirs is kept)."""
    if not AVAILABLE or TRACEPARENT in headers:
        return
    carrier = _current_carrier()
    if carrier:
        headers.update(carrier)


def job_trace_context() -> str | None:
    """The ``trace_context`` of a job enqueued now: the active span's context as JSON."""
    if not AVAILABLE:
        return None
    carrier = _current_carrier()
    if carrier is None:
        return None
    if len(carrier) == 1:  # hex digits and dashes only: no escaping to do
        return f'{{"traceparent":"{carrier[TRACEPARENT]}"}}'
    return json.dumps(carrier, separators=(",", ":"))


def _extract(carrier: Mapping[str, str] | None) -> Any:
    """A Context holding the remote span context of ``carrier``, or None without one."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    ctx = _W3C.extract(carrier)
    return ctx if _trace.get_current_span(ctx).get_span_context().is_valid else None


def _job_carrier(trace_context: str | None) -> dict[str, str] | None:
    if not trace_context:
        return None
    try:
        value = json.loads(trace_context)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def inject_http(headers: MutableMapping[str, str]) -> None:
    """``HttpProvider``: the current context into a request's headers (global propagator)."""
    if AVAILABLE and _trace.get_current_span().get_span_context().is_valid:
        # Imported here: loading the configured propagators scans the installed packages'
        # entry points, a cost every process would pay at start for a provider call.
        from opentelemetry import propagate

        propagate.inject(headers)


def log_ids() -> tuple[str, str] | None:
    """``(trace_id, span_id)`` in hex of the active span, for log lines; None without one."""
    if not AVAILABLE:
        return None
    span_context = _trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"


def flush(timeout_seconds: float = 5.0) -> None:
    """Export the spans still buffered (a batch span processor's queue): the CLIs call it
    when they stop, on SIGTERM too, so the last batch's spans are not lost."""
    if not AVAILABLE:
        return
    force_flush = getattr(_trace.get_tracer_provider(), "force_flush", None)
    if callable(force_flush):
        force_flush(int(timeout_seconds * 1000))


# -- spans ----------------------------------------------------------------------------------


class _Noop:
    """What every span helper returns when nothing is to be recorded or carried."""

    __slots__ = ()

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set(self, name: str, value: Any) -> None:
        return None

    def rename(self, name: str) -> None:
        return None


_NOOP = _Noop()


class _Attached(_Noop):
    """No SDK: make a propagated context current (so what is written under it keeps the
    trace) without creating a span."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._token: Any = None

    def __enter__(self) -> _Attached:
        self._token = _otel_context.attach(self._ctx)
        return self

    def __exit__(self, *exc: object) -> None:
        _otel_context.detach(self._token)


class _Span:
    """A recording span made current for a ``with`` block; an exception escaping the block
    is recorded on it and sets its status to ERROR."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any) -> None:
        self._span = span
        self._token: Any = None

    def __enter__(self) -> _Span:
        self._token = _otel_context.attach(_trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self._span.record_exception(exc)
                self._span.set_status(_trace.Status(_trace.StatusCode.ERROR, repr(exc)[:300]))
        finally:
            _otel_context.detach(self._token)
            self._span.end()

    def set(self, name: str, value: Any) -> None:
        if value is not None:
            self._span.set_attribute(name, value)

    def rename(self, name: str) -> None:
        self._span.update_name(name)


def _attributes(**values: Any) -> dict[str, Any]:
    return {name.replace("__", "."): v for name, v in values.items() if v is not None}


def _event_attributes(event: Any) -> dict[str, Any]:
    return {
        "outbox.topic": event.type,
        "outbox.key": event.subject,
        "outbox.tenant": event.tenant,
        "outbox.identity": event.identity,
        "outbox.event.id": event.id,
    }


def _process_span(tracer: Any, event: Any, group: str, decision: str) -> Any:
    attributes = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation": "process",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": event.stream,
        "messaging.message.id": event.entry_id,
        "messaging.consumer.group.name": group,
        "messaging.message.delivery_count": event.deliveries,
        "outbox.inbox.decision": decision,
        **_event_attributes(event),
    }
    return tracer.start_span(
        f"process {event.type}",
        context=_extract(event.headers),
        kind=_trace.SpanKind.CONSUMER,
        attributes={k: v for k, v in attributes.items() if v is not None},
    )


class _Process(_Span):
    __slots__ = ()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._span.set_attribute("outbox.inbox.decision", "failed")
        super().__exit__(exc_type, exc, tb)


def consuming(event: Any, group: str) -> _Noop | _Span:
    """The consumer, around one event's handler: a ``process`` span continuing the event's
    trace, current while the handler runs (jobs it enqueues keep its context)."""
    if not AVAILABLE:
        return _NOOP
    tracer = _get_tracer()
    if tracer is None:
        ctx = _extract(event.headers)
        return _NOOP if ctx is None else _Attached(ctx)
    return _Process(_process_span(tracer, event, group, "handled"))


class _Batch(_Noop):
    __slots__ = ("_spans",)

    def __init__(self, spans: list[Any]) -> None:
        self._spans = spans

    def __exit__(self, *exc: object) -> None:
        error = exc[1] if len(exc) > 1 else None
        for span in self._spans:
            if isinstance(error, BaseException):
                span.set_attribute("outbox.inbox.decision", "failed")
                span.set_status(_trace.Status(_trace.StatusCode.ERROR, repr(error)[:300]))
            span.end()


def consuming_batch(events: Sequence[Any], group: str) -> _Noop:
    """The consumer, around a batch handler: one ``process`` span per event (each in its
    event's trace), none of them current (a batch serves many traces)."""
    if not AVAILABLE:
        return _NOOP
    tracer = _get_tracer()
    if tracer is None:
        return _NOOP
    return _Batch([_process_span(tracer, event, group, "handled") for event in events])


def duplicate(event: Any, group: str) -> None:
    """The consumer found the event's identity in its inbox: a ``process`` span that says
    so (``outbox.inbox.decision = duplicate``), in the event's trace."""
    if not AVAILABLE:
        return
    tracer = _get_tracer()
    if tracer is not None:
        _process_span(tracer, event, group, "duplicate").end()


def publishing(batch: Sequence[Any]) -> _Noop | _Span:
    """The relay, around one batch's publish: a ``publish`` span linked to the context of
    every event in it. ``batch`` items have ``.record`` (``headers`` JSON text,
    ``event_id``, ``topic``) and ``.stream``."""
    if not AVAILABLE or not batch:
        return _NOOP
    tracer = _get_tracer()
    if tracer is None:
        return _NOOP
    links = []
    topics: set[str] = set()
    streams: set[str] = set()
    for item in batch:
        record = item.record
        topics.add(record.topic)
        streams.add(item.stream)
        headers = record.headers
        if not headers or TRACEPARENT not in headers:
            continue
        try:
            carrier = json.loads(headers)
        except ValueError:
            continue
        ctx = _extract(carrier) if isinstance(carrier, dict) else None
        if ctx is not None:
            links.append(
                _trace.Link(
                    _trace.get_current_span(ctx).get_span_context(),
                    {"outbox.event.id": record.event_id, "outbox.topic": record.topic},
                )
            )
    attributes: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.operation": "publish",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.batch.message_count": len(batch),
    }
    if len(streams) == 1:
        attributes["messaging.destination.name"] = next(iter(streams))
    if len(batch) == 1:
        attributes["messaging.message.id"] = batch[0].record.event_id
        attributes["outbox.event.id"] = batch[0].record.event_id
    name = f"publish {next(iter(topics))}" if len(topics) == 1 else "publish"
    if len(topics) == 1:
        attributes["outbox.topic"] = next(iter(topics))
    return _Span(
        tracer.start_span(
            name,
            context=_otel_context.Context(),  # a root: the batch belongs to no one trace
            kind=_trace.SpanKind.PRODUCER,
            attributes=attributes,
            links=links,
        )
    )


def _job_span(lease: Any, name: str, kind: Any, extra: dict[str, Any]) -> _Noop | _Span:
    if not AVAILABLE:
        return _NOOP
    trace_context = getattr(lease, "trace_context", None)
    tracer = _get_tracer()
    ctx = _extract(_job_carrier(trace_context))
    if tracer is None:
        return _NOOP if ctx is None else _Attached(ctx)
    attributes = _attributes(
        outbox__job__id=lease.job_id,
        outbox__tenant=lease.tenant,
        outbox__job__action=lease.action,
        outbox__job__subject=lease.subject,
        outbox__job__attempt=lease.attempts,
        outbox__job__epoch=lease.epoch,
    )
    attributes.update(extra)
    return _Span(tracer.start_span(name, context=ctx, kind=kind, attributes=attributes))


def running(lease: Any, route: Callable[[Any], Any] | None = None) -> _Noop | _Span:
    """The worker, around one job: a ``run`` span continuing the job's trace (the context
    its row recorded at enqueue), named after its handler (``route(lease)`` gives
    ``(name, fn)`` or None, called only when recording)."""
    if not AVAILABLE:
        return _NOOP
    routed = route(lease) if route is not None and _get_tracer() is not None else None
    handler = routed[0] if routed else None
    extra = {"outbox.job.handler": handler} if handler else {}
    return _job_span(lease, f"run {handler or 'job'}", _trace.SpanKind.CONSUMER, extra)


def dispatching(lease: Any, operation_id: str, provider: str, name: str) -> _Noop | _Span:
    """``Operations.dispatch``: a CLIENT span for the provider call, a child of the current
    span (the run span) or else of the job's trace."""
    if not AVAILABLE:
        return _NOOP
    tracer = _get_tracer()
    if tracer is None:
        return _NOOP
    attributes = _attributes(
        outbox__operation__id=operation_id,
        outbox__operation__name=name,
        outbox__provider=provider,
        outbox__job__id=lease.job_id,
        outbox__tenant=lease.tenant,
    )
    ctx = None
    if not _trace.get_current_span().get_span_context().is_valid:
        ctx = _extract(_job_carrier(getattr(lease, "trace_context", None)))
    return _Span(
        tracer.start_span(
            f"dispatch {provider}", context=ctx, kind=_trace.SpanKind.CLIENT, attributes=attributes
        )
    )


def reconciling(
    provider: str, operation_id: str, job_id: int, trace_context: str | None = None
) -> _Noop | _Span:
    """A reconciliation of ``operation_id``: inside a dispatch (the lookup of an earlier
    call) a child of the dispatch span; in the sweep, a child of the job's trace
    (``trace_context``: its row's column)."""
    if not AVAILABLE:
        return _NOOP
    tracer = _get_tracer()
    ctx = _extract(_job_carrier(trace_context)) if trace_context else None
    if tracer is None:
        return _NOOP if ctx is None else _Attached(ctx)
    attributes = _attributes(
        outbox__operation__id=operation_id, outbox__provider=provider, outbox__job__id=job_id
    )
    return _Span(tracer.start_span(f"reconcile {provider}", context=ctx, attributes=attributes))


def each_reconciliation(
    rows: Sequence[Any], trace_contexts: Callable[[Sequence[int]], Mapping[int, str | None]]
) -> Iterator[Any]:
    """The reconciliation sweep's rows (``job_id``, ``operation_id``, ``provider``), each
    handled under a ``reconcile`` span in its job's trace (``trace_contexts(job_ids)``
    reads the jobs' contexts, asked only while recording). The span is current while the
    loop's body runs for that row, and ends when the loop moves on."""
    if not AVAILABLE or not rows or _get_tracer() is None:
        yield from rows
        return
    contexts = trace_contexts(sorted({int(row.job_id) for row in rows}))
    for row in rows:
        job_id = int(row.job_id)
        with reconciling(row.provider, row.operation_id, job_id, contexts.get(job_id)):
            yield row


def receipt_state(state: str) -> None:
    """A receipt was recorded: ``outbox.receipt.state`` on the current span (the dispatch
    or the reconciliation that recorded it)."""
    if not AVAILABLE:
        return
    span = _trace.get_current_span()
    if span.is_recording():
        span.set_attribute("outbox.receipt.state", state)


def note(name: str, value: Any) -> None:
    """One attribute on the current span, if it is recording (e.g. a job's outcome)."""
    if not AVAILABLE or value is None:
        return
    span = _trace.get_current_span()
    if span.is_recording():
        span.set_attribute(name, value)


__all__ = [
    "AVAILABLE",
    "TRACEPARENT",
    "TRACESTATE",
    "add_trace_headers",
    "consuming",
    "consuming_batch",
    "dispatching",
    "duplicate",
    "each_reconciliation",
    "flush",
    "inject_http",
    "job_trace_context",
    "log_ids",
    "note",
    "publishing",
    "receipt_state",
    "reconciling",
    "recording",
    "running",
]
