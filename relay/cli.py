"""``outbox-relay``: run the relay, inspect and repair the outbox, try the demo.

Every flag defaults from an ``OUTBOX_<FLAG>`` environment variable (``--database-url`` from
``OUTBOX_DATABASE_URL``, ``--batch-size`` from ``OUTBOX_BATCH_SIZE``, ...). With no database
URL the tools use ``outbox.db`` in the working directory; with no Redis URL an embedded
Redis server (``outbox-redis.db``). Exit status: 0 success, 1 failure, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from outbox.backoff import Backoff, retry_forever
from outbox.db import describe_url, make_engine
from outbox.env import env, env_float, env_int
from outbox.errors import ConfigError
from outbox.hooks import Hooks
from outbox.lifecycle import GracefulStop
from outbox.logs import setup_logging
from outbox.redis_client import is_cluster_url, redis_client
from outbox.schema import DEFAULT_TABLE, build_schema, create_schema
from relay.admin import requeue, status
from relay.config import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_PARTITIONS,
    DEFAULT_RETENTION_SECONDS,
    RelayConfig,
)
from relay.publisher import DEFAULT_STREAM_RETENTION, RedisStreamPublisher, StreamTemplate

log = logging.getLogger("outbox.relay")
PROG = "outbox-relay"


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on bad usage, as we want; keep its message on stderr."""


