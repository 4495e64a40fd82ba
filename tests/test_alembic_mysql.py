"""The Alembic recipe on MariaDB/MySQL (issue 58; docs/how-to/mysql.md "Indexes"):
autogenerate with ``include_object_for(connection)``, then the documented steps (import
``Text``, add ``create_extras(op)``), then upgrade makes what the parts' own
``create_schema()`` make: the same tables, columns and indexes. A second autogenerate finds
nothing to do, and the downgrade (``drop_extras(op)`` first) leaves no table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from consumer.inbox import build_inbox_schema, create_inbox_schema
from outbox import Outbox

ENV_PY = """
from alembic import context
from sqlalchemy import create_engine

from consumer.inbox import build_inbox_schema
from outbox import build_schema
from outbox import include_object_for

# A MySQL service's recipe: the outbox and the inbox (its jobs live in PostgreSQL or SQLite).
target_metadata = [build_schema().metadata, build_inbox_schema().metadata]

engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=include_object_for(connection),
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

PARTIAL = ("ix_outbox_events_pending", "ix_outbox_events_quarantined", "ix_outbox_events_blocked")


def catalog(url: str) -> dict[str, Any]:
    """Tables, columns and indexes from information_schema (this database only)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:

            def rows(sql: str) -> list[tuple[Any, ...]]:
                return sorted(tuple(r) for r in conn.execute(sa.text(sql)))

            where = "table_schema = DATABASE() AND table_name <> 'alembic_version'"
            return {
                "tables": rows(f"SELECT table_name FROM information_schema.tables WHERE {where}"),
                "columns": rows(
                    "SELECT table_name, column_name, column_type, is_nullable, column_default "
                    f"FROM information_schema.columns WHERE {where}"
                ),
                "indexes": rows(
                    "SELECT table_name, index_name, non_unique, seq_in_index, column_name "
                    f"FROM information_schema.statistics WHERE {where}"
                ),
            }
    finally:
        engine.dispose()


@pytest.mark.slow  # alembic autogenerate against MariaDB
def test_the_mysql_recipe_makes_what_create_schema_makes(
    tmp_path: Path, mysql_admin_engine: sa.Engine, mysql_url: str
) -> None:
    reference_url = mysql_url.rsplit("/", 1)[0] + "/" + mysql_url.rsplit("/", 1)[1] + "_ref"
    name = reference_url.rsplit("/", 1)[1]
    with mysql_admin_engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        box = Outbox(reference_url)
        box.create_schema()
        create_inbox_schema(box.engine, build_inbox_schema())
        box.engine.dispose()

        directory = tmp_path / "migrations"
        config = Config(str(tmp_path / "alembic.ini"))
        config.set_main_option("script_location", str(directory))
        config.set_main_option("sqlalchemy.url", mysql_url)
        command.init(config, str(directory))
        (directory / "env.py").write_text(ENV_PY)
        command.revision(config, message="outbox tables", autogenerate=True)
        [revision] = list((directory / "versions").glob("*.py"))
        source = revision.read_text()
        for index in PARTIAL:  # include_object_for: no partial index written on MySQL
            assert index not in source, index
        # The documented step: create_extras(op) ends upgrade(), drop_extras(op) starts downgrade().
        marker = "    # ### end Alembic commands ###"
        end = source.index(marker)
        source = "from outbox.migrations import create_extras, drop_extras\n" + (
            source[:end] + "    create_extras(op)\n" + source[end:]
        )
        downgrade = source.index("def downgrade()")
        first = source.index("    # ### commands auto generated", downgrade)
        source = source[:first] + "    drop_extras(op)\n" + source[first:]
        # Alembic renders the JSON columns' PostgreSQL variant with a bare Text(): the
        # documented import.
        source = "from sqlalchemy import Text\n" + source
        revision.write_text(source)
        command.upgrade(config, "head")

        migrated, reference = catalog(mysql_url), catalog(reference_url)
        for part in reference:
            assert migrated[part] == reference[part], part
        indexes = {(t, i) for t, i, *_ in reference["indexes"]}
        assert ("outbox_events", "ix_outbox_events_state_seq") in indexes
        assert ("outbox_events", "ix_outbox_events_key_state") in indexes

        command.check(config)  # a second autogenerate finds nothing to do (raises if it does)

        command.downgrade(config, "base")
        assert catalog(mysql_url)["tables"] == []
    finally:
        with mysql_admin_engine.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
