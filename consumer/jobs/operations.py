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

The parts: the receipt's types and states in ``consumer.jobs.receipts`` (re-exported here),
the sweep, an operator's settlement and the write of a call's outcome in
``consumer.jobs.settlement``, the statements in the job driver
(``consumer.jobs.driver_operations``).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import nullcontext
from typing import Any

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
from consumer.jobs import deliveries, settlement
from consumer.jobs.checks import valid_time
from consumer.jobs.config import DEFAULT_CONCURRENCY
from consumer.jobs.limits import ProviderGate, Ticket, shared_limits
from consumer.jobs.plan import Plan, Step, arun_plan, pause_step, provider_step, run_plan
from consumer.jobs.receipts import (
    ACCEPTED,
    FAILED,
    NOT_SENT,
    PENDING,
    RECEIPT_STATES,
    UNKNOWN,
    Provider,
    Receipt,
    ReconcileResult,
    failed_state,
    failure_text,
    receipt_from_row,
    request_digest,
    retry_after_of,
)
from consumer.jobs.schema import jobs
from consumer.jobs.settlement import record_outcome
from consumer.jobs.store import Lease, Store
from outbox import tracing
from outbox.hooks import NO_HOOKS, Hooks
from outbox.logs import fields
from outbox.validate import check_number

__all__ = ["ACCEPTED", "FAILED", "NOT_SENT", "PENDING", "RECEIPT_STATES", "UNKNOWN"]
__all__ += ["OperationInFlight", "Operations", "Provider", "Receipt", "ReconcileResult"]
__all__ += ["request_digest", "retry_after_of"]

log = logging.getLogger("outbox.worker")


_MAX_RESTARTS = 3  # a dispatch re-reads its intent when the sweep changed it meanwhile
LATE_LOOKUPS = (0.0, 0.3, 0.6)
"""Pauses before each lookup of an effect whose call ran out its timeout: the first at once,
the last about a second after the deadline."""


