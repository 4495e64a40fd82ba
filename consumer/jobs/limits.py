"""Provider limits: what a provider can take, held for the whole fleet and learnt per process.

Three limits stand between a job and its provider (``Operations.dispatch`` passes them all
before it writes the intent, so a job that must wait has sent nothing and holds no call
deadline):

- **A pause, for every worker.** Any failure of a call that carries ``retry_after``
  (seconds: a ``TransientFailure(..., retry_after=S)``, ``HttpProvider``'s ``429``/``503``
  with ``Retry-After``, any exception with a numeric ``retry_after`` attribute) pauses the
  provider until then: the worker that got the answer writes ``paused_until`` into
  ``outbox_provider_limits`` (database clock), and every worker reads it before each call
  (a process that has seen the pause skips the read until it ends). The read costs no
  round trip of its own: a dispatch's intent statement, which every call writes first,
  checks the pause in the same statement (``JobDriver.operation_intent``), and so does a
  rate reservation; only the sweep's lookups read it apart. Only calls already in flight
  reach the provider during a pause.
- **A rate, for every worker.** A provider that declares ``rate_limit`` (calls per second
  for the whole fleet) gets its calls spaced, not burst: each call reserves the next start
  time in the provider's row in one UPDATE (``next_call_at = max(next_call_at, now) +
  spacing``, the statement's own database clock) and sleeps until it, right before the
  call. Every call to the provider takes a start of its own: a send, a resend, a lookup
  (in a dispatch or in the sweep). The spacing is ``1.25 / rate_limit``; reservations
  reach at most ``max_wait`` seconds ahead.

  Calls that reach the provider within ``d`` seconds after their reserved starts put at
  most ``rate_limit`` calls in any one-second window there as long as ``d <= 0.25`` (the
  margin: a window of ``1 + d`` seconds holds at most ``(1 + d) * rate_limit / 1.25``
  starts). So a call that is more than ``LATE`` (50 ms) past its start does not go: it
  gives the start back and reserves a new one. The first version sent it anyway, and the
  late calls of a busy worker arrived together with the next ones (9 calls in one second
  against a limit of 5): a cold process took 0.2-1.1 s between its reservation and its
  first byte, and even a warm one 40-90 ms now and then on a 2-core machine at load 12.
  The check is made twice: before the call, and by ``HttpProvider`` at the very moment
  its first byte is to be written (``send_by()``: a pooled connection's wait, a connect,
  a cold client all come before it; :class:`StartMissed` then, nothing sent). The other
  200 ms of the margin are for what follows the first byte (the network, the provider
  getting to the request). The price is throughput: the fleet makes at most
  ``rate_limit / 1.25`` calls per second. A provider of your own gets the first check only.
- **Calls in flight, learnt per process (AIMD).** :class:`AdaptiveLimit`
  (``consumer.jobs.permits``) starts at the
  worker's slots and halves on a timeout, takes 10 % off when the median latency of the
  last :data:`RECENT` calls exceeds ``tolerance`` times the provider's unloaded latency (a
  low percentile of the last 100 calls: a queue building up at the provider slows every
  call, a jittery provider or a busy machine only some; the unloaded latency is taken as
  at least ``latency_floor``, 20 ms, so that a provider
  answering in microseconds does not read the worker's own scheduling delays on a busy
  machine as overload and shrink to one call in flight), and adds about one per round of
  successes otherwise; at most one decrease per recent latency, so one wave of slow answers
  does not collapse it. A provider that serves 8 sends at once is then sent about that
  many, not buried under calls that time out and come back as lookups and resends (the
  metastable overload of retrying clients).

**One gate for every way in.** A process holds one :class:`FleetLimits` per database
(:func:`shared_limits`) and one :class:`ProviderGate` per provider name on it: an
``Operations(store, providers)`` built by the user apart from any worker, the worker's own
(``Worker(providers=...)``, ``ctx.dispatch``) and the receipt sweep's all pass the same
permits, rate line and pause, whichever was built first. Measured before (issue 37): a
user's own ``Operations`` had gates of its own, the worker's slots did not know them, and
its jobs churned through claims while the worker's metrics saw no provider at all.

**Waiting costs nothing.** A job whose provider has no permit free, or whose starts are
booked more than ``max_wait`` ahead, keeps its slot and its lease and waits in this
process: for a permit (woken by the call that releases one), or in the line for a start
(the head alone asks the database, when a start may be had). It is never handed back to be
claimed again: each hand-back was a claim, a move and an attempt row, and on a CPU-starved
machine one job was claimed 34 times before its call (issue 37). No intent exists while it
waits, so a SIGKILL meanwhile loses nothing and sends nothing twice. Only a **pause** hands
jobs back (:class:`~consumer.errors.ProviderThrottled`, READY again when the pause ends, no
failure counted): the provider said when it may be called again, and the slot is better
used by other providers' jobs meanwhile. A provider whose jobs wait can hold every slot of a
worker; give its queue slots of its own (``WorkerConfig(queues={"mail": 32})``) where other
providers' jobs must never wait behind it.

The worker's slot whose job a pause handed back then waits before it claims again
(``consumer.jobs.slots``, :meth:`ProviderGate.aparked`), holding no lease: PARK_BASE seconds,
doubled for each job of that provider handed back since a call last found a permit free at
once, at most PARK_MAX; a permit released here that no waiting job takes wakes one such slot
at once. Otherwise, behind a backlog of that provider's jobs, a freed slot claims the next
one at once and hands it back too, as fast as the database answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from consumer.errors import ProviderThrottled
from consumer.jobs.fleet import FleetTable
from consumer.jobs.permits import SCHEDULING, AdaptiveLimit, FallLog, SchedulingDelay, Waiter
from consumer.jobs.plan import Runner, Step
from consumer.jobs.store import Store
from outbox.hooks import NO_HOOKS, Hooks, call_hook

__all__ = [
    "PARK_BASE",
    "PARK_MAX",
    "RATE_MARGIN",
    "AdaptiveLimit",
    "FleetLimits",
    "ProviderGate",
    "SchedulingDelay",
    "StartMissed",
    "Ticket",
    "send_by",
    "shared_limits",
]

RATE_MARGIN = 1.25  # calls are spaced RATE_MARGIN / rate_limit apart (see the docstring)
MAX_WAIT = 1.0  # seconds a job may wait in its slot for a rate reservation
LATE = 0.05  # seconds past its reserved start after which a call reserves a new one
REBOOK = 2 * MAX_WAIT  # seconds a call's deadline allows for new starts after a missed one
WAIT_TICK = 1.0  # seconds between two progress reports of a job waiting for its provider
PARK_BASE = 0.25  # seconds a slot whose job was handed back waits before it claims again
PARK_MAX = 4.0  # ... doubled for each hand-back in a row, at most this (module docstring)


_SEND_BY: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "outbox_send_by", default=None
)


class StartMissed(Exception):
    """Raised by a provider client that cannot write its first byte by :func:`send_by`:
    nothing was sent; the call takes a new reserved start."""


def send_by() -> float | None:
    """The ``time.monotonic()`` by which the call being made in this context must write its
    first byte to keep to its provider's ``rate_limit`` (None: no such limit). A client
    that would write later raises :class:`StartMissed` instead of sending."""
    return _SEND_BY.get()


class FleetLimits(FleetTable):
    """The fleet-wide side (``outbox_provider_limits``, :class:`~consumer.jobs.fleet.FleetTable`:
    pauses and rate reservations, every time from the database clock so that every worker
    agrees) and this process's gate of each provider on it."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._gates: dict[str, ProviderGate] = {}

    def gate(
        self, name: str, *, rate_limit: float | None, slots: int, hooks: Hooks | None = None
    ) -> ProviderGate:
        """The one gate of provider ``name`` on this database in this process, made at the
        first ask; a later ask widens it (:meth:`ProviderGate.adopt`)."""
        with self._lock:
            gate = self._gates.get(name)
            if gate is None:
                gate = ProviderGate(name, self, rate_limit=rate_limit, slots=slots, hooks=hooks)
                self._gates[name] = gate
                return gate
        gate.adopt(rate_limit=rate_limit, slots=slots, hooks=hooks)
        return gate

    def gate_named(self, name: str) -> ProviderGate | None:
        """The gate of provider ``name``, if a call to it was made in this process."""
        with self._lock:
            return self._gates.get(name)