def _bool_env(name: str) -> bool:
    raw = env(name)
    return raw is not None and raw.strip().lower() in ("1", "true", "yes", "on")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=env("database_url"),
        help="SQLAlchemy URL (postgresql://... or sqlite:///file.db); "
        "env OUTBOX_DATABASE_URL; default: outbox.db in the working directory",
    )
    parser.add_argument(
        "--table", default=env("table", DEFAULT_TABLE), help="outbox table (env OUTBOX_TABLE)"
    )
    parser.add_argument(
        "--schema", default=env("schema"), help="database schema of the table (env OUTBOX_SCHEMA)"
    )
    parser.add_argument(
        "--log-level", default=env("log_level", "info"), help="log level (env OUTBOX_LOG_LEVEL)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Relay committed outbox events to Redis Streams.",
        epilog="Every flag defaults from OUTBOX_<FLAG> (e.g. OUTBOX_DATABASE_URL).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    run = sub.add_parser("run", help="run the relay until SIGTERM")
    _common(run)
    run.add_argument(
        "--redis-url",
        default=env("redis_url"),
        help="redis://host:port/db (env OUTBOX_REDIS_URL); default: an embedded Redis server",
    )
    _cluster_flag(run)
    run.add_argument(
        "--wait-replicas",
        type=int,
        default=None,
        metavar="N",
        help="record a receipt only after N replicas have the batch (WAIT N; env "
        "OUTBOX_WAIT_REPLICAS; default 0: do not wait)",
    )
    run.add_argument(
        "--wait-timeout",
        type=float,
        default=None,
        help="seconds WAIT may take before the batch is reconciled instead (env "
        "OUTBOX_WAIT_TIMEOUT; default 1)",
    )
    run.add_argument(
        "--stream",
        default=env("stream", "outbox.{topic}"),
        help="stream name template with {topic}, {tenant}, {partition} (env OUTBOX_STREAM; "
        "default outbox.{topic})",
    )
    run.add_argument("--batch-size", type=int, default=None, help="rows per cycle (default 500)")
    run.add_argument(
        "--partitions",
        type=int,
        default=None,
        help=f"key partitions shared by replicas, same on every replica (default "
        f"{DEFAULT_PARTITIONS})",
    )
    run.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    run.add_argument("--metrics-host", default=env("metrics_host", "127.0.0.1"))
    run.add_argument("--poll-interval", type=float, default=None, help="seconds (default 0.05)")
    run.add_argument(
        "--max-poll-interval", type=float, default=None, help="idle polling ceiling (default 1)"
    )
    run.add_argument(
        "--no-listen",
        action="store_true",
        default=_bool_env("no_listen"),
        help="PostgreSQL: poll only, no LISTEN/NOTIFY (env OUTBOX_NO_LISTEN=1)",
    )
    run.add_argument(
        "--retention",
        type=float,
        default=None,
        help=f"seconds to keep published rows; 0 keeps them (default "
        f"{int(DEFAULT_RETENTION_SECONDS)})",
    )
    run.add_argument(
        "--maxlen",
        type=int,
        default=None,
        help="approximate MAXLEN per stream, instead of --stream-retention (env OUTBOX_MAXLEN)",
    )
    run.add_argument(
        "--stream-retention",
        type=float,
        default=None,
        help=f"seconds of entries a stream keeps (XADD MINID ~), never one a consumer group "
        f"still has pending; 0 never trims (env OUTBOX_STREAM_RETENTION; default "
        f"{int(DEFAULT_STREAM_RETENTION)})",
    )
    run.add_argument(
        "--require-aof",
        action="store_true",
        default=_bool_env("require_aof"),
        help="refuse to start unless Redis runs with appendonly yes (env OUTBOX_REQUIRE_AOF=1)",
    )
    run.add_argument(
        "--auto-republish",
        action="store_true",
        default=_bool_env("auto_republish"),
        help="when Redis lost published entries, republish them without waiting for an "
        "operator (env OUTBOX_AUTO_REPUBLISH=1)",
    )
    run.add_argument(
        "--redis-check-interval",
        type=float,
        default=None,
        help="seconds between checks of Redis's persistence and of lost entries (default 60)",
    )
    run.add_argument("--source", default=env("source", "outbox"), help="CloudEvents source")
    run.add_argument("--once", action="store_true", help="run one cycle and exit")
    run.set_defaults(func=cmd_run)

    rp = sub.add_parser(
        "republish",
        help="publish retained events again (after Redis lost data); consumers deduplicate",
        description="Publish the retained (published) events again, as new entries, in "
        "per-key order, each to the stream its receipt names (or through --stream). The "
        "outbox's retention (default one day) is the recovery window. Progress on stderr, "
        "the count on stdout.",
    )
    _common(rp)
    rp.add_argument("--redis-url", default=env("redis_url"), help="env OUTBOX_REDIS_URL")
    _cluster_flag(rp)
    window = rp.add_mutually_exclusive_group(required=True)
    window.add_argument(
        "--since",
        metavar="TIME",
        help="events created at or after TIME: ISO-8601 with Z or an offset "
        "(2026-11-30T12:00:00Z) or unix seconds",
    )
    window.add_argument("--from-seq", type=int, metavar="N", help="events with seq >= N")
    rp.add_argument("--topic", default=None, help="only this topic")
    rp.add_argument(
        "--stream",
        default=None,
        metavar="TEMPLATE",
        help="route through this template instead of the stream each receipt names",
    )
    rp.add_argument("--dry-run", action="store_true", help="count, publish nothing")
    rp.add_argument("--batch-size", type=int, default=500, help="events per round trip")
    rp.add_argument("--source", default=env("source", "outbox"), help="CloudEvents source")
    rp.set_defaults(func=cmd_republish)

    st = sub.add_parser("status", help="backlog, oldest age, quarantined and attempts per topic")
    _common(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=cmd_status)

    rq = sub.add_parser("requeue", help="put quarantined events back, after a fix")
    _common(rq)
    rq.add_argument("event_ids", nargs="*", metavar="EVENT_ID")
    rq.add_argument("--all", action="store_true", help="every quarantined event")
    rq.set_defaults(func=cmd_requeue)

    pg = sub.add_parser(
        "purge",
        help="retention of published events (--dry-run shows what would go)",
        description="Delete published rows older than --retention, in batches (each its own "
        "short transaction), as the running relay does every minute. Pending and quarantined "
        "rows are never deleted. Progress on stderr, rows per table on stdout.",
    )
    _common(pg)
    pg.add_argument(
        "--retention",
        type=float,
        default=None,
        help="seconds published rows are kept (env OUTBOX_RETENTION; default "
        f"{int(DEFAULT_RETENTION_SECONDS)}; 0 keeps them)",
    )
    pg.add_argument("--batch-size", type=int, default=1000, help="rows per statement [1000]")
    pg.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    pg.add_argument("--json", action="store_true", help='{"dry_run": .., "tables": {..}}')
    pg.set_defaults(func=cmd_purge)

    init = sub.add_parser("init-db", help="create the outbox table, indexes and trigger")
    _common(init)
    init.add_argument(
        "--no-notify",
        dest="notify",
        action="store_false",
        help="no NOTIFY trigger (PostgreSQL; drops an existing one): relays wake by polling, "
        "and concurrent writers' commits do not queue on NOTIFY's global lock",
    )
    init.set_defaults(func=cmd_init_db)

    demo = sub.add_parser(
        "demo",
        help="the whole loop on the embedded default: writes, relay, consumer dedup, jobs",
    )
    _common(demo)
    demo.add_argument("--redis-url", default=env("redis_url"))
    _cluster_flag(demo)
    demo.add_argument("--rate", type=float, default=20.0, help="quotes approved per second")
    demo.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    demo.add_argument(
        "--chaos",
        action="store_true",
        help="worker processes send each quote's email through the connector simulator "
        "service, and one is SIGKILLed mid-send every 1-2 s: still one email per quote",
    )
    demo.add_argument(
        "--workers", type=int, default=3, help="worker processes with --chaos (default 3)"
    )
    demo.set_defaults(func=cmd_demo)

    try:  # `outbox-relay metrics` when the metrics package provides it
        from metrics.cli import add_metrics_command

        add_metrics_command(sub)
    except ImportError:  # pragma: no cover
        pass
    return parser


def _cluster_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        default=_bool_env("redis_cluster"),
        help="--redis-url names any node of a Redis Cluster (env OUTBOX_REDIS_CLUSTER=1; "
        "a redis+cluster:// URL says the same)",
    )


