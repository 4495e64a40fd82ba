"""``outbox-worker``: run job handlers.

```
outbox-worker run MODULE:ATTRIBUTE [--database-url URL] [--concurrency N] [--batch-size N]
                                   [--ttl SECONDS] [--no-listen] [--reconcile-interval SECONDS]
                                   [--recover-interval SECONDS] [--liveness-ttl SECONDS]
                                   [--liveness-interval SECONDS]
                                   [--metrics-port PORT] [--metrics-host HOST]
                                   [--log-level LEVEL]
outbox-worker init-db [--database-url URL]
outbox-worker receipts [--state STATE] [--limit N] [--json]
outbox-worker settle OPERATION_ID (--accepted REF | --not-sent) [--reason TEXT] [--by NAME]
outbox-worker reconcile [MODULE:ATTRIBUTE] [--limit N] [--json]
outbox-worker purge [--dry-run] [--json] [--batch-size N] [--job-retention S] ...
```

``purge`` runs the job store's retention now (``consumer.jobs.purge`` has its flags; ``run``
takes the same window flags for its retention duty).

``receipts`` lists operation receipts (oldest change first; ``--state UNKNOWN`` filters).
``settle`` records an operator's decision on an operation the system cannot settle itself:
``--accepted REF`` (it happened: the job finishes without a resend) or ``--not-sent`` (it did
not: the job becomes READY and sends once), with ``--reason`` and who (``--by``, default the
OS user) and when; settling an ACCEPTED receipt is refused (exit 1). ``reconcile`` sweeps
PENDING/UNKNOWN receipts whose call deadline passed, with the providers of the Worker named
by ``MODULE:ATTRIBUTE`` (lookups need them; without one it settles nothing).

``MODULE:ATTRIBUTE`` names a :class:`consumer.Worker` or a zero-argument factory returning
one. A worker built without a Store gets ``Store(--database-url)``; flags override its
concurrency, batch size and ttl when given. Every flag defaults to an ``OUTBOX_*``
environment variable (``OUTBOX_DATABASE_URL``, ``OUTBOX_CONCURRENCY``, ``OUTBOX_BATCH_SIZE``,
``OUTBOX_TTL``, ``OUTBOX_NO_LISTEN``, ``OUTBOX_RECONCILE_INTERVAL``, ``OUTBOX_RECOVER_INTERVAL``,
``OUTBOX_LIVENESS_TTL``, ``OUTBOX_LIVENESS_INTERVAL``, ``OUTBOX_METRICS_PORT``,
``OUTBOX_METRICS_HOST``, ``OUTBOX_LOG_LEVEL``); with no database URL, a SQLite file in the
working directory. Exit codes: 0 after a clean stop (SIGTERM/SIGINT drain the jobs in hand),
1 on failure, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

from consumer.jobs.purge import (
    WINDOWS,
    add_purge_command,
    add_window_flags,
    configured_from_environment,
    purge_command,
    retention_config,
)
from outbox.db import default_database_url, describe_url
from outbox.env import env, env_float, env_int
from outbox.errors import OutboxError
from outbox.logs import fields, setup_logging

log = logging.getLogger("outbox.worker")


class UsageError(Exception):
    """Bad usage: exit 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-worker", description="Run durable job handlers (fenced leases)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the handlers of a Worker until SIGTERM")
    run.add_argument("target", help="MODULE:ATTRIBUTE naming a Worker or a factory of one")
    run.add_argument(
        "--concurrency", type=int, default=None, help="worker loops (threads) [OUTBOX_CONCURRENCY]"
    )
    run.add_argument(
        "--batch-size", type=int, default=None, help="jobs claimed per cycle [OUTBOX_BATCH_SIZE]"
    )
    run.add_argument("--ttl", type=float, default=None, help="lease seconds [OUTBOX_TTL]")
    run.add_argument(
        "--no-listen",
        action="store_true",
        default=None,
        help="PostgreSQL: poll only, no LISTEN for new jobs [OUTBOX_NO_LISTEN=1]",
    )
    run.add_argument(
        "--reconcile-interval",
        type=float,
        default=None,
        help="seconds between receipt sweeps when the Worker has providers "
        "[OUTBOX_RECONCILE_INTERVAL, 10]",
    )
    run.add_argument(
        "--recover-interval",
        type=float,
        default=None,
        help="seconds between sweeps of expired leases and due timers [OUTBOX_RECOVER_INTERVAL, 5]",
    )
    run.add_argument(
        "--liveness-ttl",
        type=float,
        default=None,
        help="a worker that has not beaten for this long is dead: its leases are taken back "
        "[OUTBOX_LIVENESS_TTL, 3]",
    )
    run.add_argument(
        "--liveness-interval",
        type=float,
        default=None,
        help="seconds between liveness beats (and sweeps for dead workers) "
        "[OUTBOX_LIVENESS_INTERVAL, 1]",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port [OUTBOX_METRICS_PORT]",
    )
    run.add_argument(
        "--metrics-host", default=None, help="metrics bind address [OUTBOX_METRICS_HOST, 127.0.0.1]"
    )
    init = sub.add_parser("init-db", help="create the job tables")
    receipts = sub.add_parser("receipts", help="list operation receipts")
    receipts.add_argument(
        "--state",
        default=None,
        help="only receipts in this state (PENDING, ACCEPTED, UNKNOWN, NOT_SENT, FAILED)",
    )
    receipts.add_argument("--limit", type=int, default=100, help="at most this many [100]")
    receipts.add_argument("--json", action="store_true", help="one JSON array")
    settle = sub.add_parser("settle", help="record an operator's decision on an operation")
    settle.add_argument("operation_id", help="the operation id (see receipts)")
    decision = settle.add_mutually_exclusive_group(required=True)
    decision.add_argument("--accepted", metavar="REF", help="it happened: the provider's ref")
    decision.add_argument("--not-sent", action="store_true", help="it did not happen: send once")
    settle.add_argument("--reason", default=None, help="why (kept with the receipt)")
    settle.add_argument("--by", default=None, help="who decides [the OS user]")
    sweep = sub.add_parser(
        "reconcile", help="settle PENDING/UNKNOWN receipts whose call deadline passed"
    )
    sweep.add_argument(
        "target", nargs="?", default=None, help="MODULE:ATTRIBUTE: the Worker with the providers"
    )
    sweep.add_argument("--limit", type=int, default=100, help="receipts per sweep [100]")
    sweep.add_argument("--json", action="store_true", help="the result as JSON")
    purge = add_purge_command(sub)
    add_window_flags(run)  # the retention duty's windows (consumer.jobs.purge)
    for p in (run, init, receipts, settle, sweep, purge):
        p.add_argument(
            "--database-url", default=None, help="SQLAlchemy URL [OUTBOX_DATABASE_URL, ./outbox.db]"
        )
        p.add_argument("--log-level", default=None, help="log level [OUTBOX_LOG_LEVEL, info]")
    return parser


