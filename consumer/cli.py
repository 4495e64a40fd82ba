"""``outbox-consumer``: run a consumer, list its dead letters, replay one.

::

    outbox-consumer run MODULE:ATTRIBUTE   # a Consumer, or a zero-argument factory of one
    outbox-consumer dead-letters [--json] [--group G] [--all]
    outbox-consumer replay ID              # re-inject dead-letter record ID into its stream
    outbox-consumer init-db                # create the inbox and dead-letter tables

Flags take their defaults from ``OUTBOX_*`` environment variables (``OUTBOX_DATABASE_URL``,
``OUTBOX_REDIS_URL``, ``OUTBOX_GROUP``, ``OUTBOX_BATCH_SIZE``, ``OUTBOX_METRICS_PORT``,
``OUTBOX_METRICS_HOST``, ``OUTBOX_LOG_LEVEL``, ``OUTBOX_CONSUMER_SCHEMA``, and the recovery
intervals ``OUTBOX_CLAIM_IDLE_MS``, ``OUTBOX_HEARTBEAT_TTL_MS``, ``OUTBOX_HEARTBEAT_INTERVAL_MS``,
``OUTBOX_BLOCK_MS``, ``OUTBOX_MAX_DELIVERIES``; ``OUTBOX_REDIS_CLUSTER=1`` or
``--redis-cluster``: ``--redis-url`` names any node of a Redis Cluster). For ``run``, a
flag or variable that is set overrides what the application's Consumer was built with; one
that is not set leaves it.
Without a database URL the tools use the SQLite file in the working directory, without a
Redis URL the embedded Redis server.

Exit codes: 0 success, 1 failure (an unknown dead-letter id, ...), 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from consumer.admin import list_dead_letters, replay_dead_letter
from consumer.consumer import Consumer, ConsumerConfig
from consumer.errors import AlreadyReplayed, DeadLetterNotFound
from consumer.inbox import Inbox, build_inbox_schema, inbox_for
from outbox.db import describe_url, make_engine
from outbox.env import env, env_int
from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields, setup_logging
from outbox.redis_client import as_cluster_url, is_cluster_url, redis_client

log = logging.getLogger("outbox.consumer.cli")


RECOVERY_SETTINGS = {
    "claim_idle_ms": "an entry pending this long is claimed back (a failed handler's retry "
    "delay; the fallback for a hung peer)",
    "heartbeat_ttl_ms": "TTL of each consumer's heartbeat key: a peer whose key is gone is "
    "dead and its pending entries are claimed at once",
    "heartbeat_interval_ms": "how often the heartbeat is refreshed and dead peers looked for",
    "block_ms": "longest wait of a read for new entries (it returns as soon as one arrives)",
    "max_deliveries": "deliveries after which a failing entry is dead-lettered",
}
"""ConsumerConfig settings that ``run`` takes as ``--flag`` and ``OUTBOX_<SETTING>``."""


class UsageError(Exception):
    """Bad usage the parser could not see (a MODULE:ATTRIBUTE that is not a consumer)."""


def _common(parser: argparse.ArgumentParser, *, redis_url: bool) -> None:
    parser.add_argument(
        "--database-url",
        default=env("DATABASE_URL"),
        help="database URL (env OUTBOX_DATABASE_URL; default: the SQLite file outbox.db)",
    )
    if redis_url:
        parser.add_argument(
            "--redis-url",
            default=env("REDIS_URL"),
            help="Redis URL (env OUTBOX_REDIS_URL; default: the embedded Redis server)",
        )
        parser.add_argument(
            "--redis-cluster",
            action="store_true",
            default=(env("REDIS_CLUSTER") or "").strip().lower() in ("1", "true", "yes", "on"),
            help="--redis-url names any node of a Redis Cluster (env OUTBOX_REDIS_CLUSTER=1; "
            "a redis+cluster:// URL says the same)",
        )
    parser.add_argument(
        "--schema",
        default=env("CONSUMER_SCHEMA"),
        help="database schema of the consumer tables (env OUTBOX_CONSUMER_SCHEMA)",
    )
    parser.add_argument(
        "--log-level",
        default=env("LOG_LEVEL", "info"),
        help="debug, info, warning, error (env OUTBOX_LOG_LEVEL; default info)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-consumer",
        description="Consume outbox streams with deduplication by business identity.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run a consumer until SIGTERM",
        description="Run the Consumer named by MODULE:ATTRIBUTE (an instance, or a "
        "zero-argument factory returning one) until SIGTERM: the batch in hand is finished, "
        "committed and acknowledged, then exit 0.",
    )
    run.add_argument("target", metavar="MODULE:ATTRIBUTE", help="e.g. myapp.consumers:billing")
    _common(run, redis_url=True)
    run.add_argument("--group", default=env("GROUP"), help="consumer group (env OUTBOX_GROUP)")
    run.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="entries per batch and transaction (env OUTBOX_BATCH_SIZE)",
    )
    for setting, text in RECOVERY_SETTINGS.items():
        run.add_argument(
            "--" + setting.replace("_", "-"),
            type=int,
            default=None,
            help=f"{text} (env OUTBOX_{setting.upper()}; default: the application's, "
            f"else {getattr(ConsumerConfig(), setting)})",
        )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (env OUTBOX_METRICS_PORT)",
    )
    run.add_argument(
        "--metrics-host",
        default=env("METRICS_HOST", "127.0.0.1"),
        help="address of the metrics server (env OUTBOX_METRICS_HOST; default 127.0.0.1)",
    )

    dead = commands.add_parser(
        "dead-letters",
        help="list NEEDS_ATTENTION records",
        description="List dead-lettered entries (oldest first): a table, or --json.",
    )
    _common(dead, redis_url=False)
    dead.add_argument("--group", default=env("GROUP"), help="only this group (env OUTBOX_GROUP)")
    dead.add_argument("--all", action="store_true", help="include replayed records")
    dead.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    dead.add_argument("--json", action="store_true", help="print a JSON array")

    replay = commands.add_parser(
        "replay",
        help="re-inject a dead-lettered entry into its stream",
        description="Re-inject dead-letter record ID (see dead-letters) into its original "
        "stream as a new entry, after the handler or producer was fixed.",
    )
    replay.add_argument("record_id", metavar="ID", type=int, help="dead-letter record id")
    _common(replay, redis_url=True)

    init = commands.add_parser("init-db", help="create the inbox and dead-letter tables")
    _common(init, redis_url=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for bad usage
        return int(exc.code) if isinstance(exc.code, int) else 2
    try:
        setup_logging(args.log_level)
        config = ConsumerConfig(schema=args.schema)
        if args.command == "run":
            return _run(args)
        if args.command == "dead-letters":
            return _dead_letters(args, config)
        if args.command == "replay":
            return _replay(args, config)
        return _init_db(args, config)
    except (ConfigError, UsageError) as exc:
        print(f"outbox-consumer: {exc}", file=sys.stderr)
        return 2
    except (DeadLetterNotFound, AlreadyReplayed) as exc:
        print(f"outbox-consumer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 1
    except Exception as exc:
        log.exception("outbox-consumer failed")
        print(f"outbox-consumer: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


# -- run ---------------------------------------------------------------------------------------


def load_consumer(target: str) -> Consumer:
    """Import ``MODULE:ATTRIBUTE``; the attribute is a Consumer or a factory returning one."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"{target!r} is not MODULE:ATTRIBUTE (e.g. myapp.consumers:billing)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"{module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, Consumer) and callable(obj):
        obj = obj()
    if not isinstance(obj, Consumer):
        raise UsageError(f"{target} is {type(obj).__name__}, not a Consumer or a factory of one")
    return obj


