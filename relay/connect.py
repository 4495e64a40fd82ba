"""Connecting ``outbox-relay`` (:mod:`relay.cli`) to its broker: the Redis client of
``--broker-url`` (a Redis Cluster's, waited for while its seed is down), the broker
(:func:`relay.broker.broker_for`), and ``--require-aof``'s check of Redis's persistence."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from outbox.backoff import Backoff, retry_forever
from outbox.cli import UsageError
from outbox.db import describe_url
from outbox.errors import BrokerUnavailable
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.redis_client import is_cluster_url, redis_client
from relay.broker import Broker, broker_for, broker_kind

log = logging.getLogger("outbox.relay")

START_BACKOFF = Backoff(0.2, 10.0)
"""The waits between pings of a broker not answering at start (:func:`reach_broker`)."""


def uses_cluster(args: argparse.Namespace) -> bool:
    """``--redis-cluster``, OUTBOX_REDIS_CLUSTER=1 or a ``redis+cluster://`` URL."""
    return bool(getattr(args, "redis_cluster", False)) or is_cluster_url(args.redis_url)


def connect_redis(args: argparse.Namespace, stop: GracefulStop | None = None) -> Any:
    """The Redis client of ``--redis-url``: a RedisCluster with ``--redis-cluster`` (it reads
    the slot map at once, so with ``stop`` it waits and retries while the seed is down; None
    once stopped), a plain client otherwise."""
    if not uses_cluster(args):
        return redis_client(args.redis_url)
    if stop is None:
        return redis_client(args.redis_url, cluster=True)
    import redis
    from redis.exceptions import RedisClusterException

    return retry_forever(
        "connecting to the Redis Cluster",
        lambda: redis_client(args.redis_url, cluster=True),
        stop,
        (redis.RedisError, RedisClusterException, OSError),
    )


def connect_broker(
    args: argparse.Namespace, stop: GracefulStop | None = None, **options: Any
) -> Broker | None:
    """The broker of ``--broker-url`` (:func:`relay.broker.broker_for`); a Redis Cluster's
    client is connected first (see :func:`connect_redis`). None once stopped while waiting."""
    if broker_kind(args.redis_url) == "redis":
        client = connect_redis(args, stop)
        if client is None:
            return None
        return broker_for(args.redis_url, client=client, **options)
    if uses_cluster(args):
        raise UsageError("--redis-cluster applies only to a Redis --broker-url")
    broker = broker_for(args.redis_url, **options)  # a malformed URL: ConfigError, exit 2
    if stop is not None and not reach_broker(broker, args.redis_url, stop):
        return None
    return broker


def reach_broker(
    broker: Broker,
    url: str,
    stop: GracefulStop,
    backoff: Backoff = START_BACKOFF,
    *,
    every: float = 60.0,
) -> bool:
    """Wait until ``broker`` answers a ping, saying so at start: a relay on a broker where
    nothing listens logged "relay started" and nothing else while its outbox was empty (it
    had nothing to publish, so it never met the broker). The first failure is an error
    naming the broker (its password hidden), then a line every ``every`` seconds while it
    lasts, and one when the broker answers. An outage, not a configuration error: waited
    out with ``backoff``, never an exit. False once stopped first."""
    where = describe_url(url)
    attempt = 0
    first = last = 0.0
    while not stop.stopped:
        try:
            broker.ping()
        except (BrokerUnavailable, OSError) as exc:
            now = time.monotonic()
            attempt += 1
            facts = fields(broker=where, attempt=attempt, error=str(exc)[:500])
            if attempt == 1:
                first = last = now
                log.error("cannot reach the broker; retrying until it answers", extra=facts)
            elif now - last >= every:
                last = now
                log.error("still cannot reach the broker", extra=facts)
            stop.wait(backoff.delay(attempt))
            continue
        if attempt:
            log.warning(
                "broker reachable",
                extra=fields(
                    broker=where, failures=attempt, seconds=round(time.monotonic() - first, 1)
                ),
            )
        return True
    return False


def aof_refusal(client: Any, stop: GracefulStop, args: argparse.Namespace) -> str | None:
    """Why ``--require-aof`` refuses to start, or None (AOF is on). Waits while Redis is
    down, as the relay would."""
    from redis import RedisError

    from relay.redis.health import Persistence, check_persistence

    found: list[Persistence] = []

    def check() -> bool:
        found.append(check_persistence(client))
        return True

    if not retry_forever("checking Redis persistence", check, stop, (RedisError, OSError)):
        return "stopped before Redis answered"
    report = found[-1]
    if report.mode == "aof":
        return None
    where = describe_url(args.redis_url) if args.redis_url else "the embedded Redis"
    if report.mode == "unknown":
        return (
            f"--require-aof: cannot tell whether Redis at {where} runs with AOF: "
            f"{report.detail}; drop --require-aof only if your provider guarantees it"
        )
    return (
        f"--require-aof: Redis at {where} runs without AOF (mode {report.mode}: "
        f"{report.detail}); a crash would lose entries the relay has acknowledged. Set "
        "appendonly yes (CONFIG SET appendonly yes, and in redis.conf)"
    )


__all__ = ["aof_refusal", "connect_broker", "connect_redis", "reach_broker", "uses_cluster"]
