"""Receipts: their states, the :class:`Receipt` and the :class:`Provider` it is a receipt of,
the request's digest, and what the failed end of a provider call means: the receipt it
leaves, and whether it asks the fleet to slow down (``consumer.jobs.operations`` records
both; ``consumer.jobs.limits`` pauses the provider).

The receipt states and types live here (``consumer.jobs.operations`` re-exports them): PENDING (an
intent, its call may be in flight), ACCEPTED, UNKNOWN (the request may have landed:
reconciled before any resend), NOT_SENT (the provider certainly did not act: a retry
sends), FAILED (definitively rejected).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from consumer.errors import AuthFailure, JobError, JobFailure, PermanentFailure, ProviderTimeout

__all__ = ["ACCEPTED", "FAILED", "NOT_SENT", "PENDING", "RECEIPT_STATES", "UNKNOWN"]
__all__ += ["failed_state", "failure_text", "retry_after_of"]
__all__ += ["Provider", "Receipt", "ReconcileResult", "receipt_from_row", "request_digest"]

PENDING = "PENDING"
ACCEPTED = "ACCEPTED"
UNKNOWN = "UNKNOWN"
NOT_SENT = "NOT_SENT"
FAILED = "FAILED"
RECEIPT_STATES = (PENDING, ACCEPTED, UNKNOWN, NOT_SENT, FAILED)

RETRY_AFTER_MAX = 86400.0  # seconds: a longer Retry-After is taken as a day


def retry_after_of(exc: BaseException) -> float | None:
    """The seconds a failure asks to wait before the provider is called again: its
    ``retry_after`` attribute when that is a number >= 0 (any exception; a
    :class:`~consumer.errors.JobFailure` takes it as ``retry_after=``), else None."""
    value = getattr(exc, "retry_after", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(min(value, RETRY_AFTER_MAX))
    return None


def failed_state(exc: BaseException) -> str:
    """The receipt of a call that raised ``exc``: FAILED for a definitive rejection,
    NOT_SENT when the provider certainly did not act (credentials refused, ``not_sent``, a
    429/503 status: a retry sends), UNKNOWN otherwise (a timeout, anything else: the
    request may have landed; reconciled before any resend)."""
    if isinstance(exc, PermanentFailure):
        return FAILED
    if isinstance(exc, ProviderTimeout):
        return UNKNOWN
    if isinstance(exc, JobFailure) and (
        isinstance(exc, AuthFailure) or exc.not_sent or exc.status in (429, 503)
    ):
        return NOT_SENT
    return UNKNOWN


def failure_text(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    if not isinstance(exc, JobFailure):
        return repr(exc)[:2000]
    text = f"{type(exc).__name__}: {exc}"
    return (f"HTTP {status}: {text}" if status else text)[:2000]


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


def receipt_from_row(row: Any) -> Receipt:
    """The :class:`Receipt` of a row of ``outbox_operations``."""

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
