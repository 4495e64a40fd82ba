"""``outbox-relay metrics``: the standalone exporter of the database-derived gauges.

::

    outbox-relay metrics [--database-url URL] [--port 9464] [--host 127.0.0.1]
                         [--table outbox_events] [--schema S] [--cache-seconds 5]
                         [--top-n 10] [--statement-timeout-ms 2000]

Serves the gauges read from the outbox (and the consumer and job tables when they exist)
until SIGTERM/SIGINT, then exits 0. Useful when the relay runs without ``--metrics-port``, or
to scrape the database once for several relays. The same command is ``python -m metrics``.

Flags default to ``OUTBOX_*`` environment variables: ``OUTBOX_DATABASE_URL``,
``OUTBOX_METRICS_PORT``, ``OUTBOX_METRICS_HOST``, ``OUTBOX_TABLE``, ``OUTBOX_SCHEMA``,
``OUTBOX_CONSUMER_SCHEMA``, ``OUTBOX_METRICS_CACHE_SECONDS``, ``OUTBOX_METRICS_TOP_N``,
``OUTBOX_METRICS_STATEMENT_TIMEOUT_MS``, ``OUTBOX_LOG_LEVEL``.

Exit codes: 0 stopped by a signal, 1 failure (cannot reach the database), 2 bad usage, 130
interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from metrics.collector import DEFAULT_CACHE_SECONDS, DEFAULT_STATEMENT_TIMEOUT_MS, DEFAULT_TOP_N
from metrics.exporter import DEFAULT_HOST, DEFAULT_PORT, serve_forever
from outbox.cli import DATABASE, LOGGING, Flag, Parser, add_flags, run_main
from outbox.db import describe_url, make_engine
from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields, setup_logging
from outbox.schema import DEFAULT_TABLE, build_schema

log = logging.getLogger("outbox.metrics.cli")

HELP = "serve the database-derived Prometheus gauges (standalone exporter)"


FLAGS = (
    *DATABASE,
    Flag(
        "--port",
        int,
        "TCP port to serve /metrics on",
        default=DEFAULT_PORT,
        env="OUTBOX_METRICS_PORT",
        metavar="PORT",
    ),
    Flag("--host", help="address to bind", default=DEFAULT_HOST, env="OUTBOX_METRICS_HOST"),
    Flag("--table", help="outbox table name", default=DEFAULT_TABLE),
    Flag("--schema", help="database schema of the outbox table", shown_default="search path"),
    Flag("--consumer-schema", help="database schema of the consumer tables"),
    Flag(
        "--cache-seconds",
        float,
        "reuse query results for this long across scrapes",
        default=DEFAULT_CACHE_SECONDS,
        env="OUTBOX_METRICS_CACHE_SECONDS",
        metavar="SECONDS",
    ),
    Flag(
        "--top-n",
        int,
        "most-attempted pending events exported with their event id",
        default=DEFAULT_TOP_N,
        env="OUTBOX_METRICS_TOP_N",
        metavar="N",
    ),
    Flag(
        "--statement-timeout-ms",
        int,
        "bound on each gauge query",
        default=DEFAULT_STATEMENT_TIMEOUT_MS,
        env="OUTBOX_METRICS_STATEMENT_TIMEOUT_MS",
        metavar="MS",
    ),
    *LOGGING,
)
"""The standalone exporter's flags (outbox.cli declarations: a bad ``OUTBOX_METRICS_PORT``
is reported like a bad ``--port``, exit 2)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the standalone exporter, defaults from ``OUTBOX_*``."""
    add_flags(parser, *FLAGS)


def add_metrics_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``metrics`` to a CLI's subcommands (``outbox-relay metrics``).

    The subparser's ``func`` default is :func:`run`, which takes the parsed namespace and
    returns the exit status.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "metrics",
        help=HELP,
        description=HELP + ": until SIGTERM, from the outbox, consumer and job tables.",
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, stop: GracefulStop | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 0 when stopped, 1 on a failure, 2 on bad configuration."""
    try:
        setup_logging(getattr(args, "log_level", None) or "info")
        outbox_schema = build_schema(args.table, args.schema)
        engine = make_engine(args.database_url)
    except ConfigError as exc:
        print(f"outbox-relay metrics: {exc}", file=sys.stderr)
        return 2
    stopper = stop if stop is not None else GracefulStop().install()
    log.info(
        "metrics exporter starting",
        extra=fields(database=describe_url(engine.url), table=outbox_schema.qualified_name),
    )
    try:
        return serve_forever(
            args.port,
            args.host,
            engine=engine,
            outbox_schema=outbox_schema,
            stop=stopper,
            cache_seconds=args.cache_seconds,
            top_n=args.top_n,
            statement_timeout_ms=args.statement_timeout_ms,
            consumer_schema=args.consumer_schema,
        )
    except ConfigError as exc:
        print(f"outbox-relay metrics: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        log.error("metrics exporter failed", extra=fields(error=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        engine.dispose()


def build_parser() -> Parser:
    parser = Parser(prog="python -m metrics", description=HELP + ".")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m metrics``: the same exporter without the relay's CLI."""
    return run_main("outbox-relay metrics", build_parser(), argv, command=run)


if __name__ == "__main__":
    sys.exit(main())