def load_worker(target: str) -> Any:
    """Import ``MODULE:ATTRIBUTE`` and return the Worker (calling a factory if needed)."""
    from consumer.jobs.worker import Worker

    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"target {target!r} must be MODULE:ATTRIBUTE")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from None
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, Worker) and callable(obj):
        obj = obj()
    if not isinstance(obj, Worker):
        raise UsageError(f"{target!r} is not a Worker nor a factory returning one")
    return obj


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help is 0, bad usage 2
        return int(exc.code or 0)
    try:
        setup_logging(args.log_level or env("LOG_LEVEL", "info") or "info")
        url = args.database_url or env("DATABASE_URL") or default_database_url()
        if args.command == "init-db":
            from consumer.jobs.store import Store

            Store(url).dispose()
            log.info("job tables ready", extra=fields(database=describe_url(url)))
            return 0
        if args.command == "purge":
            return purge_command(args, url)
        if args.command in ("receipts", "settle", "reconcile"):
            return _operations_command(args, url)
        return _run(args, url)
    except UsageError as exc:
        print(f"outbox-worker: {exc}", file=sys.stderr)
        return 2
    except OutboxError as exc:
        # configuration problems (ConfigError, JobError) are bad usage too
        print(f"outbox-worker: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except Exception as exc:
        log.exception("worker failed", extra=fields(error=repr(exc)))
        return 1


def _run(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    worker = load_worker(args.target)
    options: dict[str, Any] = {}
    concurrency = args.concurrency if args.concurrency is not None else _env_opt_int("CONCURRENCY")
    batch = args.batch_size if args.batch_size is not None else _env_opt_int("BATCH_SIZE")
    ttl = args.ttl if args.ttl is not None else _env_opt_float("TTL")
    if concurrency is not None:
        options["concurrency"] = concurrency
    if batch is not None:
        options["batch_size"] = batch
    if ttl is not None:
        options["ttl"] = ttl
    if args.no_listen or env("NO_LISTEN") == "1":
        options["listen"] = False
    sweep = (
        args.reconcile_interval
        if args.reconcile_interval is not None
        else _env_opt_float("RECONCILE_INTERVAL")
    )
    if sweep is not None:
        options["reconcile_interval"] = sweep
    for option, flag in (
        ("recover_interval", args.recover_interval),
        ("liveness_ttl", args.liveness_ttl),
        ("liveness_interval", args.liveness_interval),
    ):
        value = flag if flag is not None else _env_opt_float(option.upper())
        if value is not None:
            options[option] = value
    if configured_from_environment() or any(
        getattr(args, flag.replace("-", "_")) is not None for flag, *_ in WINDOWS
    ):
        options["retention"] = retention_config(args)
    if options:
        worker.config = replace(worker.config, **options)
    if worker.store is None:
        worker.store = Store(url)
    port = args.metrics_port if args.metrics_port is not None else _env_opt_int("METRICS_PORT")
    if port is not None:
        from metrics import start_metrics  # lazily: only with the flag

        host = args.metrics_host or env("METRICS_HOST", "127.0.0.1") or "127.0.0.1"
        worker.hooks = start_metrics(port, host, engine=worker.store.engine)
    log.info(
        "outbox-worker starting",
        extra=fields(
            database=describe_url(str(worker.store.engine.url)),
            concurrency=worker.config.concurrency,
        ),
    )
    worker.run()
    return 0


def _operations_command(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.operations import Operations
    from consumer.jobs.store import Store

    providers: dict[str, Any] = {}
    timeout = 30.0
    if args.command == "reconcile" and args.target:
        worker = load_worker(args.target)
        providers = dict(worker.providers)
        timeout = worker.default_timeout
    store = Store(url)
    try:
        ops = Operations(store, providers, default_timeout=timeout)
        if args.command == "receipts":
            found = ops.receipts(args.state, limit=args.limit)
            if args.json:
                print(json.dumps([r.as_dict() for r in found], indent=2))
            else:
                _print_receipts(found)
            return 0
        if args.command == "settle":
            receipt = ops.settle(
                args.operation_id,
                accepted=args.accepted,
                not_sent=args.not_sent,
                reason=args.reason,
                by=args.by,
            )
            print(f"{receipt.operation_id}: {receipt.state} (settled by {receipt.settled_by})")
            return 0
        if not providers:
            print(
                "outbox-worker: no providers (name the Worker): nothing looked up", file=sys.stderr
            )
        result = ops.reconcile(limit=args.limit)
        if args.json:
            print(json.dumps(result.__dict__))
        else:
            print(" ".join(f"{k}={v}" for k, v in result.__dict__.items()))
        return 0
    finally:
        for provider in providers.values():
            close = getattr(provider, "close", None)
            if callable(close):
                close()
        store.dispose()


def _print_receipts(receipts: list[Any]) -> None:
    header = ("OPERATION", "STATE", "JOB", "PROVIDER", "CALLS", "REF", "NOTE")
    rows = [
        (
            r.operation_id,
            r.state,
            str(r.job_id),
            r.provider or "",
            str(r.attempts),
            r.provider_ref or "",
            (r.settled_reason or r.last_error or "")[:60],
        )
        for r in receipts
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())


def _env_opt_int(name: str) -> int | None:
    return env_int(name, 0) if env(name) is not None else None


def _env_opt_float(name: str) -> float | None:
    return env_float(name, 0.0) if env(name) is not None else None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
