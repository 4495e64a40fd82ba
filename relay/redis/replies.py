"""What the publisher and the cluster's per-slot path share on the wire: packed commands
and how a Redis reply is classified (transient or permanent). Its own module so that
:mod:`relay.redis.cluster` does not import :mod:`relay.redis.publisher` back (one
direction: publisher -> cluster -> replies)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from outbox.outage import TRANSIENT_REPLIES as TRANSIENT_REPLIES  # "not now", not "never"
from outbox.outage import reply_code
from relay.errors import PermanentPublishError
from relay.seam import Prepared as Prepared
from relay.seam import TransientError as TransientError


class ReplicasNotConfirmed(RedisConnectionError):
    """``WAIT`` confirmed fewer replicas than asked within its timeout (``wait_replicas``):
    the batch may be on the master only, where a failover could lose it. Raised like a
    connection error, so the relay keeps the batch's intents and reconciles them: a receipt
    is never assumed."""


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def wait_command(replicas: int, timeout_ms: int) -> bytes:
    """``WAIT replicas timeout``, packed: sent on the connection that ran the script."""
    return b"*3\r\n" + bulk(b"WAIT") + bulk(b"%d" % replicas) + bulk(b"%d" % timeout_ms)


def send_fences(
    conn: Any, keys: Sequence[str], ttl_seconds: int, wait_replicas: int, wait_timeout: float
) -> None:
    """``SET key 1 EX ttl`` for each key (and ``WAIT``) on one connection, replies read."""
    ttl = bulk(b"%d" % ttl_seconds)
    parts = [
        b"*5\r\n" + bulk(b"SET") + bulk(key.encode()) + bulk(b"1") + bulk(b"EX") + ttl
        for key in keys
    ]
    timeout_ms = max(1, int(wait_timeout * 1000))
    if wait_replicas:
        parts.append(wait_command(wait_replicas, timeout_ms))
    conn.send_packed_command(parts, check_health=True)
    for _ in keys:
        conn.read_response()
    if wait_replicas:
        acked = int(conn.read_response())
        if acked < wait_replicas:
            raise ReplicasNotConfirmed(
                f"WAIT {wait_replicas} after fencing: {acked} replica(s) within {timeout_ms} ms"
            )


def classify_reply(exc: ResponseError) -> Exception:
    """A per-entry error reply: transient (retry later) or permanent (quarantine)."""
    message = str(exc)
    if reply_code(exc) in TRANSIENT_REPLIES or isinstance(exc, redis.exceptions.ReadOnlyError):
        return TransientError(message)
    return PermanentPublishError(f"Redis refused the entry: {message}")
