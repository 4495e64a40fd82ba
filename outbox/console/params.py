"""How the console reads what a request names, and writes what a page links to, in one
place each, so the pages and actions that come later follow the same rules:

- :func:`segment` makes one path segment of a URL from a value (a queue name, an operation
  id, an event id): every character outside the unreserved set is percent-encoded, ``/``
  included, so ``../jobs/2`` stays inside its segment and a browser cannot resolve the form's
  action elsewhere. A value that is only dots (``.``, ``..``) cannot be a segment at all
  (browsers resolve ``%2E%2E`` as ``..`` too): :func:`segment` raises, and the page offers no
  button for it (the JSON API, whose clients send the path as written, still reaches it).
- :func:`integer` reads a query parameter or a path segment as a whole number: ASCII digits
  only, within a range, else a :class:`FilterError` (400), never a 500 and never a Unicode
  digit read as another number (``/api/jobs/\\uff15/cancel``, a fullwidth 5, is not job 5).
- :func:`text` reads a text parameter: bounded, and no NUL (PostgreSQL refuses NUL in text).
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote

from outbox.console.queries import FilterError
from outbox.validate import INT64_MAX, parse_int

MAX_TEXT = 400


def segment(value: object) -> str:
    """``value`` as one percent-encoded path segment (``/`` escaped); ValueError for a value
    that cannot be one (empty, or only dots)."""
    text_value = str(value)
    if text_value.strip(".") == "":
        raise ValueError(f"{text_value!r} cannot be a path segment")
    return quote(text_value, safe="")


def path(*parts: object) -> str:
    """An absolute path of this console from fixed words and values: ``path("queues", name,
    "pause")`` -> ``/queues/<name, escaped>/pause``. Every part goes through :func:`segment`."""
    return "/" + "/".join(segment(p) for p in parts)


def integer(value: object, name: str, *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """A whole number from a request, strictly (see the module docstring)."""
    return parse_int(value, name, FilterError, minimum=minimum, maximum=maximum)


def optional_integer(
    params: Mapping[str, str], name: str, default: int, *, minimum: int = 0, maximum: int
) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    return integer(raw, name, minimum=minimum, maximum=maximum)


def text(value: str | None, name: str, limit: int = MAX_TEXT) -> str | None:
    """A text parameter: None when absent or empty; FilterError when too long or holding NUL."""
    if value is None or value == "":
        return None
    if len(value) > limit or "\x00" in value:
        raise FilterError(name, f"at most {limit} characters, and no NUL")
    return value


def local_path(path: str | None) -> str:
    """A redirect target of this console only (never another site: ``//`` or a scheme)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path
