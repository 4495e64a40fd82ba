"""The completer: the slots' finishes, recorded in batches off the slots' path.

A job whose handler returned without moving itself is handed to the completer
(:meth:`Completer.submit`) and its slot is free at once: the next job starts without waiting
for the finish's commit. The completer writes what it was given in one ``Outcomes.finish``
(one fenced ``finish_batch`` statement for many jobs) as soon as ``FLUSH_SIZE`` are waiting,
or ``FLUSH_AFTER`` seconds after the first one came; while one batch is being written, the
next fills (group commit). Like River's ``JobCompleter`` and awa's ``CompletionBatcher``.

What it does not change:

- **Fencing.** Each finish in a batch carries its lease's epoch; a finish whose lease was
  taken over (expired, recovered) is refused, job by job, and reported as ``conflict``.
- **Effects.** A handler's ``dispatch`` commits its receipt before the handler returns, so a
  receipt is always committed before its job counts as done, whenever the batch commits.
- **Leases.** Until its batch commits, a finished job stays in the worker's jobs in hand and
  its lease is renewed by the heartbeat; a crash before the commit leaves it LEASED, and it
  runs again (with a new epoch) once its lease expires or its worker's liveness does. A
  dispatch it made finds its receipt and sends nothing again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.outcomes import Outcomes, Settled
from outbox.outage import report_failure

__all__ = ["FLUSH_AFTER", "FLUSH_SIZE", "Completer"]

log = logging.getLogger("outbox.worker")

FLUSH_SIZE = 256  # finishes that make a batch go at once
FLUSH_AFTER = 0.002  # seconds a lone finish waits for company before it is written

InExecutor = Callable[..., Awaitable[Any]]


class Completer:
    """Batches finishes on the slots' event loop. ``in_executor(fn, *args)`` runs a
    statement off the loop; ``on_recorded(settled)`` is called for each job once its finish
    is recorded (or refused, or failed): the job leaves the worker's hands then."""

    def __init__(
        self,
        outcomes: Outcomes,
        in_executor: InExecutor,
        on_recorded: Callable[[Settled], None],
        *,
        flush_size: int = FLUSH_SIZE,
        flush_after: float = FLUSH_AFTER,
    ) -> None:
        self.outcomes = outcomes
        self.in_executor = in_executor
        self.on_recorded = on_recorded
        self.flush_size = flush_size
        self.flush_after = flush_after
        self._pending: list[Settled] = []
        self._waiting: dict[int, asyncio.Future[None]] = {}  # job id -> its recorded future
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, settled: Settled) -> asyncio.Future[None]:
        """Queue this job's finish (on the loop's thread); returns at once, with a future
        done once the finish is recorded (a slot that must not free before awaits it)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[settled.ctx.job_id] = done
        self._pending.append(settled)
        self._idle.clear()
        self._wake.set()
        if len(self._pending) >= self.flush_size:
            self._full.set()
        return done

    @property
    def pending(self) -> Sequence[Settled]:
        """The finishes submitted and not yet being written."""
        return self._pending

    def take(self, wanted: Callable[[Settled], bool]) -> list[Settled]:
        """Take the finishes not yet being written that ``wanted`` picks, for a claim that
        writes them itself (``Runner.finish_and_claim``); hand them to :meth:`recorded`
        once written, or back to :meth:`resubmit`."""
        taken: list[Settled] = []
        kept: list[Settled] = []
        for settled in self._pending:
            (taken if wanted(settled) else kept).append(settled)
        self._pending = kept
        return taken

    def resubmit(self, batch: Sequence[Settled]) -> None:
        """Finishes taken and not written (the claim failed): written here after all."""
        if batch:
            self._pending.extend(batch)
            self._idle.clear()
            self._wake.set()

    def recorded(self, batch: Sequence[Settled]) -> None:
        """These finishes were written (or refused, or failed): the jobs leave the hands."""
        for settled in batch:
            self.on_recorded(settled)
            done = self._waiting.pop(settled.ctx.job_id, None)
            if done is not None and not done.done():
                done.set_result(None)

    async def run(self) -> None:
        """Write the batches until :meth:`close`; a task beside the slots."""
        while True:
            if not self._pending:
                self._idle.set()
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self._pending) < self.flush_size and self.flush_after and not self._closing:
                # A lone finish waits a moment for others (one statement for all of them).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.flush_after)
            self._full.clear()
            batch, self._pending = self._pending, []
            if batch:  # a claim may have taken them meanwhile
                await self._flush(batch)

    async def close(self) -> None:
        """Write everything submitted, then let :meth:`run` return."""
        self._closing = True
        self._wake.set()
        self._full.set()
        await self._idle.wait()

    async def _flush(self, batch: Sequence[Settled]) -> None:
        failed: SQLAlchemyError | None = None
        try:
            await self.in_executor(self.outcomes.finish, batch)
        except SQLAlchemyError as exc:
            failed = exc
        except Exception as exc:  # the worker's own fault: say so, the leases expire
            log.error("finishes failed in the worker", extra={"error": repr(exc)[:500]})
        finally:
            self.recorded(batch)
        if failed is None:
            return
        # The database went away: hand the leases back so the jobs run again now (their
        # handlers ran: a dispatch finds its receipt). Unreachable still: their leases expire
        # by their ttl. Only once the jobs left the hands (just above): a job handed back can
        # be claimed again by this worker at once, and its next run must not be taken for
        # this one (its slot's wait was lost, and the worker never drained).
        report_failure(log, "finishes not recorded; their leases are handed back", failed)
        try:
            await self.in_executor(self.outcomes.hand_back_after_error, [s.ctx for s in batch])
        except Exception as again:  # the leases expire by their ttl
            log.debug("hand-back failed", extra={"error": repr(again)})
