"""Operation intents with receipts: one customer-visible effect per operation (guarantee 8).

A job that calls an external provider (send an email, charge a card) does it through
:meth:`Operations.dispatch`, which

1. persists an **intent** first: a row in ``outbox_operations`` with a stable operation id
   (``"{job_id}:{name}"``: the same for every attempt and every worker), the provider, the
   SHA-256 digest of the canonical JSON request and the **call deadline** (database clock +
   the provider's ``timeout``, else ``default_timeout``), in state PENDING. The same fenced
   transaction counts the call in ``attempts`` (before it is made: a call cut off by a kill
   is counted too) and extends the job's lease to the deadline, so nobody else takes the job
   while the call may be in flight;
2. calls the provider, passing the operation id as idempotency key when it supports one;
3. records the **receipt**: ACCEPTED with the provider's reference; UNKNOWN when the
   outcome is unknown (a timeout, a reset after sending, a 5xx other than 503: the request
   may have taken effect, never FAILED); NOT_SENT when the provider certainly did not act
   (credentials refused, 429/503, a connection refused before sending: a retry, or a resume
   once fixed, sends); FAILED only when the provider definitively rejected it
   (``PermanentFailure``).

When a dispatch finds an intent left PENDING or UNKNOWN by an earlier attempt (a worker
SIGKILLed after the provider accepted, a timeout), it **reconciles** before sending again,
but never while that attempt's call may still be in flight: before the call deadline it
hands the job back, eligible again at the deadline (:class:`OperationInFlight`). After it:
with the provider's ``lookup(operation_id)`` (found: ACCEPTED without a second call; not
found: safe to send), else by resending with the idempotency key (the provider dedups).
A provider with neither cannot be reconciled: the job goes to WAITING_REVIEW and
:class:`~consumer.errors.OperationUnresolved` stops the handler; an operator settles it
(:meth:`Operations.settle`, ``outbox-worker settle``). An ACCEPTED receipt is returned as
is: a retried job never repeats an effect.

Only an idempotency key protects against a provider that records an effect after the client
gave up *and* the deadline passed: a lookup then answers "not found" and the resend makes a
second effect. Declare a ``timeout`` no shorter than the provider may take.

:meth:`Operations.reconcile` is the sweep (``outbox-worker reconcile``, and periodically in
``Worker.run``): it settles PENDING and UNKNOWN receipts whose deadline passed without the
job being claimed (lookup where the provider has it) and moves their jobs on.

Table ``outbox_operations`` (``consumer.jobs.schema.operations``; the metrics export the
count and age of UNKNOWN receipts): ``operation_id`` (primary key), ``job_id``,
``provider``, ``request_digest``, ``state`` (PENDING / ACCEPTED / UNKNOWN / NOT_SENT /
FAILED), ``provider_ref``, ``attempts`` (provider calls made), ``last_error``,
``call_deadline``, ``settled_by`` / ``settled_reason`` / ``settled_at`` (an operator's or
the sweep's decision), ``created_at``, ``updated_at`` (unix seconds, database clock).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from consumer.errors import (
    Conflict,
    JobCancelled,
    JobError,
    OperationError,
    OperationInFlight,
    OperationUnresolved,
    PermanentFailure,
    ProviderThrottled,
    ProviderTimeout,
)
from consumer.jobs import deliveries
from consumer.jobs.cancels import is_requested
from consumer.jobs.checks import valid_time
from consumer.jobs.config import DEFAULT_CONCURRENCY
from consumer.jobs.limits import ProviderGate, Ticket, shared_limits
from consumer.jobs.plan import Plan, Step, arun_plan, provider_step, run_plan
from consumer.jobs.receipts import (
    ACCEPTED,
    FAILED,
    NOT_SENT,
    PENDING,
    RECEIPT_STATES,
    UNKNOWN,
    failed_state,
    failure_text,
    retry_after_of,
)
from consumer.jobs.schema import db_epoch, jobs, operations
from consumer.jobs.states import NEEDS_ATTENTION, READY, WAITING_EXTERNAL, WAITING_REVIEW
from consumer.jobs.store import Lease, Store
from outbox import tracing
from outbox.hooks import NO_HOOKS, Hooks
from outbox.logs import fields
from outbox.validate import check_name, check_number

__all__ = ["ACCEPTED", "FAILED", "NOT_SENT", "PENDING", "RECEIPT_STATES", "UNKNOWN"]
__all__ += ["OperationInFlight", "Operations", "Provider", "Receipt", "ReconcileResult"]
__all__ += ["request_digest", "retry_after_of"]

log = logging.getLogger("outbox.worker")


_MAX_RESTARTS = 3  # a dispatch re-reads its intent when the sweep changed it meanwhile


class Provider(Protocol):
    """What a connector offers. ``send`` returns the provider's reference for the effect
    and raises ``ProviderTimeout`` when the outcome is unknown, ``PermanentFailure`` when the
    request is rejected, ``AuthFailure`` or a failure with ``not_sent`` when it did not act.
    ``lookup`` returns the reference of the effect made for an operation id, or None (only
    called when ``supports_lookup``). A provider may also declare ``timeout``: the seconds
    one call may take (``Operations(default_timeout=...)`` otherwise)."""

    name: str
    supports_lookup: bool
    supports_idempotency: bool

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str: ...

    def lookup(self, operation_id: str) -> str | None: ...


@dataclass(frozen=True)
class Receipt:
    """An operation's receipt. ``reconciled``: an earlier attempt's effect was found (or
    deduplicated by the idempotency key), not made again."""

    operation_id: str
    state: str
    provider_ref: str | None
    reconciled: bool = False
    job_id: int | None = None
    provider: str | None = None
    attempts: int = 0
    last_error: str | None = None
    call_deadline: float | None = None
    settled_by: str | None = None
    settled_reason: str | None = None
    settled_at: float | None = None
    created_at: float | None = None
    updated_at: float | None = None
    delivery_status: str | None = None  # what the provider said later (record_delivery)
    delivery_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReconcileResult:
    """What a sweep did: receipts found ACCEPTED or NOT_SENT by lookup, jobs made eligible for
    an idempotent resend, jobs sent to review (no lookup, no key), receipts skipped (provider
    not registered here, or its lookup failed)."""

    accepted: int = 0
    not_sent: int = 0
    resend: int = 0
    review: int = 0
    skipped: int = 0


def request_digest(request: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the request (sorted keys, no whitespace)."""
    try:
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise JobError("request", f"is not JSON-serialisable ({exc})") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


