"""``outbox-worker``: run job handlers.

```
outbox-worker run MODULE:ATTRIBUTE [--database-url URL] [--concurrency N] [--threads N]
                                   [--queues A,B=N] [--tenant-limit N] [--metrics-port PORT]
                                   ... (docs/reference/cli.md lists every flag)
outbox-worker init-db [--database-url URL]
outbox-worker queues pause NAME | resume NAME | list [--json]
outbox-worker receipts [--state STATE] [--limit N] [--json]
outbox-worker settle OPERATION_ID (--accepted REF | --not-sent) [--reason TEXT] [--by NAME]
outbox-worker reconcile [MODULE:ATTRIBUTE] [--limit N] [--json]
outbox-worker purge [--dry-run] [--json] [--batch-size N] [--job-retention S] ...
outbox-worker jobs reply JOB [ACTION] --reply-id ID --payload JSON [--source NAME] [--json]
outbox-worker jobs cancel JOB [ACTION] --reason TEXT [--json]
outbox-worker jobs show TENANT ACTION [--json]
outbox-worker inbound serve [--host 127.0.0.1] [--port 8790] [--secret-file FILE]
                            [--max-body BYTES] [--window SECONDS]
```

``inbound serve`` runs the signed inbound endpoint alone (``consumer.jobs.inbound``: replies
and delivery callbacks over HTTP, HMAC-SHA256 of ``timestamp.body``). Its secret is
``OUTBOX_INBOUND_SECRET``, else the first line of ``--secret-file`` (16 characters or more;
none is a usage error, exit 2).

``--queues mail=8,billing`` claims from queues mail and billing, with 8 of the slots for mail
alone and the rest of ``--concurrency`` for billing (``consumer.jobs.config``).

``queues pause NAME`` stops every worker claiming from queue NAME (the jobs in hand run to
their end), ``queues resume NAME`` lets them claim again, ``queues list`` shows each queue's
READY jobs, the oldest READY age and whether it is paused (``--json``).

``jobs reply`` and ``jobs cancel`` answer or cancel one job (``consumer.jobs.job_cli``);
``jobs show`` prints one, with its result, parents and children (``consumer.jobs.step_cli``).

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
environment variable (``OUTBOX_DATABASE_URL``, ``OUTBOX_CONCURRENCY``, ``OUTBOX_THREADS``,
``OUTBOX_BATCH_SIZE``,
``OUTBOX_TTL``, ``OUTBOX_NO_LISTEN``, ``OUTBOX_RECONCILE_INTERVAL``, ``OUTBOX_RECOVER_INTERVAL``,
``OUTBOX_SCHEDULE_INTERVAL``,
``OUTBOX_LIVENESS_TTL``, ``OUTBOX_LIVENESS_INTERVAL``, ``OUTBOX_QUEUES``,
``OUTBOX_TENANT_LIMIT``, ``OUTBOX_METRICS_PORT``,
``OUTBOX_METRICS_HOST``, ``OUTBOX_LOG_LEVEL``); with no database URL, a SQLite file in the
working directory. Exit codes: 0 after a clean stop (SIGTERM/SIGINT drain the jobs in hand),
1 on failure, 2 on bad usage, 130 interrupted. The flags are declared with :mod:`outbox.cli`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from consumer.jobs.job_cli import add_jobs_command
from consumer.jobs.order_cli import add_keys_command
from consumer.jobs.purge import (
    WINDOWS,
    add_purge_command,
    add_window_flags,
    configured_from_environment,
    purge_command,
    retention_config,
)
from consumer.jobs.schedule_cli import add_schedules_command
from outbox.cli import (
    DATABASE,
    DATABASE_URL,
    LOGGING,
    METRICS,
    Flag,
    Parser,
    UsageError,
    add_flags,
    existing_database_url,
    given_as,
    load_target,
    port,
    run_main,
)
from outbox.db import default_database_url, describe_url, same_database
from outbox.display import printable, table
from outbox.extras import require
from outbox.logs import fields, setup_logging

if TYPE_CHECKING:
    from consumer.jobs.config import WorkerConfig
    from consumer.jobs.store import Store
    from consumer.jobs.worker import Worker

log = logging.getLogger("outbox.worker")


PROG = "outbox-worker"


def _worker_default(setting: str) -> str:
    from consumer.jobs.worker import WorkerConfig

    return f"the Worker's, else {getattr(WorkerConfig(), setting)}"


def build_parser() -> Parser:
    parser = Parser(prog=PROG, description="Run durable job handlers (fenced leases).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the handlers of a Worker until SIGTERM")
    run.add_argument("target", help="MODULE:ATTRIBUTE naming a Worker or a factory of one")
    add_flags(
        run,
        Flag(
            "--concurrency",
            int,
            "slots: jobs in flight per process (a worker never leases more than its free slots)",
            shown_default=_worker_default("concurrency"),
            metavar="N",
        ),
        Flag(
            "--threads",
            int,
            "threads that run def handlers at once (the other claimed jobs wait for one, "
            "holding no thread)",
            shown_default="the Worker's, else sized from the CPUs and the jobs' waits",
            metavar="N",
        ),
        Flag(
            "--batch-size",
            int,
            "jobs one run_once cycle claims (run uses the free slots)",
            shown_default=_worker_default("batch_size"),
            metavar="N",
        ),
        Flag("--ttl", float, "lease seconds", shown_default=_worker_default("ttl"), metavar="S"),
        Flag("--no-listen", bool, "PostgreSQL: poll only, no LISTEN for new jobs"),
        Flag(
            "--claim-ahead",
            bool,
            "deprecated, no effect: a freed slot starts its next job at once without a "
            "buffer of claimed jobs",
        ),
        Flag(
            "--reconcile-interval",
            float,
            "seconds between receipt sweeps when the Worker has providers",
            shown_default=_worker_default("reconcile_interval"),
            metavar="S",
        ),
        Flag(
            "--recover-interval",
            float,
            "seconds between sweeps of expired leases and due timers",
            shown_default=_worker_default("recover_interval"),
            metavar="S",
        ),
        Flag(
            "--schedule-interval",
            float,
            "the schedules' firing duty runs at each schedule's next slot and at least this "
            "often (a schedule defined or resumed meanwhile)",
            shown_default=_worker_default("schedule_interval"),
            metavar="S",
        ),
        Flag(
            "--liveness-ttl",
            float,
            "a worker that has not beaten for this long is dead: its leases are taken back",
            shown_default=_worker_default("liveness_ttl"),
            metavar="S",
        ),
        Flag(
            "--liveness-interval",
            float,
            "seconds between liveness beats (and sweeps for dead workers)",
            shown_default=_worker_default("liveness_interval"),
            metavar="S",
        ),
        Flag(
            "--queues",
            queue_names,
            "claim only from these queues, comma-separated; NAME=N gives a queue N slots of "
            "its own out of --concurrency (the others share the rest)",
            shown_default="the Worker's, else every queue",
            metavar="A,B=N",
        ),
        Flag(
            "--tenant-limit",
            int,
            "at most N jobs of one tenant leased at once in a queue, over every worker",
            shown_default="the Worker's, else no limit",
            metavar="N",
        ),
        *METRICS,
    )
    run.set_defaults(func=_run)
    init = sub.add_parser("init-db", help="create the job tables")
    init.set_defaults(func=_init_db)
    queues = sub.add_parser(
        "queues",
        help="pause, resume or list the job queues",
        description="Pause a queue (no worker claims from it; the jobs in hand run to their "
        "end, new jobs are still enqueued), resume it, or list the queues with their READY "
        "jobs, the oldest READY age and whether they are paused.",
    )
    queues.add_argument("action", choices=("pause", "resume", "list"), help="what to do")
    queues.add_argument("name", nargs="?", default=None, help="the queue (pause, resume)")
    add_flags(queues, Flag("--json", bool, "list: one JSON object", env=None))
    queues.set_defaults(func=_queues)
    receipts = sub.add_parser("receipts", help="list operation receipts")
    add_flags(
        receipts,
        Flag(
            "--state",
            help="only receipts in this state (PENDING, ACCEPTED, UNKNOWN, NOT_SENT, FAILED)",
            env=None,
        ),
        Flag("--limit", int, "at most this many", default=100, env=None, metavar="N"),
        Flag("--json", bool, "one JSON array", env=None),
    )
    settle = sub.add_parser("settle", help="record an operator's decision on an operation")
    settle.add_argument("operation_id", help="the operation id (see receipts)")
    add_flags(
        settle.add_mutually_exclusive_group(required=True),
        Flag("--accepted", help="it happened: the provider's ref", env=None, metavar="REF"),
        Flag("--not-sent", bool, "it did not happen: send once", env=None),
    )
    add_flags(
        settle,
        Flag("--reason", help="why (kept with the receipt)", env=None),
        Flag("--by", help="who decides", shown_default="the OS user", env=None),
    )
    sweep = sub.add_parser(
        "reconcile", help="settle PENDING/UNKNOWN receipts whose call deadline passed"
    )
    sweep.add_argument(
        "target", nargs="?", default=None, help="MODULE:ATTRIBUTE: the Worker with the providers"
    )
    add_flags(
        sweep,
        Flag("--limit", int, "receipts per sweep", default=100, env=None, metavar="N"),
        Flag("--json", bool, "the result as JSON", env=None),
    )
    for p in (receipts, settle, sweep):
        p.set_defaults(func=_operations_command)
    purge = add_purge_command(sub)
    purge.set_defaults(func=purge_command)
    schedules = add_schedules_command(sub)  # consumer.jobs.schedule_cli
    jobs = add_jobs_command(sub)  # consumer.jobs.job_cli
    keys = add_keys_command(sub)  # consumer.jobs.order_cli
    inbound = sub.add_parser(
        "inbound",
        help="serve the signed inbound endpoint (replies, delivery callbacks)",
        description="Serve consumer.jobs.inbound alone: POST /replies, /deliveries and "
        "/webhooks/NAME, signed with HMAC-SHA256 of 'timestamp.body' (X-Outbox-Timestamp, "
        "X-Outbox-Signature: v1=HEX). SIGTERM drains and exits 0.",
    )
    inbound.add_argument("action", choices=("serve",), help="what to do")
    add_flags(
        inbound,
        Flag("--host", help="bind address", default="127.0.0.1", env="OUTBOX_INBOUND_HOST"),
        Flag("--port", port, "port", default=8790, env="OUTBOX_INBOUND_PORT", metavar="PORT"),
        Flag(
            "--secret-file",
            help="file whose first line is the shared secret; OUTBOX_INBOUND_SECRET wins over it",
            env="OUTBOX_INBOUND_SECRET_FILE",
            metavar="FILE",
        ),
        Flag(
            "--tenant-secrets",
            help="JSON file of each tenant's secrets ({tenant: secret or [secrets]}): "
            "requests with X-Outbox-Tenant reach that tenant's jobs only",
            env="OUTBOX_INBOUND_TENANT_SECRETS",
            metavar="FILE",
        ),
        Flag(
            "--max-body",
            int,
            "largest request body in bytes",
            default=65536,
            env="OUTBOX_INBOUND_MAX_BODY",
            metavar="BYTES",
        ),
        Flag(
            "--window",
            float,
            "seconds a signature's timestamp stays valid (replays)",
            default=300.0,
            env="OUTBOX_INBOUND_WINDOW",
            metavar="S",
        ),
    )
    inbound.set_defaults(func=_inbound)
    add_window_flags(run)  # the retention duty's windows (consumer.jobs.purge)
    for command in (
        run,
        init,
        queues,
        receipts,
        settle,
        sweep,
        purge,
        inbound,
        schedules,
        jobs,
        keys,
    ):
        add_flags(command, *DATABASE, *LOGGING)
    return parser


def load_worker(target: str) -> Any:
    """Import ``MODULE:ATTRIBUTE`` (from the working directory too) and return the Worker,
    calling a factory if needed."""
    from consumer.jobs.worker import Worker

    return load_target(target, Worker, example="myapp.jobs:worker")


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv, command=_command)


def _command(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.command in ("init-db", "run"):  # these create the tables (run: a fresh default)
        url = args.database_url or default_database_url()
    else:  # the others read or repair what is there
        url = existing_database_url(args.database_url)
    return int(args.func(args, url))


def _init_db(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    Store(url).dispose()
    log.info("job tables ready", extra=fields(database=describe_url(url)))
    return 0


def _run(args: argparse.Namespace, url: str) -> int:
    """``outbox-worker run``: the final worker is built before it runs (its config from the
    flags and ``OUTBOX_*``, its store, its hooks); the user's worker is left as it was."""
    loaded = load_worker(args.target)
    config = _run_config(args, loaded.config)
    store = _run_store(args, url, loaded)
    hooks = loaded.hooks
    if args.metrics_port is not None:
        from metrics import start_metrics  # lazily: only with the flag

        hooks = start_metrics(args.metrics_port, args.metrics_host, engine=store.engine)
    worker = loaded.bound(store=store, config=config, hooks=hooks)
    log.info(
        "outbox-worker starting",
        extra=fields(
            database=describe_url(str(store.engine.url)),
            concurrency=config.concurrency,
            queues=list(config.queues) if config.queues is not None else None,
        ),
    )
    worker.run()
    return 0


