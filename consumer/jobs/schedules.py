"""Schedules: periodic obligations that fire once per slot across the fleet (issue 39).

A schedule is "every weekday at 09:00 Europe/Berlin", owned by no subject (a timer with
business meaning stays a per-subject ``Store.schedule``). It is a row in
``outbox_schedules`` (``consumer.jobs.schema``), defined with
``Store.schedule_every(name, *, cron, tenant, action, ...)`` or by a Worker started with
``schedules=[Schedule(...)]``, and fired by the firing duty (``consumer.jobs.firing``).

Contract:

- **One job per slot, fleet-wide.** A slot is an instant (``consumer.jobs.cron``); firing
  it enqueues the job ``(tenant, f"{action}@{slot}")`` (slot in ISO 8601 UTC, e.g.
  ``digest@2026-03-30T07:00:00+00:00``) with ``kind=action``, so the handler registered for
  ``action`` runs it and sees ``ctx.slot``. The job goes through the same unique
  ``(tenant, action)`` as any job: a slot can never make two jobs, whoever fires it.
- **The database decides.** The duty locks the due rows (PostgreSQL ``FOR UPDATE SKIP
  LOCKED``, SQLite the write lock), reads the database clock (or ``now``), enqueues the
  slots' jobs and moves ``next_slot`` on, in one transaction: no leader, no worker's clock.
- **Missed slots.** A slot is *missed* when no worker fired it within ``grace`` seconds
  (default 60) after it passed: every worker was down, or all were too busy. The first
  worker back decides, once, in that transaction: ``missed="skip"`` fires none of them (the
  schedule fires again at its next slot; slots still within their grace are not missed and
  fire late), ``missed="catch_up"`` fires each of them once, the latest
  ``catch_up_limit`` ones (older ones are given up). Either way they are counted
  (``missed``, ``outbox_schedule_slots_missed_total``).
- **Paused** schedules fire nothing; ``resume_schedule`` starts again from the next slot
  after now (the slots of a pause are the operator's choice, not missed).
- **Defined in code, kept in the database.** ``schedule_every`` creates the schedule or
  updates its definition; a schedule whose cron and zone did not change keeps its
  ``next_slot`` (a restart loses no slot), one whose cron or zone changed starts from the
  next slot after now (or after its last fired slot, if later). Its paused state stays.
- **Bad input** raises :class:`~consumer.errors.InvalidSchedule` (a ``ValueError``) naming
  the field, before anything is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy.engine import Connection

from consumer.errors import InvalidSchedule, JobError, ScheduleNotFound
from consumer.jobs.checks import Time, valid_json, valid_time
from consumer.jobs.cron import Slot, check_cron, check_zone, every_cron, next_slot, slot_text
from consumer.jobs.driver import JobDriver
from consumer.jobs.schema import DEFAULT_QUEUE
from outbox.logs import fields

if TYPE_CHECKING:
    from consumer.jobs.firing import FiringResult
from outbox.validate import MAX_NAME_LENGTH, check_name, number_problem

__all__ = [
    "DEFAULT_GRACE",
    "MISSED_POLICIES",
    "Schedule",
    "ScheduleInfo",
    "ScheduleMethods",
    "SchedulesDefined",
    "define_in_code",
    "schedule_slot",
]

log = logging.getLogger("outbox.worker.schedules")

MISSED_POLICIES = ("skip", "catch_up")
DEFAULT_GRACE = 60.0
"""Seconds after a slot within which firing it is on time (not missed)."""
MAX_CATCH_UP = 1000
_SLOT_SUFFIX = len("@" + slot_text(0.0))  # "@" + the ISO text of a slot (always this long)

Missed = Literal["skip", "catch_up"]


def _invalid(field: str, problem: str) -> InvalidSchedule:
    return InvalidSchedule(field, problem)


@dataclass(frozen=True)
class Schedule:
    """A schedule's definition, as ``Store.schedule_every`` takes it (and a Worker's
    ``schedules=[...]``). Validated on construction: :class:`InvalidSchedule` names the
    field."""

    name: str
    cron: str
    tenant: str
    action: str
    payload: Any = None
    tz: str = "UTC"
    queue: str = DEFAULT_QUEUE
    missed: Missed = "skip"
    catch_up_limit: int = 10
    grace: float = DEFAULT_GRACE

    def __post_init__(self) -> None:
        check_name("name", self.name, _invalid)
        object.__setattr__(self, "cron", check_cron(self.cron))
        check_zone(self.tz)
        check_name("tenant", self.tenant, _invalid)
        check_name("action", self.action, _invalid, limit=MAX_NAME_LENGTH - _SLOT_SUFFIX)
        if "@" in self.action:
            raise InvalidSchedule("action", "must not contain '@' (it separates the slot)")
        check_name("queue", self.queue, _invalid)
        if self.missed not in MISSED_POLICIES:
            raise InvalidSchedule("missed", f"must be 'skip' or 'catch_up', got {self.missed!r}")
        problem = number_problem(self.catch_up_limit, integer=True, maximum=MAX_CATCH_UP)
        if problem:
            raise InvalidSchedule("catch_up_limit", problem)
        problem = number_problem(self.grace)
        if problem:
            raise InvalidSchedule("grace", problem)
        object.__setattr__(self, "grace", float(self.grace))
        try:
            valid_json("payload", self.payload)
        except JobError as exc:
            raise InvalidSchedule("payload", exc.problem) from None

    def values(self) -> dict[str, Any]:
        """The definition's columns."""
        return {
            "cron": self.cron,
            "tz": self.tz,
            "tenant": self.tenant,
            "action": self.action,
            "payload": self.payload,
            "queue": self.queue,
            "missed_policy": self.missed,
            "catch_up_limit": self.catch_up_limit,
            "grace": self.grace,
        }

    def first_slot_after(self, seconds: float) -> float:
        return next_slot(self.cron, check_zone(self.tz), seconds)


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as ``Store.schedules()`` reports it: its definition, whether it is paused,
    its next slot, its last fired slot with that job's id and state, and how many slots it
    fired and missed. Slots are :class:`~consumer.jobs.cron.Slot` (UTC datetimes)."""

    name: str
    cron: str
    tz: str
    tenant: str
    action: str
    payload: Any
    queue: str
    missed_policy: str
    catch_up_limit: int
    grace: float
    source: str
    paused: bool
    next_slot: Slot
    last_slot: Slot | None
    last_job_id: int | None
    last_job_state: str | None
    fired: int
    missed: int

    @property
    def schedule(self) -> Schedule:
        """The definition alone."""
        return Schedule(
            self.name,
            self.cron,
            self.tenant,
            self.action,
            self.payload,
            self.tz,
            self.queue,
            "catch_up" if self.missed_policy == "catch_up" else "skip",
            self.catch_up_limit,
            self.grace,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (slots as ISO 8601 text)."""
        found = asdict(self)
        for key in ("next_slot", "last_slot"):
            value = getattr(self, key)
            found[key] = None if value is None else str(value)
        return found


