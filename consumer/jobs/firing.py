"""The firing duty: the due slots of every schedule become jobs, once, fleet-wide.

:func:`fire_schedules` is one round, in one transaction (``consumer.jobs.schedules`` has the
contract):

1. the database clock (or ``now``) says which running schedules are due: ``next_slot <=
   clock``, read by ``ix_outbox_schedules_due``, at most ``limit`` rows, locked (PostgreSQL
   ``FOR UPDATE SKIP LOCKED``: two workers never wait for each other nor decide the same
   row; SQLite: the transaction holds the write lock);
2. for each, the slots from ``next_slot`` up to the clock are listed: those the clock is
   within ``grace`` of are on time and fire; the others are missed, and the ``missed``
   policy says which of them still fire (``skip``: none; ``catch_up``: the latest
   ``catch_up_limit``);
3. each slot that fires enqueues its job ``(tenant, f"{action}@{slot}")`` with ``kind=action``
   through the job table's unique ``(tenant, action)``, and the row moves on: ``next_slot``
   to the first slot after the clock, ``last_slot``/``last_job_id``, ``fired``/``missed``
   counted, compare-and-set on the ``next_slot`` read.

A worker that dies mid-round rolls back everything: the next worker decides the same
slots. :class:`ScheduleDuty` runs rounds in a worker: at each schedule's next slot (read from
the database after each round, so an idle fleet with 100 per-minute schedules costs each
worker one round per minute plus one every ``max_wait`` seconds), and at once when a round
found more due rows than its ``limit``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from consumer.jobs.checks import Time, job_values, valid_time
from consumer.jobs.cron import Slot, check_zone, next_slot, slot_text
from consumer.jobs.driver import JobDriver
from outbox.logs import fields

__all__ = ["FiredSlot", "FiringResult", "ScheduleDuty", "fire_schedules"]

log = logging.getLogger("outbox.worker.schedules")

MAX_LISTED_SLOTS = 10_000
"""Slots listed per schedule in one round; past that (a per-minute schedule down for a
week) the rest are counted missed in one step, without listing them."""


@dataclass(frozen=True)
class FiredSlot:
    """One slot a round fired: its schedule, the slot, its job, and whether that job
    existed already (``duplicate``: someone enqueued that identity before)."""

    schedule: str
    slot: Slot
    job_id: int
    duplicate: bool


@dataclass(frozen=True)
class FiringResult:
    """What a round did: the slots it fired, the slots missed per schedule, the clock it
    used, and when the next slot of a running schedule falls (unix seconds; None: none;
    ``more``: due rows were left for the next round)."""

    fired: tuple[FiredSlot, ...]
    missed: dict[str, int] = field(default_factory=dict)
    clock: float = 0.0
    next_due: float | None = None
    more: bool = False


def fire_schedules(driver: JobDriver, *, now: Time | None = None, limit: int = 500) -> FiringResult:
    """One round of the firing duty (module docstring), in one transaction
    (``Store.fire_schedules``). Its statements do not grow with the schedules due: the
    decisions are made in Python, the jobs go in one insert (per 500) and the schedules move
    in one batched update: a round that fires 100 schedules runs fewer than ten statements,
    not two hundred (tests/test_schedules.py counts them)."""
    when = valid_time("now", now)
    with driver.begin() as conn:
        clock = driver.clock_read(conn, when)
        rows = driver.schedule_due_list(conn, clock, limit)
        decisions = [_decide(row, clock) for row in rows]
        fired = _enqueue(driver, conn, decisions, clock)
        _move(driver, conn, decisions, clock)
        next_due = driver.schedule_next_due(conn)
    missed = {d.row.name: d.given_up for d in decisions if d.given_up}
    for slot in fired:
        log.info(
            "schedule fired",
            extra=fields(schedule=slot.schedule, slot=str(slot.slot), job_id=slot.job_id),
        )
    for name, count in missed.items():
        log.warning("schedule missed slots", extra=fields(schedule=name, missed=count))
    return FiringResult(
        tuple(fired),
        missed,
        clock,
        next_due,
        more=len(rows) >= limit,
    )


@dataclass
class _Decision:
    """What a round decided for one due schedule."""

    row: Any
    chosen: list[float]  # the slots that fire, oldest first
    given_up: int  # slots missed
    next_slot: float  # the first slot after the clock
    last_job_id: int | None = None


def _decide(row: Any, clock: float) -> _Decision:
    """The slots of one due schedule from its ``next_slot`` up to ``clock``: those within
    their grace are on time and fire; the others are missed, and the policy says which of
    those still fire (``catch_up``: the latest ``catch_up_limit``)."""
    cron, zone, grace = row.cron, check_zone(row.tz), float(row.grace)
    on_time: list[float] = []
    late: deque[float] = deque(maxlen=int(row.catch_up_limit))  # the latest missed slots
    due, slot = 0, float(row.next_slot)
    while slot <= clock and due < MAX_LISTED_SLOTS:
        (on_time if clock - slot <= grace else late).append(slot)
        due += 1
        slot = next_slot(cron, zone, slot)
    if slot <= clock:  # too many to list: the rest are missed, the rhythm resumes after now
        slot = next_slot(cron, zone, clock)
        on_time, late = [], deque()
    chosen = (list(late) if row.missed_policy == "catch_up" else []) + on_time
    return _Decision(row, chosen, due - len(chosen), slot, row.last_job_id)


def _enqueue(
    driver: JobDriver, conn: Connection, decisions: list[_Decision], clock: float
) -> list[FiredSlot]:
    """The jobs of every slot that fires, in one insert per 500 (the job table's unique
    ``(tenant, action)``: an identity that exists is a duplicate, never a second job)."""
    values = [
        job_values(
            d.row.tenant,
            f"{d.row.action}@{slot_text(moment)}",
            kind=d.row.action,
            payload=d.row.payload,
            queue=d.row.queue,
            now=clock,
        )
        for d in decisions
        for moment in d.chosen
    ]
    if not values:
        return []
    created, existing = driver.job_insert_many(conn, values)
    fired: list[FiredSlot] = []
    for d in decisions:
        for moment in d.chosen:
            key = (d.row.tenant, f"{d.row.action}@{slot_text(moment)}")
            job_id = created.get(key, existing.get(key))
            if job_id is None:  # pragma: no cover - the conflicting row vanished (deleted)
                raise RuntimeError(f"job {key} was deleted during its schedule's round")
            # Two schedules of one tenant and action share a slot's job: the second's is a
            # duplicate.
            duplicate = key not in created or any(f.job_id == job_id for f in fired)
            fired.append(FiredSlot(d.row.name, Slot.at(moment), job_id, duplicate))
            d.last_job_id = job_id
    return fired


def _move(driver: JobDriver, conn: Connection, decisions: list[_Decision], clock: float) -> None:
    """Every decided schedule moves on, in one batched statement (executemany). Filtered on
    the ``next_slot`` read: the rows are locked, so it always matches."""
    if not decisions:
        return
    driver.schedule_move_batch(
        conn,
        [
            {
                "name": d.row.name,
                "first": float(d.row.next_slot),
                "next": d.next_slot,
                "last": d.chosen[-1] if d.chosen else d.row.last_slot,
                "job": d.last_job_id,
                "fired": len(d.chosen),
                "missed": d.given_up,
            }
            for d in decisions
        ],
        clock,
    )


class Fires(Protocol):
    """What the duty steps: ``Store.fire_schedules``."""

    def fire_schedules(self, *, now: Time | None = None, limit: int = 500) -> FiringResult: ...


class ScheduleDuty:
    """The worker's firing duty: :func:`fire_schedules` when a slot falls.

    ``run_once(now=None)`` runs a round now and books the next one; ``maybe_run()`` runs one
    when due; ``remaining()`` says how long until then (a worker's idle wait is no longer).
    The next round is due at the earliest next slot of a running schedule (the database's
    answer, as a delay from its clock, so local clocks never matter), at most ``max_wait``
    seconds away (a schedule defined or resumed meanwhile is seen by then), at once when a
    round left due rows, and ``busy_wait`` seconds later when another worker holds the due
    rows (it is firing them).
    """

    def __init__(
        self,
        store: Fires,
        *,
        max_wait: float = 30.0,
        busy_wait: float = 0.25,
        limit: int = 500,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.max_wait = max_wait
        self.busy_wait = busy_wait
        self.limit = limit
        self._clock = clock
        self.next_at = -1.0  # monotonic; the first round is due at once
        self.rounds = 0

    def remaining(self) -> float:
        return max(0.0, self.next_at - self._clock())

    def due(self) -> bool:
        return self._clock() >= self.next_at

    def make_due(self) -> None:
        """The next check runs a round, whatever the last one booked."""
        self.next_at = -1.0

    def run_once(self, now: Time | None = None) -> FiringResult:
        started = self._clock()
        self.next_at = started + self.max_wait  # a round that raises waits this long
        result = self.store.fire_schedules(now=now, limit=self.limit)
        self.rounds += 1
        self.next_at = started + self.delay(result)
        return result

    def delay(self, result: FiringResult) -> float:
        """Seconds from the round's start to the next round (class docstring)."""
        if result.more:
            return 0.0
        if result.next_due is None:
            return self.max_wait
        ahead = result.next_due - result.clock
        if ahead <= 0:  # due, yet not ours: another worker holds the row and fires it
            return self.busy_wait
        return min(ahead, self.max_wait)

    def maybe_run(self) -> FiringResult | None:
        if not self.due():
            return None
        return self.run_once()
