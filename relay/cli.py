"""``outbox-relay``: run the relay, inspect and repair the outbox, try the demo.

Every flag defaults from an ``OUTBOX_<FLAG>`` environment variable (``--database-url`` from
``OUTBOX_DATABASE_URL``, ``--batch-size`` from ``OUTBOX_BATCH_SIZE``, ...). With no database
URL the tools use ``outbox.db`` in the working directory; with no Redis URL an embedded
Redis server (``outbox-redis.db``). Exit status: 0 success, 1 failure, 2 bad usage, 130
interrupted (Ctrl-C). The flags are declared with :mod:`outbox.cli`, in :mod:`relay.flags`;
connecting to the broker is :mod:`relay.connect`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from outbox.backoff import Backoff, retry_forever
from outbox.cli import (
    DATABASE_URL,
    REDIS,
    Flag,
    Parser,
    UsageError,
    add_flags,
    describe_database,
    existing_database_url,
    run_main,
)
from outbox.db import default_database_url, describe_url, make_engine
from outbox.display import table
from outbox.errors import ConfigError
from outbox.extras import require
from outbox.hooks import Hooks
from outbox.lifecycle import GracefulStop
from outbox.logs import setup_logging
from outbox.outage import misconfiguration
from outbox.reach import broker_errors, reason, where
from outbox.schema import build_schema, create_schema
from relay.admin import requeue, status
from relay.broker import broker_kind
from relay.connect import aof_refusal, connect_broker
from relay.connect import connect_redis as connect_redis
from relay.connect import uses_cluster as uses_cluster
from relay.flags import (
    COMMON,
    PARTITIONED,
    RETENTION,
    RUN_FLAGS,
    SOURCE,
    STREAM,
    STREAM_RETENTION,
)
from relay.flags import relay_config as relay_config
from relay.redis.publisher import DEFAULT_STREAM_RETENTION, StreamTemplate

log = logging.getLogger("outbox.relay")
PROG = "outbox-relay"


def build_parser() -> Parser:
    parser = Parser(
        prog=PROG,
        description="Relay committed outbox events to Redis Streams.",
        epilog="Every flag defaults from OUTBOX_<FLAG> (e.g. OUTBOX_DATABASE_URL).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="run the relay until SIGTERM")
    add_flags(run, *RUN_FLAGS)
    run.set_defaults(func=cmd_run)

    rp = sub.add_parser(
        "republish",
        help="publish retained events again (after Redis lost data); consumers deduplicate",
        description="Publish the retained (published) events again, as new entries, in "
        "per-key order, each to the stream its receipt names (or through --stream). The "
        "outbox's retention (default one day) is the recovery window. Progress on stderr, "
        "the count on stdout.",
    )
    add_flags(rp, *COMMON, *REDIS)
    add_flags(
        rp.add_mutually_exclusive_group(required=True),
        Flag(
            "--since",
            help="events created at or after TIME: ISO-8601 with Z or an offset "
            "(2026-11-30T12:00:00Z) or unix seconds",
            env=None,
            metavar="TIME",
        ),
        Flag("--from-seq", int, "events with seq >= N", env=None, metavar="N"),
    )
    add_flags(
        rp,
        Flag("--topic", help="only this topic", env=None),
        # Given, it routes every event; not given, each goes to the stream its receipt
        # names, and OUTBOX_STREAM (the relay's template) only routes events without one.
        Flag(
            "--stream",
            help="route through this template instead of the stream each receipt names",
            env=None,
            metavar="TEMPLATE",
        ),
        Flag("--dry-run", bool, "count, publish nothing", env=None),
        Flag("--batch-size", int, "events per round trip", default=500, env=None, metavar="N"),
        SOURCE,
    )
    rp.set_defaults(func=cmd_republish)

    st = sub.add_parser("status", help="backlog, oldest age, quarantined and attempts per topic")
    add_flags(st, *COMMON, Flag("--json", bool, "print one JSON object", env=None))
    st.set_defaults(func=cmd_status)

    rq = sub.add_parser("requeue", help="put quarantined events back, after a fix")
    add_flags(rq, *COMMON)
    rq.add_argument("event_ids", nargs="*", metavar="EVENT_ID", help="the events to put back")
    add_flags(rq, Flag("--all", bool, "every quarantined event", env=None))
    rq.set_defaults(func=cmd_requeue)

    pg = sub.add_parser(
        "purge",
        help="retention of published events (--dry-run shows what would go)",
        description="Delete published rows older than --retention, in batches (each its own "
        "short transaction), as the running relay does every minute. Pending and quarantined "
        "rows are never deleted. Progress on stderr, rows per table on stdout.",
    )
    add_flags(
        pg,
        *COMMON,
        RETENTION,
        Flag("--batch-size", int, "rows per statement", default=1000, env=None, metavar="N"),
        Flag("--dry-run", bool, "count what would go, delete nothing", env=None),
        Flag("--json", bool, '{"dry_run": .., "tables": {..}}', env=None),
    )
    pg.set_defaults(func=cmd_purge)

    init = sub.add_parser(
        "init-db", help="create the outbox table and indexes (the NOTIFY trigger with --notify)"
    )
    add_flags(init, *COMMON, PARTITIONED)
    add_flags(
        init.add_mutually_exclusive_group(),
        Flag(
            "--no-notify",
            bool,
            "no NOTIFY trigger (PostgreSQL; drops an existing one): relays wake by polling, "
            "and concurrent writers' commits do not queue on NOTIFY's global lock. A new table "
            "has none by default; an existing one keeps its choice",
            env=None,
        ),
        Flag(
            "--notify",
            bool,
            "add the NOTIFY trigger (PostgreSQL): relays wake at each commit, but every "
            "writer's commit takes NOTIFY's global lock (heavy concurrent writers slow down)",
            env=None,
        ),
    )
    init.set_defaults(func=cmd_init_db)

    demo = sub.add_parser(
        "demo",
        help="the whole loop on the embedded default: writes, relay, consumer dedup, jobs",
    )
    add_flags(
        demo,
        # The demo's own default: its SQLite file lives in --data-dir, not the working dir.
        dataclasses.replace(DATABASE_URL, shown_default="the SQLite file outbox.db in --data-dir"),
        *(flag for flag in COMMON if flag is not DATABASE_URL),
        *REDIS,
        Flag("--rate", float, "quotes approved per second", default=20.0, env=None),
        Flag("--duration", float, "stop after this many seconds", env=None, metavar="SECONDS"),
        Flag(
            "--chaos",
            bool,
            "worker processes send each quote's email through the connector simulator "
            "service, and one is SIGKILLed mid-send every 1-2 s: still one email per quote",
            env=None,
        ),
        Flag("--workers", int, "worker processes with --chaos", default=3, env=None, metavar="N"),
        Flag(
            "--data-dir",
            help="folder of the demo's files when no URL names the database or Redis (the "
            "SQLite file, the embedded Redis, the simulator's effects); each run starts fresh",
            default=".outbox",
            metavar="DIR",
        ),
        Flag(
            "--provider-latency",
            float,
            "with --chaos: seconds the simulator adds to every send (±50 %), as a real provider",
            default=0.0,
            env=None,
            metavar="SECONDS",
        ),
    )
    demo.set_defaults(func=cmd_demo)

    from metrics.cli import add_metrics_command  # `outbox-relay metrics`

    add_metrics_command(sub)
    return parser


class StartFailed(Exception):
    """The relay cannot start: a wrong database URL, or --once and no database."""


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _engine_and_schema(args: argparse.Namespace, *, existing: bool = False) -> tuple[Any, Any]:
    """The engine and table of the flags. ``existing``: a command that only reads or repairs
    (status, requeue, purge, republish) refuses a SQLite file that is not there, instead of
    creating an empty one to fail on."""
    schema = build_schema(args.table, args.schema)
    if existing:
        url = existing_database_url(args.database_url)
    else:
        url = args.database_url or default_database_url()
    engine = make_engine(url)
    return engine, schema


def _db_problem(exc: BaseException, args: argparse.Namespace) -> str:
    url = describe_url(args.database_url) if args.database_url else "the default SQLite file"
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    return f"cannot use the database at {url}: {first}"


# -- commands --------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    engine, schema = _engine_and_schema(args, existing=True)
    try:
        report = status(engine, schema)
    except Exception as exc:
        return _fail(_db_problem(exc, args))
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    rows = [("TOPIC", "PENDING", "QUARANTINED", "OLDEST AGE (s)", "MAX ATTEMPTS")]
    for topic, t in report["topics"].items():
        rows.append(
            (
                topic,
                str(t["pending"]),
                str(t["quarantined"]),
                f"{t['oldest_unpublished_age_seconds']:.3f}",
                str(t["max_attempts"]),
            )
        )
    rows.append(
        (
            "(all)",
            str(report["pending"]),
            str(report["quarantined"]),
            f"{report['oldest_unpublished_age_seconds']:.3f}",
            str(report["max_attempts"]),
        )
    )
    _print_rows(rows)
    if report["tables"]:
        print()
        sizes = [("TABLE", "ROWS", "DEAD", "TABLE BYTES", "INDEX BYTES", "OLDEST (s)", "KEEP (s)")]
        for table, t in report["tables"].items():
            sizes.append(
                (
                    table,
                    str(t["rows"]),
                    "-" if t["dead_rows"] is None else str(t["dead_rows"]),
                    "-" if t["table_bytes"] is None else str(t["table_bytes"]),
                    "-" if t["index_bytes"] is None else str(t["index_bytes"]),
                    "-" if t["oldest_age_seconds"] is None else f"{t['oldest_age_seconds']:.0f}",
                    f"{t['retention_seconds']:.0f}",
                )
            )
        _print_rows(sizes)
    return 0


def _print_rows(rows: Sequence[tuple[str, ...]]) -> None:
    print(table(rows, right=range(1, len(rows[0]))))


def cmd_requeue(args: argparse.Namespace) -> int:
    if args.all and args.event_ids:
        return _fail("give event ids or --all, not both", 2)
    if not args.all and not args.event_ids:
        return _fail("give at least one EVENT_ID, or --all", 2)
    engine, schema = _engine_and_schema(args, existing=True)
    try:
        result = requeue(engine, schema, args.event_ids, all_quarantined=args.all)
    except Exception as exc:
        return _fail(_db_problem(exc, args))
    finally:
        engine.dispose()
    for event_id in result.requeued:
        print(f"requeued {event_id}")
    for event_id, state in result.not_quarantined.items():
        print(f"not quarantined (state {state}), left as is: {event_id}")
    if args.all and not result.requeued:
        print("no quarantined events")
    for event_id in result.unknown:
        print(f"{PROG}: unknown event id: {event_id}", file=sys.stderr)
    return 1 if result.unknown else 0


def cmd_purge(args: argparse.Namespace) -> int:
    from relay.retention import purge_command

    retention = args.retention
    engine, schema = _engine_and_schema(args, existing=True)
    try:
        return purge_command(
            engine,
            schema,
            retention,
            dry_run=args.dry_run,
            as_json=args.json,
            batch=args.batch_size,
        )
    except ConfigError as exc:
        return _fail(str(exc), 2)
    except Exception as exc:
        return _fail(_db_problem(exc, args))
    finally:
        engine.dispose()


def cmd_init_db(args: argparse.Namespace) -> int:
    engine, schema = _engine_and_schema(args)
    try:
        notify = True if args.notify else False if args.no_notify else None  # None: as it is
        create_schema(engine, schema, notify=notify, partitioned=args.partitioned)
    except ConfigError:
        raise
    except Exception as exc:
        return _fail(_db_problem(exc, args))
    finally:
        engine.dispose()
    how = f" (partitioned {args.partitioned})" if args.partitioned else ""
    print(f"outbox table {schema.qualified_name}{how} ready at {describe_url(engine.url)}")
    return 0


# complexity: wiring of the relay's flags into its config and process
def cmd_run(args: argparse.Namespace) -> int:
    from relay.relay import Relay, infrastructure_errors

    config = relay_config(args)
    StreamTemplate.parse(args.stream)  # a bad template fails before anything starts
    if args.maxlen and args.stream_retention != DEFAULT_STREAM_RETENTION:
        # One trimming rule per stream: a --stream-retention beside --maxlen would be ignored.
        raise UsageError("--maxlen trims instead of --stream-retention: give one of them")
    setup_logging(args.log_level)
    engine, schema = _engine_and_schema(args)
    stop = GracefulStop().install()
    options: dict[str, Any] = {
        "stream_template": args.stream,
        "maxlen": args.maxlen or None,
        "source": args.source,
        "stream_retention": args.stream_retention,
    }
    if args.once:  # one cycle: a broker not there fails it, as a database not there does
        try:
            publisher = connect_broker(args, **options)
            assert publisher is not None  # without ``stop`` it raises instead of giving up
            publisher.ping()
        except broker_errors() as exc:
            return _fail(f"cannot reach the broker at {where(args.redis_url)}: {reason(exc)}")
    else:
        publisher = connect_broker(args, stop, **options)
    if publisher is None:
        return 0  # stopped while waiting for the broker
    if args.require_aof:
        if broker_kind(args.redis_url) != "redis":
            raise UsageError("--require-aof applies to a Redis broker")
        refusal = aof_refusal(getattr(publisher, "client", None), stop, args)
        if refusal is not None:
            return _fail(refusal)
    hooks: Hooks | None = None
    metrics_port = args.metrics_port
    if metrics_port is not None and metrics_port >= 0:
        from metrics import start_metrics

        hooks = start_metrics(metrics_port, args.metrics_host, engine=engine, outbox_schema=schema)
    infra = infrastructure_errors()

    # The schema is created if missing; while the database is down, wait and retry, unless
    # the first connection says the URL is wrong (that never mends), or --once (one cycle).
    def _create() -> bool:
        try:
            create_schema(engine, schema)
        except infra as exc:
            wrong = misconfiguration(exc)
            if wrong is not None or args.once:
                where = describe_database(args)
                hint = "; is the URL right?" if wrong is not None else ""
                first = str(getattr(exc, "orig", None) or exc).strip().splitlines()[:1]
                problem = wrong or (first[0] if first else type(exc).__name__)
                raise StartFailed(f"cannot use the database at {where}: {problem}{hint}") from None
            raise
        return True

    try:
        done = retry_forever(
            "creating the outbox schema",
            _create,
            stop,
            infra,
            Backoff(0.2, 10.0),
        )
    except StartFailed as failed:
        return _fail(str(failed))
    if not done:
        return 0
    relay = Relay(engine, publisher, config, hooks=hooks, schema=schema)
    if args.once:
        try:
            count = relay.run_once()
        except infra as exc:
            return _fail(f"cycle failed: {type(exc).__name__}: {exc}")
        finally:
            relay.store.close()
        print(json.dumps({"published": count}))
        return 0
    if sys.stderr.isatty():
        relay.on_progress = _live_line()
    relay.run(stop)
    if hooks is not None and hasattr(hooks, "close"):
        hooks.close()
    return 0


def cmd_republish(args: argparse.Namespace) -> int:
    from relay.republish import Throttle, parse_since, republish
    from relay.store import store_for

    since = parse_since(args.since) if args.since is not None else None
    if args.from_seq is not None and args.from_seq < 0:
        raise ConfigError("from_seq", f"must be >= 0, got {args.from_seq}")
    if args.batch_size < 1 or args.batch_size > 10_000:
        raise ConfigError("batch_size", f"must be between 1 and 10000, got {args.batch_size}")
    template = args.stream or STREAM.resolve()
    StreamTemplate.parse(template)
    setup_logging(args.log_level)
    engine, schema = _engine_and_schema(args, existing=True)
    publisher = connect_broker(
        args,
        stream_template=template,
        source=args.source,
        stream_retention=STREAM_RETENTION.resolve(),
    )
    assert publisher is not None  # without ``stop`` it raises instead of giving up

    def show(result: Any) -> None:
        verb = "would republish" if result.dry_run else "republished"
        print(f"{verb} {result.republished} events so far", file=sys.stderr, flush=True)

    try:
        result = republish(
            store_for(engine, schema),
            publisher,
            since=since,
            from_seq=args.from_seq,
            topic=args.topic,
            use_receipt_stream=args.stream is None,
            dry_run=args.dry_run,
            batch_size=args.batch_size,
            progress=Throttle(show),
        )
    except ConfigError:
        raise
    except Exception as exc:
        return _fail(f"republish failed: {type(exc).__name__}: {str(exc)[:300]}")
    finally:
        engine.dispose()
    for error in result.errors:
        print(f"{PROG}: not republished: {error}", file=sys.stderr)
    print(
        json.dumps(
            {
                "republished": result.republished,
                "failed": result.failed,
                "dry_run": result.dry_run,
                "streams": sorted(result.streams),
            }
        )
    )
    return 1 if result.failed else 0


def _live_line() -> Any:
    state = {"last": 0.0, "published": 0, "t": time.monotonic()}

    def show(relay: Any) -> None:
        now = time.monotonic()
        if now - state["last"] < 1.0:
            return
        try:
            backlog, oldest = relay.store.outbox_backlog()
        except Exception:
            backlog, oldest = -1, None
        rate = (relay.stats.published - state["published"]) / max(now - state["t"], 1e-9)
        state.update(last=now, published=relay.stats.published, t=now)
        age = "-" if oldest is None else f"{oldest:.2f}s"
        sys.stderr.write(
            f"\r\x1b[2Kpublished {relay.stats.published}  {rate:,.0f}/s  backlog {backlog}  "
            f"oldest {age}  quarantined {relay.stats.quarantined}"
        )
        sys.stderr.flush()

    return show


def cmd_demo(args: argparse.Namespace) -> int:
    require("http", "outbox-relay demo")  # its live view and chaos mode speak HTTP
    from relay.demo import run_demo

    return run_demo(args)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