_RUN_OPTIONS = (
    "concurrency",
    "threads",
    "batch_size",
    "ttl",
    "reconcile_interval",
    "recover_interval",
    "schedule_interval",
    "liveness_ttl",
    "liveness_interval",
)


def _run_config(args: argparse.Namespace, base: WorkerConfig) -> WorkerConfig:
    """The worker's config with the flags (and ``OUTBOX_*``) given over it."""
    options: dict[str, Any] = {
        option: getattr(args, option)
        for option in _RUN_OPTIONS
        if getattr(args, option) is not None
    }
    if args.no_listen:
        options["listen"] = False
    if args.claim_ahead:
        options["claim_ahead"] = True
    if args.queues is not None:
        options["queues"] = args.queues
        if isinstance(args.queues, list):  # the Worker's own slots stay for queues still named
            kept = base.queue_slots
            options["queue_slots"] = {q: n for q, n in kept.items() if q in args.queues}
    if args.tenant_limit is not None:
        options["tenant_limit"] = args.tenant_limit
    if configured_from_environment() or any(
        getattr(args, flag.replace("-", "_")) is not None for flag, *_ in WINDOWS
    ):
        options["retention"] = retention_config(args)
    return replace(base, **options) if options else base


def _run_store(args: argparse.Namespace, url: str, loaded: Worker) -> Store:
    """The worker's own store, or one on ``url``; a database named that is not the worker's
    own is refused, never ignored (the Worker would run on another database)."""
    from consumer.jobs.store import Store

    if loaded.store is None:
        return Store(url)
    if args.database_url is not None and not same_database(
        args.database_url, loaded.store.engine.url
    ):
        raise UsageError(
            f"{given_as(args, DATABASE_URL)} cannot apply: {args.target} built its own Store "
            f"on {describe_url(loaded.store.engine.url)}; drop {given_as(args, DATABASE_URL)}, "
            "or build the Worker without a store to take the database from the command line"
        )
    return loaded.store


