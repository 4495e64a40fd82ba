"""Receipt states, and what the failed end of a provider call means: the receipt it leaves,
and whether it asks the fleet to slow down (``consumer.jobs.operations`` records both;
``consumer.jobs.limits`` pauses the provider).

The receipt states live here (``consumer.jobs.operations`` re-exports them): PENDING (an
intent, its call may be in flight), ACCEPTED, UNKNOWN (the request may have landed:
reconciled before any resend), NOT_SENT (the provider certainly did not act: a retry
sends), FAILED (definitively rejected).
"""

from __future__ import annotations

from consumer.errors import AuthFailure, JobFailure, PermanentFailure, ProviderTimeout

__all__ = ["ACCEPTED", "FAILED", "NOT_SENT", "PENDING", "RECEIPT_STATES", "UNKNOWN"]
__all__ += ["failed_state", "failure_text", "retry_after_of"]

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
