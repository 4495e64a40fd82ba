"""What runs a :class:`~consumer.jobs.worker.Worker`: its parts, built once from it.

The user builds a ``Worker`` (handlers, providers, queues, config); the first ``run`` or
``run_once`` builds its :class:`Runner` from it, and from then on the worker is frozen. The
runner owns the state of a running worker, in parts that talk through their public methods:

- **claiming** (:meth:`Runner.claim`): one statement for the free slots of one group of
  slots, only of its queues, only what the handlers route, within the tenant limits;
- **the jobs in hand** and their heartbeat (``consumer.jobs.inhand``);
- **outcomes** (``consumer.jobs.outcomes``): the one settle; the one finish is
  :meth:`Runner.finish_and_claim`, which the slots' statement and ``run_once`` both use;
- **the duties** (``consumer.jobs.duties``): recovery, the receipt sweep, liveness, vacuum,
  retention, the schedules' firing;
- **the slots** (``consumer.jobs.slots``): ``run``'s event loop;
- **wake-up**: a LISTEN thread (PostgreSQL) that kicks the slots when work arrives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.checks import claim_filters
from consumer.jobs.config import WorkerConfig
from consumer.jobs.context import JobContext
from consumer.jobs.duties import WorkerDuties
from consumer.jobs.inhand import JobsInHand
from consumer.jobs.outcomes import WAITS, Outcome, Outcomes, Route, Settled
from consumer.jobs.schedules import Schedule
from consumer.jobs.store import Lease, Store, Time
from outbox.backoff import Backoff
from outbox.duty import weakly
from outbox.hooks import Hooks, call_hook
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import report_failure

if TYPE_CHECKING:
    from consumer.jobs.operations import Operations, Provider

__all__ = ["Runner"]

log = logging.getLogger("outbox.worker")


class Runner:
    """A running worker's parts (see the module docstring)."""

    def __init__(
        self,
        *,
        store: Store,
        config: WorkerConfig,
        hooks: Hooks,
        handlers: dict[str, Callable[..., Any]],
        route: Route,
        providers: dict[str, Provider],
        operations: Operations | None,
        stop: GracefulStop,
        heartbeat: bool,
        schedules: tuple[Schedule, ...] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.hooks = hooks
        self.route = route
        self.providers = providers
        self.operations = operations
        self.stop = stop
        self.in_hand = JobsInHand(
            store, ttl=config.ttl, name=config.name, stop=stop, heartbeat=heartbeat
        )
        self.outcomes = Outcomes(store, hooks, route)
        self.duties = WorkerDuties(
            store, config, hooks, operations, weakly(self.kick), schedules=schedules
        )
        # What every claim filters on, computed once: the handlers are frozen.
        self._filters = claim_filters(config, handlers)
        self._kick: Callable[[], None] | None = None  # while ``run`` runs: wake its slots
        self.listening = False  # a LISTEN connection is up: idle loops rely on NOTIFY

    def hook(self, name: str, *args: Any, **facts: Any) -> None:
        call_hook(self.hooks, name, *args, **facts)

    # -- claiming -------------------------------------------------------------------------
    def claim(
        self, free: int, queues: tuple[str, ...] | None, *, now: Time | None = None
    ) -> list[Lease]:
        """At most ``free`` jobs (the free slots of one group of slots), one statement, only
        of ``queues`` (None: every queue), only what the handlers route, within the tenant
        limits."""
        filters = {**self._filters, "queues": queues}
        return self.store.claim_batch(self.config.name, free, self.config.ttl, now=now, **filters)

    def finish_and_claim(
        self, done: Sequence[Settled], free: int, queues: tuple[str, ...] | None
    ) -> list[Lease]:
        """The worker's one writer of finishes: finish ``done`` (jobs whose handlers
        returned) and claim up to ``free`` jobs like :meth:`claim`, in one statement on
        PostgreSQL (``Store.finish_and_claim``): the slots those jobs held take their next
        jobs in the same commit. A finish refused (its lease was lost) is reported as a
        conflict, job by job."""
        if not done:
            return self.claim(free, queues) if free > 0 else []
        self.outcomes.finishing(done)
        if free <= 0:  # a stop: the finishes alone
            result = self.store.finish_batch([settled.ctx.lease for settled in done])
            self.outcomes.finished(done, result.conflicts)
            return []
        filters = {**self._filters, "queues": queues}
        result, leases = self.store.finish_and_claim(
            [settled.ctx.lease for settled in done],
            self.config.name,
            free,
            self.config.ttl,
            **filters,
        )
        self.outcomes.finished(done, result.conflicts)
        return leases

    def context(self, lease: Lease, executor: Any = None) -> JobContext:
        """The handler's view of a claimed job, held (and heartbeaten) from here."""
        ctx = JobContext(self.store, lease, self.operations, executor=executor)
        self.in_hand.add(ctx)
        return ctx

    # -- one cycle ------------------------------------------------------------------------
    def run_once(self, *, now: Time | None = None) -> int:
        """``Worker.run_once``: duties when due, one claim of ``batch_size``, the handlers
        one after another in this thread, the finishes in one batch."""
        self.duties.maintain(now)
        leases = self.claim(self.config.batch_size, self.config.queues, now=now)
        if not leases:
            return 0
        contexts = [self.context(lease) for lease in leases]
        try:
            handled, settled = self._run_in_turn(contexts)
            done = [s for s in settled if s.outcome is Outcome.DONE]
            self.finish_and_claim(done, 0, self.config.queues)
        except SQLAlchemyError:
            # The database went away mid-batch (a connection cut, a server restart).
            self.outcomes.hand_back_after_error(contexts)
            raise
        finally:
            for ctx in contexts:
                self.in_hand.remove(ctx.job_id)
        if any(s.outcome in WAITS for s in settled):
            self.duties.learn_timer()  # a wait with ``until`` may come before every timer
        self.hook("worker_cycle_ok", time.time())
        return handled

    def _run_in_turn(self, contexts: list[JobContext]) -> tuple[int, list[Settled]]:
        settled: list[Settled] = []
        for index, ctx in enumerate(contexts):
            if self.stop.stopped:
                self.outcomes.release(contexts[index:])
                break
            settled.append(self.outcomes.run(ctx))
        return len(settled), settled

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """``Worker.run``: the slots until a stop, then every job in hand to its end."""
        from consumer.jobs.slots import SlotRunner  # the runner's loop; it imports this

        log.info(
            "worker started",
            extra=fields(
                worker=self.config.name,
                concurrency=self.config.concurrency,
                slots={
                    ",".join(p.queues) if p.queues is not None else "*": p.slots
                    for p in self.config.slot_pools()
                },
                handlers=sorted(self._filters["routes"]),
            ),
        )
        alive = threading.Event()
        liveness = threading.Thread(
            target=self.duties.keep_alive, args=(alive,), name=f"{self.config.name}-liveness"
        )
        liveness.daemon = True
        liveness.start()
        slots = SlotRunner(self)
        self._kick = slots.kick
        self.store.local_wakers.append(slots.kick)  # this process's enqueues wake it
        listener = None
        if self.config.listen:
            listener = threading.Thread(
                target=self.listen, name=f"{self.config.name}-listen", daemon=True
            )
            listener.start()
        try:
            slots.run()
        finally:
            self._kick = None
            with contextlib.suppress(ValueError):
                self.store.local_wakers.remove(slots.kick)
            self.stop.stop()
            if listener is not None:
                listener.join(5)
            alive.set()  # the jobs in hand are drained: this worker stops beating
            liveness.join()
        try:
            self.store.worker_gone(self.config.name)
        except SQLAlchemyError as exc:  # its row expires by itself
            report_failure(log, "liveness row not removed; it expires by itself", exc)
        log.info("worker stopped", extra=fields(worker=self.config.name))

    def kick(self) -> None:
        """Work may be waiting (a NOTIFY, a recovery) or the worker stops: the slots' claim
        loop looks now instead of at its next poll."""
        kick = self._kick
        if kick is not None:
            kick()

    def listen(self) -> None:
        """Wake idle loops on NOTIFY (PostgreSQL); returns at once where there is none."""
        backoff = Backoff(0.5, 30.0)
        failures = 0
        listener = None
        while not self.stop.stopped:
            try:
                if listener is None:
                    listener = self.store.driver.job_ready_listener()
                    if listener is None:
                        return  # this database has no LISTEN: the loops poll
                    failures = 0
                    self.listening = True
                if listener.wait(min(1.0, self.config.poll_interval * 2)):
                    self.kick()
            except Exception as exc:
                self.listening = False
                failures += 1
                report_failure(log, "LISTEN failed; polling meanwhile", exc, attempt=failures)
                if listener is not None:
                    with contextlib.suppress(Exception):
                        listener.close()
                listener = None
                self.stop.wait(backoff.delay(failures))
        self.listening = False
        if listener is not None:
            with contextlib.suppress(Exception):
                listener.close()
