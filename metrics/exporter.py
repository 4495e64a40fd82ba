"""The HTTP exporter: a registry with the hooks' metrics and the database collector, served.

- :func:`build_metrics` builds the registry without serving (tests, ``outbox-relay metrics``
  before it binds, a caller with its own HTTP stack).
- :func:`start_metrics` also serves it on ``host:port`` (127.0.0.1 unless told otherwise) in a
  daemon thread and returns the hooks to pass to a Relay, Consumer or Worker.
- :func:`serve_forever` is the standalone exporter of the database-derived gauges: it serves
  until SIGTERM/SIGINT (or ``stop``) and returns.

Every registry is a fresh ``CollectorRegistry``, never prometheus_client's global one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from sqlalchemy.engine import Engine

from metrics.collector import (
    DEFAULT_CACHE_SECONDS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    DEFAULT_TOP_N,
    DatabaseCollector,
)
from metrics.hooks import PrometheusHooks
from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.schema import OutboxSchema

log = logging.getLogger("outbox.metrics")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464


@dataclass(frozen=True)
class Metrics:
    """A registry, the hooks registered on it and the database collector (if any)."""

    registry: CollectorRegistry
    hooks: PrometheusHooks
    collector: DatabaseCollector | None

    def render(self) -> bytes:
        """The text exposition of everything registered (what a scrape returns)."""
        return generate_latest(self.registry)


def build_metrics(
    *,
    engine: Engine | None = None,
    outbox_schema: OutboxSchema | None = None,
    registry: CollectorRegistry | None = None,
    cache_seconds: float = DEFAULT_CACHE_SECONDS,
    top_n: int = DEFAULT_TOP_N,
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS,
    **collector_options: Any,
) -> Metrics:
    """Build (without serving) a registry with :class:`PrometheusHooks` and, when ``engine``
    is given, the :class:`DatabaseCollector` for its outbox (and other tables present)."""
    reg = registry if registry is not None else CollectorRegistry()
    hooks = PrometheusHooks(reg)
    collector = None
    if engine is not None:
        collector = DatabaseCollector(
            engine,
            outbox_schema,
            cache_seconds=cache_seconds,
            top_n=top_n,
            statement_timeout_ms=statement_timeout_ms,
            **collector_options,
        )
        reg.register(collector)
    hooks.collector = collector
    return Metrics(registry=reg, hooks=hooks, collector=collector)


def build_registry(
    *,
    engine: Engine | None = None,
    outbox_schema: OutboxSchema | None = None,
    registry: CollectorRegistry | None = None,
    **options: Any,
) -> CollectorRegistry:
    """Like :func:`build_metrics`, returning just the registry."""
    return build_metrics(
        engine=engine, outbox_schema=outbox_schema, registry=registry, **options
    ).registry


def check_port(port: int) -> int:
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("metrics_port", f"{port!r} is not a TCP port (0-65535)")
    return port


def start_metrics(
    port: int,
    host: str = DEFAULT_HOST,
    *,
    engine: Engine | None = None,
    outbox_schema: OutboxSchema | None = None,
    registry: CollectorRegistry | None = None,
    **options: Any,
) -> PrometheusHooks:
    """Serve metrics on ``host:port`` (a daemon thread) and return the hooks to pass to the
    relay, consumer or worker. ``port`` 0 picks a free port: read ``hooks.port``.

    With ``engine``, the database-derived gauges are registered too. ``hooks.close()`` stops
    the server.
    """
    check_port(port)
    built = build_metrics(engine=engine, outbox_schema=outbox_schema, registry=registry, **options)
    hooks = built.hooks
    try:
        server, thread = start_http_server(port, addr=host, registry=built.registry)
    except OSError as exc:
        raise ConfigError("metrics_port", f"cannot listen on {host}:{port}: {exc}") from None
    hooks.server = server
    hooks._server_thread = thread
    log.info(
        "metrics exporter listening",
        extra=fields(host=host, port=server.server_port, database=engine is not None),
    )
    return hooks


def serve_forever(
    port: int,
    host: str = DEFAULT_HOST,
    *,
    engine: Engine,
    outbox_schema: OutboxSchema | None = None,
    stop: GracefulStop | None = None,
    **options: Any,
) -> int:
    """The standalone exporter (``outbox-relay metrics``): serve the database-derived gauges
    until SIGTERM/SIGINT or ``stop``; returns 0 (the exit status)."""
    stopper = stop if stop is not None else GracefulStop().install()
    hooks = start_metrics(port, host, engine=engine, outbox_schema=outbox_schema, **options)
    try:
        while not stopper.wait(3600):
            pass
    finally:
        hooks.close()
        log.info("metrics exporter stopped")
    return 0
