"""The worker's run loop: N slots on one event loop; a freed slot starts its next job at once.

``Worker.run`` hands its loop to a :class:`SlotRunner` (through its ``Runner``). A worker has
``WorkerConfig.concurrency`` **slots** (jobs in flight in this process), in groups
(``WorkerConfig.slot_pools``: a queue with slots of its own; the queues that share the rest).

**One path for every job.** Each group has one *cycle*: a loop that runs **one statement** at
a time, ``Runner.finish_and_claim``: it writes the finishes of the group's jobs whose
handlers returned and claims as many jobs as the group has slots not running a handler, in
one round trip and one commit on PostgreSQL. The statement is the one writer of finishes
(``Worker.run_once`` writes its batch's with it too). Every job it claims starts at once:

- a ``def`` handler on a thread (``consumer.jobs.threads``: a pool sized from the CPUs and
  the jobs' own waits; claimed jobs beyond it wait on the loop, holding no thread);
- an ``async def`` handler as a task on this loop.

**A freed slot starts its next job at once.** When a handler returns, its slot is freed by
the next statement, which starts right away if none is in flight; one in flight gathers every
slot freed meanwhile, so a freed slot waits at most for the statement in flight (one round
trip), never for a timer, another slot's cycle or a batch of other slots. The claims never
cost a round trip per slot: the busier the slots, the more each statement carries (natural
batching). A worker never holds more leases than slots: a statement claims at most the slots
not running a handler, and the finishes it writes free the others in the same commit.

**Idle.** A cycle whose last claim came back short waits for a handler to return (its finish
is written with a claim), a kick (a NOTIFY with ``StoreConfig(notify=True)``, this process's
own enqueue, a recovery, a stop) or its poll, which is adaptive: ``BUSY_POLL`` after a claim
that found work, doubling with each empty claim (at most ``BUSY_CAP`` within ``BUSY_WINDOW``
of the last claim with work, then toward ``poll_interval``); never past the earliest known
timer.

**Faults.** A statement that fails keeps its finishes for the next one and backs off (its
jobs' leases stay theirs; the heartbeat renews them, and if the database stays away past the
ttl, another worker's claim fences them out and the finish comes back a conflict). A handler
interrupted by a database error hands its lease back.

**Stop** (SIGTERM): the cycles claim nothing more; every job in hand runs to its end and its
finish is written; then the loop returns.

Recovery, the receipt sweep and the vacuum run beside it (``WorkerDuties.maintain``, every
``MAINTENANCE_TICK``), in the database executor, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.async_handlers import AsyncHandlers, is_async_handler, run_async_handler
from consumer.jobs.config import WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.duties import WorkerDuties
from consumer.jobs.inhand import JobsInHand
from consumer.jobs.limits import shared_limits
from consumer.jobs.outcomes import WAITS, Outcome, Outcomes, Route, Settled
from consumer.jobs.permits import SCHEDULING
from consumer.jobs.store import Lease, Store
from consumer.jobs.threads import HandlerThreads, ThreadGate
from outbox import tracing
from outbox.backoff import Backoff
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import report_failure

if TYPE_CHECKING:  # the worker imports operations lazily too (only with providers)
    from collections.abc import Sequence

    from consumer.errors import ProviderThrottled
    from consumer.jobs.operations import Operations, Provider

__all__ = ["SlotGroup", "SlotParts", "SlotRunner", "is_async_handler"]

log = logging.getLogger("outbox.worker")

MAINTENANCE_TICK = 0.1  # seconds between checks whether recovery or a sweep is due
BUSY_POLL = 0.01  # an idle cycle's poll (no NOTIFY) right after a claim that found work
BUSY_CAP = 0.04  # ... doubling with each empty claim up to this within BUSY_WINDOW
BUSY_WINDOW = 1.0  # seconds; after it the poll doubles toward WorkerConfig.poll_interval
# Statements a group may have under way at once. One: a slot freed while it is in flight
# waits for it (one round trip) and goes with the next, which gathers every slot freed
# meanwhile; a second in flight made more, smaller statements for no gain in the drains
# measured (issue 52: 1-ms jobs, 16 slots, on a loaded 2-core machine).
IN_FLIGHT = 1
STOP_ATTEMPTS = 3  # statements tried at a stop before its finishes are left to their ttl


class SlotParts(Protocol):
    """What the slots use of a running worker (``consumer.jobs.runner.Runner`` is one): its
    settings, statement, jobs in hand, outcomes and duties, each through its public methods."""

    config: WorkerConfig
    store: Store
    stop: GracefulStop
    route: Route
    in_hand: JobsInHand
    outcomes: Outcomes
    providers: dict[str, Provider]
    operations: Operations | None
    duties: WorkerDuties
    listening: bool

    def finish_and_claim(
        self, done: Sequence[Settled], free: int, queues: tuple[str, ...] | None
    ) -> list[Lease]: ...

    def context(self, lease: Lease, executor: Any = None) -> JobContext: ...

    def hook(self, name: str, *args: Any, **facts: Any) -> None: ...


@dataclass(eq=False)
class SlotGroup:
    """One group of slots and its cycle's state. A slot is *running* while its handler runs,
    then *done* until the statement that writes its finish (and takes the slot) commits."""

    queues: tuple[str, ...] | None
    slots: int
    own: bool  # the slots of one queue (not those its other queues share)
    running: int = 0
    done: list[Settled] = field(default_factory=list)  # finishes for the next statement
    in_flight: int = 0  # statements under way (at most IN_FLIGHT)
    asked: int = 0  # slots those statements claim for
    more: bool = True  # the last claim filled what it asked: there may be more
    kicked: bool = True  # look now (a NOTIFY, an enqueue, a stop), not at the poll
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def busy(self) -> int:
        """Slots holding a lease or about to: handlers running, finishes not yet written,
        and the slots the statements under way claim for."""
        return self.running + len(self.done) + self.asked

    @property
    def label(self) -> str:
        """The group as the ``worker_queue_slots`` hook names it: its own queue, or ``*``."""
        return self.queues[0] if self.queues is not None and self.own else "*"


class SlotRunner:
    """One worker process's slots (see the module docstring). ``run()`` blocks until the
    worker is stopped and every job in hand has ended."""

    def __init__(self, parts: SlotParts) -> None:
        self.parts = parts
        config = parts.config
        own = config.queue_slots
        self.groups = [
            SlotGroup(g.queues, g.slots, g.queues is not None and g.queues[0] in own)
            for g in config.slot_pools()
        ]
        self.slots = sum(group.slots for group in self.groups)
        # def handlers: at most ``thread_gate.size`` at once (consumer.jobs.threads), not a
        # thread per slot (two workers of 256 on 2 cores: load average 25, issue 37).
        self.thread_gate = ThreadGate(self.slots, config.threads)
        self.threads: HandlerThreads[JobContext, SlotGroup] = HandlerThreads(
            self.thread_gate, f"{config.name}-slot", parts.outcomes.run, self._def_ended
        )
        # The statements, maintenance and the database work of async handlers (their
        # dispatches' intents and receipts): short statements, bounded by the store's
        # connection pool anyway.
        self.db = ThreadPoolExecutor(
            min(16, max(4, self.slots)), thread_name_prefix=f"{config.name}-db"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._halt: asyncio.Event | None = None  # set at a stop: parked slots end their wait
        self._tasks: set[asyncio.Future[Any]] = set()
        self._backoff = Backoff(0.2, 10.0)
        self._idle = Backoff(BUSY_POLL, config.poll_interval)
        self._failures = 0  # statements failed in a row
        self._empty = 0  # empty claims in a row
        self._busy_until = 0.0
        self._reporting = False  # a report of the slot gauges is due this turn of the loop
        self._is_async = AsyncHandlers()  # inspected once per handler, not per job

    # -- from other threads ---------------------------------------------------------------
    def kick(self) -> None:
        """Work may be waiting (a NOTIFY, a recovery, an enqueue) or the worker stops: every
        cycle looks now instead of at its next poll. Thread-safe."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(self._kicked)

    def _kicked(self) -> None:
        for group in self.groups:
            group.kicked = True
            group.wake.set()
        if self._halt is not None and self.parts.stop.stopped:
            self._halt.set()

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.threads.shutdown()
            self.db.shutdown(wait=True)

    async def _db(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self.db, fn, *args)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._halt = asyncio.Event()
        for group in self.groups:  # made on this loop (Python < 3.10 bound them at creation)
            group.wake = asyncio.Event()
        self._report_slots()  # every group's series from the start, idle ones too
        await self._providers("aprepare", "provider not prepared", logging.WARNING)
        maintenance = asyncio.create_task(self._maintenance())
        try:
            await asyncio.gather(*(self._cycle(group) for group in self.groups))
            while self._tasks:  # jobs parked by their provider's limit, handed back
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            maintenance.cancel()
            await asyncio.gather(maintenance, return_exceptions=True)
            await self._providers("aclose", "provider close failed", logging.DEBUG)
            self._report_slots()  # the last change of the slots is reported too

    async def _providers(self, method: str, failed: str, level: int) -> None:
        """Each provider's ``aprepare`` (at start) or ``aclose`` (at exit), if it has one:
        best effort (a provider that cannot prepare still works)."""
        for provider in self.parts.providers.values():
            call = getattr(provider, method, None)
            if call is None:
                continue
            try:
                await call()
            except Exception as exc:
                log.log(level, failed, extra=fields(error=repr(exc)))

    async def _maintenance(self) -> None:
        backoff = Backoff(0.2, 10.0)
        failures = 0
        while True:
            try:
                if await self._db(self.parts.duties.maintain):
                    self.kick()
                await self._db(self.parts.in_hand.watch_cancels)  # operators' cancels
                failures = 0
            except SQLAlchemyError as exc:
                failures += 1
                report_failure(log, "worker maintenance failed, retrying", exc, attempt=failures)
                await asyncio.sleep(backoff.delay(failures))
            except Exception as exc:  # a provider's lookup in the sweep: logged, retried
                report_failure(log, "receipt sweep failed, retrying", exc)
            if self.parts.stop.stopped:  # a SIGTERM sets the flag only: the cycles look now
                self._kicked()
            slept = time.monotonic()
            await asyncio.sleep(MAINTENANCE_TICK)
            # How late the loop ran this tick: the provider limits allow for it (a late event
            # loop is not a slow provider, consumer.jobs.permits.SchedulingDelay).
            SCHEDULING.note(time.monotonic() - slept - MAINTENANCE_TICK)

    # -- a group's cycle: its statements --------------------------------------------------
    async def _cycle(self, group: SlotGroup) -> None:
        stop = self.parts.stop
        while True:
            group.wake.clear()  # set from here on by a handler's return, a statement, a kick
            if stop.stopped and not (group.running or group.done or group.in_flight):
                return  # every job in hand ended, every finish written
            free = self._due(group)
            if free is not None:
                self._begin(group, free)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(group.wake.wait(), self._pause(group))
            if not group.wake.is_set():
                group.kicked = True  # the poll: look once

    def _due(self, group: SlotGroup) -> int | None:
        """The slots a statement should claim now (0: finishes alone), or None: none due.
        Due when finishes wait, or slots are free and there may be work (the last claim
        filled them, or a kick or the poll); at most IN_FLIGHT under way, one after a
        failure (its backoff paces the retries)."""
        free = 0 if self.parts.stop.stopped else group.slots - group.running - group.asked
        due = group.done or (free > 0 and (group.more or group.kicked))
        room = group.in_flight < (1 if self._failures else IN_FLIGHT)
        return free if due and room else None

    def _pause(self, group: SlotGroup) -> float | None:
        """How long the cycle waits for a wake-up (None: until one; a handler's return or
        a statement's end sets it)."""
        free = group.slots - group.running - group.asked
        if free <= 0 or self.parts.stop.stopped or group.in_flight:
            return None
        return self._idle_pause()

    def _begin(self, group: SlotGroup, free: int) -> None:
        """Start a statement carrying ``group.done``'s finishes and claiming ``free``; its
        slots count as asked for from now, so the next turn does not claim them again."""
        carried, group.done = group.done, []
        group.in_flight += 1
        group.asked += free
        group.kicked = False
        self._spawn(self._statement(group, carried, free))

    def _idle_pause(self) -> float:
        """How long an idle cycle waits: without NOTIFY from the enqueuers
        (``StoreConfig.notify``, off by default) it polls every BUSY_POLL after a claim that
        found work, doubling with each empty claim in a row: up to BUSY_CAP within
        BUSY_WINDOW of the last claim that found work, then toward poll_interval; never past
        the earliest known timer. A steady trickle (issue 54: 50 jobs/s to each of two
        workers) is polled about as often as jobs arrive, not every BUSY_POLL."""
        if self.parts.listening and self.parts.store.config.notify:
            pause = self.parts.config.poll_interval  # a NOTIFY wakes it at once
        else:
            pause = self._idle.cap(self._empty)
            if time.monotonic() < self._busy_until:
                pause = min(pause, BUSY_CAP)
        limit = self.parts.duties.sleep_limit()
        return pause if limit is None else min(pause, limit)

    async def _statement(self, group: SlotGroup, carried: list[Settled], free: int) -> None:
        """Write ``carried``'s finishes and claim ``free`` jobs (one statement); start each
        job claimed at once."""
        try:
            leases: list[Lease] = await self._db(
                self.parts.finish_and_claim, carried, free, group.queues
            )
        except Exception as exc:  # the database (or a fault of the worker's): retried
            if self.parts.stop.stopped and self._failures >= STOP_ATTEMPTS:
                self._give_up(carried, exc)
            else:
                group.done[:0] = carried  # written by the next statement
            await self._failed(exc)
            return
        finally:
            group.in_flight -= 1
            group.asked -= free
            group.wake.set()
        self._failures = 0
        for settled in carried:  # written (or refused as fenced out): out of the hands
            self._leave(settled.ctx)
        group.more = free > 0 and len(leases) >= free
        if leases:
            self._busy_until = time.monotonic() + BUSY_WINDOW
            self._empty = 0
        elif free > 0:
            self._empty += 1
        for lease in leases:
            self._start(self.parts.context(lease, self.db), group)
        if leases or carried:
            self._changed()
        self.parts.hook("worker_cycle_ok", time.time())

    async def _failed(self, error: BaseException) -> None:
        delay = self._backoff.delay(self._failures)
        self._failures += 1
        log.warning(
            "worker claim failed, retrying",
            extra=fields(
                error=f"{type(error).__name__}: {error}"[:500],
                attempt=self._failures,
                retry_in_seconds=round(delay, 3),
            ),
        )
        await asyncio.sleep(delay)

    def _give_up(self, carried: list[Settled], error: BaseException) -> None:
        """A stop, and the database still refuses the finishes after STOP_ATTEMPTS: the
        process exits without them. Their leases expire by their ttl and the jobs run again
        (a dispatch finds its receipt and sends nothing twice)."""
        report_failure(log, "finishes not recorded at stop; their leases expire", error)
        for settled in carried:
            self._leave(settled.ctx)

    # -- one job --------------------------------------------------------------------------
    def _start(self, ctx: JobContext, group: SlotGroup) -> None:
        """Start a claimed job: a ``def`` handler on a thread (``HandlerThreads``: its end
        comes back through :meth:`_def_ended`), an ``async def`` one as a task here."""
        group.running += 1
        routed = self.parts.route(ctx.lease)
        if routed is None or not self._is_async(routed[1]):
            self.threads.submit(ctx, group)
            return
        task = asyncio.ensure_future(self._run_async_job(ctx, routed))
        task.add_done_callback(lambda ended: self._task_ended(ctx, group, ended))

    def _def_ended(
        self, ctx: JobContext, group: SlotGroup, settled: Any, error: BaseException | None
    ) -> None:
        """A ``def`` handler's run ended on its thread (``Outcomes.run`` settled it)."""
        if error is None and settled.outcome is Outcome.THROTTLED and ctx.throttled is not None:
            self._spawn(self._parked(ctx, group, settled, ctx.throttled))
        else:
            self._ended(ctx, group, settled, error)

    async def _run_async_job(self, ctx: JobContext, routed: tuple[str, Any]) -> Settled:
        settled = await self._run_async(ctx, routed)
        if settled.outcome is Outcome.THROTTLED and ctx.throttled is not None:
            self._leave(ctx)  # handed back: no lease left to renew
            await self._park(ctx.throttled)
        return settled

    async def _parked(
        self, ctx: JobContext, group: SlotGroup, settled: Settled, throttled: ProviderThrottled
    ) -> None:
        """A job its provider's limit handed back keeps its slot while its provider is
        paused (:meth:`_park`), then ends."""
        self._leave(ctx)  # handed back: no lease left to renew
        try:
            await self._park(throttled)
        finally:
            self._ended(ctx, group, settled, None)

    def _task_ended(self, ctx: JobContext, group: SlotGroup, task: asyncio.Future[Settled]) -> None:
        if task.cancelled():
            self._ended(ctx, group, None, None)
        else:
            error = task.exception()
            self._ended(ctx, group, None if error else task.result(), error)

    async def _run_async(self, ctx: JobContext, routed: tuple[str, Any]) -> Settled:
        """An ``async def`` handler on this loop; its settle in the database executor."""
        parts = self.parts
        started = time.monotonic()
        ctx.started()  # renewed at every beat until here
        parts.hook("worker_job_started", routed[0], **ctx.lease.facts())
        error: BaseException | None = None
        returned: Any = None
        with tracing.running(ctx.lease, parts.route) as span:  # this task's context
            try:
                returned = await run_async_handler(ctx, routed[1])
            except Exception as exc:
                error = exc
            ctx.ended()  # renewed at every beat from here
            span.set("outbox.job.outcome", "interrupted")  # unless settled below
            if error is None and returned is None:  # its own moves are written: nothing to
                settled = parts.outcomes.settle(ctx, routed, started, None)  # write here
            else:  # a failure (or a result over its cap) is written: in the executor
                settled = await self._db(
                    parts.outcomes.settle, ctx, routed, started, error, returned
                )
            span.set("outbox.job.outcome", settled.outcome)
        return settled

    def _ended(
        self,
        ctx: JobContext,
        group: SlotGroup,
        settled: Settled | None,
        error: BaseException | None,
    ) -> None:
        """A job's run ended: a ``done`` waits for the group's next statement (its slot is
        freed there); any other outcome was written by its settle and leaves the hands now."""
        group.running -= 1
        group.wake.set()
        if settled is not None and error is None and settled.outcome is Outcome.DONE:
            ctx.outcome = Outcome.DONE  # renewed by the heartbeat until its finish commits
            group.done.append(settled)
            return
        self._changed()
        if settled is not None and error is None:
            self._after(settled)
        else:
            self._interrupted(ctx, error)

    def _after(self, settled: Settled) -> None:
        """A run that did not end ``done``: its move is written; it leaves the hands."""
        ctx = settled.ctx
        self._leave(ctx)
        if settled.outcome in WAITS:
            # a wait with ``until`` may come before every timer the worker knows
            self._spawn(self._db(self.parts.duties.learn_timer))

    def _interrupted(self, ctx: JobContext, error: BaseException | None) -> None:
        """The run broke in the worker (not in the handler, which settles its own errors)."""
        if isinstance(error, SQLAlchemyError):
            # The database went away mid-job: hand the lease back so the job runs again now
            # (a dispatch already made finds its receipt and sends nothing).
            report_failure(
                log, "job interrupted by a database error; its lease is handed back", error
            )

            self._leave(ctx)  # first: once handed back, this worker may claim it again
            self._spawn(self._db(self.parts.outcomes.hand_back_after_error, [ctx]))
            return
        log.error(
            "job run failed in the worker; its lease expires by its ttl",
            extra=fields(job_id=ctx.job_id, error=repr(error)[:500]),
        )
        self._leave(ctx)

    def _leave(self, ctx: JobContext) -> None:
        """The one place a job leaves the worker's hands (the heartbeat stops renewing it):
        its finish committed or was refused, its settle moved it, or it was handed back."""
        self.parts.in_hand.discard(ctx)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _park(self, throttled: ProviderThrottled) -> None:
        """The slot of a job its provider's limit handed back waits before the group claims
        again (``ProviderGate.aparked``; ``consumer.jobs.limits``: behind a backlog for that
        provider, a slot freed at once would claim its next job and hand it back too, at the
        database's speed). A stop ends the wait."""
        gate = shared_limits(self.parts.store).gate_named(throttled.provider)
        if gate is None or self._halt is None:
            return
        parked = asyncio.ensure_future(gate.aparked())
        halted = asyncio.ensure_future(self._halt.wait())
        await asyncio.wait((parked, halted), return_when=asyncio.FIRST_COMPLETED)
        for task in (parked, halted):
            task.cancel()
        await asyncio.gather(parked, halted, return_exceptions=True)

    # -- the gauges -----------------------------------------------------------------------
    def _changed(self) -> None:
        """The slots' gauges are reported once per turn of the loop, not per job."""
        if not self._reporting:
            self._reporting = True
            asyncio.get_running_loop().call_soon(self._report_slots)

    def _report_slots(self) -> None:
        self._reporting = False
        self.parts.hook("worker_slots", sum(group.busy for group in self.groups), self.slots)
        for group in self.groups:
            self.parts.hook("worker_queue_slots", group.label, group.busy, group.slots)
