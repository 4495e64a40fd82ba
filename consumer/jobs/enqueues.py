"""Enqueueing: the rows of new jobs written in the caller's transaction, one or many (one
statement per 500 through the driver), and the buffer of a consumer's batch Session whose
enqueues are written together at its flush. ``Store.enqueue`` and ``Store.enqueue_many``
validate and decide; these write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from consumer.bulk import deferred_writes
from consumer.errors import Conflict
from consumer.jobs.base import StoreBase
from consumer.jobs.driver import JobDriver
from consumer.jobs.order_keys import release
from consumer.jobs.replies import adopt, adopt_created, kept_count
from consumer.jobs.rows import DeferredEnqueue, EnqueueResult
from consumer.jobs.states import HELD

__all__ = ["EnqueueBuffer", "enqueue_one", "enqueue_rows", "same_stamp"]


class EnqueueBuffer:
    """Jobs enqueued in one consumer batch Session, written together at its flush
    (``consumer.bulk``'s deferred writes: one statement per 500 instead of one round trip
    per job)."""

    def __init__(self, store: StoreBase, session: Session) -> None:
        self.store = store
        self.session = session
        self.rows: list[dict[str, Any]] = []
        self.results: list[EnqueueResult | None] = []
        self.start = 0  # index of self.rows[0] in self.results

    def add(self, values: dict[str, Any]) -> DeferredEnqueue:
        self.rows.append(values)
        self.results.append(None)
        return DeferredEnqueue(self, len(self.results) - 1)

    def flush(self, conn: Connection) -> None:
        rows, start = self.rows, self.start
        self.rows, self.start = [], len(self.results)
        # Rows with an explicit ``now`` keep their own timestamp: one statement per run of
        # rows that share it (usually the whole buffer).
        index = 0
        while index < len(rows):
            end = index + 1
            while end < len(rows) and same_stamp(rows[end], rows[index]):
                end += 1
            for offset, result in enumerate(enqueue_rows(self.store.driver, conn, rows[index:end])):
                self.results[start + index + offset] = result
            index = end

    def result(self, index: int) -> EnqueueResult:
        found = self.results[index]
        if found is None:
            writers = deferred_writes(self.session)
            if writers is None or writers.get(self.store) is not self:
                raise Conflict("this enqueue was rolled back with its handler's savepoint")
            self.flush(self.session.connection())
            found = self.results[index]
        assert found is not None
        return found


def _stamp(values: Mapping[str, Any]) -> float | None:
    """The row's timestamp when it is a number (``now`` given), else None (the clock)."""
    stamp = values["created_at"]
    return float(stamp) if isinstance(stamp, (int, float)) else None


def same_stamp(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows share their timestamp (the same number, or both the database clock)."""
    x, y = a["created_at"], b["created_at"]
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    return not isinstance(x, (int, float)) and not isinstance(y, (int, float))


def enqueue_one(
    driver: JobDriver, conn: Connection, values: dict[str, Any], *, adopting: bool = True
) -> tuple[EnqueueResult, bool]:
    """Insert one job in ``conn``'s transaction, or find its identity's existing job; and
    whether replies kept before it existed wait to be moved into it. The INSERT counts them
    (``replies_received``: its first run knows they are there); with ``adopting`` they are
    moved here, in the same transaction (``consumer.jobs.replies.adopt``)."""
    kept = kept_count(values["tenant"], values["action"])
    try:
        job_id, created, counted = driver.job_insert_counted(
            conn, {**values, "replies_received": kept}
        )
    except LookupError as exc:  # pragma: no cover - the conflicting row was deleted
        raise Conflict(str(exc)) from None
    waiting = created and counted > 0
    if waiting and adopting:
        adopt(driver, conn, job_id)
        waiting = False
    if created and values["state"] == HELD:  # a key's job: its key's turn, or room?
        release(conn, [job_id], ended=False, now=_stamp(values))
    return EnqueueResult(job_id, not created), waiting


def enqueue_rows(
    driver: JobDriver, conn: Connection, rows: list[dict[str, Any]]
) -> list[EnqueueResult]:
    """Insert many jobs in ``conn``'s transaction; results in the order of ``rows``."""
    # Every row of one call shares its timestamp (``now``, else the database clock read
    # once), and the batch goes as ONE statement per 500 (the driver). ON CONFLICT DO
    # NOTHING skips identities that exist and the second of two equal ones in the batch;
    # RETURNING names the rows that were created.
    stamp = rows[0]["created_at"]
    if any(row["created_at"] is not stamp for row in rows):
        rows = [{**row, "created_at": stamp, "updated_at": stamp} for row in rows]
    kept: set[tuple[str, str]] = set()
    created, existing = driver.job_insert_many(conn, rows, kept)
    adopt_created(driver, conn, created, kept)
    keys = [(row["tenant"], row["action"]) for row in rows]
    ordered = [
        created[key]
        for key, row in zip(keys, rows, strict=True)
        if key in created and row["state"] == HELD
    ]
    if ordered:  # written HELD: each new key's first job becomes its head
        release(conn, sorted(set(ordered)), ended=False, now=_stamp(rows[0]))
    results: list[EnqueueResult] = []
    seen: set[tuple[str, str]] = set()
    for key in keys:
        if key in created and key not in seen:
            results.append(EnqueueResult(created[key], False))
        elif key in created:
            results.append(EnqueueResult(created[key], True))
        elif key in existing:
            results.append(EnqueueResult(existing[key], True))
        else:  # pragma: no cover - the conflicting row vanished (deleted)
            raise Conflict(f"job {key[0]}/{key[1]} was deleted meanwhile")
        seen.add(key)
    return results
