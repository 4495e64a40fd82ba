"""The job store's row types and the mappers from result rows to them.

Frozen dataclasses (STYLE: rows are values): what ``Store`` returns and takes. The mappers
read the columns of ``outbox_jobs`` by name (:func:`job_from_row`), or a claim's by position
in ``consumer.jobs.queries.LEASE_COLUMNS`` order (:func:`lease_from_row`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class _Resolver(Protocol):
    """What a :class:`DeferredEnqueue` asks for its answer (the store's enqueue buffer)."""

    def result(self, index: int) -> EnqueueResult: ...


@dataclass(frozen=True)
class EnqueueResult:
    """``job_id`` of the job; ``duplicate`` is True when the identity existed already."""

    job_id: int
    duplicate: bool


class DeferredEnqueue(EnqueueResult):
    """The result of an ``enqueue`` buffered in a consumer's batch transaction (see
    ``Store.enqueue``): reading ``job_id`` or ``duplicate`` writes the buffer first (flush on
    access), so the answer is always right; a handler that never reads it costs no round
    trip of its own."""

    def __init__(self, buffer: _Resolver, index: int) -> None:
        object.__setattr__(self, "_buffer", buffer)
        object.__setattr__(self, "_index", index)

    def _resolved(self) -> EnqueueResult:
        buffer: _Resolver = object.__getattribute__(self, "_buffer")
        return buffer.result(object.__getattribute__(self, "_index"))

    @property
    def job_id(self) -> int:
        return self._resolved().job_id

    @property
    def duplicate(self) -> bool:
        return self._resolved().duplicate

    def __repr__(self) -> str:
        return f"DeferredEnqueue(job_id={self.job_id}, duplicate={self.duplicate})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EnqueueResult):
            return NotImplemented
        return (self.job_id, self.duplicate) == (other.job_id, other.duplicate)

    def __hash__(self) -> int:
        return hash((self.job_id, self.duplicate))


@dataclass(frozen=True)
class Timer:
    """A business timer: when, why, against which subject version, and the condition (JSON
    data the handler interprets) under which it must not act."""

    scheduled_for: float
    reason: str
    subject_version: str | None = None
    cancellation_condition: Any = None


@dataclass(frozen=True)
class Lease:
    """A claimed job: what a worker needs to run it and to prove it still holds it."""

    job_id: int
    tenant: str
    action: str
    kind: str | None
    subject: str | None
    subject_version: str | None
    payload: Any
    provider: str | None
    attempts: int
    epoch: int
    worker: str
    expires_at: float
    timer: Timer | None = None
    trace_context: str | None = None
    """The trace the job belongs to (``outbox.tracing``): its run span continues it."""
    queue: str = "default"
    enqueued_at: float | None = None  # the job's created_at: unix seconds, database clock
    replies_received: int = 0
    """Replies the job had at the claim (``consumer.jobs.replies``): its run sees those after
    ``replies_consumed``, and consumes them if it ends well."""
    replies_consumed: int = 0
    children: int = 0
    """Jobs enqueued ``after`` this one at the claim (``consumer.jobs.steps``): a lease with
    none and no ``result`` finishes on the plain path."""
    result: Any = None
    """What the run returned (JSON), written by its finish: set by the worker when the
    handler returns (``dataclasses.replace``), never by the claim."""

    def facts(self) -> dict[str, Any]:
        """Which job this is, as the worker hooks' keywords (``outbox.hooks.Hooks``)."""
        return {
            "job_id": self.job_id,
            "queue": self.queue,
            "kind": self.kind,
            "enqueued_at": self.enqueued_at,
        }


@dataclass(frozen=True)
class Job:
    """A snapshot of a job row (``Store.get``)."""

    id: int
    tenant: str
    action: str
    kind: str | None
    subject: str | None
    subject_version: str | None
    payload: Any
    provider: str | None
    state: str
    priority: int
    run_after: float | None
    attempts: int
    auth_failures: int
    last_error: str | None
    wait_reason: str | None
    lease_owner: str | None
    lease_expires_at: float | None
    lease_epoch: int
    timer: Timer | None
    created_at: float
    updated_at: float
    trace_context: str | None = None
    queue: str = "default"
    replies_received: int = 0
    replies_consumed: int = 0
    cancel_requested_at: float | None = None
    """When a cancel was requested while the job was LEASED (``Store.cancel``), or None."""
    cancel_reason: str | None = None
    result: Any = None
    """The result its handler returned (DONE jobs; ``Store.result`` waits for it)."""
    parents_pending: int = 0
    """Parents (``after=``) not DONE yet: the job is WAITING_PARENTS until none is left."""
    order_key: str | None = None
    """The job's order key (``consumer.jobs.order_keys``), or None."""
    hold: str = "wait"
    """``"run"``: later jobs of its order key pass it while it waits; ``"wait"``: they do not."""
    concurrency_key: str | None = None
    """The job's concurrency key and its limit (``consumer.jobs.order_keys``), or None."""
    concurrency_limit: int | None = None


@dataclass(frozen=True)
class Attempt:
    """One row of a job's history."""

    job_id: int
    epoch: int | None
    worker: str | None
    outcome: str
    error: str | None
    at: float


@dataclass(frozen=True)
class RecoveryResult:
    requeued: int = 0
    needs_attention: int = 0
    woken: int = 0


@dataclass(frozen=True)
class BatchResult:
    """``finish_batch``: the job ids finished, and those whose lease was lost (fenced)."""

    done: list[int] = field(default_factory=list)
    conflicts: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class QueueDepth:
    """``Store.depth``: the READY jobs of one queue (``ready``; those scheduled for later
    included), how long its oldest eligible one has waited (``oldest_ready_age_seconds``,
    database clock; 0.0 when none is eligible yet), and whether an operator paused it."""

    queue: str
    ready: int
    oldest_ready_age_seconds: float
    paused: bool = False

    def __getitem__(self, name: str) -> Any:
        """``depth["ready"]`` as well as ``depth.ready`` (a row that reads like JSON)."""
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


# -- mappers ---------------------------------------------------------------------------------


def timer_from_row(row: Any) -> Timer | None:
    return _timer(
        row.timer_scheduled_for,
        row.timer_reason,
        row.timer_subject_version,
        row.timer_cancellation_condition,
    )


def _timer(at: Any, reason: str | None, version: str | None, condition: Any) -> Timer | None:
    """A job's timer from its four columns; None when it has none."""
    if at is None:
        return None
    return Timer(
        scheduled_for=float(at),
        reason=reason or "",
        subject_version=version,
        cancellation_condition=condition,
    )


def lease_from_row(row: Any) -> Lease:
    """A claim's row, its columns in ``consumer.jobs.queries.LEASE_COLUMNS`` order (every
    claim statement returns them so), read by position: by name, 21 attribute look-ups cost
    ~7 us a lease, 0.15 ms a claim of 16 on the worker's critical path (issue 44)."""
    (
        job_id,
        tenant,
        action,
        kind,
        subject,
        subject_version,
        payload,
        provider,
        attempts,
        epoch,
        owner,
        expires_at,
        timer_at,
        timer_reason,
        timer_version,
        timer_condition,
        trace_context,
        queue,
        created_at,
        replies_received,
        replies_consumed,
        children,
    ) = row
    return Lease(
        job_id=int(job_id),
        tenant=tenant,
        action=action,
        kind=kind,
        subject=subject,
        subject_version=subject_version,
        payload=payload,
        provider=provider,
        attempts=int(attempts),
        epoch=int(epoch),
        worker=owner,
        expires_at=float(expires_at),
        timer=_timer(timer_at, timer_reason, timer_version, timer_condition),
        trace_context=trace_context,
        queue=queue,
        enqueued_at=float(created_at),
        replies_received=int(replies_received or 0),
        replies_consumed=int(replies_consumed or 0),
        children=int(children or 0),
    )


def job_from_row(row: Any) -> Job:
    return Job(
        id=int(row.id),
        tenant=row.tenant,
        action=row.action,
        kind=row.kind,
        subject=row.subject,
        subject_version=row.subject_version,
        payload=row.payload,
        provider=row.provider,
        state=row.state,
        priority=int(row.priority),
        run_after=row.run_after,
        attempts=int(row.attempts),
        auth_failures=int(row.auth_failures),
        last_error=row.last_error,
        wait_reason=row.wait_reason,
        lease_owner=row.lease_owner,
        lease_expires_at=row.lease_expires_at,
        lease_epoch=int(row.lease_epoch),
        timer=timer_from_row(row),
        created_at=float(row.created_at),
        updated_at=float(row.updated_at),
        trace_context=row.trace_context,
        queue=row.queue,
        replies_received=int(row.replies_received or 0),
        replies_consumed=int(row.replies_consumed or 0),
        cancel_requested_at=(
            None if row.cancel_requested_at is None else float(row.cancel_requested_at)
        ),
        cancel_reason=row.cancel_reason,
        result=row.result,
        parents_pending=int(row.parents_pending or 0),
        order_key=row.order_key,
        hold=row.order_hold or "wait",
        concurrency_key=row.concurrency_key,
        concurrency_limit=row.concurrency_limit,
    )