def info_from_row(row: Any, job_state: str | None) -> ScheduleInfo:
    return ScheduleInfo(
        name=row.name,
        cron=row.cron,
        tz=row.tz,
        tenant=row.tenant,
        action=row.action,
        payload=row.payload,
        queue=row.queue,
        missed_policy=row.missed_policy,
        catch_up_limit=int(row.catch_up_limit),
        grace=float(row.grace),
        source=row.source,
        paused=row.paused_at is not None,
        next_slot=Slot.at(float(row.next_slot)),
        last_slot=None if row.last_slot is None else Slot.at(float(row.last_slot)),
        last_job_id=None if row.last_job_id is None else int(row.last_job_id),
        last_job_state=job_state,
        fired=int(row.fired),
        missed=int(row.missed),
    )


def schedule_slot(kind: str | None, action: str) -> Slot | None:
    """The slot of a job a schedule made (its action is ``f"{kind}@{slot}"``), else None."""
    from consumer.jobs.cron import slot_from_text

    if kind is None or not action.startswith(kind + "@"):
        return None
    return slot_from_text(action[len(kind) + 1 :])


class ScheduleMethods:
    """Mixed into ``Store``: defining, listing, pausing and removing schedules."""

    driver: JobDriver
    schedule_clock: Callable[[], float] | None = None
    """The schedules' time (unix seconds) wherever a schedule call is given no ``now``;
    None (the default): the database clock. A test runs real worker processes on a clock of
    its own with it (minutes of schedule passing in seconds)."""

    def _schedule_time(self, now: Time | None) -> float | None:
        if now is None and self.schedule_clock is not None:
            return self.schedule_clock()
        return valid_time("now", now)

    def schedule_every(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: timedelta | float | None = None,
        tenant: str,
        action: str,
        payload: Any = None,
        tz: str = "UTC",
        queue: str = DEFAULT_QUEUE,
        missed: Missed = "skip",
        catch_up_limit: int = 10,
        grace: float = DEFAULT_GRACE,
        now: Time | None = None,
    ) -> ScheduleInfo:
        """Create the schedule ``name`` or update its definition (module docstring): each
        slot of ``cron`` read in zone ``tz`` enqueues one job ``(tenant, f"{action}@{slot}")``
        in ``queue`` with ``payload``, fleet-wide. ``missed``: ``"skip"`` or ``"catch_up"``
        (at most ``catch_up_limit`` missed slots fired); ``grace``: seconds after a slot
        within which firing it is on time. ``every`` (a ``timedelta`` or seconds) instead of
        ``cron``: a fixed interval that divides a minute, an hour or a day (stored as its cron
        expression, ``every=timedelta(seconds=10)`` as ``*/10 * * * * *``). ``InvalidSchedule``
        names a bad field; nothing is stored then."""
        if (cron is None) == (every is None):
            raise InvalidSchedule("cron", "give cron or every (one of them)")
        if every is not None:
            cron = every_cron(every)
        assert cron is not None
        schedule = Schedule(
            name, cron, tenant, action, payload, tz, queue, missed, catch_up_limit, grace
        )
        return self.define_schedule(schedule, source="api", now=now)

    def define_schedule(
        self, schedule: Schedule, *, source: str = "api", now: Time | None = None
    ) -> ScheduleInfo:
        """:meth:`schedule_every` with a :class:`Schedule` (``source``: ``"code"`` for a
        Worker's ``schedules=``, ``"api"`` otherwise)."""
        if not isinstance(schedule, Schedule):
            raise InvalidSchedule("schedule", f"must be a Schedule, got {schedule!r}")
        if source not in ("api", "code"):
            raise InvalidSchedule("source", f"must be 'api' or 'code', got {source!r}")
        when = self._schedule_time(now)
        with self.driver.begin() as conn:
            clock = self.driver.clock_read(conn, when)
            first = schedule.first_slot_after(clock)
            self.driver.schedule_insert(
                conn,
                {
                    "name": schedule.name,
                    "source": source,
                    "next_slot": first,
                    "created_at": clock,
                    "updated_at": clock,
                    **schedule.values(),
                },
            )
            row = self.driver.schedule_lock(conn, schedule.name)  # inserted or found: there
            changes = {k: v for k, v in schedule.values().items() if getattr(row, k) != v}
            if row.source != source:
                changes["source"] = source
            if "cron" in changes or "tz" in changes:
                # A new rhythm starts from now (or after its last slot, never firing a slot
                # twice): the old next_slot belongs to the old definition.
                changes["next_slot"] = schedule.first_slot_after(
                    max(clock, float(row.last_slot or 0.0))
                )
            if changes:
                changes["updated_at"] = clock
                self.driver.schedule_update(conn, schedule.name, changes)
            return _read_one(self.driver, conn, schedule.name)

    def schedules(self) -> list[ScheduleInfo]:
        """Every schedule, by name, with its next slot and its last fired slot's job."""
        with self.driver.connect() as conn:
            return _read_all(self.driver, conn)

    def get_schedule(self, name: str) -> ScheduleInfo:
        """One schedule; ``ScheduleNotFound`` if there is none of that name."""
        check_name("name", name, _invalid)
        with self.driver.connect() as conn:
            return _read_one(self.driver, conn, name)

    def pause_schedule(self, name: str, *, now: Time | None = None) -> bool:
        """Stop the schedule firing (its jobs already enqueued still run). True if it was
        running; ``ScheduleNotFound`` for an unknown name. Idempotent."""
        check_name("name", name, _invalid)
        when = self._schedule_time(now)
        with self.driver.begin() as conn:
            _locked(self.driver, conn, name)
            clock = self.driver.clock_read(conn, when)
            return self.driver.schedule_pause(conn, name, clock)

    def resume_schedule(self, name: str, *, now: Time | None = None) -> bool:
        """Let a paused schedule fire again, from its next slot after now (the slots of the
        pause are not fired nor counted missed). True if it was paused; idempotent."""
        check_name("name", name, _invalid)
        when = self._schedule_time(now)
        with self.driver.begin() as conn:
            row = _locked(self.driver, conn, name)
            if row.paused_at is None:
                return False
            clock = self.driver.clock_read(conn, when)
            definition = info_from_row(row, None).schedule
            self.driver.schedule_update(
                conn,
                name,
                {
                    "paused_at": None,
                    "next_slot": max(float(row.next_slot), definition.first_slot_after(clock)),
                    "updated_at": clock,
                },
            )
        return True

    def fire_schedules(self, *, now: Time | None = None, limit: int = 500) -> FiringResult:
        """One round of the firing duty (``consumer.jobs.firing``): every running schedule
        whose slot passed at ``now`` (default: the database clock) enqueues its slots' jobs,
        at most ``limit`` schedules. Workers run it by themselves; a test steps it."""
        from consumer.jobs.firing import fire_schedules

        return fire_schedules(self.driver, now=self._schedule_time(now), limit=limit)

    def remove_schedule(self, name: str) -> bool:
        """Delete the schedule (the jobs it made stay). ``ScheduleNotFound`` if unknown."""
        check_name("name", name, _invalid)
        with self.driver.begin() as conn:
            _locked(self.driver, conn, name)
            self.driver.schedule_delete(conn, name)
        return True


