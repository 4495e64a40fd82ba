"""What a handler gets: :class:`JobContext`, the lease's facts and the moves it may make.

A handler runs with one ``JobContext`` per job (``consumer.jobs.worker`` documents the
outcomes). ``job.dispatch(...)`` (a ``def`` handler) and ``await job.adispatch(...)`` (an
``async def`` handler) go through the worker's providers (``consumer.jobs.operations``);
``job.progress()`` keeps the lease renewed; ``wait_external``, ``wait_review``, ``defer``,
``schedule``, ``cancel`` and ``recheck`` move the job (these are short database statements:
an ``async def`` handler may call them, they block the loop for one round trip).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from consumer.errors import Conflict, JobCancelled
from consumer.jobs.cron import Slot
from consumer.jobs.replies import Reply, run_replies
from consumer.jobs.schedules import schedule_slot
from consumer.jobs.states import Outcome
from consumer.jobs.store import Lease, Store, Time, Timer, valid_time
from outbox.errors import ConfigError

if TYPE_CHECKING:
    from consumer.errors import ProviderThrottled
    from consumer.jobs.operations import Operations, Receipt

__all__ = ["JobContext"]


class JobContext:
    """What a handler gets: the lease's facts and the moves it may make on its job."""

    def __init__(
        self,
        store: Store,
        lease: Lease,
        operations: Operations | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.operations = operations
        self.executor = executor  # where adispatch runs its database statements
        self._call_depth = 0  # provider calls in flight (the heartbeat leaves the lease alone)
        self._dispatch_depth = 0  # dispatches under way (every beat renews the lease)
        self.outcome: Outcome | None = None  # set when the handler moved the job itself
        self.throttled: ProviderThrottled | None = None  # its provider's limit handed it back
        self.lost = False  # set by the heartbeat when the lease was lost (fenced)
        self._progress = 1
        self._renewed = 0
        self._on_worker = True  # waiting on the worker, not on its handler (see started())
        self._ended = False  # the handler returned (see ended())
        self._call_ends = 0.0  # monotonic: renewals during a provider call stop here
        self._lock = threading.Lock()
        self._replies: list[Reply] | None = None  # read at the first ``replies``
        self._results: dict[tuple[str, str], Any] | None = None  # read at the first ``results``
        self._cancelled = False  # a cancel request was seen (``cancelled``)
        # Set by the worker that runs an ``async def`` handler: cancels its task (thread-safe).
        self.cancel_task: Callable[[], None] | None = None
        self._cancel_after_dispatch = False
        self._cancel_told = False  # the worker told this run (``request_cancel``)
        self._adispatching = 0  # adispatch calls under way (a cancel waits for their end)

    # -- facts ----------------------------------------------------------------------------
    @property
    def job_id(self) -> int:
        return self.lease.job_id

    @property
    def tenant(self) -> str:
        return self.lease.tenant

    @property
    def action(self) -> str:
        return self.lease.action

    @property
    def subject(self) -> str | None:
        return self.lease.subject

    @property
    def subject_version(self) -> str | None:
        return self.lease.subject_version

    @property
    def payload(self) -> Any:
        return self.lease.payload

    @property
    def timer(self) -> Timer | None:
        return self.lease.timer

    @property
    def attempt(self) -> int:
        return self.lease.attempts

    @property
    def slot(self) -> Slot | None:
        """The slot this job was fired for, when a schedule made it (its action is
        ``f"{action}@{slot}"``, ``consumer.jobs.schedules``): an aware UTC datetime whose
        ``str`` is the ISO 8601 text in the action. None for any other job."""
        return schedule_slot(self.lease.kind, self.lease.action)

    @property
    def replies(self) -> list[Reply]:
        """The replies to this job that no earlier run that ended well consumed, oldest first
        (each with ``reply_id``, ``payload``, ``source``, ``received_at``): those the job had
        when this run was claimed. This run consumes them if it ends DONE, waits or defers;
        if it fails or loses its lease the next run sees them again
        (``consumer.jobs.replies``). Read once, and only when the job has new replies."""
        if self._replies is None:
            if self.lease.replies_received <= self.lease.replies_consumed:
                self._replies = []
            else:
                self._replies = run_replies(self.store.driver, self.lease)
        return list(self._replies)

    @property
    def results(self) -> dict[tuple[str, str], Any]:
        """The results of this job's parents (``after=`` at enqueue), keyed by each parent's
        ``(tenant, action)``: what their handlers returned (None for one that returned
        nothing). Read once, at the first use; empty for a job without parents."""
        if self._results is None:
            self._results = self.store.results_of_parents(self.job_id)
        return dict(self._results)

    @property
    def cancelled(self) -> bool:
        """True once a cancel was requested for this job while it runs (``Store.cancel``):
        stop at the next sensible point; the job ends CANCELLED whatever the run returns.
        Until the worker has told it, each read asks the database (one short read)."""
        if not self._cancelled:
            with self.store.driver.connect() as conn:
                self._cancelled = self.store.driver.job_cancel_requested(
                    conn, self.job_id, self.lease.epoch
                )
        return self._cancelled

    @property
    def cancel_requested(self) -> bool:
        """Whether this run knows of a cancel request, without asking the database."""
        return self._cancelled

    def request_cancel(self) -> bool:
        """The worker saw a cancel request for this job: ``cancelled`` is True from now, and
        an ``async def`` handler's task is cancelled, at once or, when an ``adispatch`` is
        under way, once it has returned its receipt (a cancel never cuts a provider call).
        False when it was told already (nothing more happens)."""
        with self._lock:
            if self._cancel_told:
                return False
            self._cancel_told = self._cancelled = True
            if self._adispatching:
                self._cancel_after_dispatch = True
                return True
        if self.cancel_task is not None:
            self.cancel_task()
        return True

    # -- heartbeat ------------------------------------------------------------------------
    def progress(self) -> None:
        """Say the handler is still making progress: the next heartbeat renews the lease."""
        with self._lock:
            self._progress += 1

    def started(self) -> None:
        """The handler starts now (the worker calls it). Before, the job waits on the
        worker's own queues (a free thread, the event loop), not on a stuck handler: every
        beat renews it. Renewed once only, the last of a 256-job claim lost their leases
        while the pool made its threads on a loaded machine."""
        with self._lock:
            self._on_worker = False
            self._progress += 1

    def ended(self) -> None:
        """The handler returned (the worker calls it): from here until its slot is freed
        the job waits on the worker again (its outcome's statements, the finish batch),
        and every beat renews it. Measured before: 108 of 600 leases ran out at their call
        deadline, their receipts ACCEPTED, while the finishes queued for the executor."""
        with self._lock:
            self._on_worker = self._ended = True

    @property
    def has_ended(self) -> bool:
        """The handler returned (:meth:`ended` was called)."""
        with self._lock:
            return self._ended

    @contextmanager
    def provider_call(self, timeout: float) -> Iterator[None]:
        """Around one provider call (``Operations.dispatch``): its intent extended the lease
        to the call's deadline; the call's end counts as progress. The beats renew it
        meanwhile too (never shorter than the deadline), for at most twice ``timeout``: a
        call that overran its deadline on a busy process (its answer came 0.4 s late, 108
        of 600 jobs at 256 async slots) keeps the lease of a live worker, so no sweep looks
        it up while it may be in flight; a call hung past that loses it, as a stuck handler
        does."""
        with self._lock:
            self._call_depth += 1
            self._call_ends = time.monotonic() + 2 * timeout
        try:
            yield
        finally:
            with self._lock:
                self._call_depth -= 1
                self._progress += 1

    @contextmanager
    def dispatching(self) -> Iterator[None]:
        """Around a whole dispatch (``Operations.dispatch``): the job waits on the worker's
        own machinery (its database statements, the provider's limits), not on a stuck
        handler, so every beat renews the lease meanwhile, however long the database takes
        on a loaded machine (outside the provider call itself: see :meth:`provider_call`)."""
        with self._lock:
            self._dispatch_depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._dispatch_depth -= 1
                self._progress += 1

    def due_for_renewal(self) -> bool:
        """Whether the next beat renews this job's lease (the heartbeat asks)."""
        with self._lock:
            if self._call_depth:
                live = time.monotonic() < self._call_ends
                return live and self.outcome is None and not self.lost
            # A job done but not yet recorded (its finish waits for the next batch) is still
            # LEASED: renewed until the batch takes it (then its renewal is skipped, locked,
            # or conflicts quietly: it is no longer running).
            if self._on_worker and self.outcome in (None, Outcome.DONE) and not self.lost:
                return True
            moving = self._progress > self._renewed or self._dispatch_depth > 0
            if moving and self.outcome is None and not self.lost:
                self._renewed = self._progress
                return True
            return False

    # -- moves ----------------------------------------------------------------------------
    def wait_external(self, reason: str | None = None, *, until: Time | None = None) -> None:
        """Release the worker until a reply (``Store.resume``) or the timer ``until``."""
        self.store.wait_external(self.lease, reason=reason, until=until)
        self.outcome = Outcome.WAITING_EXTERNAL

    def wait_review(self, reason: str | None = None) -> None:
        self.store.wait_review(self.lease, reason=reason)
        self.outcome = Outcome.WAITING_REVIEW

    def defer(self, until: Time, reason: str | None = None) -> None:
        """Hand the job back, READY again at ``until``, without counting a failure."""
        self.store.defer(self.lease, until=until, reason=reason)
        self.outcome = Outcome.DEFERRED

    def dispatch(self, name: str, provider: str, request: Mapping[str, Any]) -> Receipt:
        """``Operations.dispatch`` for this job, through the worker's providers (a ``def``
        handler: it blocks its thread until the receipt is recorded). ``JobCancelled`` when a
        cancel was requested: no new effect starts."""
        operations = self._operations()
        self._refuse_if_cancelled(name)
        try:
            return operations.dispatch(self, name, provider, request)
        except Conflict:
            self._refuse_if_cancelled(name, ask=True)  # the intent was refused for it
            raise

    async def adispatch(self, name: str, provider: str, request: Mapping[str, Any]) -> Receipt:
        """``await job.adispatch(...)`` in an ``async def`` handler: ``Operations.adispatch``
        (the same intent, limits and receipt; the provider's async form on the worker's event
        loop, the database statements in the worker's executor). ``JobCancelled`` when a
        cancel was requested: no new effect starts."""
        operations = self._operations()
        self._refuse_if_cancelled(name)
        with self._lock:
            self._adispatching += 1
        try:
            return await operations.adispatch(self, name, provider, request, executor=self.executor)
        except Conflict:
            self._refuse_if_cancelled(name, ask=True)  # the intent was refused for it
            raise
        finally:
            with self._lock:
                self._adispatching -= 1
                cancel = self._cancel_after_dispatch and not self._adispatching
                self._cancel_after_dispatch &= not cancel
            if cancel and self.cancel_task is not None:
                # Scheduled on the loop: the handler gets this receipt, and is cancelled at
                # its next ``await``.
                self.cancel_task()

    def _refuse_if_cancelled(self, name: str, *, ask: bool = False) -> None:
        # The intent's own statement refuses a job with a cancel request (no round trip of
        # its own here); the flag the worker set spares even that one.
        if self._cancelled or (ask and self.cancelled):
            raise JobCancelled(
                f"job #{self.job_id} was cancelled: effect {name!r} not started"
            ) from None

    def _operations(self) -> Operations:
        if self.operations is None:
            raise ConfigError("providers", "this worker has no providers: Worker(providers=...)")
        return self.operations

    def schedule(
        self,
        scheduled_for: Time,
        reason: str,
        subject_version: str | int | None = None,
        cancellation_condition: Any = None,
    ) -> None:
        """Re-plan: READY again at ``scheduled_for`` with this business timer."""
        self.store.schedule(
            self.lease, scheduled_for, reason, subject_version, cancellation_condition
        )
        self.outcome = Outcome.SCHEDULED

    def cancel(self, reason: str | None = None) -> None:
        self.store.cancel(self.lease, reason=reason)
        self.outcome = Outcome.CANCELLED

    def recheck(
        self,
        current_version: str | int | None,
        *,
        cancelled: bool = False,
        replan_at: Time | None = None,
    ) -> bool:
        """Compare the subject's current facts with the timer's; True means act now.

        ``cancelled``: the handler evaluated the timer's ``cancellation_condition`` against
        the subject and it holds -> the job is cancelled. A ``current_version`` different
        from the timer's ``subject_version`` -> re-planned at ``replan_at`` (same reason and
        condition, the new version), or cancelled when no ``replan_at`` is given.
        """
        timer = self.timer
        if cancelled:
            reason = timer.reason if timer else "timer"
            self.cancel(f"{reason}: cancellation condition holds")
            return False
        if timer is None or timer.subject_version is None:
            return True
        current = None if current_version is None else str(current_version)
        if current == timer.subject_version:
            return True
        if replan_at is None:
            self.cancel(f"{timer.reason}: subject changed ({timer.subject_version} -> {current})")
            return False
        if valid_time("replan_at", replan_at) is None:  # pragma: no cover - checked above
            return False
        self.schedule(replan_at, timer.reason, current, timer.cancellation_condition)
        return False
