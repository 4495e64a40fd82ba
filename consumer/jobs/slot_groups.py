"""A worker's groups of slots as its runner (``consumer.jobs.slots``) keeps them: one per
``QueueSlots`` (a queue with slots of its own; the queues that share the rest)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from consumer.jobs.context import JobContext

__all__ = ["BUFFER_SECONDS", "SlotGroup", "first_set"]

BUFFER_SECONDS = 0.5  # a buffer holds at most what its group starts in this long


@dataclass(eq=False)  # by identity: the runner finds the group of a job's slot
class SlotGroup:
    """One group of slots: how many are busy, and whether its last claim filled its free
    slots (there may be more of its jobs); its buffer of claimed jobs (claim ahead)."""

    queues: tuple[str, ...] | None
    slots: int
    own: bool  # the slots of one queue (not those its other queues share)
    busy: int = 0  # slots taken: jobs running, and jobs whose finish is not yet written
    finishing: int = 0  # of them, jobs whose handler returned and whose finish is not written
    more: bool = True
    claimed_at: float = 0.0  # monotonic time of its last claim
    # Claimed jobs waiting for a slot (claim ahead), oldest first, with their claim time.
    buffer: deque[tuple[JobContext, float]] = field(default_factory=deque)
    ahead: int = 0  # the fetch-ahead: how many buffered jobs the next claim aims for
    started: int = 0  # jobs started, for the rate that bounds the buffer
    since: float = field(default_factory=time.monotonic)

    @property
    def free(self) -> int:
        return self.slots - self.busy

    @property
    def wanted(self) -> int:
        """How many jobs a claim now would take: the free slots, plus the fetch-ahead
        not yet in the buffer."""
        return self.free + self.ahead - len(self.buffer)

    def adapt(self, claimed: int, asked: int) -> None:
        """A claim came back with ``claimed`` of ``asked``: more work waits (full) or not."""
        if claimed >= asked:
            self.ahead = min(self.slots, max(1, self.ahead * 2), self._safe())
        else:
            self.ahead //= 2

    def _safe(self) -> int:
        """What this group starts in BUFFER_SECONDS at its rate so far (at least 1)."""
        elapsed = max(time.monotonic() - self.since, 1e-3)
        return max(1, int(self.started / elapsed * BUFFER_SECONDS))

    @property
    def label(self) -> str:
        """The group as the ``worker_queue_slots`` hook names it: its own queue, or ``*``."""
        return self.queues[0] if self.queues is not None and self.own else "*"


async def first_set(events: dict[str, asyncio.Event], pause: float) -> str:
    """Wait up to ``pause`` seconds for one of ``events`` (by name): which was set first,
    or ``"poll"``."""
    waits = {asyncio.ensure_future(event.wait()): name for name, event in events.items()}
    done, pending = await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    names = {waits[task] for task in done}
    return next((name for name in events if name in names), "poll")
