"""Retry policy of jobs: what a failed attempt turns into, and when it may run again.

- ``transient``: back to READY after ``uniform(0, min(ceiling, base * 2**(attempt-1)))``
  seconds (exponential backoff with full jitter, ``outbox.backoff.Backoff``); the ceiling may
  be lower or higher per provider. When the attempts are spent (``max_attempts``) or the
  failure streak has lasted longer than the recovery window (``max_elapsed`` seconds since
  its first failure), NEEDS_ATTENTION instead: nothing retries for ever.
- ``permanent`` (a validation error): WAITING_REVIEW at once, no retry.
- ``auth`` (credentials refused): retried like a transient failure at most
  ``max_auth_failures`` times in a row, then NEEDS_ATTENTION; a queue of jobs that cannot
  authenticate never keeps growing its retries.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from consumer.jobs.states import NEEDS_ATTENTION, READY, WAITING_REVIEW
from outbox.backoff import Backoff
from outbox.errors import ConfigError
from outbox.validate import check_number

KINDS = ("transient", "permanent", "auth")


@dataclass(frozen=True)
class Decision:
    """What a failure becomes: the next ``state`` and, for READY, the ``delay`` in seconds."""

    state: str
    delay: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class RetryPolicy:
    """Frozen retry settings; validated at construction (the error names the field).

    - ``base`` / ``ceiling``: a transient failure's retry waits
      ``uniform(0, min(ceiling, base * 2**(attempt-1)))`` seconds.
    - ``provider_ceilings``: provider -> its own ceiling, lower or higher.
    - ``max_attempts``: attempts (and lease expiries) after which the job goes to
      NEEDS_ATTENTION.
    - ``max_elapsed``: seconds a failure streak may last, from its first failure, before
      NEEDS_ATTENTION: nothing retries for ever.
    - ``max_auth_failures``: credentials refused this many times in a row: NEEDS_ATTENTION.
    """

    base: float = 1.0
    ceiling: float = 300.0
    provider_ceilings: Mapping[str, float] = field(default_factory=dict)
    max_attempts: int = 10
    max_elapsed: float = 24 * 3600.0
    max_auth_failures: int = 3

    def __post_init__(self) -> None:
        if not _positive(self.base):
            raise ConfigError("retry.base", f"must be a positive number, got {self.base!r}")
        if not _positive(self.ceiling) or self.ceiling < self.base:
            raise ConfigError("retry.ceiling", f"must be at least base, got {self.ceiling!r}")
        for name, ceiling in self.provider_ceilings.items():
            if not _positive(ceiling) or ceiling < self.base:
                raise ConfigError(
                    f"retry.provider_ceilings[{name!r}]", f"must be at least base, got {ceiling!r}"
                )
        for name in ("max_attempts", "max_auth_failures"):
            check_number(f"retry.{name}", getattr(self, name), ConfigError, integer=True)
        if not _positive(self.max_elapsed):
            raise ConfigError("retry.max_elapsed", f"must be positive, got {self.max_elapsed!r}")

    def ceiling_for(self, provider: str | None) -> float:
        if provider is not None and provider in self.provider_ceilings:
            return float(self.provider_ceilings[provider])
        return self.ceiling

    def delay(
        self, attempt: int, provider: str | None = None, rng: random.Random | None = None
    ) -> float:
        """Full-jitter delay before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        return Backoff(self.base, self.ceiling_for(provider)).delay(attempt - 1, rng)

    def decide(
        self,
        kind: str,
        *,
        attempts: int,
        auth_failures: int,
        elapsed: float,
        provider: str | None = None,
        rng: random.Random | None = None,
    ) -> Decision:
        """The fate of a job whose attempt number ``attempts`` failed with ``kind``.

        ``auth_failures`` counts this failure too when ``kind == "auth"``; ``elapsed`` is the
        time since the current failure streak began (0 for its first failure).
        """
        if kind not in KINDS:
            raise ConfigError("kind", f"must be one of {KINDS}, got {kind!r}")
        if kind == "permanent":
            return Decision(WAITING_REVIEW, reason="permanent failure")
        if kind == "auth" and auth_failures >= self.max_auth_failures:
            return Decision(NEEDS_ATTENTION, reason=f"{auth_failures} authentication failures")
        if attempts >= self.max_attempts:
            return Decision(NEEDS_ATTENTION, reason=f"{attempts} attempts spent")
        if elapsed > self.max_elapsed:
            return Decision(NEEDS_ATTENTION, reason=f"failing for {elapsed:.0f}s")
        return Decision(READY, delay=self.delay(attempts, provider, rng), reason=kind)


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
