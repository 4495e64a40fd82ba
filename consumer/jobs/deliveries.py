"""Delivery callbacks: what a provider says later about an effect it accepted (issue 38).

An email "accepted" by SES or Postmark may bounce an hour later. ``Operations.record_delivery
(operation_id, status, *, ref=None, detail=None, event_id, now=None)`` calls
:func:`record_delivery`:

- the callback is kept in ``outbox_deliveries``, deduplicated by the provider's
  ``event_id`` per operation (the same callback twice changes nothing and says so:
  ``duplicate=True``; the same ``event_id`` for another operation is another callback);
- when the operation's receipt is ACCEPTED it is **applied** at once: the receipt's
  ``delivery_status`` becomes the furthest outcome seen (``delivered`` < ``opened`` <
  ``complained`` < ``bounced``: callbacks out of order, an "opened" before its "delivered",
  leave the furthest one), with ``delivery_at``;
- a callback that comes before the receipt is ACCEPTED (the provider's webhook raced the
  worker's own record of the call) waits, unapplied, and is applied when it is: by the next
  callback of that operation, and by the receipt sweep (``Operations.reconcile``, which every
  worker runs periodically: :func:`apply_pending`);
- a **bounce wakes the job**: it is recorded as a reply to the operation's job (``reply_id``
  ``delivery:<event_id>``, ``source`` ``"delivery"``, payload ``{"operation_id", "status",
  "provider_ref", "detail"}``; ``consumer.jobs.replies``). A job waiting for its customer
  becomes READY and its handler sees the bounce in ``ctx.replies`` (and may send the job to
  review); a finished job keeps it, visible in the trace.

The console's trace reads the outcome: ``sent, delivered`` or ``sent, bounced``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from consumer.errors import JobError, JobNotFound
from consumer.jobs.driver import JobDriver
from consumer.jobs.replies import record_reply
from consumer.jobs.schema import db_epoch, jobs
from consumer.jobs.states import LEASED, READY
from outbox.validate import MAX_NAME_LENGTH, check_name, check_text

__all__ = ["DELIVERY_STATUSES", "DeliveryResult", "apply_pending", "record_delivery"]

DELIVERY_STATUSES = ("delivered", "opened", "complained", "bounced")
"""A callback's status, from the least to the furthest along: a receipt keeps the furthest."""
_RANK = {status: rank for rank, status in enumerate(DELIVERY_STATUSES, start=1)}
BOUNCED = "bounced"


@dataclass(frozen=True)
class DeliveryResult:
    """What ``record_delivery`` did: ``duplicate`` (this ``event_id`` was recorded before:
    nothing changed), ``applied`` (the receipt is ACCEPTED and carries it), the receipt's
    ``delivery_status`` after the call (None when not applied), and ``woke`` (a bounce that
    was recorded as a reply the job's next run sees: False for a finished job, which keeps
    it without moving)."""

    event_id: str
    operation_id: str
    status: str
    duplicate: bool
    applied: bool
    delivery_status: str | None = None
    woke: bool = False

    @property
    def kept(self) -> bool:
        """The callback is kept for later: its receipt is not ACCEPTED yet (or not written
        yet), and the callback is applied when it is (or dropped by retention after
        ``early_retention_seconds`` if it never is)."""
        return not self.applied


def check_delivery(
    operation_id: object, status: object, ref: object, detail: object, event_id: object
) -> None:
    """``JobError`` naming the field for a callback that cannot be recorded."""
    check_name("operation_id", operation_id, JobError, limit=MAX_NAME_LENGTH * 2)
    if status not in DELIVERY_STATUSES:
        raise JobError("status", f"must be one of {', '.join(DELIVERY_STATUSES)}, got {status!r}")
    check_name("event_id", event_id, JobError, limit=MAX_NAME_LENGTH * 2)
    if ref is not None:
        check_name("ref", ref, JobError)
    check_text("detail", detail, JobError, limit=2000)  # no NUL, no lone surrogate


