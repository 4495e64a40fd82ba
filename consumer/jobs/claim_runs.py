"""Quick ``def`` handlers run in the database thread that claimed their jobs (issue 44).

While the thread gate has learned that the handlers take microseconds and wait on nothing
(``ThreadGate.quick``), the slots' claim (``consumer.jobs.slots``) runs in a database
thread, and that thread then runs the claimed jobs' handlers itself, one after another,
before the jobs reach the event loop: for such a handler, the hops to the loop, to a slot's
thread and back cost more than the handler. The first job past ``QUICK_WALL`` (or one that
raised) ends it; the rest of its claim go to the slots' threads as usual.

**Chained claims.** When every job of such a claim ended ``done``, the same thread writes
their finishes with the claim of the next jobs into the same slots (``finish_and_claim``:
one statement, one commit), and runs those too: at most :data:`CHAIN_ROUNDS` claims a call,
only for a worker with one group of slots (another group's claim waits for this call), and
never past a stop. The slots' count never changes meanwhile: each claim takes exactly the
slots its finishes free, in the same commit, so the worker still never holds more leases
than slots. The last claim's jobs go to the loop as they ran, which records their finishes
as any other's (the next claim or the completer). A chained claim that fails hands the jobs
of the claim before it to the loop unfinished: their finishes are written there instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.context import JobContext
from consumer.jobs.inhand import JobsInHand
from consumer.jobs.outcomes import Outcomes, Route, Settled
from consumer.jobs.store import Lease
from consumer.jobs.threads import QUICK_WALL, ThreadGate, timed
from outbox.lifecycle import GracefulStop

__all__ = ["CHAIN_ROUNDS", "ClaimParts", "ClaimRuns", "Claimed", "Ran"]

Ran = tuple[Settled, float, float]  # a handler's outcome, its wall time and its CPU time
Claimed = list[tuple[JobContext, Ran | BaseException | None]]
CHAIN_ROUNDS = 8  # claims one call makes at most, each finishing the jobs of the one before


class ClaimParts(Protocol):
    """What the claims use of a running worker (``consumer.jobs.slots.SlotParts`` is one)."""

    stop: GracefulStop
    route: Route
    in_hand: JobsInHand
    outcomes: Outcomes

    def claim(self, free: int, queues: tuple[str, ...] | None) -> list[Lease]: ...

    def finish_and_claim(
        self, done: Sequence[Settled], free: int, queues: tuple[str, ...] | None
    ) -> list[Lease]: ...

    def context(self, lease: Lease, executor: Any = None) -> JobContext: ...


class ClaimRuns:
    """``runs(carried, wanted, queues)`` in a database thread: the claim (writing
    ``carried``'s finishes), the quick handlers run, and the chained claims (module
    docstring). Returns the last claim's jobs, each with its run (or None: not run here),
    and the (wall, CPU) times of the runs of the claims before it, for the gate to learn."""

    def __init__(
        self,
        parts: ClaimParts,
        gate: ThreadGate,
        is_async: Callable[[Callable[..., Any]], bool],
        executor: Any,
        *,
        inline: bool,
        chain: bool,
    ) -> None:
        self.parts = parts
        self.gate = gate
        self.is_async = is_async
        self.executor = executor
        self.inline = inline  # off with claim ahead: buffered jobs wait for a slot
        self.chain = chain

    def __call__(
        self, carried: Sequence[Settled], wanted: int, queues: tuple[str, ...] | None
    ) -> tuple[Claimed, list[tuple[float, float]]]:
        parts = self.parts
        claimed = self._claim(carried, wanted, queues)
        learned: list[tuple[float, float]] = []
        for _ in range(CHAIN_ROUNDS - 1):
            done = self._all_done(claimed)
            if not self.chain or not done or len(done) < wanted or parts.stop.stopped:
                break
            try:
                following = self._claim(done, wanted, queues)
            except SQLAlchemyError:
                break  # the loop writes their finishes instead
            for settled in done:  # finished in that claim's commit
                parts.in_hand.remove(settled.ctx.job_id)
            learned += [(ran[1], ran[2]) for _, ran in claimed if isinstance(ran, tuple)]
            claimed = following
        return claimed, learned

    def _claim(
        self, carried: Sequence[Settled], wanted: int, queues: tuple[str, ...] | None
    ) -> Claimed:
        parts = self.parts
        if carried:
            leases = parts.finish_and_claim(carried, wanted, queues)
        else:
            leases = parts.claim(wanted, queues)
        contexts = [parts.context(lease, self.executor) for lease in leases]
        inline = self.inline and self.gate.quick
        claimed: Claimed = []
        for ctx in contexts:
            ran = self._run(ctx) if inline else None
            slow = isinstance(ran, BaseException) or (ran is not None and ran[1] > QUICK_WALL)
            inline = inline and not slow
            claimed.append((ctx, ran))
        return claimed

    def _run(self, ctx: JobContext) -> Ran | BaseException | None:
        """A claimed job's ``def`` handler run here: its outcome, its error, or None."""
        routed = self.parts.route(ctx.lease)
        if (routed is not None and self.is_async(routed[1])) or self.parts.stop.stopped:
            return None
        try:
            return timed(self.parts.outcomes.run, ctx)
        except BaseException as exc:  # its own job's error: raised where the job runs
            return exc

    @staticmethod
    def _all_done(claimed: Claimed) -> list[Settled]:
        """The claim's jobs, if every one ran here, quickly, and ended ``done``."""
        done: list[Settled] = []
        for _, ran in claimed:
            if not isinstance(ran, tuple) or ran[1] > QUICK_WALL or ran[0].outcome != "done":
                return []
            done.append(ran[0])
        return done
