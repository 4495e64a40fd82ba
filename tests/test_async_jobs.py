"""Async handlers enqueue jobs in their own transaction (consumer.jobs.aio), on PostgreSQL
and SQLite: the job commits or rolls back with the state change and the events."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa

from consumer import Store
from consumer.errors import JobNotFound
from consumer.jobs.aio import enqueue_async, enqueue_many_async
from outbox import AsyncOutbox


class Boom(Exception):
    pass


def test_job_event_and_state_change_commit_or_roll_back_together(db_url: str) -> None:
    store = Store(db_url)

    async def scenario() -> tuple[bool, bool, list[bool]]:
        box = AsyncOutbox(db_url)
        await box.create_schema()
        async with box.transaction() as tx:
            tx.emit("quote.approved", key="quote-017", payload={"total": 120})
            first = await enqueue_async(store, tx.session, "studio", "send-quote-017")
        with pytest.raises(Boom):
            async with box.transaction() as tx:
                tx.emit("quote.approved", key="quote-018", payload={})
                await enqueue_async(store, tx.session, "studio", "send-quote-018")
                raise Boom
        async with box.engine.begin() as conn:  # an AsyncConnection joins too
            again = await enqueue_async(store, conn, "studio", "send-quote-017")
            many = await enqueue_many_async(
                store,
                conn,
                [
                    {"tenant": "studio", "action": f"line-{i}", "payload": {"i": i}}
                    for i in range(3)
                ],
            )
        async with box.engine.connect() as conn:
            events = (await conn.execute(sa.select(box.table.c.key))).scalars().all()
        await box.dispose()
        assert events == ["quote-017"]
        return first.duplicate, again.duplicate, [r.duplicate for r in many]

    try:
        assert asyncio.run(scenario()) == (False, True, [False, False, False])
        assert store.get("studio", "send-quote-017").action == "send-quote-017"
        with pytest.raises(JobNotFound):
            store.get("studio", "send-quote-018")
        assert store.get("studio", "line-2").payload == {"i": 2}
    finally:
        store.dispose()


def test_enqueue_async_needs_an_async_session(sqlite_url: str) -> None:
    store = Store(sqlite_url)
    with pytest.raises(TypeError, match="AsyncSession"):
        asyncio.run(enqueue_async(store, store.engine, "t", "a"))  # type: ignore[arg-type]
    store.dispose()