def _positive(field_name: str, value: object) -> float:
    return check_number(field_name, value, JobError)


class Operations:
    """Dispatch external effects through persisted intents (see the module docstring)."""

    def __init__(
        self,
        store: Store,
        providers: Mapping[str, Provider] | None = None,
        *,
        default_timeout: float = 30.0,
        slots: int = DEFAULT_CONCURRENCY,
        hooks: Hooks | None = None,
    ) -> None:
        if not isinstance(store, Store):
            raise JobError("store", f"must be a Store, got {type(store).__name__}")
        check_number("slots", slots, JobError, integer=True)
        self.store = store
        self.providers: dict[str, Provider] = dict(providers or {})
        self.default_timeout = _positive("default_timeout", default_timeout)
        self.slots = slots
        self.hooks = hooks if hooks is not None else NO_HOOKS
        # One gate for every way in: this process's limits for the database, shared with
        # every other Operations on it (a worker's, a user's own; consumer.jobs.limits).
        self.limits = shared_limits(store)

    def register(self, provider: Provider) -> None:
        self.providers[provider.name] = provider

    def timeout_of(self, connector: Provider) -> float:
        """The seconds one call to ``connector`` may take: its ``timeout``, else the default."""
        declared = getattr(connector, "timeout", None)
        if declared is None:
            return self.default_timeout
        return _positive(f"{connector.name}.timeout", declared)

    def gate(self, connector: Provider) -> ProviderGate:
        """The limits between this process and ``connector`` (``consumer.jobs.limits``): the
        fleet's pause and ``rate_limit``, this process's adaptive calls in flight; the same
        gate for every ``Operations`` of this process on this database."""
        rate = getattr(connector, "rate_limit", None)
        if rate is not None:
            rate = _positive(f"{connector.name}.rate_limit", rate)
        return self.limits.gate(connector.name, rate_limit=rate, slots=self.slots, hooks=self.hooks)

    def gate_named(self, name: str) -> ProviderGate | None:
        """The limits of the provider called ``name``, if this process has called it (through
        this ``Operations`` or any other on the same database)."""
        return self.limits.gate_named(name)

    # -- reading ----------------------------------------------------------------------------

    def receipt(self, operation_id: str) -> Receipt | None:
        with self.store.driver.connect() as conn:
            row = self.store.driver.operation_get(conn, operation_id)
        return None if row is None else _receipt(row)

    def receipts(
        self, state: str | Sequence[str] | None = None, *, limit: int = 100
    ) -> list[Receipt]:
        """Receipts, oldest change first; ``state`` filters (``"UNKNOWN"`` or several)."""
        states = [state] if isinstance(state, str) else list(state or [])
        for one in states:
            if one not in RECEIPT_STATES:
                raise JobError("state", f"must be one of {', '.join(RECEIPT_STATES)}, got {one!r}")
        check_number("limit", limit, JobError, integer=True)
        with self.store.driver.connect() as conn:
            rows = self.store.driver.operation_list(conn, states=states, limit=limit)
        return [_receipt(row) for row in rows]

    # -- dispatch ---------------------------------------------------------------------------

    def dispatch(self, job: Any, name: str, provider: str, request: Mapping[str, Any]) -> Receipt:
        """Pass the provider's limits, persist the intent, reconcile an earlier attempt if
        any, call the provider once, record the receipt. ``job`` is a Lease or a
        ``consumer.jobs.worker.JobContext``. Blocks this thread (a ``def`` handler)."""
        receipt: Receipt = run_plan(self._plan(job, name, provider, request))
        return receipt

    async def adispatch(
        self,
        job: Any,
        name: str,
        provider: str,
        request: Mapping[str, Any],
        *,
        executor: Executor | None = None,
    ) -> Receipt:
        """:meth:`dispatch` for an ``async def`` handler: the same steps and guarantees, with
        the provider called through its async form (``asend``/``alookup``, e.g.
        ``HttpProvider`` on its asyncio client; a provider without them runs in a thread)
        and the database statements in ``executor`` (the worker's; the loop's default
        otherwise), so the event loop keeps many calls in flight."""
        receipt: Receipt = await arun_plan(self._plan(job, name, provider, request), executor)
        return receipt

    def _plan(self, job: Any, name: str, provider: str, request: Mapping[str, Any]) -> Plan:
        # A worker's job is renewed at every beat while its dispatch is under way.
        dispatching = getattr(job, "dispatching", None)
        with dispatching() if dispatching is not None else nullcontext():
            return (yield from self._dispatch_plan(job, name, provider, request))

    def _dispatch_plan(
        self, job: Any, name: str, provider: str, request: Mapping[str, Any]
    ) -> Plan:
        lease: Lease = getattr(job, "lease", job)
        if not isinstance(lease, Lease):
            raise JobError("job", "must be a Lease or a JobContext")
        if not isinstance(name, str) or not name.strip():
            raise JobError("name", "must be a non-empty string")
        connector = self.providers.get(provider)
        if connector is None:
            raise OperationError(f"provider {provider!r} is not registered")
        digest = request_digest(request)
        operation_id = f"{lease.job_id}:{name}"
        timeout = self.timeout_of(connector)
        gate = self.gate(connector)
        progress = getattr(job, "progress", None)
        try:
            # The pause is read by the intent's statement (no round trip of its own here).
            ticket = yield Step(
                lambda: gate.enter(progress, read_pause=False),
                lambda run: gate.aenter(run, progress, read_pause=False),
            )
        except ProviderThrottled as exc:
            # Nothing written, nothing sent: hand the job back until the provider may be
            # called again, without counting a failure.
            self._hand_back(job, lease, exc)
            raise
        try:
            with tracing.dispatching(lease, operation_id, connector.name, name):
                for _ in range(_MAX_RESTARTS):
                    receipt = yield from self._attempt(
                        job, lease, connector, ticket, operation_id, digest, request, timeout
                    )
                    if receipt is not None:
                        return receipt
                raise Conflict(f"operation {operation_id} kept changing under this dispatch")
        finally:
            gate.leave(ticket, timed_out=ticket.timed_out, retry_after=ticket.retry_after)

    # complexity: one attempt's intent, call and receipt states (owner: effects, issue 37)
    def _attempt(
        self,
        job: Any,
        lease: Lease,
        connector: Provider,
        ticket: Ticket,
        operation_id: str,
        digest: str,
        request: Mapping[str, Any],
        timeout: float,
    ) -> Generator[Step, Any, Receipt | None]:
        gate = self.gate(connector)
        progress = getattr(job, "progress", None)
        # The call's deadline counts the wait for its reserved start (a rate limit's spacing)
        # and room for a new one if the call misses it.
        timeout += gate.budget(ticket)
        try:
            step, row = self._intent(lease, operation_id, connector.name, digest, timeout)
        except ProviderThrottled as exc:  # paused: nothing written, nothing sent
            self._hand_back(job, lease, exc)
            raise
        if step == ACCEPTED:
            return _receipt(row)
        if step == FAILED:
            raise PermanentFailure(f"operation {operation_id} was rejected before")
        if step == "in_flight":
            deadline = float(row.call_deadline)
            reason = (
                f"operation {operation_id}: an earlier call may be in flight until {deadline:.3f}"
            )
            if hasattr(job, "defer"):
                job.defer(deadline, reason)
            else:
                self.store.defer(lease, until=deadline, reason=reason)
            raise OperationInFlight(reason, deadline)
        resend = step == "reconcile"
        if resend:  # an earlier attempt may have reached the provider and its deadline passed
            if connector.supports_lookup:
                with tracing.reconciling(connector.name, operation_id, lease.job_id):
                    # lookups are not counted in attempts; each takes a start of its own
                    lookup = provider_step(connector, "lookup", operation_id)
                    try:
                        found = yield gate.call(ticket, lookup, progress)
                    except ProviderThrottled as exc:  # nothing changed: the same intent later
                        self._hand_back(job, lease, exc)
                        raise
                if found is not None:
                    note = "lookup found the effect of an earlier attempt"
                    if not self._update(
                        operation_id,
                        ACCEPTED,
                        found,
                        None,
                        if_attempts=int(row.attempts),
                        settled=("reconciler", note),
                    ):
                        return None
                    log.info(
                        "receipt reconciled: not sent again",
                        extra=fields(
                            operation_id=operation_id,
                            job_id=lease.job_id,
                            provider=connector.name,
                            provider_ref=found,
                        ),
                    )
                    return Receipt(operation_id, ACCEPTED, found, reconciled=True)
            elif not connector.supports_idempotency:
                self._update(
                    operation_id,
                    UNKNOWN,
                    None,
                    "cannot reconcile: no lookup, no idempotency key",
                    if_attempts=int(row.attempts),
                )
                reason = f"operation {operation_id} outcome unknown; provider cannot reconcile"
                if hasattr(job, "wait_review"):
                    job.wait_review(reason)
                else:
                    self.store.wait_review(lease, reason=reason)
                raise OperationUnresolved(reason)
            if not self._call_start(lease, operation_id, timeout, int(row.attempts)):
                return None
        key = operation_id if connector.supports_idempotency else None
        calling = getattr(job, "provider_call", None)
        scope = calling(timeout) if calling is not None else nullcontext()
        send = provider_step(
            connector, "send", request, operation_id=operation_id, idempotency_key=key
        )
        try:
            with scope:
                ref = yield gate.call(ticket, send, progress)  # at the reserved start
        except ProviderThrottled as exc:
            # The reserved start was missed and no other was to be had: not sent.
            self._update(operation_id, NOT_SENT, None, str(exc)[:2000])
            self._hand_back(job, lease, exc)
            raise
        except Exception as exc:
            # Any failure that says when to call again pauses the provider for the fleet:
            # a TransientFailure(retry_after=S), HttpProvider's 429/503, any exception with
            # a numeric ``retry_after`` (a user's own SDK error).
            retry_after = retry_after_of(exc)
            if retry_after is not None:
                gate.pause(retry_after)  # first: the fleet's next calls wait from now
            ticket.timed_out = isinstance(exc, ProviderTimeout)
            self._update(operation_id, failed_state(exc), None, failure_text(exc))
            raise
        if not isinstance(ref, str) or not ref:
            self._update(operation_id, UNKNOWN, None, f"provider returned no reference: {ref!r}")
            raise ProviderTimeout(f"operation {operation_id}: the provider returned no reference")
        self._update(operation_id, ACCEPTED, ref, None)
        return Receipt(operation_id, ACCEPTED, ref, reconciled=resend and key is not None)

    # -- what the provider says later (consumer.jobs.deliveries) ----------------------------

    def record_delivery(
        self,
        operation_id: str,
        status: str,
        *,
        ref: str | None = None,
        detail: str | None = None,
        event_id: str,
        now: float | None = None,
    ) -> deliveries.DeliveryResult:
        """A provider's callback about an effect (delivered, bounced, complained, opened),
        deduplicated by ``event_id``: ``consumer.jobs.deliveries`` has the contract."""
        deliveries.check_delivery(operation_id, status, ref, detail, event_id)
        return deliveries.record_delivery(
            self.store.driver,
            operation_id,
            status,
            ref=ref,
            detail=detail,
            event_id=event_id,
            when=valid_time("now", now),
        )

    # -- the sweep and the operator's path --------------------------------------------------

    # complexity: the reconcile rules per receipt state (owner: effects, issue 37)
    def reconcile(self, *, limit: int = 100, now: float | None = None) -> ReconcileResult:
        """Settle PENDING and UNKNOWN receipts whose call deadline passed, without claiming
        their jobs: by lookup where the provider has one (found: ACCEPTED; not found:
        NOT_SENT), and move their jobs on: a waiting job whose receipt is settled becomes
        READY (its handler then finds the receipt, or sends once); with only an idempotency
        key the job becomes READY to resend under the key; with neither it goes to
        WAITING_REVIEW for an operator. A job leased to a live worker is left to it."""
        check_number("limit", limit, JobError, integer=True)
        driver = self.store.driver
        with driver.connect() as conn:
            clock = driver.clock_read(conn, now)
            rows = driver.operation_list(
                conn, states=(PENDING, UNKNOWN), due_before=clock, limit=limit
            )
        counts = dict.fromkeys(("accepted", "not_sent", "resend", "review", "skipped"), 0)
        for row in tracing.each_reconciliation(rows, self._trace_contexts):  # a span each
            connector = self.providers.get(row.provider)
            if connector is None:
                counts["skipped"] += 1
                continue
            job_id = int(row.job_id)
            if connector.supports_lookup:
                # At the provider's pace: a sweep's lookups pass its limits like any call.
                gate = self.gate(connector)
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
                if self._update(
                    row.operation_id,
                    state,
                    found,
                    None if found else note,
                    if_attempts=int(row.attempts),
                    if_states=(PENDING, UNKNOWN),
                    settled=("reconciler", note),
                ):
                    counts["accepted" if found else "not_sent"] += 1
                    self._wake(job_id, f"operation {row.operation_id} reconciled: {state}")
            elif connector.supports_idempotency:
                if self._wake(job_id, f"operation {row.operation_id}: resend under its key"):
                    counts["resend"] += 1
            else:
                if row.state == PENDING:
                    self._update(
                        row.operation_id,
                        UNKNOWN,
                        None,
                        "cannot reconcile: no lookup, no idempotency key",
                        if_attempts=int(row.attempts),
                        if_states=(PENDING,),
                    )
                if self._park(job_id, f"operation {row.operation_id} outcome unknown; settle it"):
                    counts["review"] += 1
        result = ReconcileResult(**counts)
        deliveries.apply_pending(self.store.driver, now=now)  # callbacks before their receipt
        if any(counts.values()):
            log.info("receipts reconciled", extra=fields(**counts))
        return result

    def settle(
        self,
        operation_id: str,
        *,
        accepted: str | None = None,
        not_sent: bool = False,
        reason: str | None = None,
        by: str | None = None,
    ) -> Receipt:
        """An operator's decision on an operation whose outcome the system cannot know.

        ``accepted=REF``: it happened (ACCEPTED with that reference; the job, made READY if it
        waits, finds the receipt and finishes without a resend). ``not_sent=True``: it did not
        happen (NOT_SENT; the job becomes READY and sends once). ``reason`` and ``by`` (default:
        the OS user) are kept with the time. Refused (``OperationError``) for an unknown
        operation, an ACCEPTED receipt, and a call that may still be in flight."""
        if (accepted is None) == (not not_sent):
            raise JobError("accepted", "give exactly one of accepted=REF or not_sent=True")
        if accepted is not None:
            check_name("accepted", accepted, JobError)
        if reason is not None and not isinstance(reason, str):
            raise JobError("reason", "must be a string")
        who = by if by is not None else _os_user()
        check_name("by", who, JobError)
        driver = self.store.driver
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
        self._wake(int(row.job_id), f"operation {operation_id} settled {state} by {who}")
        return _receipt(settled)

    # -- storage ----------------------------------------------------------------------------

    def _intent(
        self, lease: Lease, operation_id: str, provider: str, digest: str, timeout: float
    ) -> tuple[str, Any]:
        """Fenced: create the intent with its deadline (the call counted, the lease extended
        to the deadline), or read the earlier one under lock and say what to do:
        ACCEPTED, FAILED, ``send`` (a new call was started), ``in_flight`` or
        ``reconcile``."""
        driver = self.store.driver
        fenced = Conflict(f"job #{lease.job_id}: epoch {lease.epoch} is fenced out")
        # The common case, committed on its own: the intent (its deadline from the database
        # clock) and the fenced lease extension to that deadline, both or neither (one
        # statement on PostgreSQL).
        step = driver.operation_intent(
            operation_id=operation_id,
            job_id=lease.job_id,
            provider=provider,
            digest=digest,
            timeout=timeout,
            worker=lease.worker,
            epoch=lease.epoch,
        )
        if step == "created":
            return "send", None
        if step == "fenced":
            raise fenced
        if step == "paused":
            raise self.gate(self.providers[provider]).paused()
        # An earlier intent exists: read it under the job's lock and say what to do.
        with driver.begin() as conn:
            held = driver.job_lock_held(conn, jobs.c.id == lease.job_id, lease.worker, lease.epoch)
            if held is None:
                raise fenced
            clock = driver.clock_read(conn, None)
            deadline = clock + timeout
            row = driver.operation_get(conn, operation_id, lock=True)
            if row.request_digest != digest or row.provider != provider:
                raise OperationError(
                    f"operation {operation_id} was dispatched before with a different request"
                )
            if row.state in (ACCEPTED, FAILED):
                return str(row.state), row
            if is_requested(conn, lease.job_id, lease.epoch):  # no new call once cancelled
                raise JobCancelled(f"job #{lease.job_id} was cancelled: {operation_id} not sent")
            if row.state in (PENDING, UNKNOWN):
                if row.call_deadline is not None and row.call_deadline > clock:
                    return "in_flight", row
                return "reconcile", row
            # NOT_SENT: the provider did not act; a new call starts now.
            self._start(conn, lease, operation_id, deadline, None)
            return "send", row

    def _call_start(self, lease: Lease, operation_id: str, timeout: float, attempts: int) -> bool:
        """Fenced: count the call and set its deadline before making it (False: the receipt
        changed since it was read, re-read it)."""
        driver = self.store.driver
        with driver.begin() as conn:
            if (
                driver.job_lock_held(conn, jobs.c.id == lease.job_id, lease.worker, lease.epoch)
                is None
            ):
                raise Conflict(f"job #{lease.job_id}: epoch {lease.epoch} is fenced out")
            deadline = driver.clock_read(conn, None) + timeout
            return self._start(conn, lease, operation_id, deadline, attempts)

    def _start(
        self, conn: Any, lease: Lease, operation_id: str, deadline: float, attempts: int | None
    ) -> bool:
        driver = self.store.driver
        started = driver.operation_update(
            conn,
            operation_id,
            {
                "state": PENDING,
                "attempts": operations.c.attempts + 1,
                "call_deadline": deadline,
                "last_error": None,
                "updated_at": db_epoch(),
            },
            if_states=(PENDING, UNKNOWN, NOT_SENT),
            if_attempts=attempts,
        )
        if started:
            driver.job_lease_extend(conn, lease.job_id, lease.worker, lease.epoch, deadline)
        return started

    def _update(
        self,
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
        return self.store.driver.operation_record(  # one statement: one round trip
            operation_id,
            values,
            stamp=stamp,
            unless_states=(ACCEPTED,),
            if_states=if_states,
            if_attempts=if_attempts,
            durable=settled is not None,
        )

    def _hand_back(self, job: Any, lease: Lease, exc: ProviderThrottled) -> None:
        """READY again when the provider may be called, without counting a failure."""
        if hasattr(job, "defer"):
            job.defer(exc.until, str(exc))
        else:
            self.store.defer(lease, until=exc.until, reason=str(exc))

    def _trace_contexts(self, job_ids: Sequence[int]) -> dict[int, str | None]:
        """The jobs' trace contexts (``outbox.tracing``: only asked for while recording)."""
        from sqlalchemy import select

        query = select(jobs.c.id, jobs.c.trace_context).where(jobs.c.id.in_(list(job_ids)))
        with self.store.driver.connect() as conn:
            return {int(job_id): context for job_id, context in conn.execute(query)}

    def _wake(self, job_id: int, reason: str) -> bool:
        """Make a waiting job READY (its receipt was settled); True if it moved."""
        try:
            state = self.store.get(job_id).state
            if state not in (WAITING_REVIEW, WAITING_EXTERNAL, NEEDS_ATTENTION):
                return state == READY
            self.store.resume(job_id, reason=reason)
        except (LookupError, Conflict, OperationError) as exc:
            log.info("job not moved", extra=fields(job_id=job_id, error=str(exc)))
            return False
        except Exception as exc:  # IllegalTransition: it moved meanwhile
            log.info("job not moved", extra=fields(job_id=job_id, error=repr(exc)))
            return False
        return True

    def _park(self, job_id: int, reason: str) -> bool:
        """Send a READY job whose receipt nobody can settle to WAITING_REVIEW."""
        try:
            state = self.store.get(job_id).state
            if state == WAITING_REVIEW:
                return False
            if state != READY:
                return False
            self.store.park(job_id, reason=reason)
        except Exception as exc:  # it moved meanwhile (claimed, cancelled)
            log.info("job not parked", extra=fields(job_id=job_id, error=repr(exc)))
            return False
        return True


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in this environment
        return "unknown"


def _receipt(row: Any) -> Receipt:
    def number(value: Any) -> float | None:
        return None if value is None else float(value)

    return Receipt(
        operation_id=row.operation_id,
        state=row.state,
        provider_ref=row.provider_ref,
        job_id=int(row.job_id),
        provider=row.provider,
        attempts=int(row.attempts),
        last_error=row.last_error,
        call_deadline=number(row.call_deadline),
        settled_by=row.settled_by,
        settled_reason=row.settled_reason,
        settled_at=number(row.settled_at),
        created_at=number(row.created_at),
        updated_at=number(row.updated_at),
        delivery_status=row.delivery_status,
        delivery_at=number(row.delivery_at),
    )
