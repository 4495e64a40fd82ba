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
import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = [
    "MAX_PER_CPU",
    "MIN_PER_CPU",
    "HandlerThreads",
    "ThreadGate",
    "default_threads",
]

T = TypeVar("T")
A = TypeVar("A")
K = TypeVar("K")

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


class ThreadGate:
    """How many ``def`` handlers run at once (module docstring): :class:`HandlerThreads`
    admits a job while ``running < size``; :meth:`learn` after each job. ``fixed``: that many,
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


class HandlerThreads(Generic[A, K]):
    """The threads ``def`` handlers run on (module docstring), fed through one queue.

    :meth:`submit` (on the event loop) hands ``run(arg)`` to a thread while the gate has
    room, else keeps it waiting on the loop's side, holding no thread. A thread that ends a
    job puts its end on a list and wakes the loop once for every end since the last wake-up
    (``call_soon_threadsafe`` per batch): ``ended(arg, key, result, error)`` is called there,
    on the loop, for each. No future per job: the executor's futures and their callbacks were
    a third of the worker's time with 1-ms jobs at 16 slots (issue 52). The threads are
    started as the jobs running at once need them, at most ``gate.most``."""

    def __init__(
        self,
        gate: ThreadGate,
        name: str,
        run: Callable[[A], Any],
        ended: Callable[[A, K, Any, BaseException | None], None],
    ) -> None:
        self.gate = gate
        self._name = name
        self._run = run
        self._ended = ended
        self._queue: queue.SimpleQueue[tuple[A, K] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._waiting: deque[tuple[A, K]] = deque()
        self._lock = threading.Lock()
        self._ends: list[tuple[A, K, Any, BaseException | None, float, float]] = []
        self._woken = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiting(self) -> int:
        """Jobs handed over and waiting for a thread (on the loop's side, holding none)."""
        return len(self._waiting)

    def submit(self, arg: A, key: K) -> None:
        """Run ``run(arg)`` on a thread, now if the gate has room, else in turn. On the loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self.gate.running < self.gate.size and not self._waiting:
            self._hand(arg, key)
        else:
            self._waiting.append((arg, key))

    def _hand(self, arg: A, key: K) -> None:
        self.gate.running += 1
        if len(self._threads) < min(self.gate.running, self.gate.most):
            thread = threading.Thread(
                target=self._serve, name=f"{self._name}-{len(self._threads)}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        self._queue.put((arg, key))

    def _serve(self) -> None:
        run, lock = self._run, self._lock
        while (item := self._queue.get()) is not None:
            arg, key = item
            wall, cpu = time.monotonic(), time.thread_time()
            result: Any = None
            error: BaseException | None = None
            try:
                result = run(arg)
            except BaseException as exc:  # delivered to the loop, which decides
                error = exc
            end = (arg, key, result, error, time.monotonic() - wall, time.thread_time() - cpu)
            with lock:
                self._ends.append(end)
                if self._woken:
                    continue
                self._woken = True
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody to tell
                self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            ends, self._ends = self._ends, []
            self._woken = False
        gate = self.gate
        for arg, key, result, error, wall, cpu in ends:
            gate.running -= 1
            gate.learn(wall, cpu)
            self._ended(arg, key, result, error)
        while self._waiting and gate.running < gate.size:
            self._hand(*self._waiting.popleft())

    def shutdown(self) -> None:
        """Let every thread end (after the jobs handed to it) and wait for them."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()
