"""Waiting for a broker at start, and saying so (issue 53): a process whose broker (Redis or
NATS) does not answer when it starts logs one error line naming the broker, its password
hidden, with the reason; then a line a minute while it lasts, and one when the broker
answers. It waits with backoff and never exits: an outage is no configuration error.

Before, a relay on a NATS URL where nothing listened logged "relay started" and nothing else
while its outbox was empty, and one on a Redis URL (or a consumer) logged warnings about the
cycle or the heartbeat that named no broker. Both brokers now go through :func:`reach`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from outbox.backoff import Backoff
from outbox.display import display_url
from outbox.errors import BrokerUnavailable
from outbox.lifecycle import GracefulStop
from outbox.logs import fields

T = TypeVar("T")

START_BACKOFF = Backoff(0.2, 10.0)
"""The waits between attempts on a broker not answering at start."""

FIRST = "cannot reach the broker; retrying until it answers"
STILL = "still cannot reach the broker"
BACK = "broker reachable"


def broker_errors() -> tuple[type[BaseException], ...]:
    """What a broker that is not there raises: :class:`BrokerUnavailable` (NATS), Redis's
    errors (a refused or reset connection, a cluster seed down, LOADING) and OSError."""
    import redis
    from redis.exceptions import RedisClusterException

    return (BrokerUnavailable, redis.RedisError, RedisClusterException, OSError)


def where(url: str | None) -> str:
    """The broker as the lines name it: its URL with the password hidden (a text that is no
    URL, such as "the application's Redis client", as it is)."""
    if not url:
        return "the embedded Redis"
    return display_url(url) if "://" in url else url


def reason(exc: BaseException) -> str:
    """The reason of a failed attempt, bounded. A :class:`BrokerUnavailable` already names its
    cause; another error is named by its type (``ConnectionError: Error 111 ...``)."""
    text = str(exc) if isinstance(exc, BrokerUnavailable) else f"{type(exc).__name__}: {exc}"
    return text[:500]


def reach(
    attempt: Callable[[], T],
    url: str | None,
    stop: GracefulStop,
    logger: logging.Logger,
    *,
    backoff: Backoff = START_BACKOFF,
    every: float = 60.0,
    **facts: Any,
) -> T | None:
    """Run ``attempt`` (a ping, or making a client that reads the server at once) until it
    succeeds: its result, or None once ``stop`` comes first. The first failure is an error
    line (:data:`FIRST`) naming the broker of ``url`` with its password hidden and the
    reason; then one (:data:`STILL`) every ``every`` seconds while it lasts; then a warning
    (:data:`BACK`) with how many attempts failed and for how long. ``facts`` go into every
    line (the process, its group)."""
    errors = broker_errors()
    broker = where(url)
    failures = 0
    first = last = 0.0
    while not stop.stopped:
        try:
            result = attempt()
        except errors as exc:
            now = time.monotonic()
            failures += 1
            line = fields(broker=broker, attempt=failures, error=reason(exc), **facts)
            if failures == 1:
                first = last = now
                logger.error(FIRST, extra=line)
            elif now - last >= every:
                last = now
                logger.error(STILL, extra=line)
            stop.wait(backoff.delay(failures))
            continue
        if failures:
            seconds = round(time.monotonic() - first, 1)
            logger.warning(
                BACK, extra=fields(broker=broker, failures=failures, seconds=seconds, **facts)
            )
        return result
    return None


__all__ = ["BACK", "FIRST", "START_BACKOFF", "STILL", "broker_errors", "reach", "reason", "where"]