def _locked(driver: JobDriver, conn: Connection, name: str) -> Any:
    row = driver.schedule_lock(conn, name)
    if row is None:
        raise ScheduleNotFound(f"no schedule {name!r}")
    return row


def _read_all(driver: JobDriver, conn: Connection, name: str | None = None) -> list[ScheduleInfo]:
    return [info_from_row(row, row.job_state) for row in driver.schedule_list(conn, name)]


def _read_one(driver: JobDriver, conn: Connection, name: str) -> ScheduleInfo:
    found = _read_all(driver, conn, name)
    if not found:
        raise ScheduleNotFound(f"no schedule {name!r}")
    return found[0]


@dataclass(frozen=True)
class SchedulesDefined:
    """What a worker's start did with its ``schedules=``: the names it created, updated
    (definition changed) and found unchanged, and the schedules defined in code before that
    it does not define (``not_in_code``: kept, still firing, reported;
    ``outbox-worker schedules remove NAME`` deletes one)."""

    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    not_in_code: tuple[str, ...] = ()


def define_in_code(store: ScheduleMethods, definitions: Iterable[Schedule]) -> SchedulesDefined:
    """Create or update each of a worker's schedules (``source="code"``) and report the
    schedules defined in code earlier that are not among them (never deleted here)."""
    before = {info.name: info.schedule for info in store.schedules()}
    created: list[str] = []
    updated: list[str] = []
    unchanged: list[str] = []
    names = set()
    for schedule in definitions:
        names.add(schedule.name)
        store.define_schedule(schedule, source="code")
        if schedule.name not in before:
            created.append(schedule.name)
        elif before[schedule.name] != schedule:
            updated.append(schedule.name)
        else:
            unchanged.append(schedule.name)
    stored = store.schedules()
    orphans = tuple(i.name for i in stored if i.source == "code" and i.name not in names)
    for name in created:
        log.info("schedule created", extra=fields(schedule=name))
    for name in updated:
        log.info("schedule definition updated", extra=fields(schedule=name))
    for name in orphans:
        log.warning(
            "schedule no longer defined in code: kept, still firing; remove it with "
            "'outbox-worker schedules remove NAME', or pause it",
            extra=fields(schedule=name),
        )
    return SchedulesDefined(tuple(created), tuple(updated), tuple(unchanged), orphans)


def check_definitions(items: object) -> list[Schedule]:
    """A Worker's ``schedules=``: a list of :class:`Schedule` (or mappings of
    ``schedule_every``'s arguments with ``name``), names unique."""
    if items is None:
        return []
    if isinstance(items, (str, Mapping, Schedule)):
        raise InvalidSchedule("schedules", "must be a list of Schedule")
    if not isinstance(items, Iterable):
        raise InvalidSchedule("schedules", f"must be a list of Schedule, got {items!r}")
    found: list[Schedule] = []
    for item in items:
        if isinstance(item, Mapping):
            item = Schedule(**item)
        if not isinstance(item, Schedule):
            raise InvalidSchedule("schedules", f"items must be Schedule, got {item!r}")
        found.append(item)
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise InvalidSchedule("schedules", "two schedules have the same name")
    return found
