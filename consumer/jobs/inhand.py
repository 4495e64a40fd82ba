"""The jobs a worker holds, and the heartbeat that renews their leases.

Every running or finishing job of a worker is in one :class:`JobsInHand` (keyed by job id),
whoever runs it: ``Worker.run_once`` in the calling thread, or the slots. The heartbeat
thread renews the leases that are due (``JobContext.due_for_renewal``: progress, a provider
call, or waiting on the worker) every third of the ttl, in **one** fenced statement per beat
(``Store.renew_batch``), and marks a job whose renewal was refused as ``lost``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from consumer.jobs.context import JobContext
from consumer.jobs.store import Store
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import report_failure

__all__ = ["CANCEL_WATCH", "JobsInHand"]

log = logging.getLogger("outbox.worker")

CANCEL_WATCH = 0.25  # seconds between looks for cancel requests while jobs are in hand


class JobsInHand:
    """The jobs in hand (thread-safe) and their heartbeat (``heartbeat=False``: none, for
    ``outbox.testing``, which runs jobs inline on a clock the test moves)."""

    def __init__(
        self, store: Store, *, ttl: float, name: str, stop: GracefulStop, heartbeat: bool = True
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.name = name
        self.stop = stop
        self.heartbeat = heartbeat
        self._jobs: dict[int, JobContext] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pinned = False  # the heartbeat holds a connection of its own
        self._next_watch = 0.0  # monotonic: the next look for cancel requests

    def add(self, ctx: JobContext) -> None:
        with self._lock:
            self._jobs[ctx.job_id] = ctx
        self.ensure_heartbeat()

    def remove(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def discard(self, ctx: JobContext) -> None:
        """``ctx`` leaves the hands, if it is still the run held for its job (a job handed
        back may be claimed again by this worker at once: its new run stays)."""
        with self._lock:
            if self._jobs.get(ctx.job_id) is ctx:
                del self._jobs[ctx.job_id]

    def holds(self, job_id: int) -> bool:
        with self._lock:
            return job_id in self._jobs

    def snapshot(self) -> list[JobContext]:
        with self._lock:
            return list(self._jobs.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    # -- cancel requests ------------------------------------------------------------------
    def watch_cancels(self) -> int:
        """Tell the jobs in hand that an operator asked to cancel them (``Store.cancel`` of a
        LEASED job; ``consumer.jobs.cancels``): at most every :data:`CANCEL_WATCH` seconds,
        and only while jobs are in hand, one probe of a partial index that holds only such
        jobs. Returns how many were told now."""
        now = time.monotonic()
        with self._lock:
            if not self._jobs or now < self._next_watch:
                return 0
            self._next_watch = now + CANCEL_WATCH
        with self.store.driver.connect() as conn:
            requested = self.store.driver.job_cancel_requested_list(conn, self.name)
        told = 0
        for job_id in requested:
            with self._lock:
                ctx = self._jobs.get(job_id)
            if ctx is not None and ctx.request_cancel():
                log.info("cancel requested", extra=fields(job_id=job_id))
                told += 1
        return told

    # -- the heartbeat --------------------------------------------------------------------
    def ensure_heartbeat(self) -> None:
        if not self.heartbeat:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=self._beat, name=f"{self.name}-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        # Every due lease in one fenced statement: one round trip per beat, however many
        # jobs are in hand (one renewal per job, 256 of them behind the slots' own
        # statements and the GIL, took 6-20 s a beat: leases expired under live jobs).
        # On a connection of its own, kept from beat to beat: checked out of the pool
        # each time, a beat waited behind 256 slot threads for one of its 30 connections
        # (seconds on a loaded machine, longer than a ttl).
        interval = self.ttl / 3
        self._pinned = False
        with contextlib.ExitStack() as pin:
            while True:
                contexts = self.snapshot()
                if not contexts and self.stop.stopped:
                    return
                due = [ctx for ctx in contexts if ctx.due_for_renewal()]
                lost = self._renew(due, pin)
                self._mark_lost([ctx for ctx in due if ctx.job_id in lost])
                if self.stop.wait(interval) and not len(self):
                    return

    def _renew(self, due: list[JobContext], pin: contextlib.ExitStack) -> set[int]:
        """Renew ``due`` (pinning a connection the first time); the job ids refused."""
        try:
            if due and not self._pinned:
                pin.enter_context(self.store.driver.pinned())
                self._pinned = True
            result = self.store.renew_batch([c.lease for c in due], ttl=self.ttl)
        except SQLAlchemyError as exc:
            report_failure(log, "lease renewal failed; again at the next beat", exc)
            pin.close()  # a new connection at the next beat
            self._pinned = False
            return set()
        return set(result.conflicts)

    def _mark_lost(self, refused: list[JobContext]) -> None:
        for ctx in refused:
            # not merely finished, or moved by its outcome, between snapshot and renewal
            if self.holds(ctx.job_id) and ctx.outcome is None and not ctx.has_ended:
                ctx.lost = True
                log.warning("lease lost at renewal", extra=fields(job_id=ctx.job_id))
