"""When a schedule's slots fall: a 5-field cron expression read in an IANA time zone, or a
6-field one whose first field is the second (``*/10 * * * * *``: every 10 s), for tests and
short intervals; ``every`` (a ``timedelta``) is written as one (:func:`every_cron`).

Cron expressions are parsed and stepped by ``croniter`` (a well-kept library, used by
Airflow, Celery beat's alternatives and many schedulers, with the usual extensions: ranges,
steps, names, ``L``) rather than a parser of our own; zones are ``zoneinfo``'s. croniter is
given *naive local wall-clock times* only, and each local time it yields is turned into one
instant here, so the daylight-saving rules live in one function (:func:`_instant`):

- a local time that a spring-forward transition skips (02:30 in Europe/Berlin on the last
  Sunday of March) is the instant it would be with the offset in force before the
  transition (01:30 UTC, shown as 03:30 CEST): the day's slot still fires, once;
- a local time that a fall-back transition repeats (02:30 on the last Sunday of October)
  is its first occurrence only (``fold=0``): it fires once, not twice;
- two local times that fall on the same instant (an hourly schedule's 02:00, skipped and
  moved to 01:00 UTC, and its 03:00, which is 01:00 UTC too) are one slot.

A *slot* is that instant, in unix seconds (what the tables store) or as a :class:`Slot` (a
UTC datetime whose ``str`` is the ISO 8601 text used in the job's action).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from consumer.errors import InvalidSchedule

if TYPE_CHECKING:
    from croniter import croniter

__all__ = ["Slot", "check_cron", "check_zone", "every_cron", "next_slot", "slot_from_text"]
__all__ += ["slot_text"]

# No zone moves its clocks by more than this at once (the largest DST shift in use is 2 h):
# the window searched around a transition for slots that moved.
_MAX_SHIFT = timedelta(hours=3)
_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


class Slot(datetime):
    """A slot: an aware UTC datetime whose ``str()`` (and f-string) is its ISO 8601 text,
    ``2026-03-29T01:30:00+00:00``, as in the job's action ``f"{action}@{slot}"``."""

    def __str__(self) -> str:
        return self.isoformat()

    def __format__(self, spec: str) -> str:
        return self.isoformat() if not spec else super().__format__(spec)

    @classmethod
    def at(cls, seconds: float) -> Slot:
        moment = datetime.fromtimestamp(seconds, UTC)
        return cls(*moment.timetuple()[:6], moment.microsecond, tzinfo=UTC)


def slot_text(seconds: float) -> str:
    """The ISO 8601 UTC text of a slot (what follows ``@`` in its job's action)."""
    return Slot.at(seconds).isoformat()


