"""The worker's run loop: N slots on one event loop, each claimed job started at once.

``Worker.run`` hands its loop to a :class:`SlotRunner` (through its ``Runner``). A worker has
``WorkerConfig.concurrency`` **slots** (jobs in flight in this process). The runner claims at
most as many jobs as it has free slots, all of them in **one** ``Store.claim_batch``
statement, and starts each job the moment it is claimed: no job is leased to a process that
cannot start it now (a batch model let a claimed job wait behind its batch-mates while it
held a lease no idle worker could take: p99 44 s at 45 quotes/s with the old defaults).

- A ``def`` handler runs on a bounded pool of threads (``consumer.jobs.threads``: sized
  from the CPUs and the jobs' own waits, or ``WorkerConfig.threads``); the claimed jobs
  beyond it wait for a thread on the loop, holding their lease but no thread. Handlers
  learned to take microseconds run in the claim's own thread right after it, which may
  chain the next claim (``consumer.jobs.claim_runs``), or several to a hand-off
  (``QuickHandOff``).
- An ``async def`` handler runs on the runner's event loop; ``await job.adispatch(...)``
  keeps the provider call there and its database statements in a small executor.
- Claims never cost a round trip per slot: a claim takes every slot free at that moment,
  and while handlers run, claims are ``CLAIM_SPACING`` apart (unless every handler has
  returned), so slots freed meanwhile are claimed together. When a claim fills every free
  slot there may be more: the next slot freed claims again; otherwise the runner waits for
  a NOTIFY (``StoreConfig(notify=True)``), a timer or the poll, which is adaptive: every
  ``BUSY_POLL`` for ``BUSY_WINDOW`` after a claim that found work, then doubling toward
  ``poll_interval`` (an empty claim reads the READY index only).
- **A finish and the next claim in one statement** (the default). A job whose handler
  returned holds its slot until its finish is written, so a worker never holds more leases
  than slots; the claim that takes the slot writes the finish itself
  (``Store.finish_and_claim``: one statement, one commit on PostgreSQL), and the slot
  starts its next job when it commits. A finish no claim takes within ``FLUSH_AFTER`` (no
  more work) is written by the completer (``consumer.jobs.completer``).
- **Claim ahead** (``WorkerConfig(claim_ahead=True)``, ``--claim-ahead``; off by default).
  Each group of slots keeps a small buffer of claimed jobs for the slots about to free: a
  freed slot starts the next buffered job at once, and the claim that refills the buffer
  runs beside the jobs. The buffer is bounded by the group's slots and a fetch-ahead that
  adapts to the work (doubling while claims come back full, halving when one comes back
  short), and never holds more than the group starts within ``BUFFER_SECONDS``. Buffered
  jobs hold real, fenced leases; the heartbeat renews them, one buffered longer than a
  third of the ttl goes back to READY, and a stop (SIGTERM) hands the buffer back at once.
  A finished job's slot is free at once and the completer writes the finishes in batches:
  the leases a worker holds are at most its slots, its buffer and the finishes not yet
  committed (``consumer.jobs.completer``: what a crash takes back).
- Slots per queue (``WorkerConfig.slot_pools``, ``consumer.jobs.config``): each group of
  slots (a queue with slots of its own; the queues that share the rest) is claimed with its
  own statement, of that group's free slots and its queues only, so a queue's jobs never
  take more than its slots and a busy queue never takes another's. The groups that have
  free slots are claimed together (concurrently, one statement each); while jobs run, a
  group whose last claim filled its free slots claims again as soon as one of them is
  freed, the others on a NOTIFY, a timer or the poll.

Recovery, the receipt sweep and the vacuum run beside it (``WorkerDuties.maintain``, every
``MAINTENANCE_TICK``), in the executor, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.async_handlers import AsyncHandlers, is_async_handler, run_async_handler
from consumer.jobs.claim_runs import ClaimParts, ClaimRuns, Ran
from consumer.jobs.completer import Completer
from consumer.jobs.config import QueueSlots, WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.duties import WorkerDuties
from consumer.jobs.limits import shared_limits
from consumer.jobs.outcomes import WAITS, Settled
from consumer.jobs.permits import SCHEDULING
from consumer.jobs.slot_groups import SlotGroup, first_set
from consumer.jobs.store import Store
from consumer.jobs.threads import QuickHandOff, ThreadGate, timed
from outbox import tracing
from outbox.backoff import Backoff
from outbox.logs import fields
from outbox.outage import report_failure

if TYPE_CHECKING:  # the worker imports operations lazily too (only with providers)
    from consumer.errors import ProviderThrottled
    from consumer.jobs.operations import Operations, Provider

__all__ = ["CLAIM_SPACING", "SlotParts", "SlotRunner", "is_async_handler"]

log = logging.getLogger("outbox.worker")

CLAIM_SPACING = 0.005  # seconds between two claims while jobs run (see the docstring)
MAINTENANCE_TICK = 0.1  # seconds between checks whether recovery or a sweep is due
BUSY_POLL = 0.01  # an idle loop's poll (no NOTIFY) within BUSY_WINDOW of a claim with work
BUSY_WINDOW = 1.0  # seconds; after it the poll doubles toward WorkerConfig.poll_interval


class SlotParts(ClaimParts, Protocol):
    """What the slots use of a running worker (``consumer.jobs.runner.Runner`` is one): its
    settings, claim, jobs in hand, outcomes and duties, each through its public methods
    (the claims' part: ``consumer.jobs.claim_runs.ClaimParts``)."""

    config: WorkerConfig
    store: Store
    providers: dict[str, Provider]
    operations: Operations | None
    duties: WorkerDuties
    listening: bool

    def hook(self, name: str, *args: Any, **facts: Any) -> None: ...


class SlotRunner:
    """One worker process's slots (see the module docstring). ``run()`` blocks until the
    worker is stopped and every job in hand has ended."""

    def __init__(self, parts: SlotParts) -> None:
        self.parts = parts
        config = parts.config
        groups: tuple[QueueSlots, ...] = config.slot_pools()
        own = config.queue_slots
        self.pools = [
            SlotGroup(g.queues, g.slots, g.queues is not None and g.queues[0] in own)
            for g in groups
        ]
        self.slots = sum(pool.slots for pool in self.pools)
        self.busy = 0
        # def handlers: at most ``thread_gate.size`` at once (consumer.jobs.threads), not a
        # thread per slot (two workers of 256 on 2 cores: load average 25, issue 37).
        self.thread_gate = ThreadGate(self.slots, config.threads)
        self.threads = ThreadPoolExecutor(
            self.thread_gate.most, thread_name_prefix=f"{config.name}-slot"
        )
        self.quick = QuickHandOff(self.thread_gate, self.threads, parts.outcomes.run)
        # Claims, finishes, maintenance and the database statements of async dispatches:
        # short statements, bounded by the store's connection pool anyway.
        self.db = ThreadPoolExecutor(
            min(16, max(4, self.slots)), thread_name_prefix=f"{config.name}-db"
        )
        # Claim ahead (WorkerConfig.claim_ahead): a buffer, and finishes off the slot's path;
        # off, a slot is freed once its finish is recorded (written at once, group commit).
        self.ahead = config.claim_ahead
        self.completer = Completer(
            parts.outcomes,
            self._db,
            self._recorded,
        )
        # The jobs whose finish a claim of their group writes (``_after``): id -> group.
        self._finishing_in: dict[int, SlotGroup] = {}
        self._ran: dict[int, Ran | BaseException] = {}  # run by its claim's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._freed: asyncio.Event | None = None
        self._halt: asyncio.Event | None = None  # set at a stop
        self._tasks: set[asyncio.Task[None]] = set()
        # The claim loop's state: failures in a row, empty claims after the busy window.
        self._backoff = Backoff(0.2, 10.0)
        self._idle = Backoff(BUSY_POLL, config.poll_interval)
        self._failures = 0
        self._empty = 0
        self._busy_until = 0.0
        self._last_claim = 0.0
        self._reporting = False  # a report of the slot gauges is due this turn of the loop
        self._is_async = AsyncHandlers()  # inspected once per handler, not per job
        # The claims, and quick handlers run in the claim's own thread (and chained claims).
        self.claim_runs = ClaimRuns(
            parts,
            self.thread_gate,
            self._is_async,
            self.db,
            inline=not self.ahead,
            chain=len(self.pools) == 1,
        )

    # -- from other threads ---------------------------------------------------------------
    def kick(self) -> None:
        """Work may be waiting (a NOTIFY, a recovery, a stop): claim now. Thread-safe."""
        loop, kick, halt, freed = self._loop, self._kick, self._halt, self._freed
        if loop is not None and kick is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(kick.set)
                if halt is not None and freed is not None and self.parts.stop.stopped:
                    loop.call_soon_threadsafe(halt.set)  # parked slots end their wait
                    # A claim loop waiting for a slot to free (every slot busy, the buffer
                    # full) looks now: the buffer goes back at once, not when a job ends.
                    loop.call_soon_threadsafe(freed.set)

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self.threads.shutdown(wait=True)
            self.db.shutdown(wait=True)

    async def _db(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._loop is not None
        return await self._loop.run_in_executor(self.db, fn, *args)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._freed = asyncio.Event()
        self._halt = asyncio.Event()
        self._kick.set()  # claim at once
        self.parts.hook("worker_slots", 0, self.slots)
        for pool in self.pools:  # every group's series from the start, idle ones too
            self.parts.hook("worker_queue_slots", pool.label, 0, pool.slots)
        await self._providers("aprepare", "provider not prepared", logging.WARNING)
        maintenance = asyncio.create_task(self._maintenance())
        completer = asyncio.create_task(self.completer.run())
        try:
            await self._claim_loop()
            await self._hand_back_buffers()  # at once: other workers may run them now
            while self._tasks:  # drain: every job in hand runs to its end
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            await self.completer.close()
            await asyncio.gather(completer, return_exceptions=True)
            maintenance.cancel()
            await asyncio.gather(maintenance, return_exceptions=True)
            await self._providers("aclose", "provider close failed", logging.DEBUG)
            if self._reporting:  # the last change of the slots is reported too
                self._report_slots()

    async def _hand_back_buffers(self) -> None:
        buffered = [(ctx, pool) for pool in self.pools for ctx, _ in pool.buffer]
        for pool in self.pools:
            pool.buffer.clear()
        contexts = [ctx for ctx, _ in buffered if ctx.job_id not in self._ran]
        for ctx, pool in buffered:  # a job its claim's thread ran ends as run: its finish
            if ctx.job_id in self._ran:
                self._start(ctx, pool)
        if not contexts:
            return
        try:
            released = await self._db(self.parts.outcomes.release, contexts)
            log.info("claimed jobs handed back at stop", extra=fields(jobs=released))
        except SQLAlchemyError as exc:  # their leases expire by their ttl
            report_failure(log, "claimed jobs not handed back; their leases expire", exc)
        finally:
            for ctx in contexts:
                self.parts.in_hand.remove(ctx.job_id)

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
            slept = time.monotonic()
            await asyncio.sleep(MAINTENANCE_TICK)
            # How late the loop ran this tick: the provider limits allow for it (a late event
            # loop is not a slow provider, consumer.jobs.permits.SchedulingDelay).
            SCHEDULING.note(time.monotonic() - slept - MAINTENANCE_TICK)

    # -- claiming, in named steps -------------------------------------------------------
    async def _claim_loop(self) -> None:
        assert self._freed is not None
        while not self.parts.stop.stopped:
            # Cleared before the slots are looked at: a slot freed from here on wakes a wait
            # below (the loop and the jobs' ends share one thread, so nothing comes between).
            self._freed.clear()
            open_pools = [pool for pool in self.pools if pool.wanted + self._carried(pool) > 0]
            if not open_pools:
                await self._freed.wait()
                continue
            targets = await self._targets(open_pools)
            if targets:
                await self._claim_round(targets)

    async def _targets(self, open_pools: list[SlotGroup]) -> list[SlotGroup]:
        """The groups to claim for now, after waiting if none is due (empty: look again).
        Due: a group whose last claim filled its free slots, or one not claimed for a poll
        interval (another group's steady claims must not keep it from its poll)."""
        assert self._kick is not None and self._freed is not None
        kicked = self._kick.is_set()
        stale = time.monotonic() - self.parts.config.poll_interval
        due = [pool for pool in open_pools if pool.more or pool.claimed_at <= stale]
        if not due and not kicked:
            # A full group whose last claim filled it claims again once a slot is freed.
            watch_freed = any(pool.more for pool in self.pools)
            events = {"kick": self._kick} | ({"freed": self._freed} if watch_freed else {})
            if await first_set(events, self._idle_pause()) == "freed":
                return []
            if self.parts.stop.stopped:
                return []
            kicked = True  # a NOTIFY, a stop, a timer or the poll: every group looks
        self._kick.clear()
        return open_pools if kicked else due

    def _idle_pause(self) -> float:
        """How long an idle loop waits: without NOTIFY from the enqueuers
        (``StoreConfig.notify``, off by default) it polls every BUSY_POLL for a BUSY_WINDOW
        after a claim that found work, then doubling toward poll_interval; never past the
        earliest known timer."""
        if self.parts.listening and self.parts.store.config.notify:
            pause = self.parts.config.poll_interval  # a NOTIFY wakes it at once
        else:
            pause = self._idle.cap(self._empty)
        limit = self.parts.duties.sleep_limit()
        return pause if limit is None else min(pause, limit)

    async def _claim_round(self, targets: list[SlotGroup]) -> None:
        """One claim per target group, together; spaced from the last while jobs run."""
        await self._spaced()  # slots freed meanwhile join this claim
        self._last_claim = time.monotonic()
        results = await asyncio.gather(
            *(self._claim_into(pool) for pool in targets), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if not isinstance(error, SQLAlchemyError):
                raise error
        if errors:
            await self._claim_failed(errors[0])
            return
        self._failures = 0
        if any(results):
            self._busy_until = time.monotonic() + BUSY_WINDOW
            self._empty = 0
        elif time.monotonic() >= self._busy_until:
            self._empty += 1
        self.parts.hook("worker_cycle_ok", time.time())

    def _running(self) -> int:
        """Slots whose handler has not returned yet."""
        return self.busy - sum(pool.finishing for pool in self.pools)

    async def _spaced(self) -> None:
        """While handlers run, wait until CLAIM_SPACING after the last claim, or until no
        handler runs any more (the claim then takes every slot)."""
        assert self._freed is not None
        deadline = self._last_claim + CLAIM_SPACING
        while self._running() and (left := deadline - time.monotonic()) > 0:
            self._freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), left)

    def _carried(self, pool: SlotGroup) -> int:
        """Finishes waiting to be written whose slots are this group's: a claim for the
        group writes them and takes their slots (without claim ahead)."""
        return sum(map(self._of(pool), self.completer.pending)) if self._finishing_in else 0

    def _of(self, pool: SlotGroup) -> Callable[[Settled], bool]:
        """Whether a finish waiting to be written holds a slot of ``pool``."""
        return lambda settled: self._finishing_in.get(settled.ctx.job_id) is pool

    async def _claim_failed(self, error: BaseException) -> None:
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

    async def _claim_into(self, pool: SlotGroup) -> int:
        """Claim for one group (one statement): its free slots and its fetch-ahead; start
        what its free slots take, buffer the rest."""
        # The finishes of its slots, written by the claim itself (none with claim ahead).
        carried = self.completer.take(self._of(pool)) if self._finishing_in else []
        wanted = pool.wanted + len(carried)
        if wanted <= 0:
            return 0
        pool.claimed_at = time.monotonic()
        try:
            claimed, learned = await self._db(self.claim_runs, carried, wanted, pool.queues)
        except BaseException:
            self.completer.resubmit(carried)  # written on their own after all
            raise
        claimed_at = time.monotonic()
        for wall, cpu in learned:  # the runs of the claims it chained
            self.thread_gate.learn(wall, cpu)
        for ctx, ran in claimed:
            if ran is not None:
                self._ran[ctx.job_id] = ran
            pool.buffer.append((ctx, claimed_at))
        # Between the count and now slots can only have been freed: never more than its own.
        self._start_buffered(pool)
        # The carried jobs' slots free next, each taking a buffered job (``_run``).
        self.completer.recorded(carried)
        pool.more = len(claimed) >= wanted
        if self.ahead:
            pool.adapt(len(claimed), wanted)
        return len(claimed)

    def _start_buffered(self, pool: SlotGroup) -> None:
        """Start buffered jobs in the group's free slots, oldest first; one buffered past a
        third of the ttl goes back to READY instead (its lease was not taken to sit)."""
        stale = time.monotonic() - self.parts.config.ttl / 3
        while pool.buffer and pool.free > 0:
            ctx, claimed_at = pool.buffer.popleft()
            if claimed_at < stale and ctx.job_id not in self._ran:
                self._give_back(ctx)
                continue
            self._start(ctx, pool)

    def _give_back(self, ctx: JobContext) -> None:
        async def give_back() -> None:
            try:
                await self._db(self.parts.outcomes.release, [ctx])
            except SQLAlchemyError as exc:  # its lease expires by its ttl
                report_failure(log, "a buffered job not handed back; its lease expires", exc)
            finally:
                self.parts.in_hand.remove(ctx.job_id)

        task = asyncio.create_task(give_back())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one job --------------------------------------------------------------------------
    def _start(self, ctx: JobContext, pool: SlotGroup) -> None:
        pool.started += 1
        self._taken(pool, +1)
        task = asyncio.create_task(self._run(ctx, pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _taken(self, pool: SlotGroup, change: int) -> None:
        self.busy += change
        pool.busy += change
        if not self._reporting:  # the gauges once per turn of the loop, not twice per job
            self._reporting = True
            asyncio.get_running_loop().call_soon(self._report_slots)

    def _report_slots(self) -> None:
        self._reporting = False
        self.parts.hook("worker_slots", self.busy, self.slots)
        for pool in self.pools:
            self.parts.hook("worker_queue_slots", pool.label, pool.busy, pool.slots)

    async def _run(self, ctx: JobContext, pool: SlotGroup) -> None:
        parts = self.parts
        assert self._loop is not None and self._freed is not None
        try:
            settled = await self._handle(ctx)
            await self._after(settled, pool)
        except SQLAlchemyError as exc:
            # The database went away mid-job: hand the lease back so the job runs again now
            # (a dispatch already made finds its receipt and sends nothing).
            report_failure(
                log, "job interrupted by a database error; its lease is handed back", exc
            )
            with contextlib.suppress(Exception):  # unreachable still: the lease expires by its ttl
                await self._db(parts.outcomes.hand_back_after_error, [ctx])
        except Exception as exc:  # the worker's own fault, not the handler's: say so
            log.error(
                "job run failed in the worker; its lease expires by its ttl",
                extra=fields(job_id=ctx.job_id, error=repr(exc)[:500]),
            )
        finally:
            if ctx.outcome != "done":  # a finish leaves the hands once it is recorded
                parts.in_hand.remove(ctx.job_id)
            self._taken(pool, -1)
            self._start_buffered(pool)  # the next job now, no round trip
            self._freed.set()

    async def _handle(self, ctx: JobContext) -> Settled:
        """Run the job's handler: an ``async def`` one on this loop, a ``def`` one on a
        slot's thread; either way settled by ``Outcomes.settle``."""
        assert self._loop is not None
        parts = self.parts
        routed = parts.route(ctx.lease)
        if routed is None or not self._is_async(routed[1]):
            ran = self._ran.pop(ctx.job_id, None)  # run by its claim's thread already
            if isinstance(ran, BaseException):
                raise ran
            if ran is None and self.thread_gate.quick:  # with other quick ones, one hand-off
                ran = await self.quick.run(ctx)
            elif ran is None:
                async with self.thread_gate:  # waits on the loop for a thread, holding none
                    ran = await self._loop.run_in_executor(
                        self.threads, timed, parts.outcomes.run, ctx
                    )
            self.thread_gate.learn(ran[1], ran[2])
            return ran[0]
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
            settled: Settled = await self._db(
                parts.outcomes.settle, ctx, routed, started, error, returned
            )
            span.set("outbox.job.outcome", settled.outcome)
        return settled

    async def _after(self, settled: Settled, pool: SlotGroup) -> None:
        ctx = settled.ctx
        if settled.outcome == "throttled" and ctx.throttled is not None:
            self.parts.in_hand.remove(ctx.job_id)  # handed back: no lease left to renew
            await self._park(ctx.throttled)
        if settled.outcome in WAITS:
            # a wait with ``until`` may come before every timer the worker knows
            await self._db(self.parts.duties.learn_timer)
        if settled.outcome == "done":
            ctx.outcome = "done"  # renewed by the heartbeat until its finish is recorded
            recorded = self.completer.submit(settled)
            if not self.ahead:
                # Leases held never exceed the slots (DESIGN.md): the slot is freed once the
                # finish is written, by the completer or by the claim that takes the slot.
                self._finishing_in[ctx.job_id] = pool
                pool.finishing += 1
                assert self._freed is not None
                self._freed.set()
                try:
                    await recorded
                finally:
                    pool.finishing -= 1
                    self._finishing_in.pop(ctx.job_id, None)

    async def _park(self, throttled: ProviderThrottled) -> None:
        """The slot of a job its provider's limit handed back waits before it is freed
        (``ProviderGate.aparked``; ``consumer.jobs.limits``: behind a backlog for that
        provider, a slot freed at once claims its next job and hands it back too, at the
        database's speed). A stop ends the wait."""
        # The provider's one gate in this process (a user's own Operations' too).
        gate = shared_limits(self.parts.store).gate_named(throttled.provider)
        if gate is None or self._halt is None:
            return
        parked = asyncio.ensure_future(gate.aparked())
        halted = asyncio.ensure_future(self._halt.wait())
        await asyncio.wait((parked, halted), return_when=asyncio.FIRST_COMPLETED)
        for task in (parked, halted):
            task.cancel()
        await asyncio.gather(parked, halted, return_exceptions=True)

    def _recorded(self, settled: Settled) -> None:
        """The completer recorded this job's finish: it leaves the worker's hands."""
        self.parts.in_hand.remove(settled.ctx.job_id)
