"""What an outage is: a database or a Redis that went away, or is not there yet.

One place decides (DBOS's ``db_retry`` with ``retriable_postgres_exception`` is the model):
every long-running loop waits out and retries what :func:`is_outage` says is an outage, logs
it as one line (no traceback: the message says which service and why), and recovers by
itself when the service returns. Anything else is a bug or a bad input and is reported with
its traceback.
"""

from __future__ import annotations

import functools

import redis
from redis.exceptions import RedisClusterException
from sqlalchemy.exc import DBAPIError, DisconnectionError, InterfaceError, OperationalError


@functools.cache
def outage_errors() -> tuple[type[BaseException], ...]:
    """The exception classes that mean "a service is unavailable" (see :func:`is_outage`)."""
    import psycopg

    return (
        # The database: connection refused, reset or lost, a server shutting down, a
        # statement cancelled by the server's timeout, SQLite busy beyond its timeout.
        OperationalError,
        InterfaceError,
        DisconnectionError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
        # Redis: connection refused or reset, timeouts, LOADING after a restart, a cluster
        # whose slots are moving or down.
        redis.ConnectionError,
        redis.TimeoutError,
        redis.exceptions.BusyLoadingError,
        redis.exceptions.ClusterDownError,
        redis.exceptions.TryAgainError,
        RedisClusterException,
        # The network under either.
        ConnectionError,
        TimeoutError,
        OSError,
    )


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means a database or Redis that is unavailable (wait and retry), as
    opposed to a bug or a bad input. A DBAPI error that invalidated its connection (the
    server went away mid-statement) is an outage whatever its class."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, outage_errors())


def outage_service(exc: BaseException) -> str | None:
    """``"database"``, ``"Redis"`` or None: which service an outage concerns, for messages."""
    if not is_outage(exc):
        return None
    if isinstance(exc, redis.RedisError | RedisClusterException):
        return "Redis"
    if isinstance(exc, DBAPIError) or type(exc).__module__.startswith("psycopg"):
        return "database"
    return None
