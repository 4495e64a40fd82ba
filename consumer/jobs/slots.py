"""The worker's run loop: N slots on one event loop, each claimed job started at once.

``Worker.run`` hands its loop to a :class:`SlotRunner`. A worker has
``WorkerConfig.concurrency`` **slots** (jobs in flight in this process). The runner claims at
most as many jobs as it has free slots, all of them in **one** ``Store.claim_batch``
statement, and starts each job the moment it is claimed: no job is leased to a process that
cannot start it now (a batch model let a claimed job wait behind its batch-mates while it
held a lease no idle worker could take: p99 44 s at 45 quotes/s with the old defaults).

- A ``def`` handler runs on a pool of threads (one per slot, made as needed).
- An ``async def`` handler runs on the runner's event loop; ``await job.adispatch(...)``
  keeps the provider call there and its database statements in a small executor, so one
  process holds hundreds of calls in flight for little CPU.
- Claims never cost a round trip per slot: a claim takes every slot free at that moment,
  and while jobs run, claims are at least ``CLAIM_SPACING`` apart, so slots freed meanwhile
  are claimed together (2 workers x 16 threads claiming one job each was CPU-bound on this
  machine). When a claim fills every free slot there may be more: the next slot freed
  claims again; otherwise the runner waits for a NOTIFY (PostgreSQL, with
  ``StoreConfig(notify=True)``), a timer or the poll. Without NOTIFY (the default) the poll
  is adaptive, like the relay's: every ``BUSY_POLL`` for ``BUSY_WINDOW`` after a claim that
  found work, then doubling toward ``poll_interval`` (an empty claim reads the READY index
  only, ~0.1-0.2 ms of the server).
- Finishes are recorded in batches: a finished job joins the batch being written, and the
  first one waiting writes everyone's in one ``finish_batch`` (group commit). Its slot is
  freed once its finish is recorded, so the leases a worker holds never exceed its slots.
- Slots per queue (``WorkerConfig.slot_pools``, ``consumer.jobs.config``): each group of
  slots (a queue with slots of its own; the queues that share the rest) is claimed with its
  own statement, of that group's free slots and its queues only, so a queue's jobs never
  take more than its slots and a busy queue never takes another's. The groups that have
  free slots are claimed together (concurrently, one statement each); while jobs run, a
  group whose last claim filled its free slots claims again as soon as one of them is
  freed, the others on a NOTIFY, a timer or the poll.

Recovery, the receipt sweep and the vacuum run beside it (``Worker._maintain``, every
``MAINTENANCE_TICK``), in the executor, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.config import QueueSlots, WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.store import Lease, Store
from outbox import tracing
from outbox.backoff import Backoff
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import report_failure

if TYPE_CHECKING:  # the worker imports operations lazily too (only with providers)
    from consumer.errors import ProviderThrottled
    from consumer.jobs.operations import Operations, Provider

__all__ = ["CLAIM_SPACING", "SlotHost", "SlotRunner", "is_async_handler"]

log = logging.getLogger("outbox.worker")

CLAIM_SPACING = 0.005  # seconds between two claims while jobs run (see the docstring)
MAINTENANCE_TICK = 0.1  # seconds between checks whether recovery or a sweep is due
BUSY_POLL = 0.01  # an idle loop's poll (no NOTIFY) within BUSY_WINDOW of a claim with work
BUSY_WINDOW = 1.0  # seconds; after it the poll doubles toward WorkerConfig.poll_interval


def is_async_handler(fn: Callable[..., Any]) -> bool:
    """An ``async def`` handler (or a callable object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's method
    )


Routed = tuple[str, Callable[..., Any]]


class SlotHost(Protocol):
    """What the runner needs of its worker (``consumer.jobs.worker.Worker`` is one): its
    settings, its handlers' routing and outcomes, its claim, and its bookkeeping of the jobs
    in hand (the heartbeat renews those). A protocol, so that this module never imports the
    worker's (the worker imports this one)."""

    stop_flag: GracefulStop
    providers: dict[str, Provider]
    _active: dict[int, JobContext]
    _active_lock: threading.Lock
    _listening: bool

    @property
    def config(self) -> WorkerConfig: ...

    @property
    def operations(self) -> Operations | None: ...

    def route(self, lease: Lease) -> Routed | None: ...

    def _store(self) -> Store: ...

    def _claim(self, free: int, queues: tuple[str, ...] | None) -> list[Lease]: ...

    def _maintain(self) -> bool: ...

    def _ensure_heartbeat(self) -> None: ...

    def _sleep_limit(self) -> float | None: ...

    def _learn_timer(self, store: Store) -> None: ...

    def _run_traced(self, ctx: JobContext) -> tuple[str, str, float]: ...

    def _settle(
        self, ctx: JobContext, routed: Routed | None, started: float, error: BaseException | None
    ) -> tuple[str, str, float]: ...

    def _hand_back_after_error(self, contexts: list[JobContext]) -> None: ...

    def _hook(self, name: str, *args: Any, **facts: Any) -> None: ...


