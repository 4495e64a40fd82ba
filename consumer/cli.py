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

Exit codes: 0 success, 1 failure (an unknown dead-letter id, ...), 2 bad usage, 130
interrupted (Ctrl-C). The flags are declared with :mod:`outbox.cli`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from consumer.admin import list_dead_letters, replay_dead_letter
from consumer.consumer import Consumer, ConsumerConfig
from consumer.inbox import Inbox, build_inbox_schema, inbox_for
from outbox.cli import (
    DATABASE,
    DATABASE_URL,
    LOGGING,
    METRICS,
    REDIS,
    Flag,
    Parser,
    UsageError,
    add_flags,
    existing_database_url,
    given_as,
    load_target,
    run_main,
    whole_number,
)
from outbox.db import database_given, describe_url, make_engine, same_database
from outbox.display import table
from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields, setup_logging
from outbox.nats_client import NatsClient, broker_kind
from outbox.reach import reach
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


PROG = "outbox-consumer"

CONSUMER_SCHEMA = Flag(
    "--schema",
    help="database schema of the consumer tables",
    env="OUTBOX_CONSUMER_SCHEMA",
    shown_default="the search path",
)
GROUP = Flag("--group", help="consumer group", shown_default="the application's")


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
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
    add_flags(
        run,
        *DATABASE,
        *REDIS,
        CONSUMER_SCHEMA,
        *LOGGING,
        GROUP,
        Flag(
            "--batch-size",
            int,
            "entries per batch and transaction",
            shown_default="the application's",
            metavar="N",
        ),
    )
    for setting, text in RECOVERY_SETTINGS.items():
        Flag(
            "--" + setting.replace("_", "-"),
            int,
            text,
            shown_default=f"the application's, else {getattr(ConsumerConfig(), setting)}",
            metavar="MS" if setting.endswith("_ms") else "N",
        ).add_to(run)
    add_flags(run, *METRICS)
    run.set_defaults(func=_run)

    dead = commands.add_parser(
        "dead-letters",
        help="list NEEDS_ATTENTION records",
        description="List dead-lettered entries (oldest first): a table, or --json.",
    )
    add_flags(
        dead,
        *DATABASE,
        CONSUMER_SCHEMA,
        *LOGGING,
        Flag("--group", help="only this group", shown_default="every group"),
        Flag("--all", bool, "include replayed records", env=None),
        Flag("--limit", int, "at most this many", default=100, env=None, metavar="N"),
        Flag("--json", bool, "print a JSON array", env=None),
    )
    dead.set_defaults(func=_dead_letters)

    replay = commands.add_parser(
        "replay",
        help="re-inject a dead-lettered entry into its stream",
        description="Re-inject dead-letter record ID (see dead-letters) into its original "
        "stream as a new entry, after the handler or producer was fixed.",
    )
    replay.add_argument("record_id", metavar="ID", type=whole_number, help="dead-letter record id")
    add_flags(replay, *DATABASE, *REDIS, CONSUMER_SCHEMA, *LOGGING)
    replay.set_defaults(func=_replay)

    init = commands.add_parser("init-db", help="create the inbox and dead-letter tables")
    add_flags(init, *DATABASE, CONSUMER_SCHEMA, *LOGGING)
    init.set_defaults(func=_init_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv, command=_command)


def _command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    ConsumerConfig(schema=args.schema)  # a bad --schema is bad usage before anything runs
    return int(args.func(args))


# -- run ---------------------------------------------------------------------------------------


def load_consumer(target: str) -> Consumer:
    """Import ``MODULE:ATTRIBUTE`` (from the working directory too); the attribute is a
    Consumer or a factory returning one."""
    loaded: Consumer = load_target(target, Consumer, example="myapp.consumers:billing")
    return loaded


