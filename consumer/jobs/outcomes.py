"""A job's outcome, recorded once: the one settle and the one finish of every path.

A ``def`` handler run by ``Worker.run_once`` or on a slot's thread, and an ``async def``
handler awaited on the slots' event loop, end the same way (issue 42: this was written
twice): :meth:`Outcomes.settle` turns what the handler did (returned, raised, moved its job
through its :class:`~consumer.jobs.context.JobContext`) into the job's next state, and a job
that returned without moving itself is finished in batches by the worker's one writer of
finishes (``Runner.finish_and_claim``: one fenced statement for many jobs, with the claim of
the slots they free; a finish whose lease was taken over comes back as a conflict, job by
job; :meth:`Outcomes.finishing` and :meth:`Outcomes.finished` around it). Every outcome is an
:class:`Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from consumer.errors import (
    Conflict,
    JobCancelled,
    JobFailure,
    OperationUnresolved,
    PermanentFailure,
    ProviderThrottled,
    ResultTooLarge,
)
from consumer.jobs.context import JobContext
from consumer.jobs.receipts import retry_after_of
from consumer.jobs.states import Outcome
from consumer.jobs.step_results import run_result
from consumer.jobs.store import Lease, Store
from outbox import tracing
from outbox.hooks import Hooks, call_hook
from outbox.logs import fields
from outbox.outage import is_lost

__all__ = ["WAITS", "Outcome", "Outcomes", "Routed", "Settled"]

log = logging.getLogger("outbox.worker")

Routed = tuple[str, Callable[..., Any]]
Route = Callable[[Lease], "Routed | None"]
# Outcomes that may set a new earliest timer.
WAITS = frozenset({Outcome.WAITING_EXTERNAL, Outcome.WAITING_REVIEW})


@dataclass(frozen=True, slots=True)
class Settled:
    """What became of one run: its :class:`Outcome` (``DONE`` still to be finished), the
    handler's ``label`` for the hooks, and when the run ``started`` (monotonic)."""

    ctx: JobContext
    outcome: Outcome
    label: str
    started: float


