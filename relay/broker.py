"""The relay's brokers: :func:`broker_for` picks one by the URL's scheme (the one place
that reads it). The protocol and its results are :mod:`relay.seam`, re-exported here.

    from relay.broker import broker_for

    broker = broker_for("nats://127.0.0.1:4222", stream_template="outbox.{topic}")
    relay = Relay(outbox, broker)
"""

from __future__ import annotations

from typing import Any

from outbox.errors import ConfigError
from outbox.nats_client import broker_kind
from relay.seam import (
    Broker,
    BrokerCheck,
    BrokerUnavailable,
    FencedOut,
    HeldBack,
    MarkerBehind,
    Prepared,
    TransientError,
)


def broker_for(
    url: str | None,
    *,
    client: Any = None,
    cluster: bool = False,
    stream_template: str = "outbox.{topic}",
    **options: Any,
) -> Broker:
    """The broker of ``url``: ``redis://``/``rediss://`` (Redis Streams; a Redis Cluster
    with ``cluster`` or a ``redis+cluster://`` URL), ``nats://`` (NATS JetStream). This is
    the one place that reads the scheme. ``client``: a Redis client already connected (the
    CLI's, which waits for a cluster to form); ``options`` go to the broker's constructor
    (``maxlen``, ``source``, ``partitions``, ``stream_retention``, ...)."""
    if broker_kind(url) == "nats":
        if cluster:
            raise ConfigError("redis_cluster", "applies only to a Redis broker URL")
        from relay.nats.broker import NatsBroker

        return NatsBroker(url or "", stream_template, **options)
    from relay.redis.publisher import RedisStreamPublisher

    if client is None:
        from outbox.redis_client import is_cluster_url, redis_client

        if cluster or is_cluster_url(url):
            client = redis_client(url, cluster=True)
        else:
            client = redis_client(url)
    return RedisStreamPublisher(client, stream_template, **options)


__all__ = [
    "Broker",
    "BrokerCheck",
    "BrokerUnavailable",
    "FencedOut",
    "HeldBack",
    "MarkerBehind",
    "Prepared",
    "TransientError",
    "broker_for",
    "broker_kind",
]