def _run(args: argparse.Namespace) -> int:
    batch_size = args.batch_size
    if batch_size is not None and batch_size <= 0:
        raise ConfigError("batch_size", f"--batch-size must be positive, got {batch_size}")
    port = args.metrics_port
    with database_given(args.database_url):
        consumer = load_consumer(args.target)
    database: Any = args.database_url
    if database is not None:
        if not same_database(database, consumer.engine.url):
            raise UsageError(
                f"{given_as(args, DATABASE_URL)} cannot apply: {args.target} built its Consumer "
                f"on {describe_url(consumer.engine.url)}; drop {given_as(args, DATABASE_URL)}, "
                "or build the Consumer without a database to take it from the command line"
            )
        database = consumer.engine  # the engine the module's own code may hold too
    config = consumer.config
    if batch_size:
        config = dataclasses.replace(config, batch_size=batch_size)
    overrides: dict[str, Any] = {}
    for setting in RECOVERY_SETTINGS:
        value = getattr(args, setting)
        if value is not None:
            overrides[setting] = value
    if overrides:
        config = dataclasses.replace(config, **overrides)  # validated: ConfigError, exit 2
    if args.schema:
        config = dataclasses.replace(config, schema=args.schema)
    consumer = consumer.with_overrides(
        database=database,
        redis=as_cluster_url(args.redis_url) if args.redis_cluster else args.redis_url,
        group=args.group,
        config=config,
    )
    if port is not None and port >= 0:
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
    if not _reach(consumer, args.redis_url, stop):
        return 0  # stopped while waiting for the broker
    consumer.run(stop)
    return 0


def _reach(consumer: Consumer, url: str | None, stop: GracefulStop) -> bool:
    """Wait until the consumer's broker answers, saying so at start (:func:`outbox.reach.reach`:
    one error line naming the broker, its password hidden; one when it answers). Before,
    a consumer whose Redis was down at start logged heartbeat and batch warnings that named
    no broker. False once stopped first."""

    def ping() -> bool:
        if consumer.broker == "nats":
            reader: Any = consumer.reader
            reader.client.ping()
        else:
            consumer.redis.ping()  # a cluster's client is made here: it reads the slot map
        return True

    spec = url if url is not None else getattr(consumer, "_redis_spec", None)
    if spec is None:
        return True  # the embedded Redis: started on first use, never "down at start"
    where = spec if isinstance(spec, str) else "the application's Redis client"
    return bool(reach(ping, where, stop, log, group=consumer.group, consumer=consumer.name))


# -- dead letters ------------------------------------------------------------------------------


def _inbox(args: argparse.Namespace, *, existing: bool = True) -> Inbox:
    """The consumer tables of ``--database-url``, created if missing; ``existing``: a command
    that reads or repairs refuses a SQLite file that is not there (init-db creates it)."""
    url = existing_database_url(args.database_url) if existing else args.database_url
    inbox = inbox_for(make_engine(url), build_inbox_schema(args.schema))
    inbox.schema_create()
    return inbox


def _dead_letters(args: argparse.Namespace) -> int:
    if args.limit <= 0:
        raise ConfigError("--limit", "must be positive")
    rows = list_dead_letters(
        _inbox(args), group=args.group, include_replayed=args.all, limit=args.limit
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
    print(table(lines))
    return 0


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    with contextlib.suppress(TypeError, ValueError):
        out["payload"] = json.loads(row["payload"])
    for key in ("created_at", "replayed_at"):
        if out.get(key) is not None:
            out[key] = out[key].isoformat()
    return out


def _replay(args: argparse.Namespace) -> int:
    if broker_kind(args.redis_url) == "nats":
        client: Any = NatsClient(args.redis_url)
    elif args.redis_cluster or is_cluster_url(args.redis_url):
        client = redis_client(args.redis_url, cluster=True)
    else:
        client = redis_client(args.redis_url)
    entry_id = replay_dead_letter(_inbox(args), client, args.record_id)
    print(f"replayed dead-letter record {args.record_id} as entry {entry_id}")
    return 0


def _init_db(args: argparse.Namespace) -> int:
    inbox = _inbox(args, existing=False)
    print(f"consumer tables ready in {describe_url(inbox.engine.url)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
