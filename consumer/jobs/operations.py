"""Operation intents with receipts: one customer-visible effect per operation (guarantee 8).

A job that calls an external provider (send an email, charge a card) does it through
:meth:`Operations.dispatch`, which

1. persists an **intent** first: a row in ``outbox_operations`` with a stable operation id
   (``"{job_id}:{name}"``: the same for every attempt and every worker), the provider and
   the SHA-256 digest of the canonical JSON request, in state PENDING. The write is fenced
   by the job's lease (it only happens while the caller's epoch is current);
2. calls the provider, passing the operation id as idempotency key when the provider
   supports one;
3. records the **receipt**: ACCEPTED with the provider's reference; UNKNOWN when the call
   timed out (the request may have taken effect: never FAILED); FAILED only when the
   provider definitively rejected it (``PermanentFailure``).

When a dispatch finds an intent left PENDING or UNKNOWN by an earlier attempt (a worker
SIGKILLed after the provider accepted, a timeout), it **reconciles** before sending again:
with the provider's ``lookup(operation_id)`` (found: ACCEPTED without a second call; not
found: safe to send), else by resending with the idempotency key (the provider dedups).
A provider with neither cannot be reconciled: the job goes to WAITING_REVIEW and
:class:`~consumer.errors.OperationUnresolved` stops the handler. An ACCEPTED receipt is
returned as is: a retried job never repeats an effect.

Table ``outbox_operations`` (``consumer.jobs.schema.operations``; the metrics export the
count and age of UNKNOWN receipts): ``operation_id`` (primary key), ``job_id``,
``provider``, ``request_digest``, ``state`` (PENDING / ACCEPTED / UNKNOWN / FAILED),
``provider_ref``, ``attempts`` (provider calls), ``last_error``, ``created_at``,
``updated_at`` (unix seconds, database clock).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from consumer.errors import (
    Conflict,
    JobError,
    OperationError,
    OperationUnresolved,
    PermanentFailure,
    ProviderTimeout,
)
from consumer.jobs.schema import db_epoch, jobs, operations
from consumer.jobs.store import Lease, Store

PENDING = "PENDING"
ACCEPTED = "ACCEPTED"
UNKNOWN = "UNKNOWN"
FAILED = "FAILED"


class Provider(Protocol):
    """What a connector offers. ``send`` returns the provider's reference for the effect
    and raises ``ProviderTimeout`` when the outcome is unknown, ``PermanentFailure`` when the
    request is rejected. ``lookup`` returns the reference of the effect made for an
    operation id, or None (only called when ``supports_lookup``)."""

    name: str
    supports_lookup: bool
    supports_idempotency: bool

    def send(
        self, request: Mapping[str, Any], *, operation_id: str, idempotency_key: str | None
    ) -> str: ...

    def lookup(self, operation_id: str) -> str | None: ...


@dataclass(frozen=True)
class Receipt:
    operation_id: str
    state: str
    provider_ref: str | None
    reconciled: bool = False  # True when an earlier attempt's effect was found, not re-sent


def request_digest(request: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of the request (sorted keys, no whitespace)."""
    try:
        canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise JobError("request", f"is not JSON-serialisable ({exc})") from None
    return hashlib.sha256(canonical.encode()).hexdigest()


class Operations:
    """Dispatch external effects through persisted intents (see the module docstring)."""

    def __init__(self, store: Store, providers: Mapping[str, Provider] | None = None) -> None:
        self.store = store
        self.providers: dict[str, Provider] = dict(providers or {})

    def register(self, provider: Provider) -> None:
        self.providers[provider.name] = provider

    def receipt(self, operation_id: str) -> Receipt | None:
        with self.store.driver.connect() as conn:
            row = self.store.driver.operation_get(conn, operation_id)
        return None if row is None else Receipt(row.operation_id, row.state, row.provider_ref)

    def dispatch(self, job: Any, name: str, provider: str, request: Mapping[str, Any]) -> Receipt:
        """Persist the intent, reconcile an earlier attempt if any, call the provider once,
        record the receipt. ``job`` is a Lease or a ``consumer.jobs.worker.JobContext``."""
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
        created, state, ref = self._intent(lease, operation_id, provider, digest)
        if state == ACCEPTED:
            return Receipt(operation_id, ACCEPTED, ref)
        if state == FAILED:
            raise PermanentFailure(f"operation {operation_id} was rejected before")
        if not created:  # an earlier attempt may have reached the provider: reconcile
            if connector.supports_lookup:
                found = connector.lookup(operation_id)
                if found is not None:
                    self._record(lease, operation_id, ACCEPTED, found, None, calls=0)
                    return Receipt(operation_id, ACCEPTED, found, reconciled=True)
            elif not connector.supports_idempotency:
                self._record(
                    lease,
                    operation_id,
                    UNKNOWN,
                    None,
                    "cannot reconcile: no lookup, no idempotency key",
                    calls=0,
                )
                reason = f"operation {operation_id} outcome unknown; provider cannot reconcile"
                if hasattr(job, "wait_review"):
                    job.wait_review(reason)
                else:
                    self.store.wait_review(lease, reason=reason)
                raise OperationUnresolved(reason)
        key = operation_id if connector.supports_idempotency else None
        try:
            ref = connector.send(request, operation_id=operation_id, idempotency_key=key)
        except ProviderTimeout as exc:
            self._record(lease, operation_id, UNKNOWN, None, f"timeout: {exc}", calls=1)
            raise
        except PermanentFailure as exc:
            self._record(lease, operation_id, FAILED, None, str(exc), calls=1)
            raise
        except Exception as exc:
            # Anything else is as ambiguous as a timeout: the request may have landed.
            self._record(lease, operation_id, UNKNOWN, None, repr(exc), calls=1)
            raise
        self._record(lease, operation_id, ACCEPTED, ref, None, calls=1)
        return Receipt(operation_id, ACCEPTED, ref, reconciled=not created and key is not None)

    # -- storage ----------------------------------------------------------------------------
    def _intent(
        self, lease: Lease, operation_id: str, provider: str, digest: str
    ) -> tuple[bool, str, str | None]:
        driver = self.store.driver
        with driver.begin() as conn:
            # Operation rows only change while the caller's lease is current.
            held = driver.job_lock_held(conn, jobs.c.id == lease.job_id, lease.worker, lease.epoch)
            if held is None:
                raise Conflict(f"job #{lease.job_id}: epoch {lease.epoch} is fenced out")
            created = driver.operation_insert(
                conn,
                {
                    "operation_id": operation_id,
                    "job_id": lease.job_id,
                    "provider": provider,
                    "request_digest": digest,
                    "state": PENDING,
                    "created_at": db_epoch(),
                    "updated_at": db_epoch(),
                },
            )
            row = driver.operation_get(conn, operation_id)
        if row.request_digest != digest or row.provider != provider:
            raise OperationError(
                f"operation {operation_id} was dispatched before with a different request"
            )
        return created, str(row.state), row.provider_ref

    def _record(
        self,
        lease: Lease,
        operation_id: str,
        state: str,
        ref: str | None,
        error: str | None,
        *,
        calls: int,
    ) -> None:
        # The receipt is recorded whatever happened to the lease meanwhile: it is a fact
        # about the provider, and losing it would cost a reconciliation later.
        with self.store.driver.begin() as conn:
            self.store.driver.operation_update(
                conn,
                operation_id,
                {
                    "state": state,
                    "provider_ref": ref,
                    "last_error": error,
                    "attempts": operations.c.attempts + calls,
                    "updated_at": db_epoch(),
                },
                unless_states=(ACCEPTED,),
            )
