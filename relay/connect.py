"""Connecting ``outbox-relay`` (:mod:`relay.cli`) to its broker: the Redis client of
``--broker-url`` (a Redis Cluster's, waited for while its seed is down), the broker
(:func:`relay.broker.broker_for`), and ``--require-aof``'s check of Redis's persistence."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from outbox.backoff import Backoff, retry_forever
from outbox.cli import UsageError
from outbox.db import describe_url
from outbox.lifecycle import GracefulStop
from outbox.reach import START_BACKOFF, reach
from outbox.redis_client import is_cluster_url, redis_client
from relay.broker import Broker, broker_for, broker_kind

log = logging.getLogger("outbox.relay")


def uses_cluster(args: argparse.Namespace) -> bool:
    """``--redis-cluster``, OUTBOX_REDIS_CLUSTER=1 or a ``redis+cluster://`` URL."""
    return bool(getattr(args, "redis_cluster", False)) or is_cluster_url(args.redis_url)


def connect_redis(args: argparse.Namespace, stop: GracefulStop | None = None) -> Any:
    """The Redis client of ``--redis-url``: a RedisCluster with ``--redis-cluster`` (it reads
    the slot map at once, so with ``stop`` it waits while the seed is down, saying so as
    :func:`outbox.reach.reach` does; None once stopped), a plain client otherwise."""
    if not uses_cluster(args):
        return redis_client(args.redis_url)
    if stop is None:
        return redis_client(args.redis_url, cluster=True)
    return reach(lambda: redis_client(args.redis_url, cluster=True), args.redis_url, stop, log)


def connect_broker(
    args: argparse.Namespace, stop: GracefulStop | None = None, **options: Any
) -> Broker | None:
    """The broker of ``--broker-url`` (:func:`relay.broker.broker_for`); a Redis Cluster's
    client is connected first (see :func:`connect_redis`). With ``stop``, it waits until the
    broker answers a ping (:func:`reach_broker`). None once stopped while waiting."""
    if broker_kind(args.redis_url) == "redis":
        client = connect_redis(args, stop)
        if client is None:
            return None
        broker = broker_for(args.redis_url, client=client, **options)
    else:
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
    """Wait until ``broker`` answers a ping, saying so at start (:func:`outbox.reach.reach`:
    an error line naming the broker, its password hidden, then a line a minute, then one
    when it answers). A relay on a broker where nothing listens logged "relay started" and
    nothing else while its outbox was empty (NATS), or warnings naming no broker (Redis).
    An outage, not a configuration error: waited out, never an exit. False once stopped."""

    def ping() -> bool:
        broker.ping()
        return True

    return bool(reach(ping, url, stop, log, backoff=backoff, every=every))


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
