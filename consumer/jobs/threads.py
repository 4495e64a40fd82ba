"""Threads for ``def`` handlers: a bounded pool sized from the CPUs and the jobs' own waits.

A ``def`` handler holds a thread for as long as it runs, most of it blocked on its provider.
One thread per slot (256 per process by default) meant 512 threads on a 2-core machine for
two workers: load average 25, every thread late, and a provider's latency measured through
that (issue 37). Instead a worker runs its ``def`` handlers on at most :attr:`ThreadGate.size`
threads at once; the other jobs it has claimed wait for one on the event loop, holding their
slot and their lease (the heartbeat renews a job that has not started) but no thread.

The size follows the classic rule for a pool of blocking tasks, ``threads = CPUs x (1 +
wait / compute)``: each finished job reports its wall time and the CPU time its thread
spent (``time.thread_time``), and the pool allows as many threads as keep the CPUs busy
while the others wait on their providers, between :data:`MIN_PER_CPU` and
:data:`MAX_PER_CPU` threads per CPU (``docs/how-to/effects.md`` has the curve). Against a
300 ms provider a job computes 2-3 ms: the rule asks for ~100 per CPU, capped at 64. A fixed
``WorkerConfig(threads=N)`` (``--threads``, ``OUTBOX_THREADS``) replaces the rule.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "MAX_PER_CPU",
    "MIN_PER_CPU",
    "ThreadGate",
    "default_threads",
    "timed",
]

T = TypeVar("T")

MIN_PER_CPU = 8  # threads per CPU the pool allows at least (and starts at, x2)
MAX_PER_CPU = 64  # ... and at most: beyond, a 2-core machine spends itself switching
SAMPLES = 50  # finished jobs the wait / compute ratio is taken over


def cpus() -> int:
    """The CPUs this process may run on (its affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_threads(slots: int) -> int:
    """The most threads a worker of ``slots`` slots runs ``def`` handlers on by default."""
    return max(1, min(slots, MAX_PER_CPU * cpus()))


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float, float]:
    """Run ``fn(*args)`` in this thread: its result, its wall time and its CPU time."""
    wall, cpu = time.monotonic(), time.thread_time()
    result = fn(*args)
    return result, time.monotonic() - wall, time.thread_time() - cpu


class ThreadGate:
    """How many ``def`` handlers run at once (module docstring): ``async with gate:`` around
    the hand-off to the thread pool; :meth:`learn` after each job. ``fixed``: that many,
    always (``WorkerConfig.threads``); else sized from the jobs' wait / compute ratio within
    ``[MIN_PER_CPU, MAX_PER_CPU] x CPUs``, never more than ``slots``."""

    def __init__(self, slots: int, fixed: int | None = None) -> None:
        self.cpus = cpus()
        self.most = max(1, min(slots, fixed if fixed else MAX_PER_CPU * self.cpus))
        self.least = min(self.most, fixed if fixed else MIN_PER_CPU * self.cpus)
        self.fixed = fixed is not None
        self.size = self.most if fixed else min(self.most, 2 * self.least)
        self.running = 0
        self._ratios: deque[float] = deque(maxlen=SAMPLES)
        self._learned = 0
        self._turn: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        """Jobs claimed and waiting for a thread (on the loop, holding none)."""
        return len(self._turn)

    async def __aenter__(self) -> None:
        if self.running < self.size and not self._turn:
            self.running += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._turn.append(future)
        try:
            await future  # the thread is counted by whoever woke this job
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()
            else:
                self._turn.remove(future)
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        self.running -= 1
        self._wake()

    def _wake(self) -> None:
        while self._turn and self.running < self.size:
            future = self._turn.popleft()
            if not future.done():
                self.running += 1
                future.set_result(None)

    def learn(self, wall: float, cpu: float) -> None:
        """A job's handler took ``wall`` seconds, ``cpu`` of them on a CPU: resize the pool
        to ``CPUs x (1 + wait / compute)`` (the median ratio of the recent jobs)."""
        if wall <= 0:
            return
        if self.fixed:
            return
        self._ratios.append(max(0.0, wall - cpu) / max(cpu, 1e-4))
        self._learned += 1
        if len(self._ratios) < 10 or self._learned % 8:
            return  # resized every 8th job: the median of SAMPLES moves slowly anyway
        ratio = sorted(self._ratios)[len(self._ratios) // 2]
        self.size = max(self.least, min(self.most, round(self.cpus * (1 + ratio))))
        self._wake()