def _run(args: argparse.Namespace) -> int:
    batch_size = args.batch_size if args.batch_size is not None else env_int("BATCH_SIZE", 0)
    if args.batch_size is not None and batch_size <= 0:
        raise ConfigError("batch_size", f"--batch-size must be positive, got {batch_size}")
    port = args.metrics_port if args.metrics_port is not None else env_int("METRICS_PORT", -1)
    consumer = load_consumer(args.target)
    config = consumer.config
    if batch_size:
        config = dataclasses.replace(config, batch_size=batch_size)
    overrides: dict[str, Any] = {}
    for setting in RECOVERY_SETTINGS:
        value = getattr(args, setting)
        if value is None and env(setting) is not None:
            value = env_int(setting, 0)
        if value is not None:
            overrides[setting] = value
    if overrides:
        config = dataclasses.replace(config, **overrides)  # validated: ConfigError, exit 2
    if args.schema:
        config = dataclasses.replace(config, schema=args.schema)
    consumer = consumer.with_overrides(
        database=args.database_url,
        redis=as_cluster_url(args.redis_url) if args.redis_cluster else args.redis_url,
        group=args.group,
        config=config,
    )
    if port >= 0:
        from metrics import start_metrics  # imported only when asked for

        # With the engine, the exporter also serves the dead-letter gauges (the collector
        # leaves out the tables this database does not have, such as the outbox's).
        hooks = start_metrics(
            port, args.metrics_host, engine=consumer.engine, consumer_schema=config.schema
        )
        consumer.hooks = hooks
    log.info(
        "outbox-consumer starting",
        extra=fields(
            group=consumer.group,
            consumer=consumer.name,
            streams=consumer.streams,
            database=describe_url(consumer.engine.url),
            batch_size=consumer.config.batch_size,
            claim_idle_ms=consumer.config.claim_idle_ms,
            heartbeat_ttl_ms=consumer.config.heartbeat_ttl_ms,
        ),
    )
    stop = GracefulStop().install()
    consumer.run(stop)
    return 0


