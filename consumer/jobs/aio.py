"""Enqueueing jobs from async code, in the caller's ``AsyncSession`` transaction.

    from consumer.jobs.aio import enqueue_async

    async with aoutbox.transaction() as tx:
        await tx.session.execute(...)                       # the state change
        result = await enqueue_async(store, tx.session, "studio", "send-quote-017")

Why two functions and not an ``AsyncStore``: an async handler needs one thing from the job
store, to create jobs inside the transaction it already holds (the claim, lease and recovery
loops belong to workers, which are threads). ``AsyncSession.run_sync`` hands
:meth:`Store.enqueue` the sync Session behind the caller's AsyncSession (or the Connection
behind an AsyncConnection), so validation, deduplication on ``(tenant, action)``, the
dialect's INSERT and ``EnqueueResult`` are the Store's own code, run once; an AsyncStore
would have to mirror the whole Store API (a sync/async twin kept in step by hand) to offer the same.

The ``Store`` is built as usual (``Store(url)``, sync; it is only asked for its SQL here and
never opens a connection of its own in these calls): point it at the same database as the
AsyncSession. Without a transaction to join, call ``store.enqueue`` in a thread
(``await asyncio.to_thread(store.enqueue, ...)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from consumer.jobs.store import EnqueueResult, Store


async def enqueue_async(
    store: Store,
    session: AsyncSession | AsyncConnection,
    tenant: str,
    action: str,
    **options: Any,
) -> EnqueueResult:
    """``store.enqueue(tenant, action, **options)`` inside the caller's async transaction;
    never commits it. ``options`` are ``enqueue``'s keyword arguments except ``session``."""
    _check(session)
    return await session.run_sync(
        lambda sync: store.enqueue(tenant, action, session=sync, **options)
    )


async def enqueue_many_async(
    store: Store,
    session: AsyncSession | AsyncConnection,
    specs: Iterable[Mapping[str, Any]],
    *,
    now: Any = None,
) -> list[EnqueueResult]:
    """``store.enqueue_many(specs)`` inside the caller's async transaction (one statement per
    500 jobs); never commits it."""
    _check(session)
    specs = list(specs) if not isinstance(specs, Mapping) else specs
    return await session.run_sync(lambda sync: store.enqueue_many(specs, session=sync, now=now))


def _check(session: object) -> None:
    if not isinstance(session, (AsyncSession, AsyncConnection)):
        raise TypeError(
            f"expected a SQLAlchemy AsyncSession or AsyncConnection, got {type(session).__name__}"
        )
