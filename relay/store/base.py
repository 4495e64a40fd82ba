"""The relay store's protocol and what both databases' stores share (status, requeue,
receipts)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import DateTime, column, text
from sqlalchemy.engine import Connection, Engine

from outbox.dialect import quoted_table
from outbox.schema import OutboxSchema
from outbox.status import (
    age_seconds,
    backlog_by_topic,
    pending_max_attempts_by_topic,
    quarantined_by_topic,
)
from relay.records import Orphan, Record, RequeueResult, TopicStatus, entry_id_key

log = logging.getLogger("outbox.relay")


class Store(Protocol):
    """What the relay loop needs from storage (see the module doc)."""

    payload_is_json: bool
    supports_notify: bool
    partitions: int

    def connect(self) -> None: ...
    def close(self) -> None: ...
    def partition_rebalance_due(self) -> bool: ...
    def partition_rebalance(self, before_release: Callable[[], None] = lambda: None) -> bool: ...
    @property
    def partitions_owned(self) -> frozenset[int]: ...
    def outbox_claim(self, limit: int, owner: str, epoch: int, sweep: bool) -> list[Record]: ...
    def outbox_mark_published(
        self, owner: str, epoch: int, receipts: Sequence[tuple[int, str, str]]
    ) -> int: ...
    def outbox_mark_failed(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, float, str, bool]]
    ) -> None: ...
    def outbox_quarantine(
        self, owner: str, epoch: int, failures: Sequence[tuple[int, str]]
    ) -> None: ...
    def outbox_release(self, owner: str, epoch: int, seqs: Sequence[int]) -> None: ...
    def outbox_retry_now(self, seqs: Sequence[int]) -> int:
        """Make these pending, unclaimed rows available at once (their backoff is over: what
        refused them, a whole-Redis condition, has cleared); returns how many."""
        ...

    def orphan_list(self, limit: int) -> list[Orphan]: ...
    def outbox_retry_ready(self) -> bool: ...
    def orphan_resolve(
        self, found: Sequence[tuple[Orphan, str, str]], missing: Sequence[Orphan]
    ) -> None: ...
    def notify_wait(self, timeout: float) -> int: ...
    def outbox_delete_published(self, older_than_seconds: float, limit: int) -> int: ...
    def outbox_backlog(self) -> tuple[int, float | None]: ...
    def receipt_store(self) -> Store | None:
        """A second store on its own connection that writes receipts while this one claims
        (the pipelined ``run``), or None when the database gains nothing from it."""
        ...

    def outbox_vacuum_if_no_autovacuum(self) -> float | None: ...
    def outbox_status(self) -> dict[str, TopicStatus]:
        """Pending, quarantined, oldest pending age and max attempts, per topic."""
        ...

    def outbox_requeue(
        self,
        event_ids: Sequence[str] | None,
        all_quarantined: bool,
        joined: Connection | None = None,
    ) -> RequeueResult:
        """Quarantined events back to pending (see :func:`relay.admin.requeue`); in the
        caller's transaction with ``joined``."""
        ...

    def outbox_published_page(
        self,
        after_seq: int,
        limit: int,
        *,
        since: datetime | None = None,
        topic: str | None = None,
    ) -> list[tuple[Record, str | None]]:
        """Published (retained) rows with ``seq > after_seq`` (and ``created_at >= since``,
        of ``topic``), in ``seq`` order, each with the stream its receipt names: what
        ``republish`` sends again. A range scan of the primary key."""
        ...

    def receipt_latest(self) -> list[tuple[str, str]]:
        """``(stream, entry id)``: the highest entry id of each stream among the latest
        receipts (the last 1,000 published rows by ``seq``), whichever relay wrote them:
        what Redis must still hold (the data-loss check, and on a cluster each slot's
        expected marker)."""
        ...

    def outbox_oldest_published_since(self, published_after: float | None) -> datetime | None:
        """The oldest ``created_at`` among published rows whose receipt was written at or
        after ``published_after`` (unix seconds; None: every retained row). Where a
        ``republish --since`` must start to cover entries a Redis lost. Scans the retained
        published rows: run once per data loss, not per batch."""
        ...


