"""``republish``: publish retained events again, as new entries, in per-key order.

The recovery for a Redis that lost acknowledged entries (guarantee 2): the outbox keeps
published rows for its retention (one day by default), and that retention is the recovery
window. Consumers deduplicate by business identity, so an event they already handled is
skipped; nothing is published twice for them.

Rows are read in ``seq`` order (commit order for a key whose writes the domain serialises)
and sent in batches through the relay's publish script, so a key's events reach their
stream in order; an event that fails holds back the later events of its key, in this batch
and the next ones, and is reported. Receipts are left as they are: they name where the event
was first published.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from outbox.errors import ConfigError
from outbox.validate import check_number
from relay.errors import PermanentPublishError, RoutingError
from relay.seam import Broker, HeldBack, MarkerBehind, Prepared
from relay.store import Store


def parse_since(value: str) -> datetime:
    """``TIME`` of ``--since``: ISO-8601 with ``Z`` or an offset (``2026-11-30T12:00:00Z``,
    ``2026-11-30T13:00:00+01:00``), or unix seconds (``1764504000``, ``1764504000.5``).
    A time without a zone is refused: it would be read in an unknown zone."""
    text = value.strip() if isinstance(value, str) else ""
    if not text:
        raise ConfigError("since", "is empty; give ISO-8601 (2026-11-30T12:00:00Z) or unix seconds")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    else:
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError("since", f"{value!r} is not a time (unix seconds must be >= 0)")
        return datetime.fromtimestamp(seconds, UTC)
    try:
        parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "zZ" else text)
    except ValueError:
        raise ConfigError(
            "since", f"{value!r} is neither ISO-8601 (2026-11-30T12:00:00Z) nor unix seconds"
        ) from None
    if parsed.tzinfo is None:
        raise ConfigError(
            "since", f"{value!r} has no time zone; add Z (UTC) or an offset such as +01:00"
        )
    return parsed.astimezone(UTC)


def since_argument(value: datetime) -> str:
    """How to write ``value`` on the command line (``--since``)."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class RepublishResult:
    """What ``republish`` did: events sent (or, dry run, that would be), events not sent
    and why (the first errors), streams written."""

    republished: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    streams: set[str] = field(default_factory=set)
    dry_run: bool = False


# complexity: the republish options (since, from-seq, topic, dry-run) in one pass
def republish(
    store: Store,
    publisher: Broker,
    *,
    since: datetime | None = None,
    from_seq: int | None = None,
    topic: str | None = None,
    use_receipt_stream: bool = True,
    dry_run: bool = False,
    batch_size: int = 500,
    progress: Callable[[RepublishResult], None] | None = None,
) -> RepublishResult:
    """Publish the retained events created at or after ``since`` (or with ``seq >=
    from_seq``), of ``topic`` if given, again. Each goes to the stream its receipt names
    (``use_receipt_stream``), else where ``publisher``'s template routes it. Connection
    errors propagate (what was sent before them is in the stream, and a second run is safe)."""
    if (since is None) == (from_seq is None):
        raise ConfigError("since", "give exactly one of since and from_seq")
    if from_seq is not None:
        check_number("from_seq", from_seq, ConfigError, integer=True, zero=True)
    check_number("batch_size", batch_size, ConfigError, integer=True)
    result = RepublishResult(dry_run=dry_run)
    after = (from_seq - 1) if from_seq is not None else 0
    failed_keys: set[str] = set()
    while True:
        page = store.outbox_published_page(after, batch_size, since=since, topic=topic)
        if not page:
            break
        after = page[-1][0].seq
        prepared: list[Prepared] = []
        for record, stream in page:
            if record.key in failed_keys:
                result.failed += 1
                continue
            try:
                p = publisher.prepare(record)
            except (RoutingError, PermanentPublishError) as exc:
                _failed(result, failed_keys, record.key, record.event_id, exc)
                continue
            if use_receipt_stream and stream:
                p = dataclasses.replace(p, stream=stream)
            prepared.append(p)
        if dry_run:
            result.republished += len(prepared)
            result.streams.update(p.stream for p in prepared)
        else:
            for p, outcome in zip(prepared, publisher.publish(prepared), strict=True):
                if isinstance(outcome, str):
                    result.republished += 1
                    result.streams.add(p.stream)
                elif isinstance(outcome, MarkerBehind):
                    raise outcome
                elif isinstance(outcome, HeldBack):
                    result.failed += 1
                else:
                    _failed(result, failed_keys, p.record.key, p.record.event_id, outcome)
        if progress is not None:
            progress(result)
        if len(page) < batch_size:
            break
    return result


def _failed(
    result: RepublishResult, keys: set[str], key: str, event_id: str, exc: BaseException
) -> None:
    result.failed += 1
    keys.add(key)
    if len(result.errors) < 10:
        result.errors.append(f"{event_id}: {exc}")


class Throttle:
    """Call ``fn`` at most once per ``seconds`` (progress lines)."""

    def __init__(self, fn: Callable[[RepublishResult], None], seconds: float = 1.0) -> None:
        self.fn = fn
        self.seconds = seconds
        self._last = -math.inf

    def __call__(self, result: RepublishResult) -> None:
        now = time.monotonic()
        if now - self._last >= self.seconds:
            self._last = now
            self.fn(result)
