"""The ``OUTBOX_*`` environment: defaults for the command lines' flags.

Only the command lines call these; library code takes frozen config objects (STYLE: nothing
else reads the environment).
"""

from __future__ import annotations

import os

from outbox.errors import ConfigError

ENV_PREFIX = "OUTBOX_"


def env(name: str, default: str | None = None) -> str | None:
    """``OUTBOX_<NAME>`` from the environment, or ``default``."""
    value = os.environ.get(ENV_PREFIX + name.upper())
    return value if value not in (None, "") else default


def env_int(name: str, default: int) -> int:
    raw = env(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(ENV_PREFIX + name.upper(), f"{raw!r} is not an integer") from None


def env_float(name: str, default: float) -> float:
    raw = env(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(ENV_PREFIX + name.upper(), f"{raw!r} is not a number") from None