_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], FleetLimits] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _place(store: Store) -> tuple[Any, ...]:
    """What names the store's database in this process: its URL (an in-memory SQLite, the
    engine itself), and a clock of its own (``Store(clock=...)``) when it has one."""
    url = store.engine.url
    memory = url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")
    where: Any = id(store.engine) if memory else url.render_as_string(hide_password=True)
    clock = store.driver.clock
    return (where, None if clock is None else id(clock))


def shared_limits(store: Store) -> FleetLimits:
    """This process's :class:`FleetLimits` for the store's database: every ``Operations`` on
    it (a worker's, a user's own) shares its pauses and its gates (module docstring). Kept
    while an ``Operations`` holds it."""
    key = _place(store)
    with _SHARED_LOCK:
        fleet = _SHARED.get(key)
        if fleet is None:
            fleet = FleetLimits(store)
            _SHARED[key] = fleet
        return fleet


@dataclass
class Ticket:
    """A permit to call a provider now; give it back with :meth:`ProviderGate.leave`."""

    provider: str
    started: float = 0.0  # monotonic: the reserved start of the call
    waited: float = 0.0  # seconds from the permit to the reserved start
    held: bool = False  # a call went out at the reserved start (the next needs a new one)
    timed_out: bool = False  # the call got no answer in time (AIMD's strongest signal)
    retry_after: float | None = None  # a 429/503's Retry-After: the fleet pauses
    latest: float = math.inf  # monotonic: the latest start the call's deadline allows
    called: float = 0.0  # monotonic: when the last call went out (after its hold)
    answered: float = 0.0  # monotonic: when it returned or failed (AIMD's latency sample)


