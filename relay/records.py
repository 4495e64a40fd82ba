"""What the relay moves around: a claimed row, an orphaned intent, what the operator
commands report, and the relay's counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Record:
    """One claimed outbox row, as the relay needs it to build a stream entry.

    ``payload`` and ``headers`` are the stored JSON *text* (PostgreSQL renders ``jsonb`` as
    text in the claim query), so the relay never decodes and re-encodes a payload.
    ``time`` is ``created_at`` as ISO-8601 UTC; ``created_epoch`` is the same instant in Unix
    seconds, for commit-to-stream latencies.
    """

    seq: int
    event_id: str
    topic: str
    key: str
    key_hash: int
    tenant: str | None
    identity: str
    payload: str
    headers: str | None
    time: str
    created_epoch: float
    attempts: int


@dataclass(frozen=True, slots=True)
class Orphan:
    """An intent without a receipt: claimed by ``claimed_by`` at ``claimed_epoch_s`` (Unix
    seconds, database clock), never marked published. Reconciled against the stream."""

    seq: int
    event_id: str
    topic: str
    key: str
    key_hash: int
    tenant: str | None
    claimed_by: str
    claim_epoch: int
    claimed_epoch_s: float


@dataclass
class TopicStatus:
    """One topic's line of ``outbox-relay status``."""

    pending: int
    quarantined: int
    oldest_unpublished_age_seconds: float
    max_attempts: int


@dataclass
class RequeueResult:
    """What ``requeue`` did: ids put back, ids not found, ids found in another state."""

    requeued: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    not_quarantined: dict[str, str] = field(default_factory=dict)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as a sortable pair; a malformed one sorts first."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (-1, -1)


@dataclass
class RelayStats:
    """Counters for progress lines and the live view (this process only)."""

    published: int = 0
    quarantined: int = 0
    retried: int = 0
    reconciled_found: int = 0
    reconciled_missing: int = 0
    data_loss_detected: int = 0
    republished: int = 0
    cycles: int = 0
    errors: int = 0
    last_error: str | None = None
    started: float = field(default_factory=time.time)
