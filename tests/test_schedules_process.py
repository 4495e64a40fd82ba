"""Schedules with real ``outbox-worker run`` processes (issue 39), on PostgreSQL and SQLite.

The worker app is ``tests.schedule_app:build``: one per-minute schedule whose clock runs 60
times faster than real time (``Store.schedule_clock``; every process of a test shares it), so
a slot falls every real second and a test sees several in a few seconds. Everything else
(claims, leases, liveness, the firing transaction) is the real thing.

- Two workers over several slots: every slot has exactly one job, none is missed, and the
  schedule's own count of fired slots agrees (no slot was decided twice).
- Every worker SIGKILLed across slots, then two started again together: ``skip`` gives the
  outage's slots up (counted missed, no job), ``catch_up`` fires each of them once. Either
  way every slot from the first to the last decided is exactly one of fired or missed.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import select

from consumer.jobs.cron import slot_text
from consumer.jobs.schema import jobs, workers
from consumer.jobs.states import DONE, READY
from consumer.jobs.store import Store
from tests.schedule_app import schedule_clock
from tests.services import wait_for

ROOT = Path(__file__).resolve().parent.parent
SPEED = 60.0  # a schedule minute per real second

pytestmark = pytest.mark.slow


class Fleet:
    """``outbox-worker run tests.schedule_app:build`` processes sharing one schedule clock."""

    def __init__(self, url: str, **env: str) -> None:
        self.url = url
        real0 = time.time()
        # Schedule time starts 30 s past a minute: the first slot falls half a second later.
        base = math.floor(real0 / 60) * 60 + 30
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_LOG_LEVEL": "warning",
            "SCHED_BASE": repr(base),
            "SCHED_REAL0": repr(real0),
            "SCHED_SPEED": repr(SPEED),
            **env,
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def schedule_now(self) -> float:
        """The schedules' clock of this fleet's processes (``tests.schedule_app``)."""
        return schedule_clock(self.env)

    def start(self, n: int = 2) -> None:
        for _ in range(n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "consumer.jobs.cli", "run", "tests.schedule_app:build"],
                    cwd=ROOT,
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )

    def alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self.procs if p.poll() is None]

    def kill(self) -> None:
        for proc in self.alive():
            proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(30)

    def stop(self) -> None:
        for proc in self.alive():
            proc.send_signal(signal.SIGTERM)
        errors = []
        for proc in self.procs:
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code not in (0, -signal.SIGKILL):
                errors.append((code, (proc.stderr.read() if proc.stderr else b"").decode()[-3000:]))
        self.procs = []
        assert not errors, errors


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def _alive(store: Store) -> int:
    """Workers whose liveness row is fresh (each beats once it runs)."""
    with store.driver.connect() as conn:
        clock = store.driver.clock_read(conn, None)
        rows = conn.execute(select(workers.c.name).where(workers.c.alive_until > clock)).all()
    return len(rows)


def _decided(store: Store) -> int:
    try:
        info = store.get_schedule("tick")
    except LookupError:
        return 0
    return info.fired + info.missed


def _tick_jobs(store: Store) -> dict[str, str]:
    with store.driver.connect() as conn:
        rows = conn.execute(
            select(jobs.c.action, jobs.c.state).where(jobs.c.action.like("tick@%"))
        ).all()
    return {row.action: row.state for row in rows}


def _account(store: Store) -> tuple[list[float], list[float], int]:
    """Every slot from the first decided to the last: (slots with a job, slots without, the
    schedule's missed count). Asserts each slot has at most one job (by construction) and
    that the schedule's counts agree with the jobs."""
    info = store.get_schedule("tick")
    found = _tick_jobs(store)
    fired = sorted(datetime.fromisoformat(action.split("@", 1)[1]).timestamp() for action in found)
    assert fired, "no slot fired"
    last = info.next_slot.timestamp() - 60  # the latest slot decided, fired or missed
    slots = [fired[0] + 60 * k for k in range(int((last - fired[0]) // 60) + 1)]
    assert set(fired) <= set(slots)
    without = [s for s in slots if s not in set(fired)]
    assert info.fired == len(fired), (info.fired, len(fired))  # no slot decided twice
    assert info.missed == len(without), (info.missed, without)  # every slot accounted for
    return fired, without, info.missed


def test_two_workers_fire_each_slot_once(store: Store, db_url: str) -> None:
    fleet = Fleet(db_url)
    try:
        fleet.start(2)
        wait_for(lambda: _alive(store) == 2, timeout=90, what="two workers running")
        wait_for(lambda: _decided(store) >= 6, timeout=90, what="six slots decided")
        assert len(fleet.alive()) == 2
    finally:
        fleet.stop()
    fired, without, missed = _account(store)
    assert without == [] and missed == 0
    assert len(fired) >= 6
    states = _tick_jobs(store)
    assert set(states.values()) <= {DONE, READY}  # every run saw its slot (else review)
    # A slot a second: the jobs of the last ones may still wait for a claim at the stop.
    assert list(states.values()).count(DONE) >= len(fired) // 2
    assert f"tick@{slot_text(fired[0])}" in states


@pytest.mark.parametrize("missed", ["skip", "catch_up"])
def test_every_worker_killed_across_slots(store: Store, db_url: str, missed: str) -> None:
    # Grace: 90 schedule seconds (1.5 real s); the outage lasts 6 real s and more.
    fleet = Fleet(db_url, SCHED_MISSED=missed, SCHED_GRACE="90", SCHED_CATCH_UP_LIMIT="100")
    try:
        fleet.start(2)
        wait_for(lambda: _alive(store) == 2, timeout=90, what="two workers running")
        wait_for(lambda: _decided(store) >= 3, timeout=90, what="three slots decided")
        fleet.kill()  # SIGKILL every worker: nobody fires now
        down = _decided(store)
        # The outage: six slots fall on the shared schedule clock while every worker is down.
        due = store.get_schedule("tick").next_slot.timestamp() + 5 * 60
        wait_for(lambda: fleet.schedule_now() > due, timeout=60, what="six slots fallen")
        assert _decided(store) == down
        fleet.start(2)  # two come back at once: the first decides, once
        wait_for(lambda: _alive(store) == 2, timeout=90, what="two workers back")
        wait_for(lambda: _decided(store) >= down + 8, timeout=90, what="slots after the outage")
    finally:
        fleet.stop()
    fired, without, n_missed = _account(store)
    if missed == "skip":
        # The outage's slots past their grace are given up: a gap of at least 4 slots.
        assert n_missed >= 4
        gap = [b - a for a, b in pairwise(fired)]
        assert max(gap) >= 5 * 60
    else:
        assert without == [] and n_missed == 0  # each missed slot fired once, late
