"""``outbox-worker purge``: the job store's retention on demand, and the windows' flags.

```
outbox-worker purge [--database-url URL] [--dry-run] [--json] [--batch-size N]
                    [--job-retention S] [--inbox-window S] [--outbox-retention S]
                    [--stream-retention S] [--redelivery-margin S] [--worker-grace S]
                    [--dead-letter-retention S] [--audit-retention S]
```

Deletes what the workers' retention duty deletes every minute (``consumer.jobs.retention``):
DONE and CANCELLED jobs past ``--job-retention`` with their attempts, intents and receipts,
the liveness rows of workers gone longer than ``--worker-grace``, the operator console's
audit rows past ``--audit-retention`` (``outbox_audit``, when present); and, when the
consumer's tables are in the same database, replayed dead letters past
``--dead-letter-retention`` (``consumer.retention``). Batches of ``--batch-size`` rows, each
its own short transaction, until nothing is due; progress on stderr, rows per table on
stdout. ``--dry-run`` counts what would go and deletes nothing.

The windows are checked against each other as in the worker (the safety rule): a job
retention shorter than the inbox window, or than the outbox's or the stream's retention plus
the redelivery margin, is refused (exit 2). Each flag defaults from its environment variable
(``OUTBOX_JOB_RETENTION``, ``OUTBOX_INBOX_WINDOW``, ``OUTBOX_RETENTION`` and
``OUTBOX_STREAM_RETENTION`` as the relay reads them, ``OUTBOX_REDELIVERY_MARGIN``,
``OUTBOX_WORKER_GRACE``, ``OUTBOX_DEAD_LETTER_RETENTION``, ``OUTBOX_AUDIT_RETENTION``);
``outbox-worker run`` reads the
same variables for its duty.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from outbox.cli import Flag, add_flags
from outbox.retention import (
    DEFAULT_AUDIT_RETENTION,
    DEFAULT_DEAD_LETTER_RETENTION,
    DEFAULT_INBOX_WINDOW,
    DEFAULT_JOB_RETENTION,
    DEFAULT_OUTBOX_RETENTION,
    DEFAULT_REDELIVERY_MARGIN,
    DEFAULT_STREAM_RETENTION,
    DEFAULT_WORKER_GRACE,
    ProgressFn,
    check_batch,
    purge_all,
)

# (flag, JobRetentionConfig field or None, environment variable, default, help)
WINDOWS: tuple[tuple[str, str | None, str, float, str], ...] = (
    ("job-retention", "job_retention_seconds", "JOB_RETENTION", DEFAULT_JOB_RETENTION,
     "DONE/CANCELLED jobs are kept this long after their last change (0: forever)"),
    ("inbox-window", "inbox_window_seconds", "INBOX_WINDOW", DEFAULT_INBOX_WINDOW,
     "the consumers' inbox_retention_seconds (declared, for the safety check)"),
    ("outbox-retention", "outbox_retention_seconds", "RETENTION", DEFAULT_OUTBOX_RETENTION,
     "the relays' --retention (declared, for the safety check)"),
    ("stream-retention", "stream_retention_seconds", "STREAM_RETENTION",
     DEFAULT_STREAM_RETENTION, "the relays' --stream-retention (declared)"),
    ("redelivery-margin", "redelivery_margin_seconds", "REDELIVERY_MARGIN",
     DEFAULT_REDELIVERY_MARGIN, "how late past those a copy may still arrive"),
    ("worker-grace", "worker_grace_seconds", "WORKER_GRACE", DEFAULT_WORKER_GRACE,
     "liveness rows of workers gone this long, holding no lease, are deleted (0: never)"),
    ("dead-letter-retention", None, "DEAD_LETTER_RETENTION", DEFAULT_DEAD_LETTER_RETENTION,
     "replayed dead letters are kept this long (0: forever)"),
    ("audit-retention", "audit_retention_seconds", "AUDIT_RETENTION", DEFAULT_AUDIT_RETENTION,
     "the console's audit rows are kept this long (0: forever)"),
    ("early-retention", "early_retention_seconds", "EARLY_RETENTION", DEFAULT_INBOX_WINDOW,
     "replies to jobs not enqueued yet, callbacks whose receipt never came (0: forever)"),
)  # fmt: skip


def window_flags() -> tuple[Flag, ...]:
    """The windows' declarations (outbox.cli): ``--job-retention`` ... with their variables;
    None when neither is set, so a Worker's own retention config stays."""
    return tuple(
        Flag(
            f"--{flag}",
            float,
            text,
            env=f"OUTBOX_{var}",
            shown_default=f"{default:g}",
            metavar="SECONDS",
        )
        for flag, _field, var, default, text in WINDOWS
    )