def slot_from_text(text: str) -> Slot | None:
    """The slot an action's suffix names, or None when it is not one."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None or moment.utcoffset() != timedelta(0):
        return None
    return Slot.at(moment.timestamp())


HOST_ZONES = frozenset({"localtime", "posixrules"})
"""Zone file names that are links to whatever the host was set to, not IANA zones."""


def check_zone(tz: object) -> ZoneInfo:
    """The zone named ``tz`` (IANA), or ``InvalidSchedule`` on the field ``tz``."""
    if not isinstance(tz, str) or not tz.strip():
        raise InvalidSchedule("tz", f"must be an IANA time zone name, got {tz!r}")
    if tz.rpartition("/")[2] in HOST_ZONES or tz.startswith("right/") or tz == "Factory":
        # The host's own zone (a link the machine's administrator sets) or leap-second
        # clocks: the same schedule would fire at other instants on another worker's host.
        raise InvalidSchedule(
            "tz", f"{tz!r} depends on the host: name the zone (Europe/Paris, UTC)"
        )
    try:
        return _zone(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule("tz", f"unknown time zone {tz!r}") from None


@lru_cache(maxsize=256)
def _zone(tz: str) -> ZoneInfo:
    return ZoneInfo(tz)


def _croniter() -> type[croniter]:
    # Imported when a schedule is first used, not with the job store: a process that has no
    # schedules never loads it (and an environment installed before it was a dependency
    # still imports ``consumer``).
    from croniter import croniter

    return croniter


def check_cron(cron: object) -> str:
    """A 5-field cron expression (or one of croniter's ``@daily``-style macros), or a
    6-field one with the second first, normalised to single spaces; ``InvalidSchedule`` on
    the field ``cron`` otherwise."""
    if not isinstance(cron, str) or not cron.strip():
        raise InvalidSchedule("cron", f"must be a 5-field cron expression, got {cron!r}")
    text = " ".join(cron.split())
    if text.lower() in _MACROS:
        return text.lower()
    if len(text.split(" ")) not in (5, 6):
        raise InvalidSchedule(
            "cron",
            f"{cron!r} must have 5 fields (minute hour day month dow), or 6 with the second "
            "first (second minute hour day month dow)",
        )
    croniter = _croniter()
    seconds = _with_seconds(text)
    if not croniter.is_valid(text, second_at_beginning=seconds):
        raise InvalidSchedule("cron", f"{cron!r} is not a valid cron expression")
    try:  # valid syntax that never matches (30 February) would loop: refuse it here
        croniter(text, datetime(2000, 1, 1), second_at_beginning=seconds).get_next(datetime)
    except Exception as exc:  # croniter's errors have no common public base
        raise InvalidSchedule("cron", f"{cron!r} never matches ({exc})") from None
    return text


def _with_seconds(text: str) -> bool:
    """Whether a (normalised) cron expression has the seconds field (6 fields)."""
    return text.count(" ") == 5


_DAY = 86400


# (unit in seconds, the units in the next field up, the cron of every N units; "{n}" is N)
_EVERY = (
    (1, 60, "*/{n} * * * * *"),  # seconds: a six-field cron, the second first
    (60, 60, "*/{n} * * * *"),
    (3600, 24, "0 */{n} * * *"),
)
_EVERY_ONE = {1: "* * * * * *", 60: "* * * * *", 3600: "0 * * * *", 86400: "0 0 * * *"}


def _interval_seconds(every: object) -> int:
    """``every`` as a whole number of seconds > 0 (``InvalidSchedule`` on ``every``)."""
    if isinstance(every, timedelta):
        seconds = every.total_seconds()
    elif isinstance(every, (int, float)) and not isinstance(every, bool):
        seconds = float(every)
    else:
        raise InvalidSchedule("every", f"must be a timedelta or seconds, got {every!r}")
    if not seconds > 0 or seconds != int(seconds):
        raise InvalidSchedule("every", f"must be a whole number of seconds > 0, got {seconds:g}")
    return int(seconds)


def every_cron(every: object) -> str:
    """The cron expression of a fixed interval (a ``timedelta``, or seconds): whole seconds
    that divide a minute (``*/10 * * * * *``), whole minutes that divide an hour (``*/5 * *
    * *``) or whole hours that divide a day (``0 */6 * * *``), counted from the start of
    each minute, hour or day in the schedule's zone. ``InvalidSchedule`` on the field
    ``every`` otherwise (a cron expression says any other rhythm)."""
    whole = _interval_seconds(every)
    if whole in _EVERY_ONE:
        return _EVERY_ONE[whole]
    for unit, per_next, template in _EVERY:
        count, rest = divmod(whole, unit)
        if rest == 0 and count < per_next and per_next % count == 0:
            return template.format(n=count)
    raise InvalidSchedule(
        "every",
        f"{whole} s divides no minute, hour or day evenly: use a cron expression for that rhythm",
    )


_per_thread = threading.local()


def _steps(cron: str) -> croniter:
    """A croniter for ``cron``, parsed once per thread (parsing is most of a step's cost:
    ~0.7 ms against ~0.1 ms to step); each use sets its start."""
    cache: dict[str, croniter] | None = getattr(_per_thread, "steps", None)
    if cache is None:
        cache = _per_thread.steps = {}
    found = cache.get(cron)
    if found is None:
        if len(cache) >= 1024:
            cache.clear()
        found = cache[cron] = _croniter()(
            cron, datetime(2000, 1, 1), second_at_beginning=_with_seconds(cron)
        )
    return found


def _instant(local: datetime, zone: ZoneInfo) -> float:
    """The instant of a naive local wall-clock time (the DST rules: module docstring)."""
    return local.replace(tzinfo=zone, fold=0).timestamp()


def _exists(local: datetime, zone: ZoneInfo) -> bool:
    """Whether a naive local time exists in ``zone`` (False inside a spring-forward gap)."""
    aware = local.replace(tzinfo=zone, fold=0)
    back = datetime.fromtimestamp(aware.timestamp(), zone).replace(tzinfo=None)
    return back == local


def next_slot(cron: str, zone: ZoneInfo, after: float) -> float:
    """The first slot strictly after ``after`` (unix seconds).

    croniter steps local times. Instants grow with local times except around a
    spring-forward gap, where a skipped local time (moved back by the offset in force before)
    can land after the valid local times that follow it; so the search starts early enough
    to see the gap's slots (the local time of ``after`` with the smaller of the offsets of
    ``after`` and of three hours before) and, while the candidates are skipped times, keeps
    the smallest instant until a valid local time settles it.
    """
    moment = datetime.fromtimestamp(after, UTC)
    offsets = [
        (moment - _MAX_SHIFT).astimezone(zone).utcoffset() or timedelta(0),
        moment.astimezone(zone).utcoffset() or timedelta(0),
    ]
    start = (moment + min(offsets)).replace(tzinfo=None)
    steps = _steps(cron)
    steps.set_current(start, force=True)
    best: float | None = None
    first_gap: datetime | None = None
    while True:
        local = steps.get_next(datetime)
        instant = _instant(local, zone)
        if instant > after:
            best = instant if best is None else min(best, instant)
            if _exists(local, zone):
                return best
            first_gap = first_gap or local
        if best is not None and first_gap is not None and local > first_gap + _MAX_SHIFT:
            return best
