"""Vacuum for every hot table (issue 10): per-table autovacuum settings from each part's
create_schema, and a vacuum by the process itself exactly when autovacuum will not run.

The shared server runs with ``autovacuum = off``; the on/off cases each start a private
PostgreSQL with the setting given explicitly, so the tests do not depend on how the shared
server is configured. What is observed is the server's own record of manual vacuums
(``pg_stat_user_tables.vacuum_count``), not the helper's word.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from consumer.inbox import INBOX_TABLE, build_inbox_schema, create_inbox_schema
from consumer.jobs.duties import VACUUM_CATCH_UP
from consumer.jobs.schema import HOT_TABLES, JOBS_TABLE
from consumer.jobs.store import Store
from consumer.jobs.upgrades import create_schema as create_job_schema
from consumer.jobs.worker import Worker
from outbox.db import make_engine
from outbox.maintenance import (
    HOT_TABLE_AUTOVACUUM,
    PeriodicVacuum,
    psycopg_connector,
    quoted_table,
)
from tests.services import PrivatePostgres, wait_for

pytestmark = pytest.mark.slow


def vacuum_counts(engine: sa.Engine, tables: tuple[str, ...]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT relname, vacuum_count FROM pg_stat_user_tables "
                "WHERE schemaname = current_schema() AND relname = ANY(:t)"
            ),
            {"t": list(tables)},
        ).all()
    return {str(name): int(count) for name, count in rows}


def reloptions(engine: sa.Engine, table: str) -> dict[str, str]:
    with engine.connect() as conn:
        options = conn.execute(
            sa.text("SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = to_regclass(:t)"),
            {"t": table},
        ).scalar()
    return dict(str(o).split("=", 1) for o in (options or []))


@pytest.fixture(params=["off", "on"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, sa.Engine]]:
    with PrivatePostgres(settings=[f"autovacuum={request.param}"]) as pg:
        engine = make_engine(pg.url)
        try:
            yield request.param, engine
        finally:
            engine.dispose()


def test_the_worker_vacuums_the_job_tables_only_when_autovacuum_is_off(
    server: tuple[str, sa.Engine],
) -> None:
    autovacuum, engine = server
    create_job_schema(engine)
    before = vacuum_counts(engine, HOT_TABLES)
    assert set(before) == set(HOT_TABLES)

    worker = Worker(Store(engine), vacuum_interval=30.0)
    assert worker.vacuum is not None  # PostgreSQL: the worker has a vacuumer
    done = worker.vacuum.run_once()  # what the worker's loop starts every interval

    after = vacuum_counts(engine, HOT_TABLES)
    if autovacuum == "off":
        assert done is not None and set(done) == {quoted_table(t) for t in HOT_TABLES}
        assert all(after[t] == before[t] + 1 for t in HOT_TABLES), (before, after)
    else:
        assert done == {}
        assert after == before


def test_the_worker_loop_starts_the_vacuum_when_due(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        create_job_schema(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW autovacuum")).scalar() == "off"
        worker = Worker(Store(engine), vacuum_interval=0.001)
        assert worker.vacuum is not None
        before = vacuum_counts(engine, HOT_TABLES)
        worker.run_once()  # nothing to claim; the vacuum is due: it starts in the background
        worker.vacuum.join(60)
        after = vacuum_counts(engine, HOT_TABLES)
        assert after[JOBS_TABLE] == before[JOBS_TABLE] + 1
    finally:
        engine.dispose()


def test_a_table_opted_out_of_autovacuum_is_vacuumed_by_the_process() -> None:
    with PrivatePostgres(settings=["autovacuum=on"]) as pg:
        engine = make_engine(pg.url)
        try:
            create_job_schema(engine)
            with engine.begin() as conn:
                conn.execute(sa.text(f"ALTER TABLE {JOBS_TABLE} SET (autovacuum_enabled = false)"))
            vacuum = PeriodicVacuum(
                psycopg_connector(engine), [quoted_table(t) for t in HOT_TABLES]
            )
            assert vacuum.run_once() == {quoted_table(JOBS_TABLE): pytest.approx(0, abs=60)}
        finally:
            engine.dispose()


def test_create_schema_sets_the_autovacuum_settings_of_the_hot_tables(pg_url: str) -> None:
    engine = make_engine(pg_url)
    try:
        create_job_schema(engine)
        create_inbox_schema(engine, build_inbox_schema())
        for table in (*HOT_TABLES, INBOX_TABLE):
            options = reloptions(engine, table)
            for name, value in HOT_TABLE_AUTOVACUUM.items():
                assert options.get(name) == value, (table, options)
        # A value set by hand survives the next create_schema (it is set only when missing).
        with engine.begin() as conn:
            conn.execute(
                sa.text(f"ALTER TABLE {JOBS_TABLE} SET (autovacuum_vacuum_threshold = 123)")
            )
        create_job_schema(engine)
        assert reloptions(engine, JOBS_TABLE)["autovacuum_vacuum_threshold"] == "123"
    finally:
        engine.dispose()


def test_the_inbox_is_vacuumed_only_when_autovacuum_is_off(
    server: tuple[str, sa.Engine],
) -> None:
    autovacuum, engine = server
    create_inbox_schema(engine, build_inbox_schema())
    before = vacuum_counts(engine, (INBOX_TABLE,))
    vacuum = PeriodicVacuum.for_engine(engine, [quoted_table(INBOX_TABLE)])
    assert vacuum is not None
    vacuum.run_once()
    after = vacuum_counts(engine, (INBOX_TABLE,))
    expected = before[INBOX_TABLE] + (1 if autovacuum == "off" else 0)
    assert after[INBOX_TABLE] == expected


def test_the_consumer_vacuums_its_inbox_when_autovacuum_is_off(pg_url: str, redis_url: str) -> None:
    from consumer import Consumer

    engine = make_engine(pg_url)
    consumer = Consumer(engine, redis_url, group="vacuum-test", topics=["t"])
    try:
        consumer.create_schema()
        assert consumer.vacuum is not None  # PostgreSQL: the consumer has a vacuumer
        before = vacuum_counts(engine, (INBOX_TABLE,))
        consumer.vacuum.run_once()  # what its maintenance starts every interval
        after = vacuum_counts(engine, (INBOX_TABLE,))
        assert after[INBOX_TABLE] == before[INBOX_TABLE] + 1  # the shared server: autovacuum off
    finally:
        engine.dispose()


def dead_tuples(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT n_dead_tup FROM pg_stat_user_tables "
                    "WHERE schemaname = current_schema() AND relname = :t"
                ),
                {"t": table},
            ).scalar_one()
        )


def finish_by_hand(engine: sa.Engine, where: str, *, dead: int) -> None:
    """Mark the jobs ``where`` DONE (each leaves a dead tuple), then wait until the server's
    counts show ``dead`` dead tuples in all."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {JOBS_TABLE} SET state = 'DONE' WHERE {where}"))
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))
    wait_for(lambda: dead_tuples(engine, JOBS_TABLE) >= dead, "the dead tuples counted")


