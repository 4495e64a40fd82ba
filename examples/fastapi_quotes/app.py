"""The HTTP side: quotes created and approved over HTTP, events through AsyncOutbox.

    POST /quotes                 {"tenant": "studio", "total": 120}  -> {"id": 1, ...}
    POST /quotes/{id}/approve    state change + "quote.approved" event, one transaction
    GET  /quotes/{id}            the quote, and the "send the quote" job once billing made it

Settings come from the environment (run.py sets them): QUOTES_DATABASE_URL (default: the
SQLite file outbox.db in the working directory).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, select, update

from consumer import Store
from consumer.errors import JobNotFound
from outbox import AsyncOutbox, AsyncTransaction, default_database_url, write_locked

DATABASE_URL = os.environ.get("QUOTES_DATABASE_URL") or default_database_url()

domain = MetaData()
quotes = Table(
    "quotes",
    domain,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tenant", String(50), nullable=False),
    Column("total", Integer, nullable=False),
    Column("state", String(20), nullable=False),
)

aoutbox = AsyncOutbox(DATABASE_URL)
jobs: Store | None = None  # read-only here: GET shows the job billing created


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    global jobs
    await aoutbox.create_schema()
    # The relay and billing may create their tables in the same SQLite file at this moment.
    async with write_locked(aoutbox.engine).begin() as conn:
        await conn.run_sync(domain.create_all)
    jobs = await asyncio.to_thread(Store, DATABASE_URL)
    yield
    await aoutbox.dispose()
    jobs.dispose()


app = FastAPI(title="quotes", lifespan=lifespan)


class NewQuote(BaseModel):
    tenant: str = Field(min_length=1, max_length=50)
    total: int = Field(ge=0)


@app.post("/quotes", status_code=201)
async def create_quote(body: NewQuote) -> dict[str, Any]:
    async with aoutbox.transaction() as tx:
        result = await tx.session.execute(
            insert(quotes)
            .values(tenant=body.tenant, total=body.total, state="draft")
            .returning(quotes.c.id)
        )
        quote_id = int(result.scalar_one())
    return {"id": quote_id, "tenant": body.tenant, "total": body.total, "state": "draft"}


@aoutbox.transactional
async def approve_quote(tx: AsyncTransaction, quote_id: int) -> dict[str, Any]:
    """The domain transaction: the state change and its event commit together or not at all
    (an HTTPException raised here rolls both back)."""
    row = (
        await tx.session.execute(
            update(quotes)
            .where(quotes.c.id == quote_id, quotes.c.state == "draft")
            .values(state="approved")
            .returning(quotes.c.tenant, quotes.c.total)
        )
    ).first()
    if row is None:
        exists = (
            await tx.session.execute(select(quotes.c.state).where(quotes.c.id == quote_id))
        ).scalar()
        if exists is None:
            raise HTTPException(404, f"no quote {quote_id}")
        raise HTTPException(409, f"quote {quote_id} is {exists}, not draft")
    event_id = tx.emit(
        "quote.approved",
        key=f"quote-{quote_id}",
        payload={"quote": quote_id, "total": row.total, "currency": "EUR"},
        tenant=row.tenant,
        identity=f"{row.tenant}:send-quote-{quote_id}",
    )
    return {"id": quote_id, "state": "approved", "event_id": event_id}


@app.post("/quotes/{quote_id}/approve")
async def approve(quote_id: int) -> dict[str, Any]:
    return await approve_quote(quote_id)


@app.get("/quotes/{quote_id}")
async def get_quote(quote_id: int) -> dict[str, Any]:
    async with aoutbox.engine.connect() as conn:
        row = (await conn.execute(select(quotes).where(quotes.c.id == quote_id))).first()
    if row is None:
        raise HTTPException(404, f"no quote {quote_id}")
    job: dict[str, Any] | None = None
    assert jobs is not None
    try:
        found = await asyncio.to_thread(jobs.get, row.tenant, f"send-quote-{quote_id}")
        job = {"id": found.id, "state": found.state, "action": found.action}
    except JobNotFound:
        pass
    return {"id": row.id, "tenant": row.tenant, "total": row.total, "state": row.state, "job": job}