def uses_cluster(args: argparse.Namespace) -> bool:
    """``--redis-cluster``, OUTBOX_REDIS_CLUSTER=1 or a ``redis+cluster://`` URL."""
    return bool(getattr(args, "redis_cluster", False)) or is_cluster_url(args.redis_url)


def connect_redis(args: argparse.Namespace, stop: GracefulStop | None = None) -> Any:
    """The Redis client of ``--redis-url``: a RedisCluster with ``--redis-cluster`` (it reads
    the slot map at once, so with ``stop`` it waits and retries while the seed is down; None
    once stopped), a plain client otherwise."""
    if not uses_cluster(args):
        return redis_client(args.redis_url)
    if stop is None:
        return redis_client(args.redis_url, cluster=True)
    import redis
    from redis.exceptions import RedisClusterException

    return retry_forever(
        "connecting to the Redis Cluster",
        lambda: redis_client(args.redis_url, cluster=True),
        stop,
        (redis.RedisError, RedisClusterException, OSError),
    )


def _int_flag(value: int | None, name: str, default: int) -> int:
    return value if value is not None else env_int(name, default)


def _float_flag(value: float | None, name: str, default: float) -> float:
    return value if value is not None else env_float(name, default)


def relay_config(args: argparse.Namespace) -> RelayConfig:
    """Flags and environment into the frozen config (ConfigError names a bad value)."""
    poll = _float_flag(args.poll_interval, "poll_interval", 0.05)
    return RelayConfig(
        batch_size=_int_flag(args.batch_size, "batch_size", DEFAULT_BATCH_SIZE),
        partitions=_int_flag(args.partitions, "partitions", DEFAULT_PARTITIONS),
        poll_interval=poll,
        max_poll_interval=_float_flag(args.max_poll_interval, "max_poll_interval", max(1.0, poll)),
        listen=not args.no_listen,
        retention_seconds=_float_flag(args.retention, "retention", DEFAULT_RETENTION_SECONDS),
        redis_check_interval=_float_flag(args.redis_check_interval, "redis_check_interval", 60.0),
        auto_republish=bool(args.auto_republish),
        wait_replicas=_int_flag(args.wait_replicas, "wait_replicas", 0),
        wait_timeout=_float_flag(args.wait_timeout, "wait_timeout", 1.0),
    )


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return code


def _engine_and_schema(args: argparse.Namespace) -> tuple[Any, Any]:
    schema = build_schema(args.table, args.schema)
    engine = make_engine(args.database_url)
    return engine, schema


def _db_problem(exc: BaseException, args: argparse.Namespace) -> str:
    url = describe_url(args.database_url) if args.database_url else "the default SQLite file"
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = detail[0] if detail else type(exc).__name__
    return f"cannot use the database at {url}: {first}"


# -- commands --------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    engine, schema = _engine_and_schema(args)
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
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return 0


