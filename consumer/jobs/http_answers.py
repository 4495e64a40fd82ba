"""How an HTTP provider's answer becomes a reference or an error: the status mapping of
:class:`~consumer.jobs.http.HttpProvider` (the table in ``consumer.jobs.http``), the
reference read from the answer (``ref_field``), ``Retry-After``, and what a transport failure
means for the request (sent or not).

Each function takes what it reads of the provider (its ``name``, ``ref_field``, ``timeout``)
as arguments, read at the call: the provider's attributes stay the one source.
"""

from __future__ import annotations

import email.utils
import math
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from consumer.errors import (
    AuthFailure,
    PermanentFailure,
    ProviderOutcomeUnknown,
    ProviderTimeout,
    ProviderUnavailable,
)
from outbox.display import display_url
from outbox.extras import optional_module

if TYPE_CHECKING:
    import httpx
else:  # the [http] extra: this module imports without it, HttpProvider(...) names it
    httpx = optional_module("httpx", "http", "HttpProvider")

__all__ = [
    "answer_detail",
    "answer_error",
    "lookup_result",
    "lookup_silent",
    "parse_retry_after",
    "reference",
    "send_result",
    "transport_error",
]


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date
    (RFC 9110 10.2.3). None when absent or unreadable; never negative."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # an HTTP date is GMT by definition
            when = when.replace(tzinfo=UTC)
        current = datetime.now(UTC).timestamp() if now is None else now
        seconds = when.timestamp() - current
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def send_result(
    name: str, ref_field: str, status: int, payload: Any, retry_after: float | None
) -> str:
    """A send's answer: the reference of a 2xx, or the error to raise."""
    if 200 <= status < 300:
        ref = reference(ref_field, payload)
        if ref is None:
            raise ProviderOutcomeUnknown(
                f"{name}: accepted with {status} but no {ref_field!r} in the answer",
                provider=name,
                status=status,
            )
        return ref
    raise answer_error(name, status, payload, retry_after, "send")


def lookup_silent(name: str, exc: ProviderTimeout) -> ProviderUnavailable:
    """A lookup without an answer: nothing to be unsure about, a lookup acts on nothing."""
    return ProviderUnavailable(f"{name}: lookup did not answer ({exc})", provider=name)


def lookup_result(
    name: str, ref_field: str, status: int, payload: Any, retry_after: float | None
) -> str | None:
    """A lookup's answer: the reference (200), None (404), or the error to raise; never
    one that makes a receipt UNKNOWN."""
    if status == 404:
        return None
    if status == 200:
        ref = reference(ref_field, payload)
        if ref is None:
            raise ProviderUnavailable(
                f"{name}: lookup answered 200 without {ref_field!r}",
                provider=name,
                status=status,
            )
        return ref
    error = answer_error(name, status, payload, retry_after, "lookup")
    if isinstance(error, ProviderOutcomeUnknown):
        raise ProviderUnavailable(str(error), provider=name, status=status)
    raise error


def reference(ref_field: str, payload: Any) -> str | None:
    """The provider's reference at ``ref_field`` (a dotted path) of the answer, or None."""
    value = payload
    for part in ref_field.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    ref = str(value)
    return ref or None


def answer_error(
    name: str, status: int, payload: Any, retry_after: float | None, what: str
) -> Exception:
    """The error an answer other than a success means (the table in ``consumer.jobs.http``)."""
    detail = answer_detail(payload)
    message = f"{name}: {what} answered {status}{detail}"
    if status in (401, 403):
        return AuthFailure(message, provider=name, status=status, not_sent=True)
    if status in (408, 429, 503):
        return ProviderUnavailable(
            message + (f" (retry after {retry_after:g} s)" if retry_after is not None else ""),
            provider=name,
            status=status,
            retry_after=retry_after,
        )
    if status == 409:
        return PermanentFailure(
            f"{name}: {what} answered 409: conflict, the idempotency key was used "
            f"before with another request{detail}",
            provider=name,
            status=status,
        )
    if status >= 500:
        return ProviderOutcomeUnknown(
            message + " (it may have acted)", provider=name, status=status
        )
    # 400, 422 and the other 4xx (404 wrong URL, 405, 413, ...) and a redirect we do not
    # follow: the provider rejected this request, sending it again cannot help.
    return PermanentFailure(message, provider=name, status=status)


def answer_detail(payload: Any) -> str:
    """The provider's own words from an error answer, short."""
    if isinstance(payload, dict):
        for key in ("error", "message", "detail"):
            if key in payload:
                text = payload[key]
                if isinstance(text, dict):
                    text = text.get("message", text)
                return f": {str(text)[:200]}"
    return ""


def transport_error(
    name: str, timeout: float, exc: httpx.TransportError, method: str, url: str
) -> Exception:
    """What a transport failure means for the request: sorted by whether it can have left
    this process (a failure to connect, or to get a pooled connection, happens before any
    byte is written; everything after may have reached the provider)."""
    what = f"{name}: {method} {display_url(url)}"
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
        return ProviderUnavailable(f"{what}: not sent ({type(exc).__name__}: {exc})", provider=name)
    if isinstance(exc, httpx.TimeoutException):  # read or write timeout: it may have landed
        return ProviderTimeout(
            f"{what}: no answer within {timeout:g} s ({type(exc).__name__})",
            provider=name,
        )
    # reset, closed mid-answer: it may have landed
    return ProviderTimeout(
        f"{what}: connection lost after sending ({type(exc).__name__}: {exc})",
        provider=name,
    )
