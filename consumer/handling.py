"""One batch in the database: decode, deduplicate in the inbox, run the handlers, record the
dead letters, all in ONE transaction (steps 5 and 6 of the batch in the
:mod:`consumer.consumer` docstring).

:class:`BatchProcessor` turns the entries a batch read into an :class:`Outcome`: what to
acknowledge, what was handled, the duplicates and the dead letters. Handlers run first all
together with no savepoint; if one raises, the transaction is rolled back and the batch runs
again with a savepoint per entry (:meth:`BatchProcessor.handle`). Why a handler may run more
than once and only its committed work counts: ``docs/explanation/claims-and-order.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from consumer import inbox as q
from consumer.bulk import (
    bulk_insert,
    defer_writes,
    deferred_writes,
    discard_deferred,
    flush_deferred,
)
from consumer.config import ConsumerConfig
from consumer.errors import UndecodableEntry
from consumer.event import ConsumedEvent, decode_entry, text_fields
from consumer.reading import Entry
from outbox import tracing
from outbox.logs import fields

log = logging.getLogger("outbox.consumer")


@dataclass
class ConsumerTx:
    """The transaction a handler runs in: ``session`` is the one the inbox row is written in
    (inside a savepoint of the batch's transaction). Never commit or roll it back yourself:
    raise to roll back your entry, return to keep its work.

    Writes made the natural way are batched for you: ``Store.enqueue(..., session=
    tx.session)`` is buffered and written in one statement with the rest of the batch's
    (``consumer.bulk``'s deferred writes), and ``tx.session.add(obj)`` ORM objects are
    flushed together (SQLAlchemy's insertmanyvalues) at the end of the handlers."""

    session: Session
    group: str

    @property
    def connection(self) -> Connection:
        """The session's Connection, for Core statements."""
        return self.session.connection()

    def insert_many(
        self,
        table: Table,
        rows: Sequence[Mapping[str, Any]],
        *,
        conflict: Sequence[str] | None = None,
        returning: str | None = None,
    ) -> list[Any]:
        """Insert ``rows`` into ``table`` in ONE statement in this transaction (binary
        ``unnest`` arrays on PostgreSQL): the fast path for a batch handler that creates a
        job per event. ``conflict`` columns skip colliding rows; ``returning`` names a
        column to return for the inserted rows."""
        return bulk_insert(self.connection, table, rows, conflict=conflict, returning=returning)

    def reply(
        self,
        job: Any,
        action: str | None = None,
        *,
        payload: Any,
        reply_id: str,
        source: str | None = None,
        now: Any = None,
    ) -> Any:
        """``Store.reply`` in this transaction: a customer's reply that arrives as an event is
        recorded once, with its inbox row (the job tables are in this database). Returns its
        ``ReplyResult``; rolled back with the entry if the handler raises."""
        from consumer.jobs.replies import reply_in

        if deferred_writes(self.session):  # a job enqueued earlier in this batch exists first
            flush_deferred(self.session)
        return reply_in(
            self.connection, job, action, payload=payload, reply_id=reply_id, source=source, now=now
        )


@dataclass
class Dead:
    entry: Entry
    reason: str
    error: str
    event: ConsumedEvent | None = None


@dataclass
class Outcome:
    """What a batch did: the entries to acknowledge (per stream), handled counts, duplicates,
    dead letters (and their database record ids once written)."""

    acks: dict[str, list[str]] = field(default_factory=dict)
    handled: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    dead: list[Dead] = field(default_factory=list)
    dead_ids: dict[tuple[str, str], int] = field(default_factory=dict)
    dead_before: set[tuple[str, str]] = field(default_factory=set)
    """Dead letters recorded by an earlier delivery (a group destroyed and read again from
    the start): acknowledged, not counted again."""

    def ack(self, entry: Entry) -> None:
        self.acks.setdefault(entry.stream, []).append(entry.entry_id)

    def duplicate(self, entry: Entry, event: ConsumedEvent, group: str) -> None:
        self.duplicates += 1
        tracing.duplicate(event, group)
        self.ack(entry)

    def first_dead(self) -> list[Dead]:
        """The dead letters recorded by this batch: those of ``dead_before`` are neither
        counted nor copied to the dead-letter stream again (the database record stays the
        durable one; a consumer that died between its commit and the copy loses the copy)."""
        return [d for d in self.dead if (d.entry.stream, d.entry.entry_id) not in self.dead_before]

    def copy(self) -> Outcome:
        return Outcome(
            acks={stream: list(ids) for stream, ids in self.acks.items()},
            handled=dict(self.handled),
            duplicates=self.duplicates,
            dead=list(self.dead),
            dead_ids=dict(self.dead_ids),
            dead_before=set(self.dead_before),
        )

    @property
    def count(self) -> int:
        return sum(len(ids) for ids in self.acks.values())


class HandlersFailed(Exception):
    """The optimistic pass over a batch's handlers (no savepoint) raised ``error``: the
    transaction is rolled back and the batch runs again, a savepoint per entry. ``only``:
    the entry's key when the pass had one entry (it is not run a second time)."""

    def __init__(self, error: Exception, only: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.only = only


Pair = tuple[Entry, ConsumedEvent]


class BatchProcessor:
    """Runs one batch's database transaction for a consumer of ``group`` (see the module
    docstring). ``handlers`` is the consumer's own registry (shared, not copied);
    ``dead_letter_stream_for`` names the dead-letter stream of a stream."""

    def __init__(
        self,
        *,
        group: str,
        config: ConsumerConfig,
        inbox: q.Inbox,
        handlers: dict[str, tuple[Callable[..., Any], bool]],
        dead_letter_stream_for: Callable[[str], str],
    ) -> None:
        self.group = group
        self.config = config
        self.inbox = inbox
        self.handlers = handlers
        self.dead_letter_stream_for = dead_letter_stream_for

    def process(self, entries: list[Entry]) -> Outcome:
        outcome = Outcome()
        events = self._decode(entries, outcome)
        # Optimistic: the handlers run without a savepoint. If one raises, the transaction
        # is rolled back and the batch runs again with a savepoint per entry.
        decoded = outcome.copy()
        try:
            self._transact(events, outcome, None)
        except HandlersFailed as failed:
            outcome = decoded
            self._transact(events, outcome, failed)
        for dead in outcome.dead:
            outcome.ack(dead.entry)
        return outcome

    def _decode(self, entries: list[Entry], outcome: Outcome) -> list[Pair]:
        """The entries that have a handler, decoded; the others acknowledged (trimmed,
        skipped) or dead-lettered (undecodable, unknown type) in ``outcome``."""
        events: list[Pair] = []
        for entry in entries:
            if not entry.raw:
                # Deleted (trimmed) while pending: nothing left to handle.
                log.warning(
                    "pending entry no longer exists",
                    extra=fields(group=self.group, stream=entry.stream, entry_id=entry.entry_id),
                )
                outcome.ack(entry)
                continue
            size = entry_bytes(entry.raw)
            if size > self.config.max_entry_bytes:
                error = (
                    f"the entry holds {size} bytes, over the consumer's max_entry_bytes "
                    f"({self.config.max_entry_bytes}; emit caps a payload at 1 MiB): its data "
                    "is not kept"
                )
                outcome.dead.append(Dead(without_data(entry, size), q.TOO_LARGE, error))
                continue
            try:
                event = decode_entry(entry.stream, entry.entry_id, entry.raw, entry.deliveries)
            except UndecodableEntry as exc:
                outcome.dead.append(Dead(entry, q.UNDECODABLE, str(exc)))
                continue
            if event.type not in self.handlers:
                if self.config.unknown_types == "skip":
                    log.info(
                        "no handler for event type, skipped",
                        extra=fields(group=self.group, type=event.type, entry_id=entry.entry_id),
                    )
                    outcome.ack(entry)
                else:
                    error = f"no handler for event type {event.type!r} in group {self.group!r}"
                    outcome.dead.append(Dead(entry, q.UNKNOWN_TYPE, error, event))
                continue
            events.append((entry, event))
        return events

    def _transact(
        self, events: list[Pair], outcome: Outcome, failed: HandlersFailed | None
    ) -> None:
        session = self.inbox.session()
        defer_writes(session)
        try:
            with session.begin():
                conn = session.connection()
                self._deduplicate_and_handle(session, conn, events, outcome, failed)
                if outcome.dead:
                    keys = [(d.entry.stream, d.entry.entry_id) for d in outcome.dead]
                    outcome.dead_before = set(self.inbox.dead_letter_ids(conn, self.group, keys))
                    outcome.dead_ids = self.inbox.dead_letter_insert(
                        conn, [self._dead_row(d) for d in outcome.dead]
                    )
        finally:
            session.close()

    def _deduplicate_and_handle(
        self,
        session: Session,
        conn: Connection,
        events: list[Pair],
        outcome: Outcome,
        failed: HandlersFailed | None,
    ) -> None:
        if not events:
            return
        # Entries of one identity are taken in turn, each judged on its own: the first is
        # the candidate; a later one is a duplicate only once an inbox row exists (one was
        # handled, now or before), and runs itself when every earlier one failed or was
        # set aside, so it is never left pending, delivered again untried, for its twin.
        waiting: dict[str, list[Pair]] = {}
        for pair in events:
            waiting.setdefault(pair[1].identity, []).append(pair)
        while waiting:
            first = {identity: pairs.pop(0) for identity, pairs in waiting.items()}
            unsettled = self._set_aside_worn(conn, first, outcome)
            fresh = self._record_in_inbox(conn, first, outcome)
            failures = self.handle(session, [event for _entry, event in fresh], failed)
            unsettled |= self._settle(conn, fresh, failures, outcome)
            for identity, pairs in waiting.items():
                if identity not in unsettled:  # its inbox row exists: the rest are duplicates
                    for entry, event in pairs:
                        outcome.duplicate(entry, event, self.group)
            waiting = {i: pairs for i, pairs in waiting.items() if pairs and i in unsettled}

    def _set_aside_worn(
        self, conn: Connection, first: dict[str, Pair], outcome: Outcome
    ) -> set[str]:
        """Entries delivered too often are suspected of killing their consumers: do not run
        them again (unless already handled: then they are mere duplicates). Returns the
        identities dead-lettered so (they have no inbox row)."""
        worn = {i: p for i, p in first.items() if p[1].deliveries > self.config.max_deliveries}
        if not worn:
            return set()
        seen = self.inbox.inbox_seen(conn, self.group, list(worn))
        for identity, (entry, event) in worn.items():
            del first[identity]
            if identity in seen:
                outcome.duplicate(entry, event, self.group)
            else:
                error = (
                    f"delivered {entry.deliveries} times, more than max_deliveries="
                    f"{self.config.max_deliveries} (its consumers died or failed)"
                )
                outcome.dead.append(Dead(entry, q.POISON, error, event))
        return set(worn) - seen

    def _record_in_inbox(
        self, conn: Connection, first: dict[str, Pair], outcome: Outcome
    ) -> list[Pair]:
        """The inbox rows of the batch in one statement; the new identities' pairs (the
        others are duplicates, acknowledged)."""
        rows = [
            {
                "group_name": self.group,
                "identity": identity,
                "event_id": event.id,
                "topic": event.type,
                "stream": entry.stream,
                "entry_id": entry.entry_id,
            }
            for identity, (entry, event) in sorted(first.items())
        ]
        new = self.inbox.inbox_insert(conn, rows)
        fresh: list[Pair] = []
        for identity, (entry, event) in first.items():
            if identity in new:
                fresh.append((entry, event))
            else:
                outcome.duplicate(entry, event, self.group)
        return fresh

    def _settle(
        self,
        conn: Connection,
        fresh: list[Pair],
        failures: dict[str, BaseException],
        outcome: Outcome,
    ) -> set[str]:
        """Acknowledge the handled entries; a failed one loses its inbox row and waits to be
        claimed back, or is dead-lettered at its ``max_deliveries``-th delivery. Returns the
        failed identities."""
        failed_identities: set[str] = set()
        for entry, event in fresh:
            exc = failures.get(entry_key(event))
            if exc is None:
                outcome.ack(entry)
                outcome.handled[entry.stream] = outcome.handled.get(entry.stream, 0) + 1
                continue
            failed_identities.add(event.identity)
            self.inbox.inbox_delete(conn, self.group, [event.identity])
            error = f"{type(exc).__name__}: {exc}"
            context = fields(
                group=self.group,
                stream=entry.stream,
                entry_id=entry.entry_id,
                deliveries=entry.deliveries,
                error=error,
            )
            if entry.deliveries >= self.config.max_deliveries:
                outcome.dead.append(Dead(entry, q.POISON, error, event))
                log.error("handler failed, dead-lettered", extra=context)
            else:
                log.warning("handler failed, will retry", extra=context)
        return failed_identities

    def handle(
        self, session: Session, events: list[ConsumedEvent], failed: HandlersFailed | None
    ) -> dict[str, BaseException]:
        """Run the handlers of ``events``; return the failures by entry key.

        First pass (``failed`` is None), optimistic: all of them together, with no savepoint,
        their deferred writes (``consumer.bulk``: ``Store.enqueue(..., session=tx.session)``)
        and ORM objects (``tx.session.add``: insertmanyvalues) flushed once at the end. If a
        handler or that flush raises, :class:`HandlersFailed` rolls the whole transaction
        back and the batch runs again (``failed`` given): each entry in a savepoint of its
        own, so only the failing ones lose their work. Savepoints are paid when a handler
        fails, never on the happy path. A batch whose one handler failed is not run again.
        """
        if not events:
            return {}
        tx = ConsumerTx(session=session, group=self.group)
        if failed is None:
            try:
                self._run(session, events, tx)
            except Exception as exc:
                only = entry_key(events[0]) if len(events) == 1 else None
                raise HandlersFailed(exc, only) from exc
            return {}
        if len(events) == 1 and failed.only == entry_key(events[0]):
            return {failed.only: failed.error}
        failures: dict[str, BaseException] = {}
        for event in events:
            failure = self._attempt(session, [event], tx)
            if failure is not None:
                failures[entry_key(event)] = failure
        return failures

    def _attempt(
        self, session: Session, events: list[ConsumedEvent], tx: ConsumerTx
    ) -> Exception | None:
        """Run ``events``' handlers and write what they buffered, in one savepoint: None if
        it was released, else the exception that rolled it back."""
        savepoint = session.begin_nested()
        # The Session emits SAVEPOINT lazily, at its next statement: a handler that writes
        # through another client of the same connection (the Django ORM on
        # outbox.django.engine()) would otherwise write outside the savepoint, and its work
        # would survive the rollback below.
        session.connection()
        try:
            self._run(session, events, tx)
        except Exception as exc:
            savepoint.rollback()  # raises if the connection itself is gone: batch retried
            return exc
        savepoint.commit()
        return None

    def _run(self, session: Session, events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        """Call ``events``' handlers, then write what they deferred and their ORM objects; if
        anything raises, what they buffered is dropped and the exception goes on."""
        try:
            self._call(events, tx)
            flush_deferred(session)
            session.flush()
        except Exception:
            discard_deferred(session)
            raise

    def _call(self, events: list[ConsumedEvent], tx: ConsumerTx) -> None:
        batch: dict[str, list[ConsumedEvent]] = {}
        for event in events:
            fn, is_batch = self.handlers[event.type]
            if is_batch:
                batch.setdefault(event.type, []).append(event)
            else:
                with tracing.consuming(event, self.group):  # the event's trace goes on
                    fn(event, tx)
        for event_type, group in batch.items():
            with tracing.consuming_batch(group, self.group):
                self.handlers[event_type][0](group, tx)

    def _dead_row(self, dead: Dead) -> dict[str, Any]:
        entry, event = dead.entry, dead.event
        raw = text_fields(entry.raw)
        return {
            "group_name": self.group,
            "stream": entry.stream,
            "entry_id": entry.entry_id,
            "event_id": event.id if event else raw.get("id"),
            "topic": event.type if event else raw.get("type"),
            "identity": event.identity if event else None,
            "reason": dead.reason,
            "error": dead.error,
            "deliveries": entry.deliveries,
            "payload": q.encode_fields(raw),
            "dead_letter_stream": self.dead_letter_stream_for(entry.stream),
        }


def entry_bytes(raw: Mapping[Any, Any]) -> int:
    """The size of an entry: its field names and values, in bytes."""
    return sum(_size(k) + _size(v) for k, v in raw.items())


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, str)) else len(str(value))


def without_data(entry: Entry, size: int) -> Entry:
    """``entry`` with its ``data`` field (and any field over 64 KiB) replaced by a note: what
    a dead letter keeps of an entry too large to handle."""
    kept = (
        {
            k: (v if _size(v) <= 65536 and k not in (b"data", "data") else f"<{_size(v)} bytes>")
            for k, v in entry.raw.items()
        }
        if entry.raw
        else {}
    )
    return replace(entry, raw=kept)


def entry_key(event: ConsumedEvent) -> str:
    return event.entry_id + "\x00" + event.stream


__all__ = ["BatchProcessor", "ConsumerTx", "Dead", "HandlersFailed", "Outcome"]
