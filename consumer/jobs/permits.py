"""Calls in flight to one provider, learnt per process: :class:`AdaptiveLimit` (AIMD).

A worker's permits for one provider (``consumer.jobs.limits.ProviderGate`` holds one): the
limit starts at the worker's slots, halves on a timeout, takes 10 % off when the median
latency of the last :data:`RECENT` calls exceeds ``tolerance`` times the provider's unloaded
latency (a low percentile of its last 100 calls) while such cuts shorten the latency
(:meth:`AdaptiveLimit._cut_helps`: a queue of this process's calls shortens as they are
cut; latency that stays after the limit halved is the machine's or other clients'), and
grows by about one per round of successes otherwise. A job that finds no permit waits for
one (a thread, or a coroutine on the worker's loop); a worker slot whose job was handed
back can park here too
(:meth:`AdaptiveLimit.aparked`), woken by a permit no waiting job takes. Why each rule is so:
the module docstring of ``consumer.jobs.limits`` and docs/how-to/effects.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

from outbox.logs import fields

log = logging.getLogger(__name__)

__all__ = [
    "FALL_LOG_EVERY",
    "LATENCY_FLOOR",
    "RECENT",
    "AdaptiveLimit",
    "FallLog",
    "SchedulingDelay",
    "Waiter",
]


class Waiter:
    """One wait for a permit, a parked slot or a place at the head of a line: a thread's
    event, or a future on an event loop; :meth:`wake` from any thread."""

    __slots__ = ("event", "future", "granted", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.granted = False
        self.loop = loop
        self.event: threading.Event | None = None if loop else threading.Event()
        self.future: asyncio.Future[None] | None = loop.create_future() if loop else None

    def wake(self) -> None:
        self.granted = True
        if self.event is not None:
            self.event.set()
        elif self.loop is not None and self.future is not None:
            self.loop.call_soon_threadsafe(_resolve, self.future)

    def wait(self, timeout: float) -> bool:
        """Block this thread until woken, ``timeout`` seconds at most; whether it was."""
        assert self.event is not None
        self.event.wait(timeout)
        return self.granted

    async def await_wake(self, timeout: float) -> bool:
        """:meth:`wait` for a coroutine on the waiter's loop (a cancelled wait leaves the
        future as it is: a wake that comes later is still seen)."""
        assert self.future is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.future), timeout)
        return self.granted


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


RECENT = 10
"""Calls whose median latency :class:`AdaptiveLimit` compares with the provider's unloaded
latency. Judged call by call, a provider answering in 100 ms ± 50 % on a loaded 2-core
machine had enough calls over the threshold to hold a worker at 1-2 calls in flight: the
chaos matrix with that provider drained a backlog at ~31 effects/s instead of 90, and one
worker draining 3,000 jobs made 182 effects/s with the jitter against 274 without it."""

LATENCY_FLOOR = 0.02
"""Seconds: the least "best recent latency" :class:`AdaptiveLimit` compares a call with. A
provider that answers in 50 µs would otherwise count any call slower than 200 µs (a thread
scheduled late on a loaded machine) as a queue at the provider: measured at load 30, its
limit fell to 1 and the worker handed back nearly every job. Real providers answer in
50-300 ms, so the floor changes nothing for them."""


class SchedulingDelay:
    """How late this process runs its threads now: a daemon thread sleeps ``tick`` seconds
    again and again and keeps by how much each sleep overran (a CPU busy with other
    processes, the GIL held by this one's other threads, a late event loop's thread).

    A provider call's latency is measured from the thread or the loop that made it, so on
    a starved machine every call looks slow by about this much: that is the machine, not a
    queue at the provider, and :class:`AdaptiveLimit` allows for it (issue 37: at load 25
    two workers held about one call in flight each against a 100 ms provider). Started at
    the first :meth:`recent`, resting after ``rest_after`` seconds without one; one per
    process, :data:`SCHEDULING`."""

    def __init__(self, tick: float = 0.02, window: int = 50, rest_after: float = 10.0) -> None:
        self.tick = tick
        self.rest_after = rest_after
        self._late: deque[float] = deque(maxlen=window)
        self._started = False
        self._asked = 0.0  # monotonic: the last recent()
        self._lock = threading.Lock()

    def _probe(self) -> None:
        # The probe rests once nobody asked for ``rest_after`` seconds (no provider call
        # learnt from): 50 wake-ups a second of an idle worker are CPU for nothing (issue
        # 54); the next recent() starts it again, on the samples it kept.
        while time.monotonic() - self._asked < self.rest_after:
            began = time.monotonic()
            time.sleep(self.tick)
            self._late.append(max(0.0, time.monotonic() - began - self.tick))
        with self._lock:
            self._started = False

    def note(self, late: float) -> None:
        """A delay measured elsewhere (an event loop's lag): counted like the probe's."""
        self._late.append(max(0.0, late))

    def recent(self) -> float:
        """Seconds: the 90th percentile of the recent overruns (about the last second)."""
        self._asked = time.monotonic()
        if not self._started:
            with self._lock:
                if not self._started:
                    self._started = True
                    threading.Thread(
                        target=self._probe, name="outbox-scheduling-delay", daemon=True
                    ).start()
        samples = sorted(self._late)
        return samples[int(len(samples) * 0.9)] if samples else 0.0


FALL_LOG_EVERY = 10.0
"""Seconds between two log lines about one provider's limit falling (it may fall every
50 ms): each line says how many falls it stands for."""


class FallLog:
    """The log lines of one provider's falling limit: the first at once, then at most one
    per :data:`FALL_LOG_EVERY` seconds, with the reason of the last fall and the count."""

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._falls = 0  # falls not logged yet
        self._logged = -math.inf  # monotonic: the last line
        self._lock = threading.Lock()

    def fell(self, limit: int, most: int, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._falls += 1
            if now - self._logged < FALL_LOG_EVERY:
                return
            falls, self._falls, self._logged = self._falls, 0, now
        log.info(
            "provider limit fell",
            extra=fields(
                provider=self.provider, limit=limit, most=most, reason=reason, falls=falls
            ),
        )


SCHEDULING = SchedulingDelay()
"""This process's :class:`SchedulingDelay` (the gates' permits read it)."""


class AdaptiveLimit:
    """Calls in flight to one provider, adapted to what it serves (AIMD; module docstring).
    Thread-safe, shared by a worker's thread pool and its event loop. ``delay``: the
    process's :class:`SchedulingDelay` (None: judge latencies as measured), added twice to
    the threshold a median latency must pass to count as a queue at the provider."""

    def __init__(
        self,
        maximum: int,
        *,
        minimum: int = 1,
        tolerance: float = 4.0,
        backoff: float = 0.9,
        timeout_backoff: float = 0.5,
        latency_floor: float = LATENCY_FLOOR,
        delay: SchedulingDelay | None = None,
    ) -> None:
        self.maximum = max(1, maximum)
        self.minimum = max(1, min(minimum, self.maximum))
        self.tolerance = tolerance
        self.latency_floor = latency_floor
        self.delay = delay
        self.backoff = backoff
        self.timeout_backoff = timeout_backoff
        self.limit = float(self.maximum)
        self.in_flight = 0
        # Told (outside the lock) each time the whole number of calls allowed changes: the
        # new limit, and the reason when it fell (None when it grew).
        # ``consumer.jobs.limits.ProviderGate`` sets a gauge and logs a line for a fall.
        self.on_change: Callable[[int, str | None], None] | None = None
        self._waiters: deque[Waiter] = deque()
        self._parked: deque[Waiter] = deque()  # worker slots waiting to claim (aparked)
        self._samples: deque[float] = deque(maxlen=100)
        self._recent: deque[float] = deque(maxlen=RECENT)
        self._best = 0.0
        self._last_decrease = 0.0
        # (limit, median latency) when the latency first passed its threshold: cuts go on
        # while they bring the latency down (:meth:`_cut_helps`).
        self._slow_since: tuple[float, float] | None = None
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        with self._lock:
            if not self._waiters and self.in_flight < int(self.limit):
                self.in_flight += 1
                return True
            return False

    def widen(self, maximum: int) -> None:
        """Allow up to ``maximum`` calls in flight (another way in with more slots shares this
        limit); before any call was learnt from, the limit starts there too."""
        with self._lock:
            if maximum <= self.maximum:
                return
            self.maximum = maximum
            if not self._samples:
                self.limit = float(maximum)
            self._grant()

    def wait(self, tick: float, progress: Callable[[], None] | None = None) -> None:
        """Wait (a thread) for a permit as long as it takes, in turn, ``progress()`` every
        ``tick`` seconds meanwhile (the job's lease stays renewed)."""
        if self.try_acquire():
            return
        waiter = Waiter()
        with self._lock:
            self._waiters.append(waiter)
        try:
            while not waiter.wait(tick):
                if progress is not None:
                    progress()
        except BaseException:
            if self._settle(waiter):
                self.release(None)
            raise

    async def await_permit(self, tick: float, progress: Callable[[], None] | None = None) -> None:
        """:meth:`wait` for a coroutine on the worker's loop."""
        if self.try_acquire():
            return
        waiter = Waiter(asyncio.get_running_loop())
        with self._lock:
            self._waiters.append(waiter)
        try:
            while not await waiter.await_wake(tick):
                if progress is not None:
                    progress()
        except BaseException:
            if self._settle(waiter):
                self.release(None)
            raise

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a permit (a thread)."""
        if self.try_acquire():
            return True
        waiter = Waiter()
        with self._lock:
            self._waiters.append(waiter)
        waiter.wait(timeout)
        return self._settle(waiter)

    async def aacquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a permit (a coroutine on the worker's loop)."""
        if self.try_acquire():
            return True
        waiter = Waiter(asyncio.get_running_loop())
        with self._lock:
            self._waiters.append(waiter)
        try:
            await waiter.await_wake(timeout)
        except asyncio.CancelledError:
            if self._settle(waiter):
                self.release(None)
            raise
        return self._settle(waiter)

    async def aparked(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds (a worker slot whose job was handed back, on the
        worker's loop: ``consumer.jobs.slots``); a permit released that no waiting job
        takes wakes one parked slot, so that the slots claim only when a job could run."""
        waiter = Waiter(asyncio.get_running_loop())
        with self._lock:
            self._parked.append(waiter)
        try:
            await waiter.await_wake(timeout)
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._parked.remove(waiter)

    def wake_parked(self) -> None:
        """Wake one slot parked for this provider (room came that is not a permit: a place
        in the line for a rate-limited start)."""
        with self._lock:
            if self._parked:
                self._parked.popleft().wake()

    def _settle(self, waiter: Waiter) -> bool:
        with self._lock:
            if waiter.granted:
                return True
            try:
                self._waiters.remove(waiter)
            except ValueError:  # pragma: no cover - granted between the checks
                return True
            return False

    def release(self, latency: float | None, *, timed_out: bool = False) -> None:
        """A call ended after ``latency`` seconds (None: not made); ``timed_out``: no answer
        in time, the strongest sign of overload."""
        changed = None
        with self._lock:
            self.in_flight -= 1
            if latency is not None:
                before = int(self.limit)
                reason = self._learn(latency, timed_out)
                if int(self.limit) != before:
                    changed = (int(self.limit), reason)
            self._grant()
            if self._parked and self.in_flight < int(self.limit):  # room no waiter took
                self._parked.popleft().wake()
        if changed is not None and self.on_change is not None:
            self.on_change(*changed)

    def _learn(self, latency: float, timed_out: bool) -> str | None:
        """Learn from one call; the reason when the limit was cut."""
        now = time.monotonic()
        self._samples.append(latency)
        self._recent.append(latency)
        if len(self._samples) % 10 == 1 or len(self._samples) < 10:
            # The provider's unloaded latency: a low percentile of the recent samples, not
            # their minimum (one lucky fast answer must not make every ordinary one look
            # like a queue).
            ordered = sorted(self._samples)
            self._best = ordered[len(ordered) // 10]
        cooled = now - self._last_decrease >= max(self._best, 0.05)
        reason = None
        median = sorted(self._recent)[RECENT // 2] if len(self._recent) == RECENT else 0.0
        threshold = self._threshold() if median else 0.0
        if timed_out and cooled:
            self.limit = max(float(self.minimum), self.limit * self.timeout_backoff)
            self._last_decrease = now
            reason = f"a call timed out after {latency:.3f} s"
        elif median > threshold and self._cut_helps(median):
            # The median of the last RECENT calls, not one call: a queue at the provider
            # slows every call, a busy machine or a provider's jitter only some of them.
            if cooled:
                self.limit = max(float(self.minimum), self.limit * self.backoff)
                self._last_decrease = now
                reason = (
                    f"median latency of the last {RECENT} calls {median * 1000:.0f} ms "
                    f"over {threshold * 1000:.0f} ms ({self.tolerance:g} x the unloaded "
                    f"{max(self._best, self.latency_floor) * 1000:.0f} ms, with the machine's "
                    "delay)"
                )
        else:
            if median <= threshold:
                self._slow_since = None
            self.limit = min(float(self.maximum), self.limit + 1.0 / max(self.limit, 1.0))
        return reason

    def _cut_helps(self, median: float) -> bool:
        """Whether a latency over its threshold is a queue of this process's own calls: a
        queue shortens as the calls in flight are cut. Once the cuts halved the limit it
        had when the latency first passed its threshold and the median fell by less than a
        quarter, the provider is slow whatever this process sends (a loaded machine, other
        clients): the limit stops falling and grows back, so it does not sit far below the
        offered rate while the provider has room (issue 54: at load 20 a provider answering
        at once was held at 2-19 calls in flight, its latency that of the machine). A
        median half as bad again since then starts the judgement over."""
        if self._slow_since is None or median > 1.5 * self._slow_since[1]:
            self._slow_since = (self.limit, median)
            return True
        limit, slow = self._slow_since
        return not (self.limit <= limit / 2 and median >= 0.75 * slow)

    def _threshold(self) -> float:
        """The median latency above which the provider is queueing: ``tolerance`` times its
        unloaded latency, plus twice how late this process runs now (the machine's share of
        every latency measured here, :class:`SchedulingDelay`)."""
        late = self.delay.recent() if self.delay is not None else 0.0
        return self.tolerance * max(self._best, self.latency_floor) + 2 * late

    def _grant(self) -> None:
        while self._waiters and self.in_flight < int(self.limit):
            waiter = self._waiters.popleft()
            self.in_flight += 1
            waiter.wake()
