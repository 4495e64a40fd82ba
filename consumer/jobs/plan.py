"""One dispatch, written once, run from a thread or from an event loop.

``Operations.dispatch`` and ``Operations.adispatch`` share every decision (the intent, the
reconciliation, the receipt) instead of keeping a sync and an async twin in step by hand.
The decisions are a generator, a **plan**: its plain code does the database work, and it
``yield``\\ s a :class:`Step` wherever it must wait on the provider (a
limit's permit, a send, a lookup). The step's result is sent back into the plan, or its
exception thrown into it, so the plan's ``try``/``except`` records UNKNOWN or NOT_SENT exactly
as straight-line code would.

- :func:`run_plan` (a ``def`` handler, a thread) runs the plan's code and each step's sync
  form in the calling thread.
- :func:`arun_plan` (an ``async def`` handler) runs the plan's code, the database
  statements, in an executor thread, and each step's async form on the event loop: the loop
  never blocks on the database and keeps many provider calls in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable, Generator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

__all__ = ["Plan", "Runner", "Step", "arun_plan", "pause_step", "provider_step", "run_plan"]

Runner = Callable[..., Awaitable[Any]]  # run(fn, *args) in the executor, awaited


@dataclass(frozen=True)
class Step:
    """A wait on the provider, in both forms: ``sync()`` in a thread, ``aio(run)`` on the
    loop (``run`` executes a blocking function in the executor)."""

    sync: Callable[[], Any]
    aio: Callable[[Runner], Awaitable[Any]]


Plan = Generator[Step, Any, Any]


def provider_step(connector: Any, method: str, *args: Any, **kwargs: Any) -> Step:
    """Call ``connector.method``; on the loop its ``a``-prefixed coroutine (``asend``,
    ``alookup``) when it has one, else the sync method in the executor."""
    sync = functools.partial(getattr(connector, method), *args, **kwargs)
    native = getattr(connector, "a" + method, None)

    async def aio(run: Runner) -> Any:
        if native is not None:
            return await native(*args, **kwargs)
        return await run(sync)

    return Step(sync, aio)


def pause_step(seconds: float) -> Step:
    """Wait ``seconds``: a sleep in a thread, ``asyncio.sleep`` on the loop."""

    async def aio(run: Runner) -> None:
        await asyncio.sleep(seconds)

    return Step(functools.partial(time.sleep, seconds), aio)


def run_plan(plan: Plan) -> Any:
    """Run a plan in this thread; its return value."""
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = plan.throw(error) if error is not None else plan.send(value)
        except StopIteration as stop:
            return stop.value
        try:
            value, error = step.sync(), None
        except Exception as exc:
            value, error = None, exc


def _advance(plan: Plan, value: Any, error: BaseException | None) -> tuple[bool, Any]:
    # StopIteration cannot cross a Future: turn the plan's end into a value.
    try:
        step = plan.throw(error) if error is not None else plan.send(value)
    except StopIteration as stop:
        return True, stop.value
    return False, step


async def arun_plan(plan: Plan, executor: Executor | None = None) -> Any:
    """Run a plan from a coroutine: its code in ``executor``, its steps on this loop.

    Every part of the plan runs in one ``contextvars.Context``, copied from the caller's: a
    context variable the plan sets (a tracing span it opens before a send and closes after)
    is seen by the step on the loop and by the plan's next part in another thread, exactly
    as in one thread. The parts run one after another, never at once."""
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()

    def run(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
        return loop.run_in_executor(executor, fn, *args)

    value: Any = None
    error: BaseException | None = None
    try:
        while True:
            done, result = await run(context.run, _advance, plan, value, error)
            if done:
                return result
            try:
                value = await asyncio.create_task(result.aio(run), context=context)
                error = None
            except Exception as exc:
                value, error = None, exc
    finally:
        with contextlib.suppress(ValueError):  # still running in the executor: let it end
            plan.close()
