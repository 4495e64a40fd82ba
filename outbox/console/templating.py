"""The console's templates: a Jinja2 environment that escapes every value (autoescape), with
the filters the pages use (``ts``, ``pretty``) and ``path(...)``, the one way a page writes a
link or a form's action to a record (:func:`outbox.console.params.path`)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from jinja2 import Environment, PackageLoader

from outbox.console.params import path


def templates() -> Environment:
    env = Environment(loader=PackageLoader("outbox.console", "templates"), autoescape=True)
    env.filters["ts"] = ts
    env.filters["pretty"] = pretty
    env.globals["path"] = page_path
    return env


def ts(value: Any) -> str:
    """A time for a page: unix seconds or ISO text as ``YYYY-MM-DD HH:MM:SS`` UTC."""
    if value is None or value == "":
        return ""
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(float(value), UTC).strftime("%Y-%m-%d %H:%M:%S")
    return str(value).replace("T", " ")[:19]


PRETTY_CHARS = 256 * 1024
"""A value a page shows is cut after this many characters (a payload can be 1 MiB)."""


def pretty(value: Any) -> str:
    """JSON, indented; text that is not JSON (or nested too deep to parse) as it is."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return _cut(value)
    try:
        return _cut(json.dumps(value, indent=2, ensure_ascii=False, default=str))
    except (ValueError, RecursionError):
        return _cut(str(value))


def _cut(text: str) -> str:
    if len(text) <= PRETTY_CHARS:
        return text
    return f"{text[:PRETTY_CHARS]}\n... ({len(text) - PRETTY_CHARS} more characters)"


def page_path(*parts: object) -> str | None:
    """``path(...)`` for a template: None for a value that cannot be a path segment (the
    template then offers no button)."""
    try:
        return path(*parts)
    except ValueError:
        return None
