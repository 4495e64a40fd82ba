"""Prometheus metrics, the exporter and the alert rules of the toolkit.

Only this package imports prometheus-client; the relay, consumers and workers report through
:class:`outbox.hooks.Hooks`, and :class:`PrometheusHooks` turns those calls into metrics on an
injected registry. :class:`DatabaseCollector` adds gauges read from the tables at scrape time.

    hooks = start_metrics(9464, engine=engine)      # serve on 127.0.0.1:9464
    relay = Relay(..., hooks=hooks)

``alerts.yml``, ``alerts_test.yml`` and ``dashboard.json`` ship in this package
(:func:`resource_path`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from metrics.alerts import default_thresholds, render_rules
from metrics.collector import DatabaseCollector, Source, unknown_receipts_source
from metrics.exporter import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Metrics,
    build_metrics,
    build_registry,
    serve_forever,
    start_metrics,
)
from metrics.hooks import PrometheusHooks


def resource_path(name: str) -> Path:
    """Path of a file shipped with the package: ``alerts.yml``, ``alerts_test.yml``,
    ``dashboard.json``."""
    return Path(str(resources.files("metrics").joinpath(name)))


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "DatabaseCollector",
    "Metrics",
    "PrometheusHooks",
    "Source",
    "build_metrics",
    "build_registry",
    "default_thresholds",
    "render_rules",
    "resource_path",
    "serve_forever",
    "start_metrics",
    "unknown_receipts_source",
]
