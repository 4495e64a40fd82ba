"""Cancelling a running job: what a cancel request does (issue 38).

``Store.cancel`` on a LEASED job records a request on its row (``cancel_requested_at``,
``cancel_reason``) instead of moving it under its holder. From there:

- the holder's worker learns it (the driver's ``job_cancel_requested_list``, a probe of the
  tiny partial index ``ix_outbox_jobs_cancel_requested`` run with its maintenance) and tells
  the job's :class:`~consumer.jobs.context.JobContext`: ``ctx.cancelled`` is True, an ``async def``
  handler's task is cancelled (at its next ``await``, never inside a provider call: see
  ``JobContext.dispatching``), and ``ctx.dispatch`` raises ``JobCancelled`` before writing a
  new intent (the driver's ``job_cancel_requested``, read at that moment);
- whatever the run's end (a finish, a wait, a failure, a defer), the holder's fenced move
  makes the job CANCELLED instead (``LeaseMoves._move``; a batch finish in its own
  statement, ``consumer.jobs.queries``), its history saying how the run ended.

An intent written before the request keeps its receipt, whatever it becomes: a cancel cannot
recall an email. The trace says so when a CANCELLED job holds an ACCEPTED receipt.

A cancel is never lost (issue 53). An operator's cancel (:func:`operator_cancel`) runs in
one transaction that reads the job again when a claim or a run's end moved it between two
statements, so it is recorded whatever it races: READY or waiting -> CANCELLED, LEASED -> a
request, and a ``(tenant, action)`` not enqueued yet is written CANCELLED (its enqueue finds
it, ``duplicate=True``, and it never runs; retention purges it like any CANCELLED job, after
which the identity is free again). A LEASED job whose lease expires with a request, or whose
owner dies, ends CANCELLED (``Store.recover``, ``Store.claim``'s take-over: :func:`end_expired`)
and never runs again. The holder's end tries its own move first, fenced on "no request", and
only then the cancelled end, so a request committed while the run was ending is never
overwritten.

The statements are the job driver's (``consumer.jobs.driver_cancels``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, func
from sqlalchemy.engine import Connection

from consumer.errors import Conflict, IllegalTransition, JobNotFound
from consumer.jobs import order_keys
from consumer.jobs.checks import NO_TIMER, job_values
from consumer.jobs.driver import JobDriver
from consumer.jobs.schema import jobs
from consumer.jobs.states import CANCELLED, HELD, LEASED, check_transition, sources
from consumer.jobs.steps import settle_children

__all__ = ["CANCELLABLE", "ENDED_BY_CANCEL", "identity_of", "operator_cancel"]

CANCELLABLE = tuple(s for s in sources(CANCELLED) if s != LEASED)
"""The states an operator's cancel moves to CANCELLED at once (LEASED gets a request)."""

ENDED_BY_CANCEL: dict[str, Any] = {
    "state": CANCELLED,
    "lease_owner": None,
    "lease_expires_at": None,
    "wait_reason": jobs.c.cancel_reason,
}
"""A LEASED job with a request, ended CANCELLED (its run's end, or its lease's expiry)."""

_ROUNDS = 8
"""How often a cancel reads the job again when a claim or a run's end moved it between two
statements (each round sees the other's commit; two rounds are enough in practice)."""


def identity_of(job: object, action: str | None) -> tuple[str, str] | None:
    """``(tenant, action)`` of a job reference validated by ``job_key``; None for an id."""
    if isinstance(job, tuple) and len(job) == 2 and action is None:
        return str(job[0]), str(job[1])
    if isinstance(job, str) and action is not None:
        return job, action
    return None


def operator_cancel(
    driver: JobDriver,
    conn: Connection,
    where: ColumnElement[bool],
    label: str,
    identity: tuple[str, str] | None,
    reason: str | None,
    clock: float,
) -> str:
    """Record an operator's cancel in ``conn``'s transaction (module docstring): LEASED gets
    a request (returns LEASED), READY and the waiting states end CANCELLED, and a
    ``(tenant, action)`` not enqueued yet is written CANCELLED (returns CANCELLED). A job
    DONE or CANCELLED already raises :class:`IllegalTransition`; an unknown job id
    :class:`JobNotFound`. A claim or a run's end between two statements is read again,
    never answered ``Conflict``."""
    for _ in range(_ROUNDS):
        requested = driver.job_update_from(
            conn,
            where,
            (LEASED,),
            {
                "cancel_requested_at": func.coalesce(jobs.c.cancel_requested_at, clock),
                "cancel_reason": func.coalesce(jobs.c.cancel_reason, reason),
            },
        )
        if requested is not None:
            driver.attempt_insert(conn, requested, None, None, "cancel_requested", reason, clock)
            return LEASED
        values = {"state": CANCELLED, "wait_reason": reason, "updated_at": clock, **NO_TIMER}
        was = driver.job_state(conn, where)
        moved = driver.job_update_from(conn, where, CANCELLABLE, values)
        if moved is not None:
            driver.attempt_insert(conn, moved, None, None, "cancelled", reason, clock)
            settle_children(driver, conn, [moved], clock)  # its dependents, in this transaction
            if was != HELD:  # a key's head (a HELD job held no place): the next one's turn
                order_keys.release(conn, [moved], ended=True, now=clock)
            return CANCELLED
        state = driver.job_state(conn, where)
        if state is None:
            if identity is None:
                raise JobNotFound(f"no job {label}")
            if _cancel_unborn(driver, conn, identity, reason, clock):
                return CANCELLED
            continue  # enqueued meanwhile: cancel the row that now exists
        if state not in (LEASED, *CANCELLABLE):
            check_transition(label, state, CANCELLED)
            raise IllegalTransition(label, state, CANCELLED)
    raise Conflict(f"job {label} kept changing while it was cancelled")  # pragma: no cover


def _cancel_unborn(
    driver: JobDriver,
    conn: Connection,
    identity: tuple[str, str],
    reason: str | None,
    clock: float,
) -> bool:
    """Write ``identity``'s job CANCELLED before it was enqueued: its enqueue then finds it
    (``duplicate=True``) and it never runs. False when an enqueue wrote it first."""
    values = job_values(*identity, now=clock)
    values.update(
        state=CANCELLED,
        wait_reason=reason,
        cancel_requested_at=clock,
        cancel_reason=reason,
    )
    job_id, created = driver.job_insert(conn, values)
    if created:
        note = "cancelled before it was enqueued" + (f": {reason}" if reason else "")
        driver.attempt_insert(conn, job_id, None, None, "cancelled", note, clock)
    return created


def end_expired(
    driver: JobDriver, conn: Connection, job_id: int, epoch: int, clock: float, how: str
) -> bool:
    """A LEASED job with a cancel request whose lease expired (or whose owner died) ends
    CANCELLED instead of running again, fenced on the epoch read. False: it moved
    meanwhile (its holder ended it, or it has no request)."""
    hit = driver.job_update_from(
        conn,
        (jobs.c.id == job_id)
        & (jobs.c.lease_epoch == epoch)
        & jobs.c.cancel_requested_at.is_not(None),
        (LEASED,),
        {**ENDED_BY_CANCEL, **NO_TIMER, "updated_at": clock},
    )
    if hit is None:
        return False
    driver.attempt_insert(conn, job_id, epoch, None, "cancelled", f"cancel requested; {how}", clock)
    settle_children(driver, conn, [job_id], clock)
    order_keys.release(conn, [job_id], ended=True, now=clock)
    return True
