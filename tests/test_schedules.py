"""Schedules (issue 39) on PostgreSQL and SQLite, with time as a parameter (``now=``).

The firing duty is stepped with a fake clock across slots: each slot makes one job, also
when two stores (two workers' connections) step it; ``missed="skip"`` and ``"catch_up"``
after an outage; daylight saving (Europe/Berlin, both transitions); pause and resume; a
definition changed in code; bad input refused before anything is stored.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from consumer.errors import InvalidSchedule, ScheduleNotFound
from consumer.jobs.cron import Slot, check_cron, check_zone, every_cron, next_slot
from consumer.jobs.schedules import Schedule
from consumer.jobs.store import Store

T0 = datetime(2026, 6, 1, 9, 0, 30, tzinfo=UTC).timestamp()  # 30 s past a minute


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


def _jobs(store: Store, action: str) -> list[str]:
    with store.driver.connect() as conn:
        from sqlalchemy import select

        from consumer.jobs.schema import jobs

        rows = conn.execute(
            select(jobs.c.action).where(jobs.c.action.like(f"{action}@%")).order_by(jobs.c.id)
        )
        return [r.action for r in rows]


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def test_each_slot_fires_once_whoever_steps_the_duty(store: Store, db_url: str) -> None:
    store.schedule_every("digest", cron="* * * * *", tenant="studio", action="digest", now=T0)
    other = Store(db_url)  # a second worker's connection pool
    try:
        assert store.fire_schedules(now=T0 + 10).fired == ()  # 09:00:40: nothing due yet
        first = store.fire_schedules(now=T0 + 31)  # 09:01:01
        assert [str(s.slot) for s in first.fired] == [_iso(T0 + 30)]
        assert other.fire_schedules(now=T0 + 32).fired == ()  # the same slot: decided
        assert store.fire_schedules(now=T0 + 33).fired == ()
        for minute in range(2, 6):  # the two alternate, slot after slot
            stepper = other if minute % 2 else store
            result = stepper.fire_schedules(now=T0 + 30 + 60 * (minute - 1) + 2)
            assert len(result.fired) == 1
        actions = _jobs(store, "digest")
        assert actions == [f"digest@{_iso(T0 + 30 + 60 * k)}" for k in range(5)]
        job = store.get("studio", actions[0])
        assert job.kind == "digest" and job.queue == "default"
        info = store.get_schedule("digest")
        assert info.fired == 5 and info.missed == 0
        assert str(info.last_slot) == _iso(T0 + 30 + 240)
        assert info.last_job_state == "READY"
        assert info.next_slot.timestamp() == T0 + 30 + 300
    finally:
        other.dispose()


def test_concurrent_rounds_fire_each_slot_once(store: Store, db_url: str) -> None:
    for n in range(20):  # a long grace: a round that runs ahead fires the earlier slots too
        store.schedule_every(
            f"s{n}", cron="* * * * *", tenant="t", action=f"a{n}", grace=3600, now=T0
        )
    stores = [Store(db_url) for _ in range(4)]
    try:
        barrier = threading.Barrier(len(stores))
        counts: list[int] = []

        def step(s: Store) -> None:
            barrier.wait()
            for k in range(3):
                counts.append(len(s.fire_schedules(now=T0 + 31 + 60 * k).fired))

        threads = [threading.Thread(target=step, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sum(counts) == 60  # 20 schedules x 3 slots, each once
        for n in range(20):
            assert len(_jobs(store, f"a{n}")) == 3
            info = store.get_schedule(f"s{n}")
            assert (info.fired, info.missed) == (3, 0)
    finally:
        for s in stores:
            s.dispose()


def test_skip_after_an_outage_fires_only_what_is_on_time(store: Store) -> None:
    store.schedule_every("tick", cron="*/5 * * * *", tenant="t", action="tick", now=T0)
    first = T0 + 270  # 09:05
    # Down from before 09:05 until 09:30:10: slots 09:05 ... 09:30 passed (6), 09:30 is
    # within the 60 s grace and fires; the other 5 are missed.
    result = store.fire_schedules(now=first + 25 * 60 + 10)
    assert [str(s.slot) for s in result.fired] == [_iso(first + 25 * 60)]
    assert result.missed == {"tick": 5}
    # Down past the grace of the latest slot too: nothing fires, the next slot will.
    result = store.fire_schedules(now=first + 37 * 60)
    assert result.fired == () and result.missed == {"tick": 2}
    info = store.get_schedule("tick")
    assert info.fired == 1 and info.missed == 7
    assert info.next_slot.timestamp() == first + 40 * 60
    assert store.fire_schedules(now=first + 40 * 60 + 1).fired[0].slot.timestamp() == (
        first + 40 * 60
    )


def test_catch_up_fires_each_missed_slot_once_up_to_the_limit(store: Store) -> None:
    store.schedule_every(
        "tick", cron="*/5 * * * *", tenant="t", action="tick", missed="catch_up",
        catch_up_limit=3, now=T0,
    )  # fmt: skip
    first = T0 + 270  # 09:05
    result = store.fire_schedules(now=first + 25 * 60 + 10)  # 09:05 .. 09:30 due
    fired = [s.slot.timestamp() for s in result.fired]
    # The latest 3 missed slots (09:15, 09:20, 09:25) and the on-time 09:30; 09:05 and 09:10
    # are given up.
    assert fired == [first + m * 60 for m in (10, 15, 20, 25)]
    assert result.missed == {"tick": 2}
    assert store.fire_schedules(now=first + 25 * 60 + 20).fired == ()  # decided once
    assert len(_jobs(store, "tick")) == 4


def test_dst_skipped_and_repeated_slots_fire_once(store: Store) -> None:
    berlin = check_zone("Europe/Berlin")
    # 02:30 does not exist on 29 March 2026 and happens twice on 25 October 2026.
    for start, days in ((datetime(2026, 3, 27, tzinfo=UTC), 4), (datetime(2026, 10, 23), 4)):
        name = f"nightly-{start.month}"
        begin = start.replace(tzinfo=UTC).timestamp()
        store.schedule_every(
            name, cron="30 2 * * *", tenant="t", action=name, tz="Europe/Berlin", now=begin
        )
        for minute in range(0, days * 24 * 60, 10):  # a worker every 10 minutes, 4 days
            store.fire_schedules(now=begin + minute * 60)
        actions = _jobs(store, name)
        assert len(actions) == days, actions
        local = [
            datetime.fromisoformat(a.split("@", 1)[1]).astimezone(berlin).strftime("%d %H:%M")
            for a in actions
        ]
        if start.month == 3:  # the skipped 02:30 fires at 03:30 CEST (01:30 UTC), once
            assert local == ["27 02:30", "28 02:30", "29 03:30", "30 02:30"]
        else:  # the repeated 02:30 fires at its first occurrence only
            assert local == ["23 02:30", "24 02:30", "25 02:30", "26 02:30"]
        assert store.get_schedule(name).missed == 0


def test_hourly_slots_across_both_transitions_are_distinct_instants() -> None:
    berlin = check_zone("Europe/Berlin")
    for day in (datetime(2026, 3, 28, 22, tzinfo=UTC), datetime(2026, 10, 24, 21, tzinfo=UTC)):
        slots, moment = [], day.timestamp()
        for _ in range(6):
            moment = next_slot("0 * * * *", berlin, moment)
            slots.append(moment)
        assert slots == sorted(set(slots))
        local = [datetime.fromtimestamp(s, berlin).strftime("%H:%M") for s in slots]
        if day.month == 3:  # 02:00 does not exist: it is 03:00 CEST, one slot
            assert local == ["00:00", "01:00", "03:00", "04:00", "05:00", "06:00"]
        else:  # 02:00 repeats: once
            assert local == ["00:00", "01:00", "02:00", "03:00", "04:00", "05:00"]


def test_pause_and_resume(store: Store) -> None:
    store.schedule_every("tick", cron="* * * * *", tenant="t", action="tick", now=T0)
    assert store.pause_schedule("tick", now=T0 + 1) is True
    assert store.pause_schedule("tick") is False  # idempotent
    assert store.get_schedule("tick").paused
    assert store.fire_schedules(now=T0 + 600).fired == ()
    assert store.resume_schedule("tick", now=T0 + 600) is True
    assert store.resume_schedule("tick") is False
    info = store.get_schedule("tick")
    assert not info.paused and info.missed == 0  # the pause's slots are not missed
    assert info.next_slot.timestamp() == T0 + 630
    result = store.fire_schedules(now=T0 + 631)
    assert [s.slot.timestamp() for s in result.fired] == [T0 + 630]
    with pytest.raises(ScheduleNotFound):
        store.pause_schedule("nope")
    assert store.remove_schedule("tick") is True
    assert store.schedules() == []
    assert len(_jobs(store, "tick")) == 1  # its jobs stay
    with pytest.raises(ScheduleNotFound):
        store.remove_schedule("tick")


def test_a_definition_changed_in_code(store: Store) -> None:
    store.schedule_every("report", cron="0 * * * *", tenant="t", action="report", now=T0)
    assert store.get_schedule("report").next_slot.timestamp() == T0 + 3570  # 10:00
    # The same definition again, after its slot passed unfired: nothing is lost.
    store.schedule_every("report", cron="0 * * * *", tenant="t", action="report", now=T0 + 4000)
    assert store.get_schedule("report").next_slot.timestamp() == T0 + 3570
    # A new payload and policy keep the rhythm; a new cron starts from now.
    info = store.schedule_every(
        "report", cron="0 * * * *", tenant="t", action="report", payload={"v": 2},
        missed="catch_up", now=T0 + 4000,
    )  # fmt: skip
    assert info.payload == {"v": 2} and info.missed_policy == "catch_up"
    assert info.next_slot.timestamp() == T0 + 3570
    info = store.schedule_every(
        "report", cron="30 * * * *", tenant="t", action="report", now=T0 + 4000
    )
    assert info.next_slot.timestamp() == T0 + 5370  # 10:30, after now (10:06:10)
    assert info.cron == "30 * * * *" and len(store.schedules()) == 1


BAD_SCHEDULES: list[tuple[dict[str, object], str]] = [
    ({"name": ""}, "name"),
    ({"name": "  "}, "name"),
    ({"cron": "61 * * * *"}, "cron"),
    ({"cron": "* * * *"}, "cron"),
    ({"cron": "* * * * * * *"}, "cron"),
    ({"cron": "61 * * * * *"}, "cron"),
    ({"cron": None}, "cron"),  # neither cron nor every
    ({"every": timedelta(seconds=10)}, "cron"),  # both
    ({"cron": None, "every": timedelta(seconds=7)}, "every"),  # divides no minute
    ({"cron": None, "every": timedelta(seconds=1.5)}, "every"),
    ({"cron": None, "every": timedelta(0)}, "every"),
    ({"cron": None, "every": 90}, "every"),
    ({"cron": None, "every": "10s"}, "every"),
    ({"cron": None, "every": timedelta(hours=5)}, "every"),
    ({"cron": "0 0 30 2 *"}, "cron"),
    ({"tz": "Mars/Olympus"}, "tz"),
    ({"tz": ""}, "tz"),
    ({"tz": "localtime"}, "tz"),  # the host's zone: another host fires at other instants
    ({"tz": "posixrules"}, "tz"),
    ({"tz": "right/UTC"}, "tz"),
    ({"tenant": ""}, "tenant"),
    ({"action": ""}, "action"),
    ({"action": "a@b"}, "action"),
    ({"missed": "sometimes"}, "missed"),
    ({"catch_up_limit": 0}, "catch_up_limit"),
    ({"catch_up_limit": True}, "catch_up_limit"),
    ({"payload": {"x": float("nan")}}, "payload"),
]


def test_bad_input_is_refused_before_anything_is_stored(store: Store) -> None:
    """Every bad definition of BAD_SCHEDULES is refused naming its field, and nothing is
    stored (one store for all of them: a schema per case cost the fast tier 8 s)."""
    for kwargs, field in BAD_SCHEDULES:
        args: dict[str, object] = {"cron": "* * * * *", "tenant": "t", "action": "a"}
        given = dict(kwargs)
        name = given.pop("name", "good")
        args.update(given)
        try:
            store.schedule_every(name, **args)  # type: ignore[arg-type]
        except InvalidSchedule as error:
            assert isinstance(error, ValueError), kwargs
            assert error.field == field, kwargs
        else:
            pytest.fail(f"accepted: {kwargs!r}")
        assert store.schedules() == [], kwargs


def test_every_ten_seconds_fires_a_slot_each_ten_seconds(store: Store) -> None:
    """Issue 59: schedules with seconds (``every`` or a six-field cron, seconds first), for
    tests and short intervals."""
    info = store.schedule_every(
        "tick", every=timedelta(seconds=10), tenant="t", action="tick", now=T0
    )
    assert info.cron == "*/10 * * * * *"
    assert info.next_slot.timestamp() == T0 + 10  # 09:00:40
    assert store.fire_schedules(now=T0 + 9).fired == ()
    fired = [store.fire_schedules(now=T0 + 10 * k + 1).fired for k in (1, 2, 3)]
    assert [[s.slot.timestamp() for s in f] for f in fired] == [[T0 + 10], [T0 + 20], [T0 + 30]]
    assert _jobs(store, "tick") == [f"tick@{_iso(T0 + 10 * k)}" for k in (1, 2, 3)]
    # A six-field cron: second 15 of every other minute.
    other = store.schedule_every("odd", cron="15  */2 * * * *", tenant="t", action="odd", now=T0)
    assert other.cron == "15 */2 * * * *"
    assert other.next_slot.timestamp() == T0 + 60 + 45  # 09:02:15
    zone = check_zone("UTC")
    assert next_slot("*/10 * * * * *", zone, T0 + 0.5) == T0 + 10


@pytest.mark.parametrize(
    ("every", "cron"),
    [
        (timedelta(seconds=1), "* * * * * *"),
        (timedelta(seconds=30), "*/30 * * * * *"),
        (60, "* * * * *"),
        (timedelta(minutes=15), "*/15 * * * *"),
        (timedelta(hours=1), "0 * * * *"),
        (timedelta(hours=6), "0 */6 * * *"),
        (timedelta(days=1), "0 0 * * *"),
    ],
)
def test_every_is_stored_as_its_cron_expression(every: object, cron: str) -> None:
    assert every_cron(every) == cron
    assert check_cron(cron) == cron


def test_slot_prints_as_the_action_suffix() -> None:
    slot = Slot.at(T0 + 30)
    assert str(slot) == f"{slot}" == "2026-06-01T09:01:00+00:00"
    assert slot == datetime(2026, 6, 1, 9, 1, tzinfo=UTC)
    assert Schedule("n", "@daily", "t", "a").cron == "@daily"
    assert next_slot("@daily", check_zone("UTC"), T0) == T0 - 9 * 3600 - 30 + 86400
    assert timedelta(0) == slot.utcoffset()


def test_a_worker_defines_fires_and_runs_its_schedules(store: Store) -> None:
    from consumer import Worker
    from consumer.jobs.context import JobContext

    clock = [T0]
    store.schedule_clock = lambda: clock[0]  # the schedules' time; claims keep the database's
    store.define_schedule(Schedule("old", "0 3 * * *", "t", "old"), source="code", now=T0)
    store.schedule_every("by-hand", cron="0 3 * * *", tenant="t", action="by-hand", now=T0)
    seen: list[tuple[object, object, object]] = []
    digest = Schedule("digest", "* * * * *", "studio", "digest", payload={"k": 1})
    worker = Worker(store, schedules=[digest])

    @worker.handler("digest")
    def run_digest(job: JobContext) -> None:
        seen.append((job.slot, job.payload, job.action))

    assert worker.run_once() == 0  # defines its schedule; the first slot is 09:01
    report = worker.schedules_defined
    assert report is not None and report.created == ("digest",)
    assert report.not_in_code == ("old",)  # reported, kept: only code-defined ones
    assert store.get_schedule("old").name == "old"
    clock[0] = T0 + 31
    duty = worker.schedule_duty
    assert duty is not None
    duty.make_due()
    assert worker.run_once() == 1
    slot = Slot.at(T0 + 30)
    assert seen == [(slot, {"k": 1}, f"digest@{slot}")]
    assert store.get_schedule("digest").last_job_state == "DONE"
    # The definition changed in code: the next worker updates it, and keeps the rhythm's
    # history (last slot) while starting the new cron after now.
    changed = Worker(store, schedules=[Schedule("digest", "*/5 * * * *", "studio", "digest")])
    report = changed.define_schedules()
    assert report.updated == ("digest",) and report.created == ()
    info = store.get_schedule("digest")
    assert info.cron == "*/5 * * * *" and info.payload is None
    assert info.next_slot.timestamp() == T0 + 270  # 09:05
    assert info.last_slot == slot and info.source == "code"
    # The same definitions again: unchanged.
    again = Worker(store, schedules=[Schedule("digest", "*/5 * * * *", "studio", "digest")])
    assert again.define_schedules().unchanged == ("digest",)
    assert Worker(store).define_schedules().not_in_code == ()  # no schedules=: no report


def test_run_once_with_now_fires_the_slots_of_that_time(store: Store) -> None:
    from consumer import Worker
    from consumer.jobs.context import JobContext

    store.schedule_every("report", cron="0 * * * *", tenant="t", action="report", now=T0)
    worker = Worker(store)  # no schedules= of its own: it fires every schedule anyway
    slots: list[object] = []

    @worker.handler("report")
    def run_report(job: JobContext) -> None:
        slots.append(job.slot)

    assert worker.run_once(now=T0 + 60) == 0  # 09:01:30: the 10:00 slot is ahead
    assert worker.run_once(now=T0 + 3600) == 1  # 10:00:30
    assert slots == [Slot.at(T0 + 3570)]
    assert worker.schedules_defined is not None and worker.schedules_defined.created == ()


def test_a_round_costs_a_few_statements_whatever_the_schedules_due(store: Store) -> None:
    from sqlalchemy import event

    for n in range(100):
        store.schedule_every(f"s{n:03d}", cron="* * * * *", tenant=f"t{n}", action="a", now=T0)
    # Two schedules of one tenant and action share each slot's job.
    store.schedule_every("twin", cron="* * * * *", tenant="t0", action="a", now=T0)
    statements: list[str] = []

    def count(_c: object, _cur: object, statement: str, *_: object) -> None:
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        result = store.fire_schedules(now=T0 + 31)
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert len(result.fired) == 101
    assert sum(1 for s in result.fired if s.duplicate) == 1
    assert len({s.job_id for s in result.fired}) == 100
    assert len(statements) <= 10, statements  # not one per schedule
    assert not result.more
    assert store.get_schedule("twin").fired == 1


def test_skip_fires_every_slot_still_within_its_grace(store: Store) -> None:
    store.schedule_every("tick", cron="*/5 * * * *", tenant="t", action="tick", grace=600, now=T0)
    first = T0 + 270  # 09:05; down until 09:16: 09:05 is past its 600 s grace, 09:10 and
    result = store.fire_schedules(now=first + 11 * 60)  # 09:15 are not
    assert [s.slot.timestamp() for s in result.fired] == [first + 300, first + 600]
    assert result.missed == {"tick": 1}


def test_a_running_worker_fires_a_one_second_schedule_each_second(db_url: str) -> None:
    """In real time: a Worker given ``every=1 s`` runs one job per second, each seeing its
    slot (the firing duty waits for the next slot, not its 30 s ceiling)."""
    from consumer import Worker
    from consumer.jobs.context import JobContext
    from tests.services import wait_for

    store = Store(db_url)
    seen: list[Slot] = []
    worker = Worker(store, poll_interval=0.05)

    @worker.handler("beat")
    def beat(job: JobContext) -> None:
        assert job.slot is not None
        seen.append(job.slot)

    store.schedule_every("beat", every=timedelta(seconds=1), tenant="t", action="beat")
    runner = threading.Thread(target=worker.run, kwargs={"install_signals": False})
    runner.start()
    try:
        wait_for(lambda: len(seen) >= 3, "three slots run", timeout=60)
    finally:
        worker.stop()
        runner.join(30)
        store.dispose()
    assert not runner.is_alive()
    stamps = [s.timestamp() for s in seen[:3]]
    assert [b - a for a, b in pairwise(stamps)] == [1.0, 1.0]  # consecutive whole seconds
