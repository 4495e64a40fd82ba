"""``async def`` handlers: how the slots tell them apart, and how one runs as a task that a
cancel request can cancel (``consumer.jobs.slots`` runs them on its event loop)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from consumer.errors import JobCancelled
from consumer.jobs.context import JobContext

__all__ = ["AsyncHandlers", "is_async_handler", "run_async_handler"]


def is_async_handler(fn: Callable[..., Any]) -> bool:
    """An ``async def`` handler (or a callable object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's method
    )


class AsyncHandlers:
    """:func:`is_async_handler` of a handler, inspected once per handler, not per job."""

    def __init__(self) -> None:
        self._seen: dict[Callable[..., Any], bool] = {}

    def __call__(self, handler: Callable[..., Any]) -> bool:
        try:
            if handler not in self._seen:
                self._seen[handler] = is_async_handler(handler)
            return self._seen[handler]
        except TypeError:  # an unhashable callable object
            return is_async_handler(handler)


async def run_async_handler(ctx: JobContext, handler: Callable[..., Any]) -> Any:
    """Run an ``async def`` handler as a task of its own, which a cancel request cancels
    (``JobContext.request_cancel``: never inside a provider call); a cancelled handler
    ends as ``JobCancelled`` (the job then ends CANCELLED). Returns what it returned."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(handler(ctx))

    def cancel() -> None:  # from the maintenance thread, or from the loop itself
        loop.call_soon_threadsafe(task.cancel)

    ctx.cancel_task = cancel
    if ctx.cancel_requested:  # requested before it started: it never runs
        task.cancel()
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():  # this slot itself is cancelled: so is the handler
            task.cancel()
            raise
        raise JobCancelled(f"job #{ctx.job_id}: its handler was cancelled") from None
    finally:
        ctx.cancel_task = None
