"""The completer: finishes of the slots' jobs, recorded in batches.

A job whose handler returned joins the batch being written, and the first one waiting writes
everyone's in one ``Outcomes.finish`` (one fenced ``finish_batch`` statement: group commit).
A finish whose lease was lost comes back refused, job by job (``conflict``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from consumer.jobs.outcomes import Outcomes, Settled

__all__ = ["Completer"]

InExecutor = Callable[..., Awaitable[Any]]


class Completer:
    """Batches finishes on the slots' event loop; ``in_executor(fn, *args)`` runs the
    statement off the loop."""

    def __init__(self, outcomes: Outcomes, in_executor: InExecutor) -> None:
        self.outcomes = outcomes
        self.in_executor = in_executor
        self._pending: list[tuple[Settled, asyncio.Future[bool]]] = []
        self._flushing = False

    async def finish(self, settled: Settled) -> bool:
        """Record this job's finish in the next batch; True if it counted (not fenced out)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending.append((settled, done))
        if not self._flushing:
            self._flushing = True
            try:
                while self._pending:
                    batch, self._pending = self._pending, []
                    await self._flush(batch)
            finally:
                self._flushing = False
        return await done

    async def _flush(self, batch: Sequence[tuple[Settled, asyncio.Future[bool]]]) -> None:
        try:
            lost = await self.in_executor(self.outcomes.finish, [s for s, _ in batch])
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for settled, future in batch:
            future.set_result(settled.ctx.job_id not in lost)