def _ran_out(ticket: Ticket, timeout: float) -> bool:
    """The call took its whole ``timeout`` (so the deadline, which counts the wait for its
    start, has passed): a timeout, not an answer lost early (a reset after sending)."""
    return ticket.answered - ticket.called >= timeout * 0.98  # a timer may fire a hair early


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
        return None if row is None else receipt_from_row(row)

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
        return [receipt_from_row(row) for row in rows]

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
            return receipt_from_row(row)
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
                    return self._accept_found(
                        lease,
                        connector,
                        operation_id,
                        found,
                        "lookup found the effect of an earlier attempt",
                        "receipt reconciled: not sent again",
                        if_attempts=int(row.attempts),
                    )
            elif not connector.supports_idempotency:
                record_outcome(
                    self.store.driver,
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
            record_outcome(self.store.driver, operation_id, NOT_SENT, None, str(exc)[:2000])
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
            record_outcome(
                self.store.driver, operation_id, failed_state(exc), None, failure_text(exc)
            )
            own = self.timeout_of(connector)
            if ticket.timed_out and connector.supports_lookup and _ran_out(ticket, own):
                found = yield from self._look_up_late(connector, ticket, operation_id, progress)
                if found is not None:
                    return self._settled_late(lease, connector, operation_id, found)
            raise
        if not isinstance(ref, str) or not ref:
            record_outcome(
                self.store.driver,
                operation_id,
                UNKNOWN,
                None,
                f"provider returned no reference: {ref!r}",
            )
            raise ProviderTimeout(f"operation {operation_id}: the provider returned no reference")
        record_outcome(self.store.driver, operation_id, ACCEPTED, ref, None)
        return Receipt(operation_id, ACCEPTED, ref, reconciled=resend and key is not None)

    def _look_up_late(
        self,
        connector: Provider,
        ticket: Ticket,
        operation_id: str,
        progress: Any,
    ) -> Generator[Step, Any, str | None]:
        """The call ran out its timeout, so its deadline has passed: look the effect up now
        (and again, ``LATE_LOOKUPS``, within about a second, while a loaded provider records
        it), instead of leaving it UNKNOWN for a retry after backoff (issue 54: 4-5 s per
        such effect). Only "found" settles it: "not found" so soon after the deadline may
        be a request the provider still processes, so that answer is left to the reconcile
        path as before. The ticket's timing stays the send's (the limit learns from it)."""
        gate = self.gate(connector)
        timing = (ticket.called, ticket.answered)
        try:
            for pause in LATE_LOOKUPS:
                if pause:
                    yield pause_step(pause)
                lookup = provider_step(connector, "lookup", operation_id)
                try:
                    found = yield gate.call(ticket, lookup, progress)
                except ProviderThrottled:
                    return None  # no start to be had: the reconcile path looks it up later
                except Exception as exc:  # the provider is struggling: the same, later
                    log.debug("lookup after a timeout failed", extra=fields(error=str(exc)))
                    continue
                if found is not None:
                    return str(found)
            return None
        finally:
            ticket.called, ticket.answered = timing

    def _settled_late(
        self, lease: Lease, connector: Provider, operation_id: str, found: str
    ) -> Receipt | None:
        """Record what :meth:`_look_up_late` found (None: the receipt changed meanwhile,
        re-read it)."""
        return self._accept_found(
            lease,
            connector,
            operation_id,
            found,
            "lookup right after the call's timeout found its effect",
            "receipt reconciled after a timeout: not sent again",
            if_states=(UNKNOWN,),
        )

    def _accept_found(
        self,
        lease: Lease,
        connector: Provider,
        operation_id: str,
        found: str,
        note: str,
        said: str,
        **guard: Any,
    ) -> Receipt | None:
        """A lookup found the operation's effect: ACCEPTED with the reconciler's ``note``,
        if the receipt is still as ``guard`` (``record_outcome``'s ``if_attempts`` or
        ``if_states``) says; None when it changed meanwhile (re-read it)."""
        if not record_outcome(
            self.store.driver,
            operation_id,
            ACCEPTED,
            found,
            None,
            settled=("reconciler", note),
            **guard,
        ):
            return None
        log.info(
            said,
            extra=fields(
                operation_id=operation_id,
                job_id=lease.job_id,
                provider=connector.name,
                provider_ref=found,
            ),
        )
        return Receipt(operation_id, ACCEPTED, found, reconciled=True)

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

    def reconcile(self, *, limit: int = 100, now: float | None = None) -> ReconcileResult:
        """Settle PENDING and UNKNOWN receipts whose call deadline passed, without claiming
        their jobs: by lookup where the provider has one (found: ACCEPTED; not found:
        NOT_SENT), and move their jobs on: a waiting job whose receipt is settled becomes
        READY (its handler then finds the receipt, or sends once); with only an idempotency
        key the job becomes READY to resend under the key; with neither it goes to
        WAITING_REVIEW for an operator. A job leased to a live worker is left to it
        (``consumer.jobs.settlement.sweep``)."""
        return settlement.sweep(self.store, self.providers, self.gate, limit=limit, now=now)

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
        return settlement.settle(
            self.store, operation_id, accepted=accepted, not_sent=not_sent, reason=reason, by=by
        )

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
            if driver.job_cancel_requested(conn, lease.job_id, lease.epoch):  # none once cancelled
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
        """Count the call and set its deadline, and extend the lease to that deadline."""
        driver = self.store.driver
        started = driver.operation_call_start(conn, operation_id, deadline, attempts)
        if started:
            driver.job_lease_extend(conn, lease.job_id, lease.worker, lease.epoch, deadline)
        return started

    def _hand_back(self, job: Any, lease: Lease, exc: ProviderThrottled) -> None:
        """READY again when the provider may be called, without counting a failure."""
        if hasattr(job, "defer"):
            job.defer(exc.until, str(exc))
        else:
            self.store.defer(lease, until=exc.until, reason=str(exc))
