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

Exit codes: 0 stopped by a signal, 1 failure (cannot reach the database), 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from metrics.collector import DEFAULT_CACHE_SECONDS, DEFAULT_STATEMENT_TIMEOUT_MS, DEFAULT_TOP_N
from metrics.exporter import DEFAULT_HOST, DEFAULT_PORT, serve_forever
from outbox.db import describe_url, make_engine
from outbox.env import env
from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields, setup_logging
from outbox.schema import DEFAULT_TABLE, build_schema

log = logging.getLogger("outbox.metrics.cli")

HELP = "serve the database-derived Prometheus gauges (standalone exporter)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the standalone exporter, defaults from ``OUTBOX_*``.

    Numeric defaults stay strings so argparse converts them with ``type``: a bad
    ``OUTBOX_METRICS_PORT`` is reported like a bad ``--port`` (exit 2), not a traceback."""
    parser.add_argument(
        "--database-url",
        default=env("DATABASE_URL"),
        help="database URL (env OUTBOX_DATABASE_URL; default: the SQLite file outbox.db)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=env("METRICS_PORT", str(DEFAULT_PORT)),
        help=f"TCP port to serve /metrics on (env OUTBOX_METRICS_PORT; default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--host",
        default=env("METRICS_HOST", DEFAULT_HOST),
        help=f"address to bind (env OUTBOX_METRICS_HOST; default {DEFAULT_HOST})",
    )
    parser.add_argument(
        "--table",
        default=env("TABLE", DEFAULT_TABLE),
        help=f"outbox table name (env OUTBOX_TABLE; default {DEFAULT_TABLE})",
    )
    parser.add_argument(
        "--schema",
        default=env("SCHEMA"),
        help="database schema of the outbox table (env OUTBOX_SCHEMA; default: search path)",
    )
    parser.add_argument(
        "--consumer-schema",
        default=env("CONSUMER_SCHEMA"),
        help="database schema of the consumer tables (env OUTBOX_CONSUMER_SCHEMA)",
    )
    parser.add_argument(
        "--cache-seconds",
        type=float,
        default=env("METRICS_CACHE_SECONDS", str(DEFAULT_CACHE_SECONDS)),
        help="reuse query results for this long across scrapes (env "
        f"OUTBOX_METRICS_CACHE_SECONDS; default {DEFAULT_CACHE_SECONDS:g})",
    )
    parser.add_argument(
        "--top-n",
        type=int,
        default=env("METRICS_TOP_N", str(DEFAULT_TOP_N)),
        help="most-attempted pending events exported with their event id (env "
        f"OUTBOX_METRICS_TOP_N; default {DEFAULT_TOP_N})",
    )
    parser.add_argument(
        "--statement-timeout-ms",
        type=int,
        default=env("METRICS_STATEMENT_TIMEOUT_MS", str(DEFAULT_STATEMENT_TIMEOUT_MS)),
        help="bound on each gauge query (env OUTBOX_METRICS_STATEMENT_TIMEOUT_MS; default "
        f"{DEFAULT_STATEMENT_TIMEOUT_MS})",
    )
    if not any(a.dest == "log_level" for a in parser._actions):
        parser.add_argument(
            "--log-level",
            default=env("LOG_LEVEL", "info"),
            help="debug, info, warning, error (env OUTBOX_LOG_LEVEL; default info)",
        )


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m metrics``: the same exporter without the relay's CLI."""
    parser = argparse.ArgumentParser(prog="python -m metrics", description=HELP + ".")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
