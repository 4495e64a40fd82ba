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

One gate per kind of input (issue 53), used by every way in (the HTTP apps, the command
lines, the ``OUTBOX_*`` variables, the public methods that store text):

- whole numbers written as text (a path, a query, a flag, a variable, a header):
  :func:`parse_int` (ASCII digits only, in range: no fullwidth or superscript digits, no
  sign, no overflow);
- numbers written as text: :func:`parse_float` (finite: no ``nan``, no ``inf``; in range);
- free text (a reason, an operator's name, a detail): :func:`check_text` (no NUL, no lone
  surrogate, bounded);
- JSON values to store: :func:`json_problem` (encodable, no NUL, no lone surrogate, bounded
  depth); JSON bodies to read: :func:`load_json` (bounded size and depth; a body nested
  30,000 deep is a refusal, not a ``RecursionError``).

Each raises the caller's typed error naming the field, or returns the problem, so a bad
input is a 4xx, a typed error, or exit 2, before anything is read or written.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

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


MAX_JSON_DEPTH = 64
"""The deepest JSON value accepted from outside (a body, a payload): objects and arrays."""

_FLOAT = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?|\.[0-9]{1,15}")


def float_problem(
    text: object, *, minimum: float = 0.0, maximum: float = float(INT64_MAX)
) -> str | None:
    """What is wrong with ``text`` as a number written in ASCII (``30``, ``2.5``) from
    ``minimum`` to ``maximum``, or None. ``float()`` accepts ``nan``, ``inf``, exponents,
    signs, underscores and other scripts' digits; this does not."""
    if not isinstance(text, str) or not _FLOAT.fullmatch(text):
        return f"must be a number in ASCII digits (like 30 or 2.5), got {repr(text)[:40]}"
    value = float(text)
    if not minimum <= value <= maximum:
        return f"must be from {minimum:g} to {maximum:g}, got {text}"
    return None


def parse_float(
    text: object,
    field: str,
    error: ErrorFactory,
    *,
    minimum: float = 0.0,
    maximum: float = float(INT64_MAX),
) -> float:
    """``text`` as a finite float in ``minimum..maximum`` (:func:`float_problem`); else
    ``error(field, problem)``."""
    problem = float_problem(text, minimum=minimum, maximum=maximum)
    if problem is not None:
        raise error(field, problem)
    assert isinstance(text, str)
    return float(text)


def text_problem(value: object, *, limit: int) -> str | None:
    """What is wrong with ``value`` as a free text to store (a reason, a name given by a
    person, a detail), or None: a string of at most ``limit`` characters, without NUL (which
    PostgreSQL refuses) or a lone surrogate (which no database encodes)."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if len(value) > limit:
        return f"is {len(value)} characters, longer than {limit}"
    if "\x00" in value:
        return "must not contain NUL characters"
    return utf8_problem(value)


def check_text(
    field: str, value: object, error: ErrorFactory, *, limit: int, required: bool = False
) -> str | None:
    """``value`` if it is a good free text (:func:`text_problem`; None when optional and
    absent), else ``error(field, problem)``."""
    if value is None:
        if required:
            raise error(field, "is required")
        return None
    problem = text_problem(value, limit=limit)
    if problem is not None:
        raise error(field, problem)
    assert isinstance(value, str)
    return value


def json_problem(value: object, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What is wrong with ``value`` as JSON to store, or None: encodable (no NaN, no
    infinity, no other types), no NUL in a string (PostgreSQL's jsonb refuses it), no lone
    surrogate (no database encodes it), at most ``max_depth`` levels of objects and arrays."""
    if _too_deep(value, max_depth):
        return f"is nested deeper than {max_depth} levels"
    try:
        encoded = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:  # a cycle, an object
        return f"is not JSON-serialisable ({exc})"
    if "\\u0000" in encoded:
        return "must not contain NUL characters"
    return utf8_problem(encoded)


def load_json(body: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON body read from outside: ``ValueError`` with the problem when it is not JSON,
    not UTF-8, nested deeper than ``max_depth``, or holds what :func:`json_problem`
    refuses. The size is the caller's bound (the body is read already)."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise ValueError(f"the JSON is nested deeper than {max_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    problem = json_problem(value, max_depth=max_depth)
    if problem is not None:
        raise ValueError(f"the JSON {problem}")
    return value


def _too_deep(value: object, max_depth: int) -> bool:
    """Whether ``value`` nests objects and arrays deeper than ``max_depth`` (iterative:
    never a ``RecursionError`` itself)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return True
        children = item.values() if isinstance(item, dict) else item
        assert isinstance(children, Iterable)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
