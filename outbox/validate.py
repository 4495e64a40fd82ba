"""The name rules and limits every part shares: events, jobs, consumers.

A *name* is a topic, key, tenant, identity, job action, consumer group, ...: a non-blank
string of at most :data:`MAX_NAME_LENGTH` characters without NUL. The columns that hold names
are this wide, and PostgreSQL refuses NUL in text (``DataError``) while SQLite stores it, so
the rule is checked here, in Python, before anything reaches either database: the same bad
name fails the same way on both.

Each part raises its own typed error (``InvalidEvent``, ``JobError``, ``ConfigError``,
``UndecodableEntry``): they all take ``(field, problem)``, and :func:`check_name` and
:func:`check_number` are given the class to raise.

A *number* setting (a size, a count, seconds, a rate) is an ``int`` or ``float``, never a
``bool``, finite, and positive (or, where zero means "off", non-negative): one rule, checked
by :func:`check_number`, so ``inf``, ``nan`` and ``True`` fail the same way everywhere.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

MAX_NAME_LENGTH = 200
"""Longest name accepted (characters). Every name column is this wide."""

MAX_EVENT_ID_LENGTH = 64
"""Longest event id accepted from a stream entry (ours are 36-character UUIDv7 strings)."""

ErrorFactory = Callable[[str, str], Exception]


def name_problem(value: object, *, limit: int = MAX_NAME_LENGTH) -> str | None:
    """What is wrong with ``value`` as a name, or None when it is a good one."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value or value.isspace():  # the same as "not value.strip()", without a copy
        return "must not be empty"
    if len(value) > limit:
        return f"is {len(value)} characters, longer than {limit}"
    if "\x00" in value:
        return "must not contain NUL characters"
    return utf8_problem(value)


def utf8_problem(text: str) -> str | None:
    """None when ``text`` can be encoded as UTF-8; else where its lone surrogate is (a
    ``"\\ud800"`` a JSON decoder or ``surrogateescape`` let through: no database, Redis or
    JSON reader downstream accepts it)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{text[exc.start]!r} at character {exc.start}"
        return f"holds a lone surrogate {where}: not valid UTF-8"
    return None


def check_name(
    field: str,
    value: object,
    error: ErrorFactory,
    *,
    required: bool = True,
    limit: int = MAX_NAME_LENGTH,
) -> str | None:
    """Return ``value`` if it is a good name (None if optional and absent), else raise
    ``error(field, problem)``."""
    if value is None:
        if required:
            raise error(field, "is required")
        return None
    problem = name_problem(value, limit=limit)
    if problem is not None:
        raise error(field, problem)
    assert isinstance(value, str)
    return value


def number_problem(
    value: object, *, integer: bool = False, zero: bool = False, maximum: float | None = None
) -> str | None:
    """What is wrong with ``value`` as a number setting, or None when it is a good one.
    ``integer``: whole numbers only; ``zero``: 0 is allowed (it means "off");
    ``maximum``: the largest value allowed."""
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return f"must be {'an integer' if integer else 'a number'}, got {value!r}"[:200]
    assert isinstance(value, int | float)
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        return f"must be {'non-negative' if zero else 'positive'}, got {value!r}"
    if maximum is not None and value > maximum:
        return f"must be at most {maximum:g}, got {value!r}"
    return None


def check_number(
    field: str,
    value: object,
    error: ErrorFactory,
    *,
    integer: bool = False,
    zero: bool = False,
    maximum: float | None = None,
    item: str | None = None,
) -> float:
    """Return ``value`` as a float if it is a good number setting (see the module doc), else
    raise ``error(field, problem)``; ``item`` names the entry of a mapping setting the value
    belongs to. Integers: ``int(check_number(..., integer=True))``."""
    problem = number_problem(value, integer=integer, zero=zero, maximum=maximum)
    if problem is not None:
        raise error(field, problem if item is None else f"{item!r}: {problem}")
    assert isinstance(value, int | float)
    return float(value)


INT64_MAX = 2**63 - 1
"""The largest BIGINT (a row id, a cursor): a larger number is refused, not sent to a database."""

_DIGITS = re.compile(r"[0-9]{1,20}")


def int_problem(text: object, *, minimum: int, maximum: int) -> str | None:
    """What is wrong with ``text`` as a whole number written in ASCII digits from
    ``minimum`` to ``maximum``, or None. ``str.isdigit`` and ``int()`` accept other scripts'
    digits (fullwidth, superscript, Arabic-Indic), signs, spaces and underscores; this does not."""
    if not isinstance(text, str) or not _DIGITS.fullmatch(text):
        shown = repr(text)[:40]
        return f"must be a whole number in ASCII digits (0-9), got {shown}"
    value = int(text)
    if not minimum <= value <= maximum:
        return f"must be from {minimum} to {maximum}, got {value}"
    return None


def parse_int(text: object, field: str, error: ErrorFactory, *, minimum: int, maximum: int) -> int:
    """``text`` (a query parameter, a path segment, a command-line value) as an int, strictly:
    ASCII digits only and within ``minimum..maximum``; else ``error(field, problem)``."""
    problem = int_problem(text, minimum=minimum, maximum=maximum)
    if problem is not None:
        raise error(field, problem)
    assert isinstance(text, str)
    return int(text)
