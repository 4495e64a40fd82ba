"""The Alembic recipe (README, outbox.migrations) in a real Alembic environment against a
fresh PostgreSQL database: autogenerate + upgrade makes exactly what create_schema() makes.

Two databases are created on the shared server for the test (unique names, dropped after):
one migrated by Alembic from an environment generated in tmp_path (``alembic init``, then the
recipe's env.py), one made by the parts' own ``create_schema()``. Their catalogs are compared:
tables, columns, constraints, every index definition (partial predicates included), storage
parameters and triggers. A second autogenerate (``alembic check``) must find nothing to do.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from consumer import Store
from consumer.inbox import build_inbox_schema, create_inbox_schema
from outbox import Outbox
from tests.conftest import PG_BASE

ENV_PY = """
from alembic import context
from sqlalchemy import create_engine

# The recipe (README "Alembic"): every part's tables in target_metadata.
from consumer.inbox import build_inbox_schema
from consumer.jobs.schema import metadata as jobs_metadata
from outbox import build_schema

target_metadata = [
    build_schema().metadata,
    build_inbox_schema().metadata,
    jobs_metadata,
]

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


def database_url(name: str) -> str:
    return sa.make_url(PG_BASE).set(database=name).render_as_string(hide_password=False)


@pytest.fixture
def fresh_databases(pg_admin_engine: sa.Engine) -> Iterator[tuple[str, str]]:
    names = [f"alembic_{uuid.uuid4().hex[:10]}", f"reference_{uuid.uuid4().hex[:10]}"]
    with pg_admin_engine.connect() as conn:
        for name in names:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield database_url(names[0]), database_url(names[1])
    with pg_admin_engine.connect() as conn:
        for name in names:
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"
                ),
                {"d": name},
            )
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}"'))


