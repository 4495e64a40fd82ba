"""The name rules and limits every part shares: events, jobs, consumers.

A *name* is a topic, key, tenant, identity, job action, consumer group, ...: a non-blank
string of at most :data:`MAX_NAME_LENGTH` characters without NUL. The columns that hold names
are this wide, and PostgreSQL refuses NUL in text (``DataError``) while SQLite stores it, so
the rule is checked here, in Python, before anything reaches either database: the same bad
name fails the same way on both.

Each part raises its own typed error (``InvalidEvent``, ``JobError``, ``ConfigError``,
``UndecodableEntry``): they all take ``(field, problem)``, and :func:`check_name` is given the
class to raise.
"""

from __future__ import annotations

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
