"""Issue 60: the worker says when the vacuum horizon is pinned.

A real transaction is held open on a private PostgreSQL (so the shared server's other tests
are not pinned by it): REPEATABLE READ, one read, then idle in transaction. Observed: who
``outbox.horizon`` names as the holder, the worker's vacuum (its warning naming the backend,
its not vacuuming again in vain, its line when the horizon moves), and the exporter's gauges.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from consumer.jobs.schema import JOBS_TABLE
from consumer.jobs.store import Store
from consumer.jobs.worker import Worker
from metrics import DatabaseCollector
from outbox.db import make_engine
from outbox.horizon import HorizonWatch, horizon_holder
from tests.services import PrivatePostgres, wait_for

pytestmark = pytest.mark.slow

HOLDER = "nightly-report"


@pytest.fixture(scope="module")
def server() -> Iterator[PrivatePostgres]:
    # autovacuum off: only the vacuums under test run. Prepared transactions allowed.
    with PrivatePostgres(settings=["autovacuum=off", "max_prepared_transactions=4"]) as pg:
        yield pg


@pytest.fixture
def engine(server: PrivatePostgres) -> Iterator[sa.Engine]:
    schema = f"h_{id(server) % 10_000}_{abs(hash(object())) % 10**8}"
    admin = sa.create_engine(server.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine = make_engine(server.url_for_schema(schema))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def libpq(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def hold(server: PrivatePostgres) -> psycopg.Connection[tuple[object, ...]]:
    """A transaction left idle after one read, as a report or a forgotten session does."""
    conn = psycopg.connect(libpq(server.url), application_name=HOLDER)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.execute("SELECT count(*) FROM pg_class").fetchone()
    return conn


def pid_of(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    return int(conn.info.backend_pid)


def dead_tuples(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
        found = conn.execute(
            sa.text(
                "SELECT n_dead_tup FROM pg_stat_user_tables "
                "WHERE schemaname = current_schema() AND relname = :t"
            ),
            {"t": JOBS_TABLE},
        ).scalar_one()
    return int(found)


def vacuum_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT vacuum_count FROM pg_stat_user_tables "
                    "WHERE schemaname = current_schema() AND relname = :t"
                ),
                {"t": JOBS_TABLE},
            ).scalar_one()
        )


def finish_by_hand(engine: sa.Engine, where: str) -> None:
    """Mark jobs DONE: each leaves a dead tuple behind."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {JOBS_TABLE} SET state = 'DONE' WHERE {where}"))


def test_the_holder_is_the_session_idle_in_transaction(server: PrivatePostgres) -> None:
    with psycopg.connect(libpq(server.url), autocommit=True) as observer:
        held = hold(server)
        try:
            with psycopg.connect(libpq(server.url), autocommit=True) as writer:
                writer.execute("SELECT txid_current()")  # transactions go by after it began
            found = horizon_holder(observer)
            assert found is not None
            assert (found.kind, found.pid, found.name) == ("backend", pid_of(held), HOLDER)
            assert found.state == "idle in transaction"
            assert found.age_seconds is not None and found.age_seconds >= 0
            assert found.xid_age >= 1
            assert found.fields()["application_name"] == HOLDER
        finally:
            held.commit()
            held.close()
        after = horizon_holder(observer)
        assert after is None or after.pid != pid_of(held)


def test_a_prepared_transaction_nobody_committed_holds_it(server: PrivatePostgres) -> None:
    with psycopg.connect(libpq(server.url), autocommit=True) as observer:
        observer.execute("CREATE TABLE IF NOT EXISTS prepared_probe (n int)")
        prepared = psycopg.connect(libpq(server.url))
        try:
            prepared.execute("INSERT INTO prepared_probe VALUES (1)")
            prepared.execute("PREPARE TRANSACTION 'forgotten-2pc'")
            prepared.close()
            with psycopg.connect(libpq(server.url), autocommit=True) as writer:
                writer.execute("SELECT txid_current()")
            found = horizon_holder(observer)
            assert found is not None
            assert (found.kind, found.pid, found.name, found.state) == (
                "prepared",
                None,
                "forgotten-2pc",
                "prepared",
            )
        finally:
            observer.execute("COMMIT PREPARED 'forgotten-2pc'")
        after = horizon_holder(observer)
        assert after is None or after.kind != "prepared"