def catalog(url: str) -> dict[str, Any]:
    """What the comparison looks at, from PostgreSQL's catalogs (schema public)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:

            def rows(sql: str) -> list[tuple[Any, ...]]:
                return sorted(tuple(r) for r in conn.execute(sa.text(sql)))

            return {
                "tables": rows(
                    "SELECT relname, coalesce(reloptions, '{}')::text FROM pg_class "
                    "WHERE relnamespace = 'public'::regnamespace AND relkind = 'r' "
                    "AND relname <> 'alembic_version'"
                ),
                "columns": rows(
                    "SELECT table_name, column_name, data_type, character_maximum_length, "
                    "is_nullable, column_default FROM information_schema.columns "
                    "WHERE table_schema = 'public' AND table_name <> 'alembic_version'"
                ),
                "constraints": rows(
                    "SELECT conrelid::regclass::text, conname, contype, "
                    "pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE connamespace = 'public'::regnamespace "
                    "AND conrelid <> coalesce(to_regclass('alembic_version'), 0)"
                ),
                "indexes": rows(
                    "SELECT tablename, indexname, indexdef FROM pg_indexes "
                    "WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
                ),
                "triggers": rows(
                    "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) "
                    "FROM pg_trigger WHERE NOT tgisinternal"
                ),
                "functions": rows(
                    "SELECT proname, pg_get_functiondef(oid) FROM pg_proc "
                    "WHERE pronamespace = 'public'::regnamespace"
                ),
            }
    finally:
        engine.dispose()


@pytest.mark.slow  # alembic autogenerate on both databases (~15 s under load)
def test_autogenerate_then_upgrade_makes_what_create_schema_makes(
    tmp_path: Path, fresh_databases: tuple[str, str]
) -> None:
    migrated_url, reference_url = fresh_databases

    # The reference: each part's own create_schema().
    box = Outbox(reference_url)
    box.create_schema()
    box.engine.dispose()
    engine = sa.create_engine(reference_url)
    create_inbox_schema(engine, build_inbox_schema())
    engine.dispose()
    Store(reference_url).dispose()

    # A real Alembic environment, generated and then given the recipe's env.py.
    directory = tmp_path / "migrations"
    config = Config(str(tmp_path / "alembic.ini"))
    config.set_main_option("script_location", str(directory))
    config.set_main_option("sqlalchemy.url", migrated_url)
    command.init(config, str(directory))
    (directory / "env.py").write_text(ENV_PY)

    command.revision(config, message="outbox tables", autogenerate=True)
    [revision] = list((directory / "versions").glob("*.py"))
    source = revision.read_text()
    assert "postgresql_where" in source  # the partial indexes are autogenerated
    # The documented manual step: one line at the end of upgrade() for the extras.
    marker = "    # ### end Alembic commands ###"
    upgrade_end = source.index(marker)
    source = (
        "from outbox.migrations import create_extras, drop_extras\n"
        "from consumer.jobs.migrations import create_job_extras, drop_job_extras\n"
        + source[:upgrade_end]
        + "    create_extras(op)\n"
        + "    create_job_extras(op)\n"
        + source[upgrade_end:]
    )
    downgrade = source.index("def downgrade()")
    first_command = source.index("    # ### commands auto generated", downgrade)
    source = (
        source[:first_command]
        + "    drop_extras(op)\n    drop_job_extras(op)\n"
        + source[first_command:]
    )
    revision.write_text(source)
    command.upgrade(config, "head")

    migrated, reference = catalog(migrated_url), catalog(reference_url)
    for part in reference:
        assert migrated[part] == reference[part], part
    table_names = {name for name, _ in reference["tables"]}
    assert {"outbox_events", "outbox_jobs", "outbox_operations"} <= table_names
    assert any("autovacuum_vacuum_threshold" in options for _, options in reference["tables"])
    assert reference["triggers"] == []  # no NOTIFY trigger by default (issue 25)
    partial = [name for _, name, definition in reference["indexes"] if " WHERE " in definition]
    assert "ix_outbox_events_pending" in partial and "ix_outbox_jobs_ready" in partial
    assert "outbox_jobs_tenant_room" in [name for name, _ in reference["functions"]]

    # A second autogenerate finds no differences (raises if it finds any).
    command.check(config)

    # And the downgrade undoes it all.
    command.downgrade(config, "base")
    assert catalog(migrated_url)["tables"] == []
    assert catalog(migrated_url)["triggers"] == []
    assert catalog(migrated_url)["functions"] == []


def test_the_migration_extras_know_every_hot_table() -> None:
    """outbox.migrations cannot import the consumer side, so it names the hot tables; they
    must stay the ones the inbox and the job store tune in their create_schema."""
    from consumer.inbox import build_inbox_schema
    from consumer.jobs.schema import HOT_TABLES as JOB_HOT_TABLES
    from outbox.migrations import HOT_TABLES

    assert set(HOT_TABLES) == {build_inbox_schema().inbox.name, *JOB_HOT_TABLES}


@pytest.mark.slow  # alembic autogenerate (~9 s under load)
def test_a_database_migrated_before_tracing_gets_the_trace_context_column_by_autogenerate(
    tmp_path: Path, fresh_databases: tuple[str, str]
) -> None:
    """The recipe for existing databases (issue 23): ``outbox_jobs.trace_context`` is a plain
    nullable column, so the next ``alembic revision --autogenerate`` adds it."""
    migrated_url, _ = fresh_databases
    directory = tmp_path / "migrations"
    config = Config(str(tmp_path / "alembic.ini"))
    config.set_main_option("script_location", str(directory))
    config.set_main_option("sqlalchemy.url", migrated_url)
    command.init(config, str(directory))
    (directory / "env.py").write_text(ENV_PY)
    command.revision(config, message="outbox tables", autogenerate=True)
    command.upgrade(config, "head")
    engine = sa.create_engine(migrated_url)
    try:
        with engine.begin() as conn:  # the table as it was before the column existed
            conn.execute(sa.text("ALTER TABLE outbox_jobs DROP COLUMN trace_context"))
        command.revision(config, message="trace context", autogenerate=True)
        [added] = [
            path
            for path in (directory / "versions").glob("*.py")
            if "trace context" in path.read_text()
        ]
        source = added.read_text()
        assert "op.add_column('outbox_jobs', sa.Column('trace_context'" in source
        command.upgrade(config, "head")
        columns = {c["name"] for c in sa.inspect(engine).get_columns("outbox_jobs")}
        assert "trace_context" in columns
        command.check(config)  # nothing left to migrate
    finally:
        engine.dispose()


def test_create_job_extras_upgrades_a_job_table_made_before_queues(
    fresh_databases: tuple[str, str],
) -> None:
    """The Alembic recipe on a database made before queues: ``create_job_extras(op)`` in a
    migration gives the job table what ``create_schema()`` makes today (the queue column, the
    READY index leading with it, the tenant-limit index and function, the paused table)."""
    from alembic.migration import MigrationContext
    from alembic.operations import Operations

    from consumer.jobs.migrations import create_job_extras
    from tests.test_queues import make_old_jobs_table

    old_url, reference_url = fresh_databases
    Store(reference_url).dispose()
    engine = sa.create_engine(old_url)
    make_old_jobs_table(engine)
    with engine.begin() as conn:
        create_job_extras(Operations(MigrationContext.configure(conn)))
    engine.dispose()
    migrated, reference = catalog(old_url), catalog(reference_url)

    def upgraded(found: dict[str, Any]) -> list[tuple[Any, ...]]:
        names = ("ix_outbox_jobs_ready", "ix_outbox_jobs_leased_tenant")
        return [row for row in found["indexes"] if row[1] in names]

    assert len(upgraded(reference)) == 2
    assert upgraded(migrated) == upgraded(reference)
    queue = [row for row in migrated["columns"] if row[:2] == ("outbox_jobs", "queue")]
    assert queue == [row for row in reference["columns"] if row[:2] == ("outbox_jobs", "queue")]
    assert migrated["functions"] == reference["functions"]
    assert "outbox_paused_queues" in [name for name, _ in migrated["tables"]]
    store = Store(old_url, create_schema=False)
    assert store.depth()["default"].ready == 3
    assert len(store.claim_batch("w", 10, tenant_limit=1)) == 1
    store.dispose()
