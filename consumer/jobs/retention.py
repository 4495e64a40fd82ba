"""Retention of the job store: finished jobs with their history, and gone workers' rows.

Two tables grow without it (issue 25): every job ever enqueued stays in ``outbox_jobs`` with
its attempt history (``outbox_job_attempts``) and its operation intents and receipts
(``outbox_operations``), and the liveness rows of workers that died with nobody left to
recover them stay in ``outbox_workers``. :class:`JobRetention` purges both, in bounded
batches (:data:`outbox.retention.DEFAULT_PURGE_BATCH` rows per statement), as the targets of
the worker's retention duty (``Worker.retention``) and of ``outbox-worker purge``.

**What goes.** A job in DONE or CANCELLED (terminal: nothing moves it again) whose last
change is older than ``job_retention_seconds``, together with its attempts and operation
rows, in the same statement. A job with an open receipt (PENDING or UNKNOWN: an effect whose
outcome is not settled) is kept whatever its age; so is every job in any other state
(READY, LEASED, the waiting states, NEEDS_ATTENTION). A liveness row that expired more than
``worker_grace_seconds`` ago and whose worker holds no lease any more. The rows of order and
concurrency keys idle for longer than ``job_retention_seconds``
(``consumer.jobs.key_retention``).

**The safety rule: no retention setting may make a second effect possible.** The job row
is the deduplication of ``(tenant, action)``: enqueueing an identity that has a row returns
that row. A copy of an event can reach a consumer again while its outbox row is retained
(``outbox-relay republish``) or its stream entry is (a new consumer group, a pending
entry); the consumer's inbox drops a copy whose identity it has seen within its window, and
past that only the job row stops the copy from creating the job again. So the job row is
kept at least as long as each of those windows, plus a margin for a copy still under way
(:meth:`JobRetentionConfig.shortest_safe_retention`), and a configuration that would
delete it sooner is refused with :class:`~outbox.errors.ConfigError` naming
``job_retention_seconds``. The windows are those of other processes (the relay, the
consumer): the config declares them, with the project's defaults, and the operator who
lengthens one there declares it here too. ``docs/explanation/retention.md`` has the table.

The job is kept whole rather than as a tombstone: the row IS the unique key that every
enqueue already honours (no second lookup on the enqueue path), and its history goes with it.

This module decides (what is old, what is safe, what went); the job driver runs the
statements (``consumer.jobs.driver_retention``, the purge per database in ``driver_pg`` and
``driver_sqlite``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Connection

from consumer.jobs.driver_retention import PG_JOB_PURGE as PG_JOB_PURGE  # re-exported
from consumer.jobs.key_retention import idle_key_targets
from consumer.jobs.replies import adopt
from consumer.jobs.schema import (
    ATTEMPTS_TABLE,
    EARLY_REPLIES_TABLE,
    FINISHED_JOBS_INDEX,
    JOB_OPERATIONS_INDEX,
    JOBS_TABLE,
    OPERATIONS_TABLE,
    WORKERS_TABLE,
)
from consumer.jobs.store import Store
from outbox.errors import ConfigError
from outbox.retention import (
    DEFAULT_AUDIT_RETENTION,
    DEFAULT_INBOX_WINDOW,
    DEFAULT_JOB_RETENTION,
    DEFAULT_OUTBOX_RETENTION,
    DEFAULT_PURGE_BATCH,
    DEFAULT_PURGE_INTERVAL,
    DEFAULT_REDELIVERY_MARGIN,
    DEFAULT_STREAM_RETENTION,
    DEFAULT_WORKER_GRACE,
    AuditRetention,
    PurgeTarget,
    RetentionDuty,
    check_batch,
    check_seconds,
)

__all__ = ["JobRetention", "JobRetentionConfig", "job_retention_duty"]


def _days(seconds: float) -> str:
    if seconds >= 86400 and seconds % 3600 == 0:
        return f"{seconds / 86400:g} days ({seconds:g} s)"
    return f"{seconds:g} s"


@dataclass(frozen=True)
class JobRetentionConfig:
    """How long the job store keeps what has finished (validated at construction).

    - ``job_retention_seconds``: DONE and CANCELLED jobs, with their attempts, intents and
      receipts, go this long after their last change. Default 7 days; 0 keeps them forever.
    - ``inbox_window_seconds`` / ``outbox_retention_seconds`` / ``stream_retention_seconds``:
      the windows of the other processes, declared here so the safety rule can be checked
      (module docstring): the consumers' ``inbox_retention_seconds`` (default 7 days), the
      relays' ``retention_seconds`` (1 day) and ``--stream-retention`` (1 day). 0 means that
      process keeps forever, and then so must the jobs (``job_retention_seconds`` 0).
    - ``redelivery_margin_seconds``: how late past the outbox's and the stream's retention a
      copy may still arrive (default 1 hour).
    - ``worker_grace_seconds``: liveness rows expired longer than this, holding no lease,
      are deleted (default 1 hour; 0 never).
    - ``audit_retention_seconds``: the operator console's audit rows (``outbox_audit``, when
      that table is in the job store's database) go after this (default 90 days; 0 never).
    - ``early_retention_seconds``: replies kept for a job not enqueued yet, and delivery
      callbacks whose receipt never became ACCEPTED, go this long after they came (default
      7 days, the consumers' inbox window: the longest an event may take to create its job;
      0 keeps them forever).
    - ``purge_interval`` / ``purge_batch``: the duty's interval (default 60 s; 0 turns the
      duty off in the worker, ``outbox-worker purge`` still works) and the rows per
      statement (default 1,000).
    """

    job_retention_seconds: float = DEFAULT_JOB_RETENTION
    inbox_window_seconds: float = DEFAULT_INBOX_WINDOW
    outbox_retention_seconds: float = DEFAULT_OUTBOX_RETENTION
    stream_retention_seconds: float = DEFAULT_STREAM_RETENTION
    redelivery_margin_seconds: float = DEFAULT_REDELIVERY_MARGIN
    worker_grace_seconds: float = DEFAULT_WORKER_GRACE
    audit_retention_seconds: float = DEFAULT_AUDIT_RETENTION
    early_retention_seconds: float = DEFAULT_INBOX_WINDOW
    purge_interval: float = DEFAULT_PURGE_INTERVAL
    purge_batch: int = DEFAULT_PURGE_BATCH

    def __post_init__(self) -> None:
        for name in (
            "job_retention_seconds",
            "inbox_window_seconds",
            "outbox_retention_seconds",
            "stream_retention_seconds",
            "redelivery_margin_seconds",
            "worker_grace_seconds",
            "audit_retention_seconds",
            "early_retention_seconds",
            "purge_interval",
        ):
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        check_batch("purge_batch", self.purge_batch)
        keep = self.job_retention_seconds
        if keep == 0:
            return  # jobs kept forever: always safe
        forever = [
            name
            for name in (
                "inbox_window_seconds",
                "outbox_retention_seconds",
                "stream_retention_seconds",
            )
            if getattr(self, name) == 0
        ]
        if forever:
            raise ConfigError(
                "job_retention_seconds",
                f"{forever[0]} is 0 (kept forever), so a copy of an event may arrive at any "
                "time and only the job row stops it from creating the job again: keep jobs "
                "forever too (job_retention_seconds=0)",
            )
        safe = self.shortest_safe_retention()
        if keep < safe:
            raise ConfigError(
                "job_retention_seconds",
                f"{_days(keep)} is shorter than {_days(safe)}, the longest window in which a "
                "copy of an event can still reach a consumer (inbox window; outbox and "
                "stream retention + redelivery margin): a republished event would create "
                "its job again. Keep jobs at least that long, or shorten those windows",
            )

    def shortest_safe_retention(self) -> float:
        """The least job retention that keeps the safety rule with these windows."""
        margin = self.redelivery_margin_seconds
        return max(
            self.inbox_window_seconds,
            self.outbox_retention_seconds + margin,
            self.stream_retention_seconds + margin,
        )


class _FinishedJobs:
    table = JOBS_TABLE

    def __init__(self, owner: JobRetention) -> None:
        self.owner = owner

    def due(self) -> int:
        return self.owner.count_finished()

    def purge(self, limit: int) -> int:
        return self.owner.purge_finished(limit)


class _GoneWorkers:
    table = WORKERS_TABLE

    def __init__(self, owner: JobRetention) -> None:
        self.owner = owner

    def due(self) -> int:
        return self.owner.count_gone_workers()

    def purge(self, limit: int) -> int:
        return self.owner.purge_gone_workers(limit)


class _EarlyReplies:
    table = EARLY_REPLIES_TABLE

    def __init__(self, owner: JobRetention) -> None:
        self.owner = owner

    def due(self) -> int:
        return self.owner.count_early()

    def purge(self, limit: int) -> int:
        return self.owner.purge_early(limit)


class JobRetention:
    """The job store's retention (module docstring): targets for a duty or a purge command.

    ``now`` (unix seconds) may be given to every method, as to the store's; otherwise the
    database clock decides what is old.
    """

    def __init__(self, store: Store, config: JobRetentionConfig | None = None) -> None:
        if not isinstance(store, Store):
            raise ConfigError("store", f"must be a Store, got {type(store).__name__}")
        self.store = store
        self.config = config if config is not None else JobRetentionConfig()
        if not isinstance(self.config, JobRetentionConfig):
            raise ConfigError("config", "must be a JobRetentionConfig")
        self._indexed = False
        self.deleted: dict[str, int] = {JOBS_TABLE: 0, ATTEMPTS_TABLE: 0, OPERATIONS_TABLE: 0}
        """Rows this retention deleted so far, per table (jobs with their history)."""

    def targets(self) -> list[PurgeTarget]:
        """The tables this retention purges (those whose window is not 0 = forever)."""
        found: list[PurgeTarget] = []
        if self.config.job_retention_seconds > 0:
            found.append(_FinishedJobs(self))
        if self.config.worker_grace_seconds > 0:
            found.append(_GoneWorkers(self))
        if self.config.early_retention_seconds > 0:
            found.append(_EarlyReplies(self))
        found.extend(idle_key_targets(self))  # rows of idle order and concurrency keys
        if self.config.audit_retention_seconds > 0:
            found.append(AuditRetention(self.store.engine, self.config.audit_retention_seconds))
        return found

    # -- finished jobs ----------------------------------------------------------------------

    def _cutoff(self, conn: Connection, age: float, now: float | None) -> float:
        if now is not None:
            return float(now) - age
        return self.store.driver.clock_epoch(conn) - age

    def ensure_indexes(self) -> None:
        """The two indexes retention reads, on a job store created before they existed
        (``create_all`` adds no index to an existing table). PostgreSQL builds them
        CONCURRENTLY: writers are not blocked while a large table is indexed."""
        if self._indexed:
            return
        self.store.driver.schema_index_ensure((FINISHED_JOBS_INDEX, JOB_OPERATIONS_INDEX))
        self._indexed = True

    def count_finished(self, *, now: float | None = None) -> int:
        """DONE and CANCELLED jobs a purge would delete now."""
        return self.due_by_table(now=now)[JOBS_TABLE]

    def due_by_table(self, *, now: float | None = None) -> dict[str, int]:
        """What a purge would delete now: the jobs, their attempts and operation rows."""
        if self.config.job_retention_seconds <= 0:
            return {JOBS_TABLE: 0, ATTEMPTS_TABLE: 0, OPERATIONS_TABLE: 0}
        self.ensure_indexes()
        with self.store.driver.connect() as conn:
            cutoff = self._cutoff(conn, self.config.job_retention_seconds, now)
            jobs_due, attempts_due, operations_due = self.store.driver.job_purge_due(conn, cutoff)
        return {
            JOBS_TABLE: jobs_due,
            ATTEMPTS_TABLE: attempts_due,
            OPERATIONS_TABLE: operations_due,
        }

    def purge_finished(self, limit: int, *, now: float | None = None) -> int:
        """Delete at most ``limit`` finished jobs past the retention, with their attempts,
        intents and receipts, in one transaction; how many jobs went."""
        check_batch("limit", limit)
        if self.config.job_retention_seconds <= 0:
            return 0
        self.ensure_indexes()
        age = self.config.job_retention_seconds
        with self.store.driver.begin() as conn:
            cutoff = self._cutoff(conn, age, now)
            return self._count(*self.store.driver.job_purge_finished(conn, cutoff, limit))

    def _count(self, jobs_gone: int, attempts_gone: int, operations_gone: int) -> int:
        self.deleted[JOBS_TABLE] += jobs_gone
        self.deleted[ATTEMPTS_TABLE] += attempts_gone
        self.deleted[OPERATIONS_TABLE] += operations_gone
        return jobs_gone

    # -- liveness rows ----------------------------------------------------------------------

    def count_gone_workers(self, *, now: float | None = None) -> int:
        with self.store.driver.connect() as conn:
            cutoff = self._cutoff(conn, self.config.worker_grace_seconds, now)
            return self.store.driver.worker_gone_count(conn, cutoff)

    def purge_gone_workers(self, limit: int, *, now: float | None = None) -> int:
        check_batch("limit", limit)
        if self.config.worker_grace_seconds <= 0:
            return 0
        with self.store.driver.begin() as conn:
            cutoff = self._cutoff(conn, self.config.worker_grace_seconds, now)
            return self.store.driver.worker_gone_delete(conn, cutoff, limit)

    # -- kept for a job or a receipt that never came ----------------------------------------

    def count_early(self, *, now: float | None = None) -> int:
        """Replies kept for a job not enqueued, and callbacks waiting for a receipt, older
        than ``early_retention_seconds``."""
        driver = self.store.driver
        with driver.connect() as conn:
            cutoff = self._cutoff(conn, self.config.early_retention_seconds, now)
            return driver.reply_kept_due(conn, cutoff) + driver.delivery_unapplied_due(conn, cutoff)

    def purge_early(self, limit: int, *, now: float | None = None) -> int:
        """Move replies that raced their job's enqueue into it (the job exists now), then
        delete at most ``limit`` kept replies and ``limit`` waiting callbacks past
        ``early_retention_seconds``; how many were deleted."""
        check_batch("limit", limit)
        if self.config.early_retention_seconds <= 0:
            return 0
        driver = self.store.driver
        with driver.begin() as conn:
            for job_id in driver.reply_kept_orphans(conn, limit):
                adopt(driver, conn, job_id)
            cutoff = self._cutoff(conn, self.config.early_retention_seconds, now)
            gone = driver.reply_kept_purge(conn, cutoff, limit)
            return gone + driver.delivery_unapplied_purge(conn, cutoff, limit)


def job_retention_duty(store: Store, config: JobRetentionConfig | None = None) -> RetentionDuty:
    """The worker's named duty: ``run_once()`` purges one batch per table now,
    ``maybe_run()`` when ``config.purge_interval`` has passed."""
    retention = JobRetention(store, config)
    cfg = retention.config
    return RetentionDuty(
        "job retention",
        retention.targets(),
        interval=cfg.purge_interval,
        batch=cfg.purge_batch,
    )