def add_window_flags(parser: argparse.ArgumentParser) -> None:
    """The windows' flags (``--job-retention`` ...), each defaulting from its variable."""
    add_flags(parser, *window_flags())


def window_values(args: argparse.Namespace) -> dict[str, float]:
    """Flag, else environment, else default, per window flag name (``job_retention`` ...)."""
    values: dict[str, float] = {}
    for flag, _field, _var, default, _text in WINDOWS:
        given = getattr(args, flag.replace("-", "_"), None)
        values[flag] = given if given is not None else default
    return values


def retention_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The :class:`consumer.jobs.retention.JobRetentionConfig` of the flags (ConfigError
    for windows that break the safety rule)."""
    from consumer.jobs.retention import JobRetentionConfig

    values = window_values(args)
    fields: dict[str, Any] = {
        field: values[flag] for flag, field, *_ in WINDOWS if field is not None
    }
    return JobRetentionConfig(**{**fields, **overrides})


def configured_from_environment() -> bool:
    """Whether any window is set in the environment (``outbox-worker run`` then builds its
    duty's config from it rather than keep the Worker's own)."""
    return any(os.environ.get(f"OUTBOX_{var}") for _flag, _field, var, _default, _text in WINDOWS)


def add_purge_command(sub: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        "purge",
        help="retention of DONE/CANCELLED jobs with their history and receipts "
        "(--dry-run shows what would go)",
    )
    add_flags(
        parser,
        Flag("--dry-run", bool, "count, delete nothing", env=None),
        Flag("--json", bool, '{"dry_run": .., "tables": {..}}', env=None),
        Flag("--batch-size", int, "rows per statement", default=1000, env=None, metavar="N"),
    )
    add_window_flags(parser)
    return parser


def purge_command(args: argparse.Namespace, url: str) -> int:
    from consumer.inbox import DEAD_LETTER_TABLE, inbox_for
    from consumer.jobs.retention import JobRetention
    from consumer.jobs.store import Store
    from consumer.retention import DeadLetterRetention
    from outbox.purge import run_purge

    batch = check_batch("batch_size", args.batch_size)
    config = retention_config(args)
    dead_letters_after = window_values(args)["dead-letter-retention"]
    store = Store(url)
    try:
        retention = JobRetention(store, config)
        targets = list(retention.targets())
        with store.driver.connect() as conn:
            dead_letters = store.driver.schema_has_table(conn, DEAD_LETTER_TABLE)
        if dead_letters:
            targets.append(DeadLetterRetention(inbox_for(store.engine), dead_letters_after))

        def count() -> Mapping[str, int]:
            rows = dict(retention.due_by_table()) if config.job_retention_seconds > 0 else {}
            for target in targets:
                if target.table not in rows:
                    rows[target.table] = target.due()
            return rows

        def purge(progress: ProgressFn) -> Mapping[str, int]:
            rows = dict(purge_all(targets, batch=batch, progress=progress))
            if config.job_retention_seconds > 0:
                rows.update(retention.deleted)
            return rows

        return run_purge(
            "outbox-worker", dry_run=args.dry_run, as_json=args.json, count=count, purge=purge
        )
    finally:
        store.dispose()