def cmd_requeue(args: argparse.Namespace) -> int:
    if args.all and args.event_ids:
        return _fail("give event ids or --all, not both", 2)
    if not args.all and not args.event_ids:
        return _fail("give at least one EVENT_ID, or --all", 2)
    engine, schema = _engine_and_schema(args)
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

    retention = _float_flag(args.retention, "retention", DEFAULT_RETENTION_SECONDS)
    engine, schema = _engine_and_schema(args)
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
        create_schema(engine, schema, notify=args.notify)
    except Exception as exc:
        return _fail(_db_problem(exc, args))
    finally:
        engine.dispose()
    print(f"outbox table {schema.qualified_name} ready at {describe_url(engine.url)}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from relay.relay import Relay, infrastructure_errors

    config = relay_config(args)
    StreamTemplate.parse(args.stream)  # a bad template fails before anything starts
    setup_logging(args.log_level)
    engine, schema = _engine_and_schema(args)
    stop = GracefulStop().install()
    client = connect_redis(args, stop)
    if client is None:
        return 0  # stopped while waiting for the cluster
    maxlen = args.maxlen if args.maxlen is not None else (env_int("maxlen", 0) or None)
    publisher = RedisStreamPublisher(
        client,
        args.stream,
        maxlen,
        source=args.source,
        stream_retention=_float_flag(
            args.stream_retention, "stream_retention", DEFAULT_STREAM_RETENTION
        ),
    )
    if args.require_aof:
        refusal = _aof_refusal(client, stop, args)
        if refusal is not None:
            return _fail(refusal)
    hooks: Hooks | None = None
    metrics_port = (
        args.metrics_port if args.metrics_port is not None else (env_int("metrics_port", -1))
    )
    if metrics_port is not None and metrics_port >= 0:
        from metrics import start_metrics

        hooks = start_metrics(metrics_port, args.metrics_host, engine=engine, outbox_schema=schema)
    infra = infrastructure_errors()

    # The schema is created if missing; while the database is down, wait and retry.
    def _create() -> bool:
        create_schema(engine, schema)
        return True

    done = retry_forever(
        "creating the outbox schema",
        _create,
        stop,
        infra,
        Backoff(0.2, 10.0),
    )
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


def _aof_refusal(client: Any, stop: GracefulStop, args: argparse.Namespace) -> str | None:
    """Why ``--require-aof`` refuses to start, or None (AOF is on). Waits while Redis is
    down, as the relay would."""
    from redis import RedisError

    from relay.redis_health import Persistence, check_persistence

    found: list[Persistence] = []

    def check() -> bool:
        found.append(check_persistence(client))
        return True

    if not retry_forever("checking Redis persistence", check, stop, (RedisError, OSError)):
        return "stopped before Redis answered"
    report = found[-1]
    if report.mode == "aof":
        return None
    where = args.redis_url or "the embedded Redis"
    if report.mode == "unknown":
        return (
            f"--require-aof: cannot tell whether Redis at {where} runs with AOF: "
            f"{report.detail}; drop --require-aof only if your provider guarantees it"
        )
    return (
        f"--require-aof: Redis at {where} runs without AOF (mode {report.mode}: "
        f"{report.detail}); a crash would lose entries the relay has acknowledged. Set "
        "appendonly yes (CONFIG SET appendonly yes, and in redis.conf)"
    )


def cmd_republish(args: argparse.Namespace) -> int:
    from relay.republish import Throttle, parse_since, republish
    from relay.store import open_store

    since = parse_since(args.since) if args.since is not None else None
    if args.from_seq is not None and args.from_seq < 0:
        raise ConfigError("from_seq", f"must be >= 0, got {args.from_seq}")
    if args.batch_size < 1 or args.batch_size > 10_000:
        raise ConfigError("batch_size", f"must be between 1 and 10000, got {args.batch_size}")
    template = args.stream or env("stream", "outbox.{topic}") or "outbox.{topic}"
    StreamTemplate.parse(template)
    setup_logging(args.log_level)
    engine, schema = _engine_and_schema(args)
    client = connect_redis(args)
    publisher = RedisStreamPublisher(
        client,
        template,
        source=args.source,
        stream_retention=env_float("stream_retention", DEFAULT_STREAM_RETENTION),
    )

    def show(result: Any) -> None:
        verb = "would republish" if result.dry_run else "republished"
        print(f"{verb} {result.republished} events so far", file=sys.stderr, flush=True)

    try:
        result = republish(
            open_store(engine, schema),
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
            backlog, oldest = relay.store.backlog()
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
    from relay.demo import run_demo

    return run_demo(args)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    # A SIGTERM before a command installs its graceful stop (during imports, connecting,
    # start-up) exits cleanly through SystemExit instead of dying by the signal.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"{PROG} {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
