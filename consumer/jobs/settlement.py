"""Settling receipts: the sweep (:meth:`Operations.reconcile
<consumer.jobs.operations.Operations.reconcile>`), an operator's decision
(:meth:`Operations.settle <consumer.jobs.operations.Operations.settle>`), the one write of a
call's outcome on its receipt (:func:`record_outcome`, also the dispatch's), and the moves of
the jobs whose receipts were settled (:func:`wake_job`, :func:`park_job`).

``consumer.jobs.operations`` keeps the contract (its module docstring); these are its parts.
"""

from __future__ import annotations

import getpass
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from consumer.errors import Conflict, JobError, OperationError, ProviderThrottled, ProviderTimeout
from consumer.jobs import deliveries
from consumer.jobs.driver import JobDriver
from consumer.jobs.limits import ProviderGate
from consumer.jobs.plan import provider_step
from consumer.jobs.receipts import (
    ACCEPTED,
    NOT_SENT,
    PENDING,
    UNKNOWN,
    Provider,
    Receipt,
    ReconcileResult,
    receipt_from_row,
    retry_after_of,
)
from consumer.jobs.states import NEEDS_ATTENTION, READY, WAITING_EXTERNAL, WAITING_REVIEW
from consumer.jobs.store import Store
from outbox import tracing
from outbox.logs import fields
from outbox.validate import check_name, check_number

__all__ = ["os_user", "park_job", "record_outcome", "settle", "sweep", "trace_contexts", "wake_job"]

log = logging.getLogger("outbox.worker")


# complexity: the reconcile rules per receipt state (owner: effects, issue 37)
def sweep(
    store: Store,
    providers: Mapping[str, Provider],
    gate_of: Callable[[Provider], ProviderGate],
    *,
    limit: int,
    now: float | None,
) -> ReconcileResult:
    """Settle PENDING and UNKNOWN receipts whose call deadline passed, without claiming
    their jobs: by lookup where the provider has one (found: ACCEPTED; not found:
    NOT_SENT), and move their jobs on: a waiting job whose receipt is settled becomes
    READY (its handler then finds the receipt, or sends once); with only an idempotency
    key the job becomes READY to resend under the key; with neither it goes to
    WAITING_REVIEW for an operator. A job leased to a live worker is left to it."""
    check_number("limit", limit, JobError, integer=True)
    driver = store.driver
    with driver.connect() as conn:
        clock = driver.clock_read(conn, now)
        rows = driver.operation_list(conn, states=(PENDING, UNKNOWN), due_before=clock, limit=limit)
    counts = dict.fromkeys(("accepted", "not_sent", "resend", "review", "skipped"), 0)
    for row in tracing.each_reconciliation(rows, partial(trace_contexts, driver)):  # a span each
        connector = providers.get(row.provider)
        if connector is None:
            counts["skipped"] += 1
            continue
        job_id = int(row.job_id)
        if connector.supports_lookup:
            # At the provider's pace: a sweep's lookups pass its limits like any call.
            gate = gate_of(connector)
            try:
                ticket = gate.enter()
            except ProviderThrottled:
                counts["skipped"] += 1
                continue
            lookup = provider_step(connector, "lookup", row.operation_id)
            try:
                found = gate.call(ticket, lookup).sync()  # at its reserved start
            except ProviderThrottled:
                gate.leave(ticket)
                counts["skipped"] += 1
                continue
            except Exception as exc:
                timed_out = isinstance(exc, ProviderTimeout)
                gate.leave(ticket, timed_out=timed_out, retry_after=retry_after_of(exc))
                log.warning(
                    "receipt lookup failed",
                    extra=fields(operation_id=row.operation_id, error=repr(exc)[:500]),
                )
                counts["skipped"] += 1
                continue
            gate.leave(ticket)
            state = ACCEPTED if found is not None else NOT_SENT
            note = "lookup found the effect" if found else "lookup: no effect by the deadline"
            if record_outcome(
                driver,
                row.operation_id,
                state,
                found,
                None if found else note,
                if_attempts=int(row.attempts),
                if_states=(PENDING, UNKNOWN),
                settled=("reconciler", note),
            ):
                counts["accepted" if found else "not_sent"] += 1
                wake_job(store, job_id, f"operation {row.operation_id} reconciled: {state}")
        elif connector.supports_idempotency:
            if wake_job(store, job_id, f"operation {row.operation_id}: resend under its key"):
                counts["resend"] += 1
        else:
            if row.state == PENDING:
                record_outcome(
                    driver,
                    row.operation_id,
                    UNKNOWN,
                    None,
                    "cannot reconcile: no lookup, no idempotency key",
                    if_attempts=int(row.attempts),
                    if_states=(PENDING,),
                )
            if park_job(store, job_id, f"operation {row.operation_id} outcome unknown; settle it"):
                counts["review"] += 1
    result = ReconcileResult(**counts)
    deliveries.apply_pending(driver, now=now)  # callbacks before their receipt
    if any(counts.values()):
        log.info("receipts reconciled", extra=fields(**counts))
    return result