def full_table(schema: OutboxSchema) -> str:
    return quoted_table(schema.table_name, schema.schema)


def topic_status(conn: Connection, table: str, now_sql: str) -> dict[str, TopicStatus]:
    """Per-topic status from the backlog statements above; ages on the database clock
    (``now_sql``), the clock that wrote ``created_at``."""
    now = conn.execute(
        text(f"SELECT {now_sql} AS now").columns(column("now", DateTime(timezone=True)))
    ).scalar_one()
    out: dict[str, TopicStatus] = {}
    for topic, count, oldest in conn.execute(backlog_by_topic(table)):
        out[topic] = TopicStatus(int(count), 0, age_seconds(now, oldest) or 0.0, 0)
    for topic, attempts in conn.execute(pending_max_attempts_by_topic(table)):
        out[topic].max_attempts = int(attempts or 0)
    for topic, count, attempts in conn.execute(quarantined_by_topic(table)):
        status = out.setdefault(topic, TopicStatus(0, 0, 0.0, 0))
        status.quarantined = int(count)
        status.max_attempts = max(status.max_attempts, int(attempts or 0))
    return dict(sorted(out.items()))


def highest_receipts(rows: Sequence[Any]) -> list[tuple[str, str]]:
    best: dict[str, str] = {}
    for stream, entry_id in rows:
        if not stream or not entry_id:
            continue
        held = best.get(str(stream))
        if held is None or entry_id_key(str(entry_id)) > entry_id_key(held):
            best[str(stream)] = str(entry_id)
    return list(best.items())


def in_transaction(engine: Engine, joined: Connection | None) -> AbstractContextManager[Connection]:
    """A transaction of its own on ``engine``, or the caller's ``joined`` one."""
    return engine.begin() if joined is None else nullcontext(joined)


def requeue_quarantined(
    engine: Engine,
    t: str,
    now_sql: str,
    event_ids: Sequence[str] | None,
    all_quarantined: bool,
    after: Callable[[Connection], None] | None = None,
    joined: Connection | None = None,
) -> RequeueResult:
    """Both databases' requeue; ``after``: one more statement in the same transaction when
    anything was requeued (PostgreSQL asks the relays for a sweep); ``joined``: the caller's
    transaction to run in (an operator's action and its audit row commit together)."""
    result = RequeueResult()
    with in_transaction(engine, joined) as conn:
        if all_quarantined:
            ids = [
                r[0]
                for r in conn.execute(
                    text(f"SELECT event_id FROM {t} WHERE state = 'quarantined' ORDER BY seq")
                )
            ]
        else:
            wanted = list(dict.fromkeys(event_ids or []))
            states: dict[str, str] = {}
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                params = {f"i{n}": v for n, v in enumerate(chunk)}
                marks = ", ".join(f":i{n}" for n in range(len(chunk)))
                for event_id, state in conn.execute(
                    text(f"SELECT event_id, state FROM {t} WHERE event_id IN ({marks})"), params
                ):
                    states[event_id] = state
            ids = []
            for event_id in wanted:
                state = states.get(event_id)
                if state is None:
                    result.unknown.append(event_id)
                elif state != "quarantined":
                    result.not_quarantined[event_id] = state
                else:
                    ids.append(event_id)
        if ids:
            conn.execute(
                text(
                    f"UPDATE {t} SET state = 'pending', available_at = {now_sql}, "
                    "claimed_by = NULL, claim_epoch = NULL, claimed_at = NULL "
                    "WHERE event_id = :id AND state = 'quarantined'"
                ),
                [{"id": i} for i in ids],
            )
            if after is not None:
                after(conn)
        result.requeued = ids
    return result