# -- dead letters ------------------------------------------------------------------------------


def _inbox(args: argparse.Namespace, config: ConsumerConfig) -> Inbox:
    """The consumer tables of ``--database-url``, created if missing."""
    inbox = inbox_for(make_engine(args.database_url), build_inbox_schema(config.schema))
    inbox.schema_create()
    return inbox


def _dead_letters(args: argparse.Namespace, config: ConsumerConfig) -> int:
    if args.limit <= 0:
        raise ConfigError("--limit", "must be positive")
    rows = list_dead_letters(
        _inbox(args, config), group=args.group, include_replayed=args.all, limit=args.limit
    )
    if args.json:
        print(json.dumps([_jsonable(row) for row in rows], indent=2, default=str))
        return 0
    if not rows:
        print("no dead letters")
        return 0
    header = ("ID", "GROUP", "STREAM", "ENTRY", "EVENT", "REASON", "DELIVERIES", "STATE", "ERROR")
    lines = [header] + [
        (
            str(row["id"]),
            row["group_name"],
            row["stream"],
            row["entry_id"],
            row["event_id"] or "-",
            row["reason"],
            str(row["deliveries"]),
            row["state"],
            (row["error"] or "").replace("\n", " ")[:80],
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    for line in lines:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False))
            + "  "
            + line[-1]
        )
    return 0


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    with contextlib.suppress(TypeError, ValueError):
        out["payload"] = json.loads(row["payload"])
    for key in ("created_at", "replayed_at"):
        if out.get(key) is not None:
            out[key] = out[key].isoformat()
    return out


def _replay(args: argparse.Namespace, config: ConsumerConfig) -> int:
    if args.redis_cluster or is_cluster_url(args.redis_url):
        client: Any = redis_client(args.redis_url, cluster=True)
    else:
        client = redis_client(args.redis_url)
    entry_id = replay_dead_letter(_inbox(args, config), client, args.record_id)
    print(f"replayed dead-letter record {args.record_id} as entry {entry_id}")
    return 0


def _init_db(args: argparse.Namespace, config: ConsumerConfig) -> int:
    inbox = _inbox(args, config)
    print(f"consumer tables ready in {describe_url(inbox.engine.url)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