class ProviderGate:
    """One provider's limits in one process: the fleet's pause and rate, this process's
    AIMD permits. :meth:`enter` / :meth:`aenter` before a call (they raise
    :class:`ProviderThrottled` when the job must be handed back), :meth:`leave` after."""

    def __init__(
        self,
        name: str,
        fleet: FleetLimits | None,
        *,
        rate_limit: float | None,
        slots: int,
        hooks: Hooks | None = None,
    ) -> None:
        self.name = name
        self.fleet = fleet
        self.spacing = RATE_MARGIN / rate_limit if rate_limit else 0.0
        self.permits = AdaptiveLimit(slots, delay=SCHEDULING)
        self.permits.on_change = self._limit_changed
        self.hooks = hooks if hooks is not None else NO_HOOKS
        self._fall_log = FallLog(name)
        self.handed_back = 0  # jobs handed back since a call found a permit free (aparked)
        self._line: deque[Waiter] = deque()  # jobs waiting here for a start (rate_limit)
        self._line_lock = threading.Lock()

    def adopt(self, *, rate_limit: float | None, slots: int, hooks: Hooks | None = None) -> None:
        """Another way in asks for this gate (a worker's ``Operations`` after a user's own, or
        the other way round): the most slots any of them has (permits start there, they do
        not crawl up to it), the strictest ``rate_limit``, and hooks where there were none
        (a worker's metrics)."""
        if rate_limit:
            self.spacing = max(self.spacing, RATE_MARGIN / rate_limit)
        self.permits.widen(slots)
        if hooks is not None and hooks is not NO_HOOKS and self.hooks is NO_HOOKS:
            self.hooks = hooks

    def _limit_changed(self, limit: int, reason: str | None) -> None:
        """The calls in flight this process allows changed: the gauge; a fall, a line too."""
        call_hook(self.hooks, "provider_limit", self.name, limit, reason=reason)
        if reason is not None:
            self._fall_log.fell(limit, self.permits.maximum, reason)

    def _throttled(self, why: str, until: float) -> ProviderThrottled:
        return ProviderThrottled(f"provider {self.name!r} {why}", self.name, until)

    def _check_pause(self, read: bool = True) -> None:
        """Refuse a call to a paused provider: what this process learnt (no round trip),
        then, when ``read``, the database. A dispatch passes ``read=False``: its intent's
        statement reads the pause (``JobDriver.operation_intent``: ``"paused"``), and a rate
        reservation reads it too, each in a statement that is made anyway."""
        if self.fleet is None:
            return
        if read and not self.spacing:
            until = self.fleet.paused_until(self.name)  # what it learnt, else the database
        else:
            until = self.fleet.paused_locally(self.name)
        if until is not None:
            raise self._throttled(f"is paused until {until:.3f}", until)

    def paused(self) -> ProviderThrottled:
        """The refusal for a provider found paused by a dispatch's intent statement."""
        until = self.fleet.paused_until(self.name) if self.fleet is not None else None
        if until is None:  # the pause ended since: try again at once
            clock = self.fleet.store.driver.clock if self.fleet is not None else None
            until = (clock or time.time)()
        return self._throttled(f"is paused until {until:.3f}", until)

    async def aparked(self) -> None:
        """A worker slot whose job this provider's limit handed back waits before it claims
        again: PARK_BASE doubled for each hand-back since a call last found a permit free
        at once, at most PARK_MAX, or less: a permit released here that no waiting job
        takes wakes one such slot (module docstring)."""
        self.handed_back += 1
        seconds = min(PARK_MAX, PARK_BASE * 2 ** min(self.handed_back - 1, 16))
        await self.permits.aparked(seconds)

    def _try_reserve(self) -> tuple[float | None, float, float | None]:
        """``(start, 0, None)``, or ``(None, seconds to try again in, until)`` when the
        provider is paused or its starts are booked too far ahead. The start (monotonic) is
        read in the thread that made the reservation: a coroutine resumed later by a busy
        loop must not push its call later (and out of step with the calls reserved after
        it)."""
        if self.fleet is None or not self.spacing:
            return time.monotonic(), 0.0, None
        wait, until = self.fleet.reserve(self.name, self.spacing, MAX_WAIT)
        if until is not None:
            return None, wait, until
        return time.monotonic() + wait, 0.0, None

    # -- the line for a rate-limited provider's next start --------------------------------
    #
    # Behind a backlog, a rate-limited provider's starts are booked MAX_WAIT ahead, and a job
    # that could not reserve one was handed back at once: its slot parked, woke, claimed the
    # next job of that provider and handed it back too. With 512 slots over two workers and
    # a 16-calls/s provider that was 2,500-5,500 hand-backs (a claim, a move and an attempt
    # row each) for 300 effects (``python -m bench limits``). Instead the job waits in this
    # process's line (its lease kept by progress) as long as it takes, and only the head of
    # the line asks the database, when a start may be had: one reservation a start per
    # process. A pause alone sends the line back.

    def _line_join(self, loop: asyncio.AbstractEventLoop | None = None) -> Waiter:
        """Join the line (the head at once when it is empty)."""
        with self._line_lock:
            waiter = Waiter(loop)
            self._line.append(waiter)
            if len(self._line) == 1:
                waiter.wake()  # the head
            return waiter

    def _line_leave(self, waiter: Waiter) -> None:
        with self._line_lock:
            head = bool(self._line) and self._line[0] is waiter
            with contextlib.suppress(ValueError):
                self._line.remove(waiter)
            if head and self._line:
                self._line[0].wake()

    def _line_refused(self, until: float | None) -> ProviderThrottled:
        assert until is not None
        return self._throttled(f"is paused or at its rate limit until {until:.3f}", until)

    @contextlib.contextmanager
    def _in_line(
        self,
        until: float | None,
        progress: Callable[[], None] | None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Iterator[Waiter]:
        """A place in the line, counted as a job waiting for its provider while it is held;
        a paused provider hands the job back instead (``until``: when to try again)."""
        if self._paused_now():
            raise self._line_refused(until)
        waiter = self._line_join(loop)
        self._waiting(+1, progress)
        try:
            yield waiter
        finally:
            self._waiting(-1, progress)
            self._line_leave(waiter)

    def _reserve_waiting(self, progress: Callable[[], None] | None) -> float:
        """Reserve the call's start (:meth:`_try_reserve`), waiting in line (this thread) when
        the starts are booked too far ahead, as long as it takes, rather than handing the job
        back; a pause hands it back at once."""
        start, retry_in, until = self._try_reserve()
        if start is not None:
            return start
        with self._in_line(until, progress) as waiter:
            while True:
                if progress is not None:
                    progress()  # the lease stays renewed while the job waits in line
                if not waiter.granted:
                    waiter.wait(WAIT_TICK)
                    continue
                start, retry_in, until = self._try_reserve()
                if start is not None:
                    return start
                if self._paused_now():
                    raise self._line_refused(until)
                time.sleep(min(retry_in, WAIT_TICK))

    async def _areserve_waiting(
        self, run: Callable[..., Any], progress: Callable[[], None] | None
    ) -> float:
        """:meth:`_reserve_waiting` on the event loop (the reservations through ``run``)."""
        start, retry_in, until = await run(self._try_reserve)
        if start is not None:
            return float(start)
        with self._in_line(until, progress, asyncio.get_running_loop()) as waiter:
            while True:
                if progress is not None:
                    progress()
                if not waiter.granted:
                    await waiter.await_wake(WAIT_TICK)
                    continue
                start, retry_in, until = await run(self._try_reserve)
                if start is not None:
                    return float(start)
                if self._paused_now():
                    raise self._line_refused(until)
                await asyncio.sleep(min(retry_in, WAIT_TICK))

    def _paused_now(self) -> bool:
        return self.fleet is not None and self.fleet.paused_locally(self.name) is not None

    def enter(
        self, progress: Callable[[], None] | None = None, *, read_pause: bool = True
    ) -> Ticket:
        """Wait (in this thread) for the right to call the provider now (``read_pause``:
        :meth:`_check_pause`)."""
        self._check_pause(read_pause)
        free = self.permits.try_acquire()
        if not free:
            self._waiting(+1, progress)
            try:  # its lease kept: the job waits, in turn, never handed back
                self.permits.wait(WAIT_TICK, progress)
            finally:
                self._waiting(-1, progress)
        try:
            start = self._reserve_waiting(progress)
        except BaseException:
            self.permits.release(None)
            raise
        return self._ticket(start, free)

    def _ticket(self, start: float, free: bool) -> Ticket:
        if free:
            self.handed_back = 0  # room: the slots parked for this provider are not needed
        return Ticket(self.name, start, max(0.0, start - time.monotonic()))

    async def aenter(
        self,
        run: Callable[..., Any],
        progress: Callable[[], None] | None = None,
        *,
        read_pause: bool = True,
    ) -> Ticket:
        """:meth:`enter` for a coroutine: the database reads go through ``run`` (the worker's
        executor), the waits are the event loop's."""
        if read_pause and self.fleet is not None and not self.spacing:
            await run(self._check_pause)
        else:
            self._check_pause(False)  # no round trip: no executor hop either
        free = self.permits.try_acquire()
        if not free:
            self._waiting(+1, progress)
            try:
                await self.permits.await_permit(WAIT_TICK, progress)
            finally:
                self._waiting(-1, progress)
        try:
            if self.spacing:
                start = await self._areserve_waiting(run, progress)
            else:  # no rate limit: nothing to reserve, no hop to a thread for it either
                start = time.monotonic()
        except BaseException:
            self.permits.release(None)
            raise
        return self._ticket(start, free)

    def budget(self, ticket: Ticket) -> float:
        """Seconds the call's deadline must allow beyond its timeout: the wait for its
        reserved start, and room for new starts if it misses it (``ticket.latest``)."""
        now = time.monotonic()
        budget = max(0.0, ticket.started - now)
        if self.spacing and self.fleet is not None:
            budget += REBOOK
        ticket.latest = now + budget
        return budget

    def _left(self, ticket: Ticket) -> float | None:
        """Seconds until the ticket's start; None when it cannot be used for this call: a
        call went out on it already, or its start passed more than ``LATE`` ago."""
        if not self.spacing or self.fleet is None:
            return 0.0
        left = ticket.started - time.monotonic()
        if ticket.held or left < -LATE:
            return None
        return left

    def _rebook(self, ticket: Ticket) -> None:
        """Reserve a new start for the ticket (its own was missed or used), within what the
        call's deadline allows; ProviderThrottled when none is to be had (paused, booked
        ahead, out of time): the call is not made."""
        assert self.fleet is not None
        room = min(MAX_WAIT, ticket.latest - time.monotonic())
        if room < 0:
            clock = self.fleet.store.driver.clock or time.time
            raise self._throttled("missed its reserved start", clock() + self.spacing)
        wait, until = self.fleet.reserve(self.name, self.spacing, room)
        if until is not None:
            raise self._throttled(f"is paused or at its rate limit until {until:.3f}", until)
        ticket.started = time.monotonic() + wait
        ticket.waited += wait
        ticket.held = False

    def hold(self, ticket: Ticket, progress: Callable[[], None] | None = None) -> None:
        """Wait (this thread) until the ticket's reserved start, just before the call: the
        intent is written already, so nothing but the call itself stands between the
        reserved time and the provider (the spacing survives a slow database). A start
        missed by more than ``LATE``, or used by an earlier call, is reserved anew."""
        while True:
            left = self._left(ticket)
            if left is None:
                self._rebook(ticket)
                continue
            if left <= 0:
                break
            self._waiting(+1, progress)
            time.sleep(left)
            self._waiting(-1, progress)
        ticket.held = True

    async def ahold(
        self,
        ticket: Ticket,
        progress: Callable[[], None] | None = None,
        run: Callable[..., Any] | None = None,
    ) -> None:
        """:meth:`hold` on the event loop; a new reservation goes through ``run`` (the
        worker's executor), the wait is the loop's."""
        while True:
            left = self._left(ticket)
            if left is None:
                if run is None:
                    self._rebook(ticket)
                else:
                    await run(self._rebook, ticket)
                continue
            if left <= 0:
                break
            self._waiting(+1, progress)
            await asyncio.sleep(left)
            self._waiting(-1, progress)
        ticket.held = True

    def call(self, ticket: Ticket, step: Step, progress: Callable[[], None] | None = None) -> Step:
        """``step`` (one call to the provider) at the ticket's reserved start: :meth:`hold`
        then the call with :func:`send_by` set; a :class:`StartMissed` takes a new start
        and tries again (nothing was sent)."""

        # The latency AIMD learns from is the call's alone, from here to its answer: not the
        # intent and receipt writes around it, nor a wait for the database or the CPU
        # before it (a busy worker must not read its own queues as a slow provider, cut
        # its permits and hand its jobs back: that churn is what collapsed a loaded worker).
        def sync() -> Any:
            while True:
                self.hold(ticket, progress)
                token = _SEND_BY.set(self._send_by(ticket))
                ticket.called = time.monotonic()
                try:
                    return step.sync()
                except StartMissed:
                    continue  # held: the next hold reserves a new start
                finally:
                    ticket.answered = time.monotonic()
                    _SEND_BY.reset(token)

        async def aio(run: Runner) -> Any:
            while True:
                await self.ahold(ticket, progress, run)
                token = _SEND_BY.set(self._send_by(ticket))
                ticket.called = time.monotonic()
                try:
                    return await step.aio(run)
                except StartMissed:
                    continue
                finally:
                    ticket.answered = time.monotonic()
                    _SEND_BY.reset(token)

        return Step(sync, aio)

    def _send_by(self, ticket: Ticket) -> float | None:
        return ticket.started + LATE if self.spacing and self.fleet is not None else None

    def leave(
        self, ticket: Ticket, *, timed_out: bool = False, retry_after: float | None = None
    ) -> None:
        """The call ended: learn from its latency; a Retry-After pauses the fleet."""
        made = ticket.held and ticket.called > 0.0
        latency = max(0.0, ticket.answered - ticket.called) if made else None
        self.permits.release(latency, timed_out=timed_out)
        if retry_after is not None:
            self.pause(retry_after)

    def pause(self, seconds: float) -> None:
        """The provider asked to be left alone for ``seconds`` (a failure's ``retry_after``):
        pause it for the fleet now, before anything else is recorded, so that the calls
        made after this one wait."""
        if self.fleet is not None:
            until = self.fleet.pause(self.name, seconds)
            call_hook(self.hooks, "provider_paused", self.name, seconds, until)

    def _waiting(self, delta: int, progress: Callable[[], None] | None) -> None:
        if progress is not None:
            progress()  # the lease stays renewed while the job waits
        call_hook(self.hooks, "provider_limit_waiting", self.name, delta)