def test_the_worker_vacuums_a_job_table_autovacuum_has_not_come_to_yet() -> None:
    """Issue 44: autovacuum visits a database once per naptime (a minute by default; an hour
    here, so it never comes during the test). The worker looks every VACUUM_CATCH_UP seconds
    and vacuums a hot table whose dead tuples are past the table's own threshold (5,000), and
    leaves one below it alone."""
    with PrivatePostgres(settings=["autovacuum=on", "autovacuum_naptime=3600"]) as pg:
        engine = make_engine(pg.url)
        try:
            store = Store(engine)
            store.enqueue_many([{"tenant": "t", "action": f"a-{i}"} for i in range(6000)])
            worker = Worker(store)
            assert worker.vacuum is not None and worker.vacuum.catch_up == VACUUM_CATCH_UP
            tables = tuple(HOT_TABLES)
            finish_by_hand(engine, "id <= 4000", dead=4000)
            before = vacuum_counts(engine, tables)
            assert worker.vacuum.run_catch_up() == {}  # 4,000 dead: below the threshold
            finish_by_hand(engine, "id > 4000", dead=6000)
            catching_up = PeriodicVacuum(
                psycopg_connector(engine),
                [quoted_table(t) for t in tables],
                interval=3600,
                catch_up=0.001,
            )
            # A look is due within a millisecond; the interval's vacuum is an hour away.
            wait_for(catching_up.maybe_start, "a catch-up look started")
            catching_up.join(60)
            after = vacuum_counts(engine, tables)
            assert after[JOBS_TABLE] == before[JOBS_TABLE] + 1
            assert {t: after[t] for t in tables if t != JOBS_TABLE} == {
                t: before[t] for t in tables if t != JOBS_TABLE
            }
            assert dead_tuples(engine, JOBS_TABLE) < 6000
            # When the interval's vacuum is due at the same tick (it leaves every table to
            # autovacuum, which is on), the look still comes.
            finish_by_hand(engine, "true", dead=6000)
            both = PeriodicVacuum(
                psycopg_connector(engine),
                [quoted_table(t) for t in tables],
                interval=0.001,
                catch_up=0.001,
            )
            wait_for(both.maybe_start, "the interval's vacuum and a look started")
            both.join(60)
            assert both.last_result == {}  # the interval's round: autovacuum is on
            assert vacuum_counts(engine, tables)[JOBS_TABLE] == after[JOBS_TABLE] + 1
        finally:
            engine.dispose()