def queue_names(raw: str) -> list[str] | dict[str, int | None]:
    """``--queues a,b`` (and ``OUTBOX_QUEUES``): the queue names, comma-separated; a name
    may carry slots of its own, ``mail=8,billing`` (then a mapping, None: shares the rest)."""
    names = [name.strip() for name in raw.split(",")]
    if not all(names):
        raise ValueError(f"{raw!r} is not a comma-separated list of queue names")
    if not any("=" in name for name in names):
        return names
    slots: dict[str, int | None] = {}
    for item in names:
        name, sep, count = (part.strip() for part in item.partition("="))
        if not name or (sep and not (count.isascii() and count.isdigit() and int(count) > 0)):
            raise ValueError("each queue is NAME or NAME=SLOTS (a positive integer)")
        slots[name] = int(count) if sep else None
    return slots


# complexity: one branch per queues subcommand (list, pause, resume) and format
def _queues(args: argparse.Namespace, url: str) -> int:
    from consumer.jobs.store import Store

    if args.action in ("pause", "resume") and not args.name:
        raise UsageError(f"queues {args.action} needs the queue's NAME")
    if args.action == "list" and args.name:
        raise UsageError("queues list takes no NAME")
    store = Store(url)
    try:
        if args.action == "pause":
            changed = store.pause_queue(args.name)
            print(f"{printable(args.name)}: paused" + ("" if changed else " (it was already)"))
            return 0
        if args.action == "resume":
            changed = store.resume_queue(args.name)
            print(f"{printable(args.name)}: running" + ("" if changed else " (it was not paused)"))
            return 0
        depth = store.depth()
        if args.json:
            print(json.dumps({name: d.as_dict() for name, d in depth.items()}, indent=2))
            return 0
        rows = [
            (d.queue, str(d.ready), f"{d.oldest_ready_age_seconds:.1f}", "yes" if d.paused else "")
            for d in depth.values()
        ]
        header = ("QUEUE", "READY", "OLDEST_READY_S", "PAUSED")
        print(table([header, *rows]))
        return 0
    finally:
        store.dispose()


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
                not_sent=bool(args.not_sent),
                reason=args.reason,
                by=args.by,
            )
            print(
                f"{printable(receipt.operation_id)}: {receipt.state} "
                f"(settled by {printable(receipt.settled_by)})"
            )
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


