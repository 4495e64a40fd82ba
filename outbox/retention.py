"""Retention as a named periodic duty: every table that grows is purged in bounded batches.

Each part of the toolkit owns the SQL of its own tables (``relay.store``'s published rows,
``consumer.jobs.retention``'s finished jobs and liveness rows, ``consumer.retention``'s dead
letters). Here is what they share:

- :class:`PurgeTarget`: one table's retention, two methods: ``due()`` counts what would go
  now (``--dry-run``), ``purge(limit)`` deletes at most ``limit`` rows in ONE short
  transaction and returns how many went.
- :class:`RetentionDuty`: the duty a long-running process steps (River's maintenance
  services: a name, ``run_once()``, its interval in one place). ``maybe_run()`` is what a
  loop calls as often as it likes: it runs when the interval has passed, never blocks on
  another thread's round (a lock taken without waiting), and comes back at once, not after
  the interval, when a batch was full (more is due).
- :func:`purge_all`: what the ``purge`` commands do: batches until nothing is due, with a
  progress callback per batch.

The windows (how long each table keeps its rows) are documented together, with how they
relate, in ``docs/explanation/retention.md``. Their defaults are named here so that a part
can check its own setting against the others' (``consumer.jobs.retention`` refuses a job
retention shorter than the windows in which an event can be delivered again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from outbox.errors import ConfigError
from outbox.logs import fields
from outbox.outage import report_failure
from outbox.validate import check_number

log = logging.getLogger("outbox.retention")

DAY = 24 * 3600.0

DEFAULT_PURGE_INTERVAL = 60.0
"""Seconds between two rounds of a retention duty (a full batch brings the next at once)."""

DEFAULT_PURGE_BATCH = 1000
"""Rows one purge statement deletes at most: one short transaction, short row locks."""

DEFAULT_OUTBOX_RETENTION = DAY
"""The relay keeps published rows one day (``RelayConfig.retention_seconds``): the window of
``outbox-relay republish``."""

DEFAULT_STREAM_RETENTION = DAY
"""Stream entries are trimmed after one day (``outbox-relay run --stream-retention``)."""

DEFAULT_INBOX_WINDOW = 7 * DAY
"""A consumer remembers a handled identity seven days
(``ConsumerConfig.inbox_retention_seconds``): the deduplication window."""

DEFAULT_JOB_RETENTION = 7 * DAY
"""DONE and CANCELLED jobs (with their attempts, intents and receipts) go after seven days."""

DEFAULT_REDELIVERY_MARGIN = 3600.0
"""How late, past the outbox's and the stream's retention, a copy of an event may still
reach a consumer (a republish started just before the row went, a consumer's lag)."""

DEFAULT_DEAD_LETTER_RETENTION = 30 * DAY
"""Replayed dead letters are kept thirty days; those that still need attention are kept."""

DEFAULT_WORKER_GRACE = 3600.0
"""Liveness rows of workers gone (expired) longer than this, holding no lease, are deleted."""


def check_seconds(name: str, value: object, *, zero: bool = True) -> float:
    """A window in seconds: a finite number >= 0 (0 where allowed: keep forever)."""
    return check_number(name, value, ConfigError, zero=zero)


def check_batch(name: str, value: object) -> int:
    return int(check_number(name, value, ConfigError, integer=True, maximum=100_000))


class PurgeTarget(Protocol):
    """One table's retention (see the module docstring)."""

    @property
    def table(self) -> str:
        """The table's name, for reports and progress."""
        ...

    def due(self) -> int:
        """How many rows would go now."""
        ...

    def purge(self, limit: int) -> int:
        """Delete at most ``limit`` rows that are due, in one short transaction."""
        ...


ProgressFn = Callable[[str, int, int, bool], None]
"""``progress(table, deleted_by_this_batch, deleted_so_far, finished)`` after each batch;
``finished`` on the table's last one."""


def purge_all(
    targets: Sequence[PurgeTarget],
    *,
    batch: int = DEFAULT_PURGE_BATCH,
    progress: ProgressFn | None = None,
    max_batches: int | None = None,
) -> dict[str, int]:
    """Purge each target until nothing is due (or ``max_batches`` per target); rows deleted
    per table. For the ``purge`` commands: batches of ``batch`` rows, each its own
    transaction, so a long purge never holds a lock for long."""
    check_batch("batch", batch)
    deleted: dict[str, int] = {}
    for target in targets:
        total = 0
        rounds = 0
        while max_batches is None or rounds < max_batches:
            removed = target.purge(batch)
            rounds += 1
            total += removed
            finished = removed < batch or (max_batches is not None and rounds >= max_batches)
            if progress is not None:
                progress(target.table, removed, total, finished)
            if finished:
                break
        deleted[target.table] = deleted.get(target.table, 0) + total
    return deleted


def count_due(targets: Sequence[PurgeTarget]) -> dict[str, int]:
    """What a purge would delete now, per table (``--dry-run``)."""
    due: dict[str, int] = {}
    for target in targets:
        due[target.table] = due.get(target.table, 0) + target.due()
    return due


class RetentionDuty:
    """A named periodic duty that purges its targets (see the module docstring).

    ``run_once()`` runs one round now: one batch per target, and more batches of a target
    whose batch was full, up to ``max_batches``. ``maybe_run()`` runs a round when
    ``interval`` seconds have passed since the last one (at once after a round that left
    rows due), and returns None otherwise. A round's failure is logged and counted, never
    raised from ``maybe_run`` (a database outage must not stop the loop that steps it; the
    next round retries). ``interval`` 0 or no targets: it never runs.
    """

    def __init__(
        self,
        name: str,
        targets: Sequence[PurgeTarget],
        *,
        interval: float = DEFAULT_PURGE_INTERVAL,
        batch: int = DEFAULT_PURGE_BATCH,
        max_batches: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.targets = list(targets)
        self.interval = check_seconds("purge_interval", interval)
        self.batch = check_batch("purge_batch", batch)
        self.max_batches = check_batch("max_batches", max_batches)
        self._clock = clock
        self._next = clock() + self.interval  # the first round one interval after start
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.failures = 0
        self.last_deleted: dict[str, int] = {}
        self.total_deleted: dict[str, int] = {}

    def run_once(self) -> dict[str, int]:
        """One round now, in the calling thread: rows deleted per table."""
        deleted = purge_all(self.targets, batch=self.batch, max_batches=self.max_batches)
        self.last_deleted = deleted
        for table, count in deleted.items():
            self.total_deleted[table] = self.total_deleted.get(table, 0) + count
        if any(deleted.values()):
            log.info(f"{self.name}: retention purged", extra=fields(deleted=deleted))
        return deleted

    def due_now(self) -> bool:
        """Whether a round is due (cheap: no database work)."""
        return self.interval > 0 and bool(self.targets) and self._clock() >= self._next

    def maybe_start(self) -> bool:
        """:meth:`maybe_run` in a background thread when a round is due and none runs, so
        the loop that steps the duty never waits for a DELETE; True if one started."""
        if not self.due_now() or self._lock.locked():
            return False
        thread = threading.Thread(target=self.maybe_run, name=self.name, daemon=True)
        self._thread = thread
        thread.start()
        return True

    def join(self, timeout: float | None = None) -> None:
        """Wait for a background round (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def maybe_run(self) -> dict[str, int] | None:
        """A round if one is due and no other thread runs one; None when none ran."""
        if not self.due_now() or not self._lock.acquire(blocking=False):
            return None
        try:
            try:
                deleted = self.run_once()
            except Exception as exc:
                self.failures += 1
                self._next = self._clock() + self.interval
                report_failure(
                    log, f"{self.name}: retention round failed; retrying next interval", exc
                )
                return None
            limit = self.batch * self.max_batches
            behind = any(count >= limit for count in deleted.values())
            self._next = self._clock() + (0.0 if behind else self.interval)
            return deleted
        finally:
            self._lock.release()


DEFAULT_AUDIT_RETENTION = 90 * DAY
"""Operator actions (``outbox_audit``, the console's) are kept ninety days."""


class AuditRetention:
    """The console's audit rows older than ``retention_seconds`` (a purge target), through
    ``outbox.console.schema.purge_audit``. A database without the console's table has
    nothing to purge (``due`` and ``purge`` are 0)."""

    table = "outbox_audit"

    def __init__(self, engine: Any, retention_seconds: float = DEFAULT_AUDIT_RETENTION) -> None:
        self.engine = engine
        self.retention_seconds = check_seconds("audit_retention_seconds", retention_seconds)

    def _present(self) -> bool:
        from sqlalchemy import inspect

        return bool(inspect(self.engine).has_table(self.table))

    def due(self) -> int:
        if self.retention_seconds <= 0 or not self._present():
            return 0
        from sqlalchemy import func, select

        from outbox.console.schema import audit
        from outbox.dialect import db_epoch

        with self.engine.connect() as conn:
            cutoff = float(conn.execute(select(db_epoch())).scalar_one()) - self.retention_seconds
            query = select(func.count()).select_from(audit).where(audit.c.at < cutoff)
            return int(conn.execute(query).scalar_one())

    def purge(self, limit: int) -> int:
        if self.retention_seconds <= 0 or not self._present():
            return 0
        from outbox.console.schema import purge_audit

        return purge_audit(self.engine, self.retention_seconds, check_batch("limit", limit))
