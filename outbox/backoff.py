"""Exponential backoff with full jitter, and the retry loop every process waits out outages with."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from outbox.errors import ConfigError
from outbox.lifecycle import GracefulStop
from outbox.logs import fields

log = logging.getLogger("outbox")


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with full jitter: ``uniform(0, min(ceiling, base * 2**attempt))``."""

    base: float = 0.1
    ceiling: float = 30.0

    def __post_init__(self) -> None:
        if self.base <= 0:
            raise ConfigError("backoff.base", "must be positive")
        if self.ceiling < self.base:
            raise ConfigError("backoff.ceiling", "must be at least the base")

    def cap(self, attempt: int) -> float:
        return float(min(self.ceiling, self.base * (2 ** min(max(attempt, 0), 62))))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        return (rng or random).uniform(0, self.cap(attempt))


def retry_forever(
    what: str,
    operation: Callable[[], Any],
    stop: GracefulStop,
    retryable: tuple[type[BaseException], ...],
    backoff: Backoff = Backoff(0.2, 10.0),
) -> Any:
    """Run ``operation`` until it succeeds or stop is requested; log and back off between.

    Returns the operation's result, or None if stopped first.
    """
    attempt = 0
    while not stop.stopped:
        try:
            return operation()
        except retryable as exc:
            delay = backoff.delay(attempt)
            log.warning(
                f"{what} failed, retrying",
                extra=fields(
                    error=f"{type(exc).__name__}: {exc}",
                    attempt=attempt + 1,
                    retry_in_seconds=round(delay, 3),
                ),
            )
            attempt += 1
            stop.wait(delay)
    return None
