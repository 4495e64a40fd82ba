"""Workers: claim jobs fairly, run their handlers under a heartbeat, record the outcome.

```python
from consumer import Store, Worker

worker = Worker(Store("postgresql+psycopg://localhost/app"))

@worker.handler("send-quote")            # runs jobs whose kind is "send-quote", or whose
def send_quote(job):                     # action starts with "send-quote-", ":" ...
    quote = load(job.subject)
    job.progress()                       # long handlers report progress: the lease is
    ...                                  # renewed only while they do

@worker.handler("send-invoice")          # an ``async def`` handler runs on the worker's
async def send_invoice(job):             # event loop, many jobs in flight per process
    await job.adispatch("email", "mail", {"to": job.subject})

worker.run_once()                        # one cycle; returns how many jobs it handled
worker.run()                             # until SIGTERM: finishes the jobs in hand, exits
```

What a worker does, and where each part is explained (the design text lives there once):

- **Slots** (``run``): ``concurrency`` jobs in flight (``DEFAULT_CONCURRENCY``, 256), claimed
  in one statement and started at once; ``def`` handlers on threads, ``async def`` ones on
  the event loop; queues with slots of their own. ``consumer.jobs.slots``,
  ``consumer.jobs.config``; docs/how-to/effects.md, docs/how-to/queues.md. ``run_once`` is
  the steppable form: up to ``batch_size`` jobs, one after another, in the calling thread.
- **Outcomes**: a handler that returns finishes its job (finishes are batched and fenced);
  it may move the job itself through its :class:`JobContext` (wait, schedule, cancel,
  ``recheck`` a timer); ``TransientFailure``/``PermanentFailure``/``AuthFailure`` are
  recorded as such, any other exception as transient. A job no handler routes stays READY.
  docs/how-to/jobs-and-effects.md (States, Recovery and retries, Timers).
- **Leases**: the heartbeat renews a running job's lease only while its handler reports
  progress (a provider call in flight keeps it); :attr:`Worker.liveness` keeps this worker's
  row in ``outbox_workers`` and takes back the leases of workers whose row expired.
  docs/explanation/fencing.md, docs/how-to/jobs-and-effects.md (Worker liveness).
- **Effects**: ``providers=`` gives handlers ``job.dispatch``/``job.adispatch``
  (``consumer.jobs.operations``); :attr:`Worker.reconciliation` sweeps receipts whose call
  deadline passed. docs/explanation/reconciliation.md.
- **Duties**, each named with ``run_once()`` and its interval (``outbox.duty``):
  :attr:`Worker.recovery` (expired leases and due timers, every ``recover_interval`` and as
  soon as the earliest timer comes due), :attr:`Worker.reconciliation`,
  :attr:`Worker.liveness`, and in the background :attr:`Worker.vacuum` and
  :attr:`Worker.retention` (``consumer.jobs.duties``; docs/explanation/retention.md).
- **Wake-up**: an adaptive poll, or LISTEN with ``StoreConfig(notify=True)``.
  docs/how-to/jobs-and-effects.md (Wake on work).

An outage in ``run`` (the database gone) is logged in one line (``outbox.outage``) and waited
out with backoff; the loop never exits on it. Hooks (``outbox.hooks.Hooks``) observe every
outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from consumer.errors import Conflict, JobFailure, OperationUnresolved, ProviderThrottled
from consumer.jobs.checks import claim_filters, tenant_limits
from consumer.jobs.config import DEFAULT_CONCURRENCY, QueueSlots, WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.duties import WorkerDuties
from consumer.jobs.slots import SlotRunner
from consumer.jobs.store import Lease, RecoveryResult, Store, Time
from outbox import tracing
from outbox.backoff import Backoff
from outbox.duty import Duty, weakly
from outbox.errors import ConfigError
from outbox.hooks import NO_HOOKS, Hooks, call_hook
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import report_failure
from outbox.validate import check_number

if TYPE_CHECKING:
    from consumer.jobs.operations import Operations, Provider

__all__ = [
    "DEFAULT_CONCURRENCY",
    "Handler",
    "JobContext",
    "QueueSlots",
    "Worker",
    "WorkerConfig",
]

log = logging.getLogger("outbox.worker")

Handler = Callable[["JobContext"], Any]
_SEPARATORS = "-:/.#_"


class Worker(WorkerDuties):
    """Runs job handlers (see the module docstring). ``store`` may be left None and bound
    later (the ``outbox-worker`` command binds it from ``--database-url``)."""

    config: WorkerConfig

    def __init__(
        self,
        store: Store | None = None,
        *,
        config: WorkerConfig | None = None,
        hooks: Hooks | None = None,
        providers: Mapping[str, Provider] | None = None,
        default_timeout: float = 30.0,
        **options: Any,
    ) -> None:
        if store is not None and not isinstance(store, Store):
            raise ConfigError("store", f"must be a Store, got {type(store).__name__}")
        base = config if config is not None else WorkerConfig()
        if not isinstance(base, WorkerConfig):
            raise ConfigError("config", "must be a WorkerConfig")
        self.config = replace(base, **options) if options else base
        self.store = store
        self.hooks = hooks if hooks is not None else NO_HOOKS
        self.handlers: dict[str, Handler] = {}
        self.stop_flag = GracefulStop()
        self._active: dict[int, JobContext] = {}
        self._active_lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        # False: no heartbeat thread (``outbox.testing`` runs jobs inline, on a clock the test
        # moves: no lease outlives a real-time interval there, and no thread may write).
        self.heartbeat = True
        self._liveness_stop = threading.Event()
        # Its periodic duties besides vacuum and retention (consumer.jobs.duties), named,
        # each with run_once() and its interval (outbox.duty). The intervals read the config
        # at each check (the CLI replaces it after construction), through weak references: a
        # lambda on self would keep a dropped worker alive.
        self.recovery: Duty[bool] = Duty(
            "recovery", weakly(self._recover_seconds), weakly(self._recover_round)
        )
        self._next_timer: float | None = None  # unix seconds: the earliest waiting job's timer
        self._due_timer_seen: float | None = None  # a timer learnt already due, acted on once
        self._recover_lock = threading.Lock()
        self.default_timeout = check_number("default_timeout", default_timeout, ConfigError)
        self.providers: dict[str, Provider] = dict(providers or {})
        self._operations: Operations | None = None
        # The receipt sweep: its first round one interval after start.
        self.reconciliation: Duty[None] = Duty(
            "receipt sweep",
            weakly(self._reconcile_seconds),
            weakly(self._reconcile_round),
            first="later",
        )
        # The liveness beat, from a thread of its own while ``run`` runs.
        self.liveness: Duty[RecoveryResult] = Duty(
            "liveness", weakly(self._liveness_seconds), weakly(self.beat)
        )
        # Wake-ups of idle loops: the LISTEN thread (PostgreSQL) counts notifications, an idle
        # loop sleeps only if none came since its last empty claim (no lost wake-up).
        self._kick: Callable[[], None] | None = None  # while ``run`` runs: wake its slots
        self._listening = False  # a LISTEN connection is up: idle loops rely on NOTIFY

    # -- registry -------------------------------------------------------------------------
    def handler(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` for jobs of kind ``name`` (or actions prefixed by it)."""

        def decorate(fn: Handler) -> Handler:
            self.register(name, fn)
            return fn

        return decorate

    def register(self, name: str, fn: Handler) -> None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError("handler name", "must be a non-empty string")
        if not callable(fn):
            raise ConfigError("handler", f"{name!r}: not callable")
        self.handlers[name] = fn

    def route(self, lease: Lease) -> tuple[str, Handler] | None:
        """The handler for a job: by ``kind``, else the action itself, else the longest
        registered name the action starts with followed by a separator (``-:/.#_``)."""
        if lease.kind is not None:
            fn = self.handlers.get(lease.kind)
            return (lease.kind, fn) if fn is not None else None
        if lease.action in self.handlers:
            return lease.action, self.handlers[lease.action]
        best: str | None = None
        for name in self.handlers:
            if (
                lease.action.startswith(name)
                and lease.action[len(name)] in _SEPARATORS
                and (best is None or len(name) > len(best))
            ):
                best = name
        return (best, self.handlers[best]) if best is not None else None

    @property
    def operations(self) -> Operations | None:
        """Operation intents through this worker's providers (None without providers)."""
        if not self.providers:
            return None
        store = self._store()
        if self._operations is None or self._operations.store is not store:
            from consumer.jobs.operations import Operations

            self._operations = Operations(
                store,
                self.providers,
                default_timeout=self.default_timeout,
                slots=self.config.slots,
                hooks=self.hooks,
            )
        return self._operations

    def _store(self) -> Store:
        if self.store is None:
            raise ConfigError("store", "the worker has no Store: pass one or bind worker.store")
        return self.store

    # -- one cycle ------------------------------------------------------------------------
    def run_once(self, *, now: Time | None = None) -> int:
        """Recover if due, claim a batch, run its handlers, record outcomes; returns how many
        jobs were handled (0: nothing eligible). Database errors propagate (``run`` retries)."""
        store = self._store()
        self._maybe_recover(store, now)
        self._maybe_reconcile()
        self.step_duties()  # vacuum, retention (consumer.jobs.duties): background, when due
        leases = self._claim(self.config.batch_size, self.config.queues, now=now)
        if not leases:
            return 0
        operations = self.operations
        contexts = [JobContext(store, lease, operations) for lease in leases]
        with self._active_lock:
            for ctx in contexts:
                self._active[ctx.job_id] = ctx
        self._ensure_heartbeat()
        done: list[tuple[JobContext, str, float]] = []
        handled = 0
        try:
            for index, ctx in enumerate(contexts):
                if self.stop_flag.stopped:
                    self._release(contexts[index:])
                    break
                outcome, label, started = self._run_traced(ctx)
                handled += 1
                if outcome == "done":
                    done.append((ctx, label, started))
            if done:
                for ctx, _, _ in done:
                    ctx.outcome = "done"  # the heartbeat leaves it alone from here
                result = store.finish_batch([ctx.lease for ctx, _, _ in done])
                lost = set(result.conflicts)
                for ctx, label, started in done:
                    end, took = ("conflict" if ctx.job_id in lost else "done"), _since(started)
                    if end == "conflict":
                        self._hook("worker_lease_conflict", label)
                    self._hook("worker_job_finished", label, end, took, **ctx.lease.facts())
        except SQLAlchemyError:
            # The database went away mid-batch (a connection cut, a server restart): hand
            # back every lease this worker still holds, so that the jobs run again now
            # rather than after the lease ttl (this worker is alive: no peer recovers them).
            # A job whose handler already dispatched finds its receipt and sends nothing.
            self._hand_back_after_error(contexts)
            raise
        finally:
            with self._active_lock:
                for ctx in contexts:
                    self._active.pop(ctx.job_id, None)
        if any(ctx.outcome in ("waiting_external", "waiting_review") for ctx in contexts):
            self._learn_timer(store)  # a wait with ``until`` this cycle set may come first
        self._hook("worker_cycle_ok", time.time())
        return handled

    def _claim(
        self, free: int, queues: tuple[str, ...] | None, *, now: Time | None = None
    ) -> list[Lease]:
        """One claim of this worker: at most ``free`` jobs (the free slots of one group of
        its slots, ``WorkerConfig.slot_pools``), one statement, only of ``queues`` (None:
        every queue), only what its handlers route, within its tenant limits."""
        filters = claim_filters(self.config, self.handlers)
        filters["queues"] = queues
        return self._store().claim_batch(
            self.config.name, free, self.config.ttl, now=now, **filters
        )

    def _maintain(self) -> bool:
        """What ``run`` does beside claiming (``consumer.jobs.slots``): recovery and the
        receipt sweep when due, the vacuum in the background. True if jobs became READY."""
        store = self._store()
        moved = self._maybe_recover(store, None)
        self._maybe_reconcile()
        self.step_duties()  # vacuum, retention: background threads, when due
        return moved

    def _run_traced(self, ctx: JobContext) -> tuple[str, str, float]:
        with tracing.running(ctx.lease, self.route) as span:  # the job's trace goes on
            try:
                result = self._run_one(ctx)
            except BaseException:
                span.set("outbox.job.outcome", "interrupted")
                raise
            span.set("outbox.job.outcome", result[0])  # on the run span, whatever is current
        return result

    def _run_one(self, ctx: JobContext) -> tuple[str, str, float]:
        """Run one job's handler in this thread and record its outcome (a ``def`` handler;
        an ``async def`` one called here runs to its end on an event loop of its own)."""
        started = time.monotonic()
        ctx.started()  # renewed at every beat until here (a busy process starts late)
        routed = self.route(ctx.lease)
        self._hook("worker_job_started", routed[0] if routed else "unrouted", **ctx.lease.facts())
        error: BaseException | None = None
        if routed is not None:
            try:
                result = routed[1](ctx)
                if inspect.isawaitable(result):
                    asyncio.run(_awaited(result))
            except Exception as exc:
                error = exc
        ctx.ended()  # renewed at every beat from here (the outcome waits on the worker)
        return self._settle(ctx, routed, started, error)

    def _settle(
        self,
        ctx: JobContext,
        routed: tuple[str, Handler] | None,
        started: float,
        error: BaseException | None,
    ) -> tuple[str, str, float]:
        """Record a handler's outcome (``error``: what it raised, None if it returned); the
        same for ``def`` and ``async def`` handlers. A success is left to the caller, which
        finishes jobs in batches."""
        store = self._store()
        label = routed[0] if routed else "unrouted"
        facts = ctx.lease.facts()  # which job, for the hooks
        try:
            if routed is None:
                store.fail(
                    ctx.lease,
                    error=f"no handler registered for action {ctx.action!r}",
                    kind="permanent",
                )
                outcome = "no_handler"
            else:
                try:
                    if error is not None:
                        raise error
                except Conflict:
                    raise
                except ProviderThrottled as throttled:
                    ctx.throttled = throttled
                    outcome = "throttled"  # dispatch handed the job back until the provider
                except OperationUnresolved:
                    outcome = ctx.outcome or "waiting_review"  # dispatch moved the job
                except JobFailure as failure:
                    state = store.fail(
                        ctx.lease,
                        error=failure,
                        kind=failure.kind,
                        provider=failure.provider,
                        retry_after=_retry_after(failure),
                    )
                    outcome = "failed_" + state.lower()
                except Exception as exc:  # any other handler error: transient
                    log.warning(
                        "job handler failed",
                        extra=fields(job_id=ctx.job_id, action=ctx.action, error=repr(exc)),
                    )
                    outcome = "failed_" + store.fail(ctx.lease, error=exc).lower()
                else:
                    outcome = ctx.outcome or "done"
        except Conflict as exc:
            log.info("lease lost", extra=fields(job_id=ctx.job_id, error=str(exc)))
            self._hook("worker_lease_conflict", label)
            self._hook("worker_job_finished", label, "conflict", _since(started), **facts)
            return "conflict", label, started
        if outcome != "done":
            self._hook("worker_job_finished", label, outcome, _since(started), **facts)
        return outcome, label, started

    def _hand_back_after_error(self, contexts: list[JobContext]) -> None:
        released = 0
        for ctx in contexts:
            try:
                self._store().release(ctx.lease)
                released += 1
            except Conflict:
                continue  # no longer ours: finished, waiting, failed or taken over
            except SQLAlchemyError:
                return  # still unreachable: the leases expire by their ttl
        if released:
            log.info("leases handed back after a database error", extra=fields(jobs=released))

    def _release(self, contexts: list[JobContext]) -> None:
        for ctx in contexts:
            try:
                self._store().release(ctx.lease)
            except Conflict:
                continue

    def _maybe_recover(self, store: Store, now: Time | None) -> bool:
        # Due every recover_interval, and as soon as the earliest timer of a waiting job
        # (read after each recovery) comes due, so a timer fires on time, not up to an
        # interval late. A timer the clocks disagree on is dropped: the interval remains.
        with self._recover_lock:
            timer = self._next_timer
            due = self.recovery.due() or (timer is not None and time.time() >= timer)
            if due:
                self.recovery.interval.done()
                self._next_timer = None
        return self._recover(store, now) if due else False

    def _recover_round(self) -> bool:
        """``recovery.run_once()``: one round now. True if jobs became READY."""
        return self._recover(self._store(), None)

    def _recover(self, store: Store, now: Time | None) -> bool:
        result = store.recover(now=now)
        moved = bool(result.requeued or result.needs_attention or result.woken)
        if moved:
            log.info("recovered jobs", extra=fields(**result.__dict__))
        self._learn_timer(store)
        if self.config.tenant_limit is not None or self.config.tenant_limits:
            waiting = store.waiting_on_tenant_limit(**tenant_limits(self.config))
            self._hook("worker_tenant_limit_waiting", waiting)
        return moved

    def _learn_timer(self, store: Store) -> None:
        upcoming = store.next_timer()
        if upcoming is None:
            return
        with self._recover_lock:
            if upcoming <= time.time():
                # Already due when learnt (the cycle that set a short wait took longer than
                # the wait, e.g. on a loaded machine): recover at once, but once per timer, so
                # a timer the clocks disagree on cannot make every cycle a recovery; then the
                # interval remains.
                if upcoming == self._due_timer_seen:
                    return
                self._due_timer_seen = upcoming
            if self._next_timer is None or upcoming < self._next_timer:
                self._next_timer = upcoming

    def _sleep_limit(self) -> float | None:
        """Seconds until the earliest known timer (an idle loop wakes for it)."""
        with self._recover_lock:
            timer = self._next_timer
        return None if timer is None else max(0.0, timer - time.time())

    def _maybe_reconcile(self) -> None:
        operations = self.operations
        if operations is None:
            return
        with self._recover_lock:
            due = self.reconciliation.due()
            if due:
                self.reconciliation.interval.done()
        if due:
            self.reconciliation.run_once()

    def _reconcile_round(self) -> None:
        """``reconciliation.run_once()``: settle the receipts whose call deadline passed
        (``Operations.reconcile``); nothing without providers."""
        operations = self.operations
        if operations is not None:
            operations.reconcile()

    # -- heartbeat ------------------------------------------------------------------------
    def _ensure_heartbeat(self) -> None:
        if not self.heartbeat:
            return
        if self._heartbeat is not None and self._heartbeat.is_alive():
            return
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"{self.config.name}-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def _beat(self) -> None:
        interval = self.config.ttl / 3
        pin = contextlib.ExitStack()
        pinned = False
        while True:
            with self._active_lock:
                contexts = list(self._active.values())
            if not contexts and self.stop_flag.stopped:
                pin.close()
                return
            # Every due lease in one fenced statement: one round trip per beat, however many
            # jobs are in hand (one renewal per job, 256 of them behind the slots' own
            # statements and the GIL, took 6-20 s a beat: leases expired under live jobs).
            # On a connection of its own, kept from beat to beat: checked out of the pool
            # each time, a beat waited behind 256 slot threads for one of its 30 connections
            # (seconds on a loaded machine, longer than a ttl).
            due = [ctx for ctx in contexts if ctx._due_for_renewal()]
            store = self._store()
            try:
                if not pinned and due:
                    pin.enter_context(store.driver.pinned())
                    pinned = True
                result = store.renew_batch([c.lease for c in due], ttl=self.config.ttl)
            except SQLAlchemyError as exc:
                report_failure(log, "lease renewal failed; again at the next beat", exc)
                pin.close()  # a new connection at the next beat
                pinned = False
                result = None
            lost = set(result.conflicts) if result is not None else set()
            for ctx in due:
                if ctx.job_id not in lost:
                    continue
                with self._active_lock:
                    still_running = ctx.job_id in self._active and ctx.outcome is None
                # not merely finished, or moved by its outcome, between snapshot and renewal
                if still_running and not ctx._ended:
                    ctx.lost = True
                    log.warning("lease lost at renewal", extra=fields(job_id=ctx.job_id))
            if self.stop_flag.wait(interval) and not self._active:
                pin.close()
                return

    # -- liveness -------------------------------------------------------------------------
    def beat(self, *, now: Time | None = None) -> RecoveryResult:
        """One liveness tick: this worker is alive for ``liveness_ttl`` more seconds, and the
        leases of workers whose liveness expired go back to READY at once (fenced)."""
        store = self._store()
        result = store.worker_beat(self.config.name, self.config.liveness_ttl, now=now)
        if result.requeued or result.needs_attention:
            log.info("recovered the jobs of dead workers", extra=fields(**result.__dict__))
            self._notified()  # this worker's idle loops claim them at once
        return result

    def _recover_seconds(self) -> float:
        return self.config.recover_interval

    def _reconcile_seconds(self) -> float:
        return self.config.reconcile_interval

    def _liveness_seconds(self) -> float:
        return self.config.liveness_interval

    def _liveness(self) -> None:
        # Its own thread: a long handler never makes this worker look dead.
        failures = 0
        while True:
            try:
                self.liveness.run_once()
                failures = 0
            except SQLAlchemyError as exc:
                failures += 1
                report_failure(log, "liveness beat failed", exc, attempt=failures)
            if self._liveness_stop.wait(self.liveness.interval.seconds):
                return

    # -- the loop -------------------------------------------------------------------------
    def run(self, *, install_signals: bool = True) -> None:
        """Run the worker's slots (``consumer.jobs.slots``) until SIGTERM/SIGINT or
        ``stop()``: no new claims, every job in hand runs to its end, the call returns."""
        self._store()
        if install_signals:
            self.stop_flag.install()
        log.info(
            "worker started",
            extra=fields(
                worker=self.config.name,
                concurrency=self.config.concurrency,
                slots={
                    ",".join(p.queues) if p.queues is not None else "*": p.slots
                    for p in self.config.slot_pools()
                },
                handlers=sorted(self.handlers),
            ),
        )
        self._liveness_stop.clear()
        liveness = threading.Thread(
            target=self._liveness, name=f"{self.config.name}-liveness", daemon=True
        )
        liveness.start()
        runner = SlotRunner(self)
        self._kick = runner.kick
        listener = None
        if self.config.listen:
            listener = threading.Thread(
                target=self._listen, name=f"{self.config.name}-listen", daemon=True
            )
            listener.start()
        try:
            runner.run()
        finally:
            self._kick = None
            self.stop_flag.stop()
            if listener is not None:
                listener.join(5)
            self._liveness_stop.set()  # the jobs in hand are drained: this worker stops beating
            liveness.join()
        try:
            self._store().worker_gone(self.config.name)
        except SQLAlchemyError as exc:  # its row expires by itself
            report_failure(log, "liveness row not removed; it expires by itself", exc)
        log.info("worker stopped", extra=fields(worker=self.config.name))

    def stop(self) -> None:
        self.stop_flag.stop()
        self._notified()

    def _notified(self) -> None:
        """Work may be waiting (a NOTIFY, a recovery) or the worker stops: the slots' claim
        loop looks now instead of at its next poll."""
        kick = self._kick
        if kick is not None:
            kick()

    def _listen(self) -> None:
        """Wake idle loops on NOTIFY (PostgreSQL); returns at once where there is none."""
        backoff = Backoff(0.5, 30.0)
        failures = 0
        listener = None
        while not self.stop_flag.stopped:
            try:
                if listener is None:
                    listener = self._store().driver.job_ready_listener()
                    if listener is None:
                        return  # this database has no LISTEN: the loops poll
                    failures = 0
                    self._listening = True
                if listener.wait(min(1.0, self.config.poll_interval * 2)):
                    self._notified()
            except Exception as exc:
                self._listening = False
                failures += 1
                report_failure(log, "LISTEN failed; polling meanwhile", exc, attempt=failures)
                if listener is not None:
                    with contextlib.suppress(Exception):
                        listener.close()
                listener = None
                self.stop_flag.wait(backoff.delay(failures))
        self._listening = False
        if listener is not None:
            with contextlib.suppress(Exception):
                listener.close()

    def _hook(self, name: str, *args: Any, **facts: Any) -> None:
        call_hook(self.hooks, name, *args, **facts)


def _retry_after(failure: JobFailure) -> float | None:
    """A provider's ``Retry-After`` (seconds) carried by the failure, if any."""
    value = getattr(failure, "retry_after", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


async def _awaited(result: Awaitable[Any]) -> Any:
    return await result


def _since(started: float) -> float:
    return time.monotonic() - started
