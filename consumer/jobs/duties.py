"""The worker's periodic duties besides claiming, each a named service with ``run_once()``.

- ``recovery``: expired leases and due timers back to READY (``Store.recover``), every
  ``recover_interval`` and as soon as the earliest timer of a waiting job comes due, so a
  timer fires on time, not up to an interval late.
- ``reconciliation``: the receipt sweep (``Operations.reconcile``), only with providers.
- ``liveness``: this worker's row in ``outbox_workers``; the leases of workers whose row
  expired go back to READY at once (``Store.worker_beat``). From a thread of its own while
  the worker runs, so a long handler never makes it look dead.
- ``vacuum``: the job tables, when the server runs without autovacuum
  (``WorkerConfig.vacuum_interval``; ``outbox.maintenance.PeriodicVacuum``), and, every
  ``VACUUM_CATCH_UP`` seconds, those past their autovacuum threshold that no vacuum has come
  to yet (autovacuum visits a database once a minute by default; a worker at full speed
  leaves tens of thousands of dead rows meanwhile). ``vacuum_interval=0`` turns both off.
- ``retention``: finished jobs with their history and receipts, and gone workers' liveness
  rows (``WorkerConfig.retention``; ``consumer.jobs.retention``).
- ``firing``: the schedules whose slot fell enqueue their slots' jobs, once fleet-wide
  (``consumer.jobs.firing``), at each schedule's next slot and at least every
  ``schedule_interval``; before its first round, the worker's own ``schedules=`` are created
  or updated (``consumer.jobs.schedules.define_in_code``), once.

Vacuum and retention run their rounds in background threads, so a claim never waits for a
VACUUM or a DELETE. ``Worker.recovery`` and the others are these objects.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.checks import tenant_limits
from consumer.jobs.config import WorkerConfig
from consumer.jobs.firing import ScheduleDuty
from consumer.jobs.retention import job_retention_duty
from consumer.jobs.schedules import Schedule, SchedulesDefined, define_in_code
from consumer.jobs.schema import HOT_TABLES
from consumer.jobs.store import RecoveryResult, Store, Time
from outbox.duty import Duty, weakly
from outbox.hooks import Hooks, call_hook
from outbox.logs import fields
from outbox.maintenance import PeriodicVacuum, quoted_table
from outbox.outage import Streak
from outbox.retention import RetentionDuty

if TYPE_CHECKING:
    from consumer.jobs.operations import Operations

__all__ = ["WorkerDuties"]

log = logging.getLogger("outbox.worker")

VACUUM_CATCH_UP = 5.0  # seconds between two looks for a job table autovacuum has left behind


class WorkerDuties:
    """A worker's duties on ``store`` (see the module docstring). ``on_work`` is called
    when one of them made jobs READY (the worker's idle slots claim at once)."""

    def __init__(
        self,
        store: Store,
        config: WorkerConfig,
        hooks: Hooks,
        operations: Operations | None,
        on_work: Callable[[], None],
        schedules: tuple[Schedule, ...] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.hooks = hooks
        self.operations = operations
        self.on_work = on_work
        self._lock = threading.Lock()
        self._next_timer: float | None = None  # unix seconds: the earliest waiting job's timer
        self._due_timer_seen: float | None = None  # a timer learnt already due, acted on once
        # Through weak references: a bound method would keep a dropped worker's duties (its
        # engine, its connections) alive until the cyclic collector runs.
        self.recovery: Duty[bool] = Duty(
            "recovery", lambda: config.recover_interval, weakly(self.recover_round)
        )
        # The receipt sweep: its first round one interval after start.
        self.reconciliation: Duty[None] = Duty(
            "receipt sweep",
            lambda: config.reconcile_interval,
            weakly(self.reconcile),
            first="later",
        )
        self.liveness: Duty[RecoveryResult] = Duty(
            "liveness", lambda: config.liveness_interval, weakly(self.beat)
        )
        self.vacuum: PeriodicVacuum | None = PeriodicVacuum.for_engine(
            store.engine,
            [quoted_table(t) for t in HOT_TABLES],
            interval=config.vacuum_interval,
            what="job tables",
            catch_up=VACUUM_CATCH_UP,
        )
        self.retention: RetentionDuty = job_retention_duty(store, config.retention)
        self.firing = ScheduleDuty(store, max_wait=config.schedule_interval)
        self.schedules = schedules  # None: this worker defines none (it still fires them)
        self.schedules_defined: SchedulesDefined | None = None

    # -- one step of each, when due -----------------------------------------------------
    def maintain(self, now: Time | None = None) -> bool:
        """Recovery and the receipt sweep when due, vacuum and retention started in the
        background when due. True if jobs became READY."""
        moved = self.maybe_recover(now)
        fired = self.fire_due(now)
        self.maybe_reconcile()
        if self.vacuum is not None:
            self.vacuum.maybe_start()
        self.retention.maybe_start()
        return moved or fired

    # -- schedules --------------------------------------------------------------------------
    def define_schedules(self) -> SchedulesDefined:
        """Create or update this worker's ``schedules=`` and report those defined in code
        before that it no longer defines (kept). Nothing without ``schedules=``."""
        if self.schedules is None:
            report = SchedulesDefined()
        else:
            report = define_in_code(self.store, self.schedules)
        self.schedules_defined = report
        return report

    def fire_due(self, now: Time | None = None) -> bool:
        """A firing round when due, or at ``now`` whenever a caller steps time with it
        (``run_once(now=...)``); this worker's schedules are defined first, once. True if it
        enqueued jobs."""
        if now is None and not self.firing.due():
            return False
        if self.schedules_defined is None:
            self.define_schedules()
        return any(not slot.duplicate for slot in self.firing.run_once(now).fired)

    # -- recovery -------------------------------------------------------------------------
    def maybe_recover(self, now: Time | None) -> bool:
        # Due every recover_interval, and as soon as the earliest timer of a waiting job
        # (read after each recovery) comes due. A timer the clocks disagree on is dropped:
        # the interval remains.
        with self._lock:
            timer = self._next_timer
            due = self.recovery.due() or (timer is not None and time.time() >= timer)
            if due:
                self.recovery.interval.done()
                self._next_timer = None
        return self.recover(now) if due else False

    def recover_round(self) -> bool:
        """``recovery.run_once()``: one round now. True if jobs became READY."""
        return self.recover(None)

    def recover(self, now: Time | None) -> bool:
        """One recovery round now. True if jobs became READY."""
        result = self.store.recover(now=now)
        moved = bool(result.requeued or result.needs_attention or result.woken)
        if moved:
            log.info("recovered jobs", extra=fields(**result.__dict__))
        self.learn_timer()
        if self.config.tenant_limit is not None or self.config.tenant_limits:
            waiting = self.store.waiting_on_tenant_limit(**tenant_limits(self.config))
            call_hook(self.hooks, "worker_tenant_limit_waiting", waiting)
        return moved

    def learn_timer(self) -> None:
        """Read the earliest timer of a waiting job: recovery runs as it comes due."""
        upcoming = self.store.next_timer()
        if upcoming is None:
            return
        with self._lock:
            if upcoming <= time.time():
                # Already due when learnt (the cycle that set a short wait took longer than
                # the wait, e.g. on a loaded machine): recover at once, but once per timer,
                # so a timer the clocks disagree on cannot make every cycle a recovery.
                if upcoming == self._due_timer_seen:
                    return
                self._due_timer_seen = upcoming
            if self._next_timer is None or upcoming < self._next_timer:
                self._next_timer = upcoming

    def sleep_limit(self) -> float | None:
        """Seconds until the earliest known timer (an idle loop wakes for it)."""
        with self._lock:
            timer = self._next_timer
        return None if timer is None else max(0.0, timer - time.time())

    # -- the receipt sweep ----------------------------------------------------------------
    def maybe_reconcile(self) -> None:
        if self.operations is None:
            return
        with self._lock:
            due = self.reconciliation.due()
            if due:
                self.reconciliation.interval.done()
        if due:
            self.reconciliation.run_once()

    def reconcile(self) -> None:
        """Settle the receipts whose call deadline passed; nothing without providers."""
        if self.operations is not None:
            self.operations.reconcile()

    # -- liveness -------------------------------------------------------------------------
    def beat(self, *, now: Time | None = None) -> RecoveryResult:
        """One liveness tick: this worker is alive for ``liveness_ttl`` more seconds, and the
        leases of workers whose liveness expired go back to READY at once (fenced)."""
        result = self.store.worker_beat(self.config.name, self.config.liveness_ttl, now=now)
        if result.requeued or result.needs_attention:
            log.info("recovered the jobs of dead workers", extra=fields(**result.__dict__))
            self.on_work()  # this worker's idle slots claim them at once
        return result

    def keep_alive(self, stop: threading.Event) -> None:
        """The liveness beats, until ``stop`` is set (a thread of its own)."""
        streak = Streak(log, "liveness beat")  # a line at the start, each minute, the end
        while True:
            try:
                self.liveness.run_once()
                streak.succeeded()
            except SQLAlchemyError as exc:
                streak.failed(exc)
            if stop.wait(self.liveness.interval.seconds):
                return