@dataclass
class _Pool:
    """One group of slots (``QueueSlots``) as the runner keeps it: how many are busy, and
    whether its last claim filled its free slots (there may be more of its jobs)."""

    queues: tuple[str, ...] | None
    slots: int
    own: bool  # the slots of one queue (not those its other queues share)
    busy: int = 0
    more: bool = True
    claimed_at: float = 0.0  # monotonic time of its last claim

    @property
    def free(self) -> int:
        return self.slots - self.busy

    @property
    def label(self) -> str:
        """The group as the ``worker_queue_slots`` hook names it: its own queue, or ``*``."""
        return self.queues[0] if self.queues is not None and self.own else "*"


class SlotRunner:
    """One worker process's slots (see the module docstring). ``run()`` blocks until the
    worker is stopped and every job in hand has ended."""

    def __init__(self, worker: SlotHost) -> None:
        self.worker = worker
        groups: tuple[QueueSlots, ...] = worker.config.slot_pools()
        own = worker.config.queue_slots
        self.pools = [
            _Pool(g.queues, g.slots, g.queues is not None and g.queues[0] in own) for g in groups
        ]
        self.slots = sum(pool.slots for pool in self.pools)
        self.busy = 0
        name = worker.config.name
        self.threads = ThreadPoolExecutor(self.slots, thread_name_prefix=f"{name}-slot")
        # Claims, finishes, maintenance and the database statements of async dispatches:
        # short statements, bounded by the store's connection pool anyway.
        self.db = ThreadPoolExecutor(min(16, max(4, self.slots)), thread_name_prefix=f"{name}-db")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick: asyncio.Event | None = None
        self._freed: asyncio.Event | None = None
        self._halt: asyncio.Event | None = None  # set at a stop
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: list[tuple[JobContext, str, float, asyncio.Future[bool]]] = []
        self._flushing = False

    # -- from other threads ---------------------------------------------------------------
    def kick(self) -> None:
        """Work may be waiting (a NOTIFY, a recovery, a stop): claim now. Thread-safe."""
        loop, kick, halt = self._loop, self._kick, self._halt
        if loop is not None and kick is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(kick.set)
                if halt is not None and self.worker.stop_flag.stopped:
                    loop.call_soon_threadsafe(halt.set)  # parked slots end their wait

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
        self.worker._hook("worker_slots", 0, self.slots)
        for pool in self.pools:  # every group's series from the start, idle ones too
            self.worker._hook("worker_queue_slots", pool.label, 0, pool.slots)
        for provider in self.worker.providers.values():
            prepare = getattr(provider, "aprepare", None)
            if prepare is not None:
                try:
                    await prepare()
                except Exception as exc:  # a provider that cannot prepare still works
                    log.warning("provider not prepared", extra=fields(error=repr(exc)))
        maintenance = asyncio.create_task(self._maintenance())
        try:
            await self._claim_loop()
            while self._tasks:  # drain: every job in hand runs to its end
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
        finally:
            maintenance.cancel()
            await asyncio.gather(maintenance, return_exceptions=True)
            await self._close_providers()

    async def _close_providers(self) -> None:
        for provider in self.worker.providers.values():
            aclose = getattr(provider, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception as exc:  # closing is best effort at exit
                    log.debug("provider close failed", extra=fields(error=repr(exc)))

    async def _maintenance(self) -> None:
        backoff = Backoff(0.2, 10.0)
        failures = 0
        while True:
            try:
                if await self._db(self.worker._maintain):
                    self.kick()
                failures = 0
            except SQLAlchemyError as exc:
                failures += 1
                report_failure(log, "worker maintenance failed, retrying", exc, attempt=failures)
                await asyncio.sleep(backoff.delay(failures))
            except Exception as exc:  # a provider's lookup in the sweep: logged, retried
                report_failure(log, "receipt sweep failed, retrying", exc)
            await asyncio.sleep(MAINTENANCE_TICK)

    async def _claim_loop(self) -> None:
        assert self._kick is not None and self._freed is not None
        worker = self.worker
        stop = worker.stop_flag
        backoff = Backoff(0.2, 10.0)
        idle = Backoff(BUSY_POLL, worker.config.poll_interval)
        # Without NOTIFY from the enqueuers (``StoreConfig.notify``, off by default) an idle
        # loop polls: every BUSY_POLL for a BUSY_WINDOW after a claim that found work, then
        # doubling toward poll_interval (``empty`` counts the empty claims after the window).
        notified = worker._store().config.notify
        busy_until = 0.0
        failures = 0
        empty = 0
        last_claim = 0.0
        while not stop.stopped:
            # Cleared before the slots are looked at: a slot freed from here on wakes a wait
            # below (the loop and the jobs' ends share one thread, so nothing comes between).
            self._freed.clear()
            open_pools = [pool for pool in self.pools if pool.free > 0]
            if not open_pools:
                await self._freed.wait()
                continue
            kicked = self._kick.is_set()
            # Due: a group whose last claim filled its free slots, or one not claimed for a
            # poll interval (another group's steady claims must not keep it from its poll).
            stale = time.monotonic() - worker.config.poll_interval
            due = [pool for pool in open_pools if pool.more or pool.claimed_at <= stale]
            if not due and not kicked:
                limit = worker._sleep_limit()
                if worker._listening and notified:
                    pause = worker.config.poll_interval  # a NOTIFY wakes it at once
                else:
                    pause = idle.cap(empty)
                pause = pause if limit is None else min(pause, limit)
                # A full group whose last claim filled it claims again once a slot is freed.
                watch_freed = any(pool.more for pool in self.pools)
                if await self._wait(pause, watch_freed) == "freed":
                    continue
                if stop.stopped:
                    break
                kicked = True  # a NOTIFY, a stop, a timer or the poll: every group looks
            self._kick.clear()
            spacing = CLAIM_SPACING - (time.monotonic() - last_claim)
            if self.busy and spacing > 0:
                await asyncio.sleep(spacing)  # slots freed meanwhile join this claim
            targets = open_pools if kicked else due
            last_claim = time.monotonic()
            results = await asyncio.gather(
                *(self._claim_into(pool) for pool in targets), return_exceptions=True
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            for error in errors:
                if not isinstance(error, SQLAlchemyError):
                    raise error
            if errors:
                delay = backoff.delay(failures)
                failures += 1
                log.warning(
                    "worker claim failed, retrying",
                    extra=fields(
                        error=f"{type(errors[0]).__name__}: {errors[0]}"[:500],
                        attempt=failures,
                        retry_in_seconds=round(delay, 3),
                    ),
                )
                await asyncio.sleep(delay)
                continue
            failures = 0
            if any(results):
                busy_until = time.monotonic() + BUSY_WINDOW
                empty = 0
            elif time.monotonic() >= busy_until:
                empty += 1
            worker._hook("worker_cycle_ok", time.time())

    async def _wait(self, pause: float, watch_freed: bool) -> str:
        """Wait up to ``pause`` seconds for a kick (or a freed slot, ``watch_freed``): which
        came, or ``"poll"``."""
        assert self._kick is not None and self._freed is not None
        waits = {asyncio.ensure_future(self._kick.wait()): "kick"}
        if watch_freed:
            waits[asyncio.ensure_future(self._freed.wait())] = "freed"
        done, pending = await asyncio.wait(
            waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if any(waits[task] == "kick" for task in done):
            return "kick"
        return "freed" if done else "poll"

    async def _claim_into(self, pool: _Pool) -> int:
        """Claim the free slots of one group (one statement) and start what came."""
        free = pool.free
        if free <= 0:
            return 0
        pool.claimed_at = time.monotonic()
        leases: list[Lease] = await self._db(self.worker._claim, free, pool.queues)
        # Between the count and now slots can only have been freed: never more than its own.
        for lease in leases:
            self._start(lease, pool)
        pool.more = len(leases) >= free
        return len(leases)

    # -- one job --------------------------------------------------------------------------
    def _start(self, lease: Lease, pool: _Pool) -> None:
        worker = self.worker
        ctx = JobContext(worker._store(), lease, worker.operations, executor=self.db)
        with worker._active_lock:
            worker._active[ctx.job_id] = ctx
        worker._ensure_heartbeat()
        self.busy += 1
        pool.busy += 1
        worker._hook("worker_slots", self.busy, self.slots)
        worker._hook("worker_queue_slots", pool.label, pool.busy, pool.slots)
        task = asyncio.create_task(self._run(ctx, pool))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, ctx: JobContext, pool: _Pool) -> None:
        worker = self.worker
        assert self._loop is not None and self._freed is not None
        try:
            routed = worker.route(ctx.lease)
            if routed is not None and is_async_handler(routed[1]):
                started = time.monotonic()
                ctx.started()  # renewed at every beat until here
                worker._hook("worker_job_started", routed[0], **ctx.lease.facts())
                error: BaseException | None = None
                with tracing.running(ctx.lease, worker.route) as span:  # this task's context
                    try:
                        await routed[1](ctx)
                    except Exception as exc:
                        error = exc
                    ctx.ended()  # renewed at every beat from here
                    span.set("outbox.job.outcome", "interrupted")  # unless settled below
                    result = await self._db(worker._settle, ctx, routed, started, error)
                    span.set("outbox.job.outcome", result[0])
            else:
                result = await self._loop.run_in_executor(self.threads, worker._run_traced, ctx)
            outcome, label, started = result
            if outcome == "throttled" and ctx.throttled is not None:
                with worker._active_lock:  # handed back: no lease for the heartbeat to renew
                    worker._active.pop(ctx.job_id, None)
                await self._park(ctx.throttled)
            if outcome in ("waiting_external", "waiting_review"):
                # a wait with ``until`` may come before every timer the worker knows
                await self._db(worker._learn_timer, worker._store())
            if outcome == "done":
                ctx.outcome = "done"  # the heartbeat leaves it alone from here
                await self._finish(ctx, label, started)
        except SQLAlchemyError as exc:
            # The database went away mid-job: hand the lease back so the job runs again now
            # (a dispatch already made finds its receipt and sends nothing).
            report_failure(
                log, "job interrupted by a database error; its lease is handed back", exc
            )
            with contextlib.suppress(Exception):  # unreachable still: the lease expires by its ttl
                await self._db(worker._hand_back_after_error, [ctx])
        except Exception as exc:  # the worker's own fault, not the handler's: say so
            log.error(
                "job run failed in the worker; its lease expires by its ttl",
                extra=fields(job_id=ctx.job_id, error=repr(exc)[:500]),
            )
        finally:
            with worker._active_lock:
                worker._active.pop(ctx.job_id, None)
            self.busy -= 1
            pool.busy -= 1
            self._freed.set()
            worker._hook("worker_slots", self.busy, self.slots)
            worker._hook("worker_queue_slots", pool.label, pool.busy, pool.slots)

    async def _park(self, throttled: ProviderThrottled) -> None:
        """The slot of a job its provider's limit handed back waits before it is freed
        (``ProviderGate.aparked``; ``consumer.jobs.limits``: behind a backlog for that
        provider, a slot freed at once claims its next job and hands it back too, at the
        database's speed). A stop ends the wait."""
        operations = self.worker.operations
        gate = operations.gate_named(throttled.provider) if operations is not None else None
        if gate is None or self._halt is None:
            return
        parked = asyncio.ensure_future(gate.aparked())
        halted = asyncio.ensure_future(self._halt.wait())
        await asyncio.wait((parked, halted), return_when=asyncio.FIRST_COMPLETED)
        for task in (parked, halted):
            task.cancel()
        await asyncio.gather(parked, halted, return_exceptions=True)

    async def _finish(self, ctx: JobContext, label: str, started: float) -> None:
        """Record this job's finish in the next batch (group commit, module docstring)."""
        assert self._loop is not None
        done: asyncio.Future[bool] = self._loop.create_future()
        self._pending.append((ctx, label, started, done))
        if not self._flushing:
            self._flushing = True
            try:
                while self._pending:
                    batch, self._pending = self._pending, []
                    try:
                        result = await self._db(
                            worker_store_finish, self.worker, [c.lease for c, _, _, _ in batch]
                        )
                    except BaseException as exc:
                        for _, _, _, future in batch:
                            if not future.done():
                                future.set_exception(exc)
                        continue
                    lost = set(result.conflicts)
                    for c, name, began, future in batch:
                        outcome = "conflict" if c.job_id in lost else "done"
                        if outcome == "conflict":
                            self.worker._hook("worker_lease_conflict", name)
                        took = time.monotonic() - began
                        self.worker._hook(
                            "worker_job_finished", name, outcome, took, **c.lease.facts()
                        )
                        future.set_result(outcome == "done")
            finally:
                self._flushing = False
        await done


def worker_store_finish(worker: SlotHost, leases: list[Lease]) -> Any:
    return worker._store().finish_batch(leases)