def settle(
    store: Store,
    operation_id: str,
    *,
    accepted: str | None = None,
    not_sent: bool = False,
    reason: str | None = None,
    by: str | None = None,
) -> Receipt:
    """:meth:`consumer.jobs.operations.Operations.settle`, whose docstring is the contract:
    an operator's decision on an operation whose outcome the system cannot know."""
    if (accepted is None) == (not not_sent):
        raise JobError("accepted", "give exactly one of accepted=REF or not_sent=True")
    if accepted is not None:
        check_name("accepted", accepted, JobError)
    if reason is not None and not isinstance(reason, str):
        raise JobError("reason", "must be a string")
    who = by if by is not None else os_user()
    check_name("by", who, JobError)
    driver = store.driver
    state = ACCEPTED if accepted is not None else NOT_SENT
    with driver.begin() as conn:
        row = driver.operation_get(conn, operation_id, lock=True)
        if row is None:
            raise OperationError(f"no operation {operation_id!r}")
        if row.state == ACCEPTED:
            raise OperationError(
                f"operation {operation_id} is ACCEPTED already "
                f"(ref {row.provider_ref}): refusing to settle it again"
            )
        clock = driver.clock_read(conn, None)
        if row.state == PENDING and row.call_deadline is not None and row.call_deadline > clock:
            raise OperationError(
                f"operation {operation_id}: a call may be in flight for another "
                f"{row.call_deadline - clock:.1f} s; settle it after its deadline"
            )
        driver.operation_update(
            conn,
            operation_id,
            {
                "state": state,
                "provider_ref": accepted,
                "settled_by": who,
                "settled_reason": reason,
                "settled_at": clock,
                "updated_at": clock,
            },
        )
        settled = driver.operation_get(conn, operation_id)
    log.info(
        "operation settled",
        extra=fields(operation_id=operation_id, state=state, by=who, reason=reason),
    )
    wake_job(store, int(row.job_id), f"operation {operation_id} settled {state} by {who}")
    return receipt_from_row(settled)


def record_outcome(
    driver: JobDriver,
    operation_id: str,
    state: str,
    ref: str | None,
    error: str | None,
    *,
    if_attempts: int | None = None,
    if_states: Sequence[str] = (),
    settled: tuple[str, str] | None = None,
) -> bool:
    # The receipt is recorded whatever happened to the lease meanwhile: it is a fact
    # about the provider, and losing it would cost a reconciliation later. An ACCEPTED
    # receipt never changes again. Its commit does not wait for the WAL flush
    # (durable=False): only a database crash in the next moments could lose it, which
    # leaves the receipt as a worker killed after the call leaves it (PENDING past its
    # deadline: reconciled), and it saves a flush per call. An operator's settlement
    # (``settled``) waits for its flush, as every action of theirs does.
    tracing.receipt_state(state)  # on the dispatch's or the reconciliation's span
    values: dict[str, Any] = {"state": state, "provider_ref": ref, "last_error": error}
    stamp: tuple[str, ...] = ("updated_at",)
    if settled is not None:
        values.update(settled_by=settled[0], settled_reason=settled[1])
        stamp += ("settled_at",)
    return driver.operation_record(  # one statement: one round trip
        operation_id,
        values,
        stamp=stamp,
        unless_states=(ACCEPTED,),
        if_states=if_states,
        if_attempts=if_attempts,
        durable=settled is not None,
    )


def wake_job(store: Store, job_id: int, reason: str) -> bool:
    """Make a waiting job READY (its receipt was settled); True if it moved."""
    try:
        state = store.get(job_id).state
        if state not in (WAITING_REVIEW, WAITING_EXTERNAL, NEEDS_ATTENTION):
            return state == READY
        store.resume(job_id, reason=reason)
    except (LookupError, Conflict, OperationError) as exc:
        log.info("job not moved", extra=fields(job_id=job_id, error=str(exc)))
        return False
    except Exception as exc:  # IllegalTransition: it moved meanwhile
        log.info("job not moved", extra=fields(job_id=job_id, error=repr(exc)))
        return False
    return True


def park_job(store: Store, job_id: int, reason: str) -> bool:
    """Send a READY job whose receipt nobody can settle to WAITING_REVIEW."""
    try:
        state = store.get(job_id).state
        if state == WAITING_REVIEW:
            return False
        if state != READY:
            return False
        store.park(job_id, reason=reason)
    except Exception as exc:  # it moved meanwhile (claimed, cancelled)
        log.info("job not parked", extra=fields(job_id=job_id, error=repr(exc)))
        return False
    return True


def trace_contexts(driver: JobDriver, job_ids: Sequence[int]) -> dict[int, str | None]:
    """The jobs' trace contexts (``outbox.tracing``: only asked for while recording)."""
    with driver.connect() as conn:
        return driver.job_trace_contexts(conn, job_ids)


def os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment
        return "unknown"