class Outcomes:
    """Settles and finishes jobs on ``store``, reporting each end to ``hooks``."""

    def __init__(self, store: Store, hooks: Hooks, route: Route) -> None:
        self.store = store
        self.hooks = hooks
        self.route = route

    def hook(self, name: str, *args: Any, **facts: Any) -> None:
        call_hook(self.hooks, name, *args, **facts)

    # -- running a handler in this thread ------------------------------------------------
    def run(self, ctx: JobContext) -> Settled:
        """Run one job's handler in this thread and settle it (a ``def`` handler; an
        ``async def`` one called here runs to its end on an event loop of its own)."""
        with tracing.running(ctx.lease, self.route) as span:  # the job's trace goes on
            try:
                settled = self._run_here(ctx)
            except BaseException:
                span.set("outbox.job.outcome", "interrupted")
                raise
            span.set("outbox.job.outcome", settled.outcome)
        return settled

    def _run_here(self, ctx: JobContext) -> Settled:
        started = time.monotonic()
        ctx.started()  # renewed at every beat until here (a busy process starts late)
        routed = self.route(ctx.lease)
        self.hook("worker_job_started", routed[0] if routed else "unrouted", **ctx.lease.facts())
        error: BaseException | None = None
        result: Any = None
        if routed is not None:
            try:
                result = routed[1](ctx)
                if inspect.isawaitable(result):
                    result = asyncio.run(_awaited(result))
            except Exception as exc:
                error = exc
        ctx.ended()  # renewed at every beat from here (the outcome waits on the worker)
        return self.settle(ctx, routed, started, error, result)

    # -- the one settle ------------------------------------------------------------------
    def settle(
        self,
        ctx: JobContext,
        routed: Routed | None,
        started: float,
        error: BaseException | None,
        returned: Any = None,
    ) -> Settled:
        """Record a handler's outcome (``error``: what it raised, None if it returned); the
        same for ``def`` and ``async def`` handlers. A success is left to the finish (in
        batches, ``Runner.finish_and_claim``); every other end is reported to the hooks
        here. What the handler ``returned`` rides on the lease to the finish (the job's
        result, capped)."""
        label = routed[0] if routed else "unrouted"
        if returned is not None and error is None:
            try:
                ctx.lease = replace(ctx.lease, result=run_result(returned))
            except ResultTooLarge as exc:  # never truncated: the run fails for good
                error = PermanentFailure(str(exc))
        try:
            outcome = self._outcome(ctx, routed, error)
        except Conflict as exc:
            log.info("lease lost", extra=fields(job_id=ctx.job_id, error=str(exc)))
            self.hook("worker_lease_conflict", label)
            outcome = Outcome.CONFLICT
        if outcome is not Outcome.DONE:
            took = time.monotonic() - started
            self.hook("worker_job_finished", label, outcome, took, **ctx.lease.facts())
        return Settled(ctx, outcome, label, started)

    def _outcome(
        self, ctx: JobContext, routed: Routed | None, error: BaseException | None
    ) -> Outcome:
        store = self.store
        if routed is None:
            reason = f"no handler registered for action {ctx.action!r}"
            store.fail(ctx.lease, error=reason, kind="permanent")
            return Outcome.NO_HANDLER
        if error is None:
            return Outcome(ctx.outcome or Outcome.DONE)
        if isinstance(error, Conflict):
            raise error
        if isinstance(error, JobCancelled):
            # A cancel was requested while it ran: any end of the holder's makes the job
            # CANCELLED (``LeaseMoves``); this one counts no failure.
            store.release(ctx.lease)
            return Outcome.CANCELLED
        if isinstance(error, ProviderThrottled):
            ctx.throttled = error  # dispatch handed the job back until the provider's time
            return Outcome.THROTTLED
        if isinstance(error, OperationUnresolved):
            return Outcome(ctx.outcome or Outcome.WAITING_REVIEW)  # dispatch moved the job
        if is_lost(error):
            # The store's connection was cut under the handler (its dispatch's intent or
            # receipt, after their own retries): no failure of the job's. Raised to the
            # caller, which hands the lease back (``hand_back_after_error``).
            raise error
        if isinstance(error, JobFailure):
            state = store.fail(
                ctx.lease,
                error=error,
                kind=error.kind,
                provider=error.provider,
                retry_after=retry_after(error),
            )
            return Outcome.failed(state)
        log.warning(  # any other handler error: transient
            "job handler failed",
            extra=fields(job_id=ctx.job_id, action=ctx.action, error=repr(error)),
        )
        state = store.fail(ctx.lease, error=error, retry_after=retry_after(error))
        return Outcome.failed(state)

    # -- around the one finish (Runner.finish_and_claim writes it) ----------------------
    def finishing(self, done: Sequence[Settled]) -> None:
        """These jobs' finishes are being written: the heartbeat leaves them alone."""
        for settled in done:
            settled.ctx.outcome = Outcome.DONE

    def finished(self, done: Sequence[Settled], conflicts: Sequence[int]) -> set[int]:
        """Report each finish written (``done``, or ``conflict`` for the ids refused);
        returns the refused ids."""
        lost = set(conflicts)
        now = time.monotonic()
        for settled in done:
            end = "conflict" if settled.ctx.job_id in lost else "done"
            if end == "conflict":
                self.hook("worker_lease_conflict", settled.label)
            facts = settled.ctx.lease.facts()
            self.hook("worker_job_finished", settled.label, end, now - settled.started, **facts)
        return lost

    # -- handing leases back -------------------------------------------------------------
    def release(self, contexts: Sequence[JobContext]) -> int:
        """Hand back jobs not started (a stop): READY again at once, for any worker. Returns
        how many went back (a job no longer ours is skipped)."""
        released = 0
        for ctx in contexts:
            try:
                self.store.release(ctx.lease)
                released += 1
            except Conflict:
                continue  # no longer ours: finished, waiting, failed or taken over
        return released

    def hand_back_after_error(self, contexts: Sequence[JobContext]) -> None:
        """The database went away mid-run: hand back every lease still held, so that the
        jobs run again now rather than after the lease ttl (this worker is alive: no peer
        recovers them). A job whose handler already dispatched finds its receipt. Still
        unreachable: the leases expire by their ttl."""
        with contextlib.suppress(SQLAlchemyError):
            released = self.release(contexts)
            if released:
                log.info("leases handed back after a database error", extra=fields(jobs=released))


def retry_after(failure: BaseException) -> float | None:
    """A provider's ``Retry-After`` (seconds) carried by the failure, if any: any exception
    with a numeric ``retry_after`` (``consumer.jobs.receipts.retry_after_of``), so that the
    job's retry comes after the pause its failure started (issue 37)."""
    return retry_after_of(failure)


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result
