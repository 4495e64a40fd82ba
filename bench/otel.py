"""The cost of tracing (issue 23): run another benchmark in one OpenTelemetry mode.

    python -m bench otel none  outbox_write --threads 1 --notify off   # as if not installed
    python -m bench otel api   outbox_write --threads 1 --notify off   # the extra, no SDK
    python -m bench otel sdk   consumer --messages 10000               # SDK + batch exporter

``none`` hides the ``opentelemetry`` package from the import system before the toolkit is
imported (what a user without the extra has); ``api`` runs as installed, with the API's
default no-op provider; ``sdk`` installs the SDK's ``TracerProvider`` with a
``BatchSpanProcessor`` whose exporter encodes every span as OTLP protobuf and drops it (the
processor's and the encoder's work, without a network). The ratios of the same benchmark
run in two modes are the overhead; compare runs made back to back.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from typing import Any

MODES = ("none", "api", "sdk")


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "opentelemetry" or fullname.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden by bench otel)")
        return None


def _install_sdk() -> Any:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Counting(SpanExporter):
        spans = 0

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            Counting.spans += len(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Counting()))
    trace.set_tracer_provider(provider)
    return provider, Counting


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in MODES:
        print(__doc__)
        return 2
    mode, rest = argv[0], argv[1:]
    if "outbox" in sys.modules and mode == "none":
        print("bench otel none must run before the toolkit is imported", file=sys.stderr)
        return 2
    installed = None
    if mode == "none":
        sys.meta_path.insert(0, _Hide())
    elif mode == "sdk":
        installed = _install_sdk()
    from bench.__main__ import main as bench_main
    from outbox import tracing

    print(
        f"# otel mode {mode}: api importable={tracing.AVAILABLE}, recording={tracing.recording()}"
    )
    try:
        return bench_main(rest)
    finally:
        if installed is not None:
            provider, counting = installed
            provider.shutdown()
            print(f"# spans exported: {counting.spans}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
