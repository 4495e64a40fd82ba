"""NOTIFY channels are database-wide: each outbox table notifies, and each relay listens on,
a channel that names the table's schema, so outboxes in other schemas of one database (a
``search_path`` per tenant or per test) do not wake each other's relays."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from outbox import Outbox
from outbox.schema import table_schema_of
from tests.conftest import pg_url_for_schema


@pytest.fixture
def other_schema(pg_admin_engine: sa.Engine) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    yield name
    with pg_admin_engine.connect() as conn:
        conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))


def _listen(url: str, outbox: Outbox) -> psycopg.Connection:
    with outbox.engine.connect() as conn:
        channel = outbox.schema.notify_channel(table_schema_of(conn, outbox.schema))
    listener = psycopg.connect(
        url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )
    listener.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
    return listener


def _emit(outbox: Outbox) -> None:
    with outbox.transaction() as tx:
        tx.emit("t", key="k", payload={})


def test_an_outbox_in_another_schema_does_not_wake_this_one(
    pg_url: str, pg_schema: str, other_schema: str
) -> None:
    mine = Outbox(pg_url)
    mine.create_schema(notify=True)
    theirs = Outbox(pg_url_for_schema(other_schema))
    theirs.create_schema(notify=True)
    listener = _listen(pg_url, mine)
    try:
        _emit(theirs)
        assert list(listener.notifies(timeout=0.5)) == []
        _emit(mine)
        notes = list(listener.notifies(timeout=2, stop_after=1))
        assert [n.channel for n in notes] == [f"outbox_events_new.{pg_schema}"]
    finally:
        listener.close()
        mine.engine.dispose()
        theirs.engine.dispose()


def test_a_trigger_made_by_an_earlier_version_is_brought_up_to_date(pg_url: str) -> None:
    outbox = Outbox(pg_url)
    outbox.create_schema(notify=True)  # a table made with the trigger (init-db --notify)
    with outbox.engine.begin() as conn:  # the body an earlier version wrote: one fixed channel
        conn.execute(
            sa.text(
                'CREATE OR REPLACE FUNCTION "outbox_events_notify"() RETURNS trigger '
                "LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('outbox_events_new', ''); "
                "RETURN NULL; END $$"
            )
        )
    outbox.create_schema()  # what every relay start runs: the choice kept, the body renewed
    listener = _listen(pg_url, outbox)
    try:
        _emit(outbox)
        assert len(list(listener.notifies(timeout=2, stop_after=1))) == 1
    finally:
        listener.close()
        outbox.engine.dispose()
