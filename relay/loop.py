"""The relay's run loop (:meth:`relay.relay.Relay.run`): turn after turn of the cycle, its
batch handed to the pipeline's threads where the store offers a second connection
(:mod:`relay.pipeline`), the duties that are due, the pace between turns, and an outage
waited out with backoff; never an exit because a service is down.

:class:`RelayLoop` is a part of :class:`relay.relay.Relay` (its base class): the cycle
itself (:meth:`relay.relay.Relay.run_once`), the batch publisher and the duties stay there,
and the attributes this loop reads of them are declared below.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from outbox.display import display_url
from outbox.duty import Duty, Interval
from outbox.lifecycle import GracefulStop
from outbox.logs import fields
from outbox.outage import Streak
from relay.batch import BatchPublisher
from relay.config import RelayConfig
from relay.errors import ConfigError
from relay.pipeline import Recorder, Sender
from relay.records import Record, RelayStats
from relay.seam import Broker
from relay.store import Store

log = logging.getLogger("outbox.relay")

Claimed = tuple[list[Record], int, float, float]
"""A claimed batch: its records, the epoch of its intent, the cycle's and the claim's start
(monotonic)."""


class RelayLoop:
    """``run()`` and ``stop()`` of :class:`relay.relay.Relay`, which sets what is declared
    here (its ``__init__``) and defines the cycle the loop turns (``_cycle``, ``_publish``)."""

    name: str
    engine: Engine
    config: RelayConfig
    publisher: Broker
    store: Store
    stats: RelayStats
    on_progress: Callable[[Any], None] | None
    retention: Duty[int]
    partition_duty: Duty[Any]
    vacuum: Duty[None] | None
    _stopping: threading.Event
    _sender: Sender | None
    _batches: BatchPublisher
    _sweep: Interval
    _infra: tuple[type[BaseException], ...]
    _cycle: Callable[..., tuple[int, Claimed | None]]
    _publish: Callable[[list[Record], int, float, float], int]
    _hook: Callable[..., None]

    def stop(self) -> None:
        """Ask ``run()`` to finish the batches in hand, record their receipts and return
        (from any thread; before ``run()`` starts, it makes ``run()`` return at once)."""
        self._stopping.set()

    def run(self, stop: GracefulStop | threading.Event | None = None) -> None:
        """Run until SIGTERM/SIGINT, :meth:`stop`, or ``stop`` (an event a caller shares
        between runners) is set. Never exits on an outage."""
        if stop is None:
            graceful = GracefulStop()
            graceful.event = self._stopping  # SIGTERM/SIGINT set the relay's own flag
            graceful.install()
            external = None
        elif isinstance(stop, GracefulStop):
            external = stop.event
        elif isinstance(stop, threading.Event):
            external = stop
        else:
            raise ConfigError("stop", "must be a GracefulStop or a threading.Event")
        event = _EitherEvent(self._stopping, external)
        try:
            self._run(event)
        finally:
            self._stopping.clear()

    def _run(self, event: _EitherEvent) -> None:
        self._log_start()
        receipts = self.store.receipt_store()
        if receipts is not None:
            self._batches.recorder = Recorder(receipts)
            self._sender = Sender(self._publish)
        loop = _LoopState(interval=self.config.poll_interval, last_progress=time.monotonic())
        try:
            while not event.is_set():
                started = time.monotonic()
                try:
                    published = self._step()
                    loop.streak.succeeded()  # one line when a run of failures ends
                    loop.outage_attempt = 0
                except Exception as exc:
                    self._wait_out(exc, loop, event)
                    continue
                now = time.monotonic()
                self._report_progress(loop, now)
                if published >= self.config.batch_size:
                    loop.interval = self.config.poll_interval
                    continue
                self._pace(loop, published, now)
                if event.is_set():
                    break
                # The interval runs from the cycle's start: a claim that took 4 ms of a 5 ms
                # poll waits 1 ms, not 5 (commit -> stream was claim + a whole interval).
                wait = loop.interval - (now - started)
                if wait > 0:
                    self._idle(wait, event)
        finally:
            self._stop_pipeline()

    def _log_start(self) -> None:
        cfg = self.config
        log.info(
            "relay started",
            extra=fields(
                relay=self.name,
                database=display_url(self.engine.url),
                stream=self.publisher.stream_template,
                batch_size=cfg.batch_size,
                partitions=self.store.partitions,
                listen=cfg.listen and self.store.supports_notify,
                retention_seconds=cfg.retention_seconds,
                wait_replicas=cfg.wait_replicas,
                **self.publisher.describe(),
            ),
        )

    def _quiesce(self) -> None:
        """Wait until every batch in hand is published and its outcome written."""
        if self._sender is not None:
            self._sender.wait_idle()
        if self._batches.recorder is not None:
            self._batches.recorder.wait_idle()

    def _step(self) -> int:
        """One turn of ``run``: a cycle, its batch published (or handed to the sender
        thread), the duties that are due. Returns how many events it published or claimed."""
        if self._sender is not None and self._sender.error is not None:
            error, self._sender.error = self._sender.error, None
            raise error
        published, batch = self._cycle(self._quiesce if self._sender is not None else None)
        claimed = 0
        if batch is not None:
            claimed = len(batch[0])
            if self._sender is not None:
                self._sender.submit(batch)
            else:
                published += self._publish(*batch)
        self._run_duties(time.monotonic())
        return max(published, claimed)

    def _run_duties(self, now: float) -> None:
        """Retention, partition upkeep and vacuum, when due, by the owner of partition 0."""
        if self.retention.due(now) and 0 in self.store.partitions_owned:
            self.retention.run_now(now)
        if self.partition_duty.due(now) and 0 in self.store.partitions_owned:
            self.partition_duty.run_now(now)
        if self.vacuum is not None and self.vacuum.due(now) and 0 in self.store.partitions_owned:
            self.vacuum.run_now(now)

    def _wait_out(self, exc: Exception, loop: _LoopState, event: _EitherEvent) -> None:
        """A turn failed: log it (outages are expected; anything else is a bug, logged with
        its traceback), drop what is in hand and the partitions, wait with backoff. Neither
        ends the loop."""
        loop.outage_attempt += 1
        self.stats.errors += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        delay = self.config.outage_backoff.delay(loop.outage_attempt)
        # A line when the run of failures starts and one a minute while it lasts (an
        # outage: no traceback; anything else: with it).
        loop.streak.failed(
            exc,
            attempt=loop.outage_attempt,
            retry_in_seconds=round(delay, 3),
        )
        self._hook("relay_publish_error", type(exc).__name__, None)
        if self._sender is not None:
            # Outcomes not written keep their intents; dropping the partitions (closing the
            # claim connection) makes the next owner, maybe this relay again, mark and
            # reconcile them before claiming.
            self._quiesce()
            self._sender.error = None
            if self._batches.recorder is not None:
                self._batches.recorder.error = None
            self._batches.held.clear()
            self._batches.seen_at_claim.clear()
        self.store.close()
        event.wait(delay)

    def _report_progress(self, loop: _LoopState, now: float) -> None:
        if now - loop.last_progress >= self.config.progress_interval:
            self._log_progress(now - loop.last_progress, loop.published_at_progress)
            loop.last_progress = now
            loop.published_at_progress = self.stats.published
        if self.on_progress is not None:
            try:
                self.on_progress(self)
            except Exception:
                log.debug("progress callback failed", exc_info=True)

    def _pace(self, loop: _LoopState, published: int, now: float) -> None:
        """The next wait, following the arrival rate: a cycle that finds a batch worth its
        round trips (``FEW`` events or more) halves the wait, down to ``poll_interval``; a
        cycle that found fewer doubles it, up to ``BUSY_SLOWEST`` x ``poll_interval`` while
        work trickles in (and for a ``BUSY_WINDOW`` after); a whole window without work
        doubles it toward ``max_poll_interval``. A full batch polls again at once (``_run``).
        A steady flow settles where cycles find about ``FEW`` events (a reset to
        ``poll_interval`` at each such cycle made the wait swing 5 -> 40 ms and back)."""
        busiest = min(self.config.max_poll_interval, self.config.poll_interval * BUSY_SLOWEST)
        if published >= FEW:  # halved, not reset: a steady flow settles near FEW a cycle
            loop.interval = max(self.config.poll_interval, min(loop.interval, busiest) / 2)
        elif published or now < loop.busy_until:
            loop.interval = min(busiest, max(loop.interval, loop.interval * 2))
        else:  # a second without work: back off toward idle
            loop.interval = min(self.config.max_poll_interval, loop.interval * 2)
        if published:
            loop.busy_until = now + BUSY_WINDOW
            loop.interval = min(loop.interval, busiest)

    def _idle(self, interval: float, event: _EitherEvent) -> None:
        """Wake on a NOTIFY, a stop request, or the polling interval."""
        if self.store.supports_notify and self.config.listen:
            if self.store.notify_wait(min(interval, 0.25)) == 2:
                self._sweep.make_due()
        else:
            event.wait(interval)

    def _stop_pipeline(self) -> None:
        if self._sender is not None:
            self._sender.close()  # the batches in hand are published first
            self._sender = None
        if self._batches.recorder is not None:
            self._batches.recorder.close()  # and get their receipts
            self._batches.recorder = None
            self._batches.held.clear()
        self.store.close()
        log.info("relay stopped", extra=fields(relay=self.name, published=self.stats.published))

    def _log_progress(self, elapsed: float, before: int) -> None:
        try:
            backlog, oldest = self.store.outbox_backlog()
        except self._infra:
            backlog, oldest = -1, None
        log.info(
            "progress",
            extra=fields(
                published=self.stats.published,
                rate_per_second=round((self.stats.published - before) / max(elapsed, 1e-9), 1),
                backlog=backlog,
                oldest_unpublished_age_seconds=None if oldest is None else round(oldest, 3),
                quarantined=self.stats.quarantined,
                partitions=sorted(self.store.partitions_owned),
            ),
        )


BUSY_WINDOW = 1.0
"""Seconds after a cycle that found work during which the wait stays at most
``BUSY_SLOWEST`` x ``poll_interval``; only after a whole window without work does the wait
double toward ``max_poll_interval``."""

FEW = 4
"""Events a cycle must find for the next wait to be halved (down to ``poll_interval``). A
steady trickle (100 events/s over 2 relays) kept each relay at its 5 ms pace, ~200 claims/s
that found one event or none: 2.4 claim statements and a transaction per event, the relay's
CPU. Polling slower while cycles find fewer, the claims share their round trips."""

BUSY_SLOWEST = 10
"""The slowest busy wait, in ``poll_interval``s (50 ms by default): a commit waits at most
that for its claim while work flows. At 20 ms (and a reset to 5 ms after each cycle that
found 4), 100 events/s over 2 relays still made ~1 claim per event, and each relay's batch
is what the consumers read at once: the larger it is, the fewer batches downstream
(issue 54: the relays' CPU per effect 1.2 -> 0.75 ms, the consumers' fell with it)."""


@dataclass
class _LoopState:
    """What ``Relay._run`` carries from one turn to the next."""

    interval: float  # the next wait when idle
    last_progress: float  # monotonic: the last progress line
    published_at_progress: int = 0
    busy_until: float = 0.0  # until then (monotonic), empty cycles keep the short interval
    outage_attempt: int = 0  # turns failed in a row
    streak: Streak = field(default_factory=lambda: Streak(log, "relay cycle"))


class _EitherEvent:
    """The relay's own stop flag, or a caller's stop event: whichever is set first. Waits
    wake on the relay's flag at once and look at the caller's every 0.1 s."""

    def __init__(self, own: threading.Event, external: threading.Event | None) -> None:
        self.own = own
        self.external = external

    def is_set(self) -> bool:
        return self.own.is_set() or (self.external is not None and self.external.is_set())

    def wait(self, seconds: float) -> bool:
        if self.external is None:
            return self.own.wait(seconds)
        deadline = time.monotonic() + seconds
        while not self.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.own.wait(min(remaining, 0.1))
        return True


__all__ = ["BUSY_SLOWEST", "BUSY_WINDOW", "FEW", "Claimed", "RelayLoop"]