def _inbound(args: argparse.Namespace, url: str) -> int:
    import os
    import signal

    require("inbound", "outbox-worker inbound serve")
    import uvicorn

    from consumer.jobs.inbound import InboundApp
    from consumer.jobs.inbound_scope import server_secrets
    from consumer.jobs.store import Store

    secret, tenants = server_secrets(
        os.environ.get("OUTBOX_INBOUND_SECRET", ""), args.secret_file, args.tenant_secrets
    )
    store = Store(url)
    try:
        app = InboundApp(
            store, secret, tenant_secrets=tenants, max_body=args.max_body, window=args.window
        )
        if args.host != "127.0.0.1":
            log.warning(
                "the inbound endpoint listens beyond this machine: put TLS in front of it",
                extra=fields(host=args.host),
            )
        print(f"outbox-worker: inbound serving http://{args.host}:{args.port}/", flush=True)
        log.info(
            "inbound serving",
            extra=fields(host=args.host, port=args.port, database=describe_url(url)),
        )
        # uvicorn drains on SIGTERM/SIGINT, then raises the signal again under the handler
        # it found at start: no-op handlers make that second delivery harmless (exit 0).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        uvicorn.run(  # no forwarded headers: nothing here trusts a client's address
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            proxy_headers=False,
        )
        return 0
    finally:
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
    print(table([header, *rows]))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