def test_the_worker_vacuum_names_the_holder_and_stops_vacuuming_in_vain(
    server: PrivatePostgres, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """6,000 jobs finish while a transaction holds the horizon: the worker's catch-up look
    vacuums the job table, which stays past its threshold (5,000 dead rows it could not
    remove); a warning names the backend. The next look leaves the table alone while the
    same transaction holds it. Once it commits, a vacuum removes the rows, and says so."""
    store = Store(engine)
    store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(6000)])
    worker = Worker(store)
    vacuum = worker.vacuum
    assert vacuum is not None
    held = hold(server)
    try:
        finish_by_hand(engine, "true")
        wait_for(lambda: dead_tuples(engine) >= 6000, "the dead tuples counted")
        count = vacuum_count(engine)
        with caplog.at_level(logging.INFO, logger="outbox.maintenance"):
            done = vacuum.run_catch_up()
        assert done is not None and any(JOBS_TABLE in t for t in done)
        assert vacuum_count(engine) == count + 1
        assert dead_tuples(engine) >= 6000  # none of them could go
        warnings = [r for r in caplog.records if "cannot keep up" in r.getMessage()]
        assert len(warnings) == 1
        logged = warnings[0].__dict__["fields"]
        assert logged["pid"] == pid_of(held)
        assert logged["application_name"] == HOLDER
        assert logged["state"] == "idle in transaction"
        assert logged["holder"] == "backend" and logged["age_seconds"] >= 0
        assert any(JOBS_TABLE in t for t in logged["tables"])
        assert vacuum.horizon.holder is not None and vacuum.horizon.holder.pid == pid_of(held)
        # The same transaction still holds it: the next look does not vacuum in vain.
        assert vacuum.run_catch_up() == {}
        assert vacuum_count(engine) == count + 1
    finally:
        held.commit()
        held.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="outbox.maintenance"):
        done = vacuum.run_catch_up()
    assert done is not None and any(JOBS_TABLE in t for t in done)
    assert dead_tuples(engine) < 5000
    assert vacuum.horizon.pinned == {}
    assert any("removes dead rows again" in r.getMessage() for r in caplog.records)
    assert not any("cannot keep up" in r.getMessage() for r in caplog.records)


def test_the_exporter_shows_the_oldest_transaction_age(
    server: PrivatePostgres, engine: sa.Engine
) -> None:
    """``outbox_jobs_horizon_age_seconds`` and ``..._xid_age`` where a job table is: the
    held transaction's age while it is open, 0 once nothing holds a snapshot."""
    Store(engine)  # the job tables
    collector = DatabaseCollector(engine, cache_seconds=0)
    registry = CollectorRegistry()
    registry.register(collector)

    def gauges() -> tuple[float | None, float | None]:
        collector.invalidate()
        return (
            registry.get_sample_value("outbox_jobs_horizon_age_seconds"),
            registry.get_sample_value("outbox_jobs_horizon_xid_age"),
        )

    assert registry.get_sample_value("outbox_metrics_source_up", {"source": "horizon"}) in (
        None,
        1.0,
    )
    held = hold(server)
    try:
        with psycopg.connect(libpq(server.url), autocommit=True) as writer:
            writer.execute("SELECT txid_current()")
        age, xids = gauges()
        with psycopg.connect(libpq(server.url), autocommit=True) as observer:
            since = observer.execute(
                "SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 "
                "FROM pg_stat_activity WHERE pid = %s",
                (pid_of(held),),
            ).fetchone()
        assert since is not None
        assert age is not None and 0 < age <= float(since[0])
        assert xids is not None and xids >= 1
        assert registry.get_sample_value("outbox_metrics_source_up", {"source": "horizon"}) == 1
    finally:
        held.commit()
        held.close()
    engine.dispose()  # no pooled session of the test's own in a transaction
    assert gauges() == (0.0, 0.0)


def test_a_holder_nobody_can_see_is_reported_once_a_minute(
    server: PrivatePostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """A table stays past its threshold but no session visible to this role holds a snapshot
    (another role's session, without pg_read_all_stats): the warning says so and how to see
    it, once per ``repeat``, however often the vacuum looks; never a skipped vacuum."""
    now = [1000.0]
    watch = HorizonWatch(
        "job tables",
        lambda conn, table: True,
        logging.getLogger("test.horizon"),
        repeat=60.0,
        clock=lambda: now[0],
    )
    with psycopg.connect(libpq(server.url), autocommit=True) as conn:
        assert horizon_holder(conn) is None
        with caplog.at_level(logging.WARNING, logger="test.horizon"):
            for _ in range(5):
                watch.after_vacuum(conn, {"outbox_jobs": 0.01})
                assert not watch.skip(conn, "outbox_jobs")
                now[0] += 5.0
            assert len(caplog.records) == 1
            logged = caplog.records[0].__dict__["fields"]
            assert logged["holder"] == "unknown" and "pg_read_all_stats" in logged["hint"]
            now[0] += 60.0
            watch.after_vacuum(conn, {"outbox_jobs": 0.01})
            assert len(caplog.records) == 2
