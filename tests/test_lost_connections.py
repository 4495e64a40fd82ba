"""A database connection cut under a statement (issue 53): ``outbox.outage.is_lost``,
``retry_lost`` and ``ConnectionWatch``, and the job store's own statements on a real
PostgreSQL whose backends are terminated (``pg_terminate_backend``, what a failover or a
pooler restart does). The worker process under 16 such cuts: tests/test_worker_cuts.py."""

from __future__ import annotations

import logging

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from consumer import Store
from outbox.outage import ConnectionWatch, is_cut, is_lost, retry_lost


def _terminate(admin: sa.Engine, name: str) -> int:
    with admin.connect() as conn:
        sql = (
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = :name AND pid <> pg_backend_pid()"
        )
        return int(conn.execute(sa.text(sql), {"name": name}).scalar_one())


def _lost() -> DBAPIError:
    return OperationalError("SELECT 1", {}, Exception("cut"), connection_invalidated=True)


def test_a_cut_is_told_from_a_refusal_and_from_a_bad_statement() -> None:
    shutdown = psycopg.errors.AdminShutdown("terminating connection due to administrator command")
    assert is_cut(shutdown)
    assert is_cut(psycopg.OperationalError("consuming input failed: server closed"))
    assert not is_cut(psycopg.errors.UniqueViolation("duplicate key"))
    assert not is_cut(psycopg.errors.QueryCanceled("statement timeout"))  # the session lives
    assert not is_cut(ValueError("not a driver error"))
    assert is_lost(_lost())
    assert is_lost(OperationalError("SELECT 1", {}, shutdown))
    assert not is_lost(ProgrammingError("SELECT 1", {}, Exception("syntax")))
    assert not is_lost(ConnectionResetError("not a statement's error"))


def test_a_statement_cut_under_it_runs_again_and_nothing_else_does() -> None:
    calls: list[int] = []
    slept: list[float] = []

    def twice_cut() -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise _lost()
        return "ran"

    assert retry_lost(twice_cut, sleep=slept.append) == "ran"
    assert len(calls) == 3 and len(slept) == 2 and all(0 <= s <= 1.0 for s in slept)

    def refused() -> None:
        calls.append(1)
        raise ProgrammingError("SELECT 1", {}, Exception("syntax"))

    calls.clear()
    with pytest.raises(ProgrammingError):
        retry_lost(refused, sleep=slept.append)
    assert len(calls) == 1  # a bad statement is not run again


def test_a_cut_that_lasts_past_the_patience_goes_to_the_caller() -> None:
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def always_cut() -> None:
        raise _lost()

    with pytest.raises(OperationalError):
        retry_lost(always_cut, patience=0.0, sleep=sleep)


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    watch = ConnectionWatch(
        logging.getLogger("outbox.test"), "database", "job store", clock=lambda: now[0]
    )
    with caplog.at_level(logging.INFO, logger="outbox.test"):
        watch.back()  # nothing was lost: nothing to say
        for _ in range(5):
            watch.lost(_lost())
        now[0] += 2.5
        watch.back()
        watch.back()
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "database connection lost; retrying on new connections",
        "database connection back",
    ]
    assert caplog.records[1].fields == {  # type: ignore[attr-defined]
        "service": "database",
        "at": "job store",
        "lost_seconds": 2.5,
        "cut": 5,
    }
    assert watch.outages == 1 and not watch.down


def test_the_dispatch_statements_outlive_their_backends(
    pg_url: str, pg_schema: str, pg_admin_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The dispatch path's statements, sent on the DBAPI connection itself: before issue 53,
    a cut there raised psycopg's own error, which no loop waits out (the worker exited), and
    left the dead connection in the pool."""
    name = f"lost-{pg_schema}"
    store = Store(f"{pg_url}&application_name={name}")
    driver = store.driver
    job = store.enqueue("t", "a-1")
    lease = store.claim_batch("w", 1, 30.0)[0]
    assert lease.job_id == job.job_id
    intent = {
        "job_id": lease.job_id,
        "provider": "p",
        "digest": "d",
        "timeout": 5.0,
        "worker": "w",
        "epoch": lease.epoch,
    }
    with caplog.at_level(logging.WARNING, logger="outbox.worker"):
        assert driver.operation_intent(operation_id="op-1", **intent) == "created"
        assert _terminate(pg_admin_engine, name) >= 1
        # Each runs again on a new connection, and says what it would have said.
        assert driver.operation_record("op-1", {"state": "ACCEPTED", "provider_ref": "r"})
        assert _terminate(pg_admin_engine, name) >= 1
        assert driver.operation_intent(operation_id="op-1", **intent) == "exists"
        assert _terminate(pg_admin_engine, name) >= 1
        assert driver.provider_pause("p") is None
        assert _terminate(pg_admin_engine, name) >= 1
        # A transaction of the store's: the cut fails it as SQLAlchemy's error, and the
        # next one runs on a new connection.
        with pytest.raises(DBAPIError) as failed:
            store.get(job.job_id)
        assert is_lost(failed.value)
        assert store.get(job.job_id).state == "LEASED"
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("database connection lost; retrying on new connections") == 4
    assert messages.count("database connection back") == 4
    store.dispose()
