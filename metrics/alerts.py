"""The shipped alert rules (``alerts.yml``) and tuned copies of them.

Every tunable number in ``alerts.yml`` is the last token of its rule's single-quoted ``expr``
and carries a ``# threshold: NAME`` comment. :func:`render_rules` rewrites those numbers (and,
optionally, every ``for:`` duration) without a YAML library, so an operator can generate a
copy for their own thresholds and the end-to-end test can make the rules fire in seconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from outbox.errors import ConfigError

RULES_FILE = "alerts.yml"

_THRESHOLD = re.compile(
    r"^(?P<head>\s*expr:\s*'.*?)(?P<value>-?\d+(?:\.\d+)?)(?P<tail>'\s*#\s*threshold:\s*"
    r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*)$"
)
_FOR = re.compile(r"^(?P<head>\s*for:\s*)(?P<value>\S+)(?P<tail>\s*)$")
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def rules_path() -> Path:
    """The installed ``alerts.yml`` (what ``metrics.resource_path`` gives, read here so that
    the package root may re-export this module's functions)."""
    return Path(str(resources.files("metrics").joinpath(RULES_FILE)))


def default_thresholds(rules_text: str | None = None) -> dict[str, float]:
    """The named thresholds of the rules and their values."""
    text = rules_text if rules_text is not None else rules_path().read_text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _THRESHOLD.match(line)
        if match:
            found[match["name"]] = float(match["value"])
    return found


def render_rules(
    thresholds: Mapping[str, float] | None = None,
    *,
    for_duration: str | None = None,
    rules_text: str | None = None,
) -> str:
    """``alerts.yml`` with the named thresholds replaced, and every ``for:`` set to
    ``for_duration`` when given (e.g. ``"0s"`` in a test). Unknown names raise ConfigError."""
    text = rules_text if rules_text is not None else rules_path().read_text()
    wanted = dict(thresholds or {})
    unknown = set(wanted) - set(default_thresholds(text))
    if unknown:
        raise ConfigError("thresholds", f"unknown threshold names: {sorted(unknown)}")
    if for_duration is not None and not _DURATION.match(for_duration):
        raise ConfigError("for_duration", f"{for_duration!r} is not a Prometheus duration")
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\n")
        newline = line[len(body) :]
        match = _THRESHOLD.match(body)
        if match and match["name"] in wanted:
            value = wanted[match["name"]]
            number = str(int(value)) if float(value).is_integer() else repr(float(value))
            body = f"{match['head']}{number}{match['tail']}"
        elif for_duration is not None:
            for_match = _FOR.match(body)
            if for_match:
                body = f"{for_match['head']}{for_duration}{for_match['tail']}"
        out.append(body + newline)
    return "".join(out)
