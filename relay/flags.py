"""The flags of ``outbox-relay`` (:mod:`relay.cli`): one declaration each, with
:mod:`outbox.cli`'s ``Flag``, shared by the subcommands that take them, and what ``run``'s
flags make of the relay's config (:func:`relay_config`)."""

from __future__ import annotations

import argparse

from outbox.cli import DATABASE, LOGGING, METRICS, REDIS, Flag, UsageError
from outbox.schema import DEFAULT_TABLE
from relay.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_PARTITIONS,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_RETENTION_SECONDS,
    RelayConfig,
)
from relay.redis.trim import DEFAULT_STREAM_RETENTION

TABLE = Flag("--table", help="outbox table", default=DEFAULT_TABLE)
SCHEMA = Flag("--schema", help="database schema of the table", shown_default="the search path")
COMMON = (*DATABASE, TABLE, SCHEMA, *LOGGING)
STREAM = Flag(
    "--stream",
    help="stream name template with {topic}, {tenant}, {partition}",
    default="outbox.{topic}",
    metavar="TEMPLATE",
)
SOURCE = Flag("--source", help="CloudEvents source", default="outbox")
STREAM_RETENTION = Flag(
    "--stream-retention",
    float,
    "seconds of entries a stream keeps (XADD MINID ~), never one a consumer group still has "
    "pending; 0 never trims",
    default=DEFAULT_STREAM_RETENTION,
    metavar="SECONDS",
)
RETENTION = Flag(
    "--retention",
    float,
    "seconds to keep published rows; 0 keeps them",
    default=DEFAULT_RETENTION_SECONDS,
    metavar="SECONDS",
)
PARTITIONED = Flag(
    "--partitioned",
    help="PostgreSQL: create a new table partitioned on created_at, one partition per hour "
    "or day; retention then drops whole partitions (an existing plain table is refused, "
    "never converted)",
    choices=("hourly", "daily"),
    metavar="hourly|daily",
)
WAIT_TIMEOUT = Flag(
    "--wait-timeout",
    float,
    "seconds WAIT may take before the batch is reconciled instead (with --wait-replicas)",
    default=1.0,
    metavar="SECONDS",
)
RUN_FLAGS = (
    *COMMON,
    *REDIS,
    Flag(
        "--wait-replicas",
        int,
        "record a receipt only after N replicas have the batch (WAIT N); 0: do not wait",
        default=0,
        metavar="N",
    ),
    WAIT_TIMEOUT,
    STREAM,
    Flag("--batch-size", int, "rows per cycle", default=DEFAULT_BATCH_SIZE, metavar="N"),
    Flag(
        "--partitions",
        int,
        "key partitions shared by replicas, same on every replica",
        default=DEFAULT_PARTITIONS,
        metavar="N",
    ),
    *METRICS,
    Flag(
        "--poll-interval",
        float,
        "seconds before the next claim after a busy cycle (each idle one doubles it)",
        default=DEFAULT_POLL_INTERVAL,
        metavar="SECONDS",
    ),
    Flag(
        "--max-poll-interval",
        float,
        "idle polling ceiling",
        shown_default="1 (or --poll-interval if longer)",
        metavar="SECONDS",
    ),
    Flag("--no-listen", bool, "PostgreSQL: poll only, no LISTEN/NOTIFY"),
    RETENTION,
    Flag(
        "--maxlen",
        int,
        "approximate MAXLEN per stream, instead of --stream-retention; 0: none",
        metavar="N",
    ),
    STREAM_RETENTION,
    Flag("--require-aof", bool, "refuse to start unless Redis runs with appendonly yes"),
    Flag(
        "--auto-republish",
        bool,
        "when Redis lost published entries, republish them without waiting for an operator",
    ),
    Flag(
        "--redis-check-interval",
        float,
        "seconds between checks of Redis's persistence and of lost entries",
        default=60.0,
        metavar="SECONDS",
    ),
    SOURCE,
    Flag("--once", bool, "run one cycle and exit", env=None),
)


def relay_config(args: argparse.Namespace) -> RelayConfig:
    """Flags and environment into the frozen config (ConfigError names a bad value)."""
    if not args.wait_replicas and args.wait_timeout != WAIT_TIMEOUT.default:
        raise UsageError("--wait-timeout applies only with --wait-replicas N (N > 0)")
    poll = args.poll_interval
    max_poll = args.max_poll_interval
    return RelayConfig(
        batch_size=args.batch_size,
        partitions=args.partitions,
        poll_interval=poll,
        max_poll_interval=max_poll if max_poll is not None else max(1.0, poll),
        listen=not args.no_listen,
        retention_seconds=args.retention,
        redis_check_interval=args.redis_check_interval,
        auto_republish=bool(args.auto_republish),
        wait_replicas=args.wait_replicas,
        wait_timeout=args.wait_timeout,
    )


__all__ = [
    "COMMON",
    "PARTITIONED",
    "RETENTION",
    "RUN_FLAGS",
    "SCHEMA",
    "SOURCE",
    "STREAM",
    "STREAM_RETENTION",
    "TABLE",
    "WAIT_TIMEOUT",
    "relay_config",
]