def record_delivery(
    driver: JobDriver,
    operation_id: str,
    status: str,
    *,
    ref: str | None,
    detail: str | None,
    event_id: str,
    when: float | None,
) -> DeliveryResult:
    """Keep a callback and apply it if its receipt is ACCEPTED (module docstring); checked
    already (:func:`check_delivery`). One transaction of three statements in the usual case
    (the receipt locked, the callback inserted, applied with any that waited), four when the
    receipt's outcome moves; the clock is the database's, in the statements themselves."""
    stamp = _stamp(driver, when)
    with driver.begin() as conn:
        # The receipt first, locked: a callback racing its receipt's record waits for it.
        receipt = driver.operation_get(conn, operation_id, lock=True)
        created = driver.delivery_insert(
            conn,
            event_id=event_id,
            operation_id=operation_id,
            status=status,
            provider_ref=ref,
            detail=detail,
            received_at=stamp,
        )
        current = None if receipt is None else receipt.delivery_status
        if not created:
            kept = driver.delivery_applied_at(conn, operation_id, event_id)
            return DeliveryResult(
                event_id, operation_id, status, True, kept is not None, current, False
            )
        if receipt is None or receipt.state != "ACCEPTED":
            return DeliveryResult(event_id, operation_id, status, False, False, None, False)
        # This one and any that came before the receipt was ACCEPTED.
        after, bounces = _apply(driver, conn, receipt, stamp, when)
    return DeliveryResult(event_id, operation_id, status, False, True, after, event_id in bounces)


def apply_pending(driver: JobDriver, *, limit: int = 500, now: float | None = None) -> int:
    """Apply the kept callbacks whose receipt is ACCEPTED now (the receipt sweep's step);
    returns how many. Reads ``ix_outbox_deliveries_unapplied``: only what waits."""
    applied = 0
    stamp = _stamp(driver, now)
    with driver.begin() as conn:
        waiting = driver.delivery_waiting_list(conn, limit)
        for operation_id in dict.fromkeys(waiting):
            receipt = driver.operation_get(conn, operation_id, lock=True)
            if receipt is None or receipt.state != "ACCEPTED":
                continue
            _, done = _apply(driver, conn, receipt, stamp, now, count=True)
            applied += len(done)
    return applied


def _stamp(driver: JobDriver, when: float | None) -> Any:
    """``when``, the store's clock (a test's), or the database clock as an expression."""
    if when is not None:
        return when
    return driver.clock() if driver.clock is not None else db_epoch()


def _apply(
    driver: JobDriver,
    conn: Connection,
    receipt: Any,
    stamp: Any,
    when: float | None,
    *,
    count: bool = False,
) -> tuple[str | None, set[str]]:
    """Apply the operation's waiting callbacks to its ACCEPTED receipt in one statement: the
    furthest status wins (one more statement when it moves); each bounce is a reply to the
    job. Returns the receipt's status after, and the event ids of the bounces (of every
    callback applied, with ``count``)."""
    rows = driver.delivery_apply(conn, receipt.operation_id, stamp)
    before = receipt.delivery_status
    after = before
    for row in rows:
        if after is None or _RANK.get(str(row.status), 0) > _RANK.get(after, 0):
            after = str(row.status)
    if after != before:
        driver.operation_delivery_set(conn, receipt.operation_id, after, stamp)
    bounces: set[str] = set()
    for row in sorted(rows, key=lambda r: (float(r.received_at), str(r.event_id))):
        if row.status == BOUNCED and _reply_bounce(driver, conn, receipt, row, when):
            bounces.add(str(row.event_id))
    return after, {str(r.event_id) for r in rows} if count else bounces


def _reply_bounce(
    driver: JobDriver, conn: Connection, receipt: Any, row: Any, when: float | None
) -> bool:
    """A bounce is a reply to the operation's job (``delivery:<event_id>``, source
    ``delivery``). True when it woke the job: a run of it will see the bounce (it is READY,
    or LEASED and its next run sees it). False when the job only keeps it (finished,
    cancelled, or waiting for a person), and when the job is gone (retention: the receipt
    keeps the outcome)."""
    try:
        result = record_reply(
            driver,
            conn,
            jobs.c.id == int(receipt.job_id),
            f"#{receipt.job_id}",
            payload={
                "operation_id": receipt.operation_id,
                "status": str(row.status),
                "provider_ref": row.provider_ref or receipt.provider_ref,
                "detail": row.detail,
            },
            reply_id=f"delivery:{row.event_id}",
            source="delivery",
            when=when,
        )
    except JobNotFound:
        return False
    return not result.duplicate and result.state in (READY, LEASED)
